"""Tokenizers: from the GGUF file itself or from a Hugging Face folder, via ``transformers``."""

from __future__ import annotations

import logging

from ..errors import UserError
from .source import ModelSource


def load_tokenizer(source: ModelSource):
    """A fast Hugging Face tokenizer for the model (built offline from GGUF metadata for ``.gguf`` files)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        if source.kind == "gguf":
            return AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
        return AutoTokenizer.from_pretrained(str(source.path))
    except Exception as exc:
        raise UserError(f"Cannot build a tokenizer for {source.path} ({exc}).") from None


def eos_token_ids(tokenizer) -> set[int]:
    """Token ids that end generation: the tokenizer's EOS plus chat end-of-turn markers it knows."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    for marker in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
        if marker in vocab:
            ids.add(vocab[marker])
    return ids
