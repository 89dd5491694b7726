"""One call from a ``--model`` argument to a ready model and tokenizer."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..linear import default_linear_options, resolve_format
from ..model import Transformer
from .source import ModelSource, resolve_model
from .tokenizer import load_tokenizer
from .weights import load_model_tensors, load_state, save_model_tensors, tensor_cache_file, tensor_cache_root

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# Values accepted for ``weights`` (``bf16`` = ``dense``; ``auto`` = by role, see ``linear.auto_format``).
WEIGHT_CHOICES = ("auto", "dense", "bf16", "int8", "int4")


@dataclass
class LoadedModel:
    """A model with its tokenizer and where it came from.

    ``weights`` is the concrete weight format (``dense``, ``int8`` or ``int4``, after resolving ``auto``);
    ``from_cache`` tells whether the tensors came from the on-disk tensor cache.
    """

    name: str
    source: ModelSource
    config: ModelConfig
    model: Transformer
    tokenizer: object
    weights: str = "dense"
    from_cache: bool = False


def load_model(
    ref: str,
    dtype: torch.dtype = torch.bfloat16,
    weights: str = "dense",
    tokenizer: bool = True,
    *,
    role: str = "target",
    cache: bool | str | Path = True,
) -> LoadedModel:
    """Resolve ``ref`` (fixture name, ``.gguf`` path or Hugging Face folder) and load weights and tokenizer.

    Args:
        ref: the model.
        dtype: compute dtype (``torch.bfloat16`` or ``torch.float32``).
        weights: ``dense`` (alias ``bf16``: weights in ``dtype``), ``int8``, ``int4`` or ``auto`` (by ``role``).
        tokenizer: also load the tokenizer.
        role: ``"target"`` or ``"draft"``, for ``weights="auto"``.
        cache: the on-disk tensor cache (see ``loading/weights.py``): ``True`` = default folder, ``False`` = off,
            or a folder. A hit skips reading the source's weights and building the model; a miss builds the model
            and stores it. For GGUF files the tokenizer is cached too (next to the tensors).
    """
    source = resolve_model(ref)
    fmt = resolve_format(weights, role)
    root = tensor_cache_root(cache)
    file = None if root is None else tensor_cache_file(root, source, dtype, fmt, default_linear_options(fmt, dtype))
    hit = None if file is None else load_model_tensors(file, dtype, fmt)
    if hit is not None:
        config, model = hit
    else:
        config, state = load_state(source)
        model = Transformer(config, state, dtype, fmt)
        del state
        if file is not None:
            save_model_tensors(model, file, source)
    tok = None
    if tokenizer:
        tok = _cached_tokenizer(source, None if file is None else file.parent / "tokenizer")
    return LoadedModel(source.name, source, config, model, tok, fmt, hit is not None)


def _cached_tokenizer(source: ModelSource, folder: Path | None):
    """The tokenizer, from ``folder`` (a ``save_pretrained`` copy) when present; GGUF tokenizers are saved there.

    Building a tokenizer from GGUF metadata parses the whole file (seconds for a 150k-token vocabulary); the
    saved copy loads in a fraction of that. Hugging Face folders already hold a saved tokenizer.
    """
    if folder is None or source.kind != "gguf":
        return load_tokenizer(source)
    if (folder / "tokenizer_config.json").is_file():
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(folder))
        except Exception:  # unreadable copy: rebuild it below
            pass
    tok = load_tokenizer(source)
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(str(tmp))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except Exception:  # caching is best effort (e.g. a full disk)
        shutil.rmtree(tmp, ignore_errors=True)
    return tok
