"""Tokenizers: a small wrapper around a ``tokenizers`` (Rust) tokenizer and the model's chat template.

A model's tokenizer is built once with ``transformers`` (from the GGUF file's metadata, or from a Hugging Face
folder) and stored next to its tensors (``load.py``); every later start reads that copy with :class:`Tokenizer`
alone, without importing ``transformers``, whose import is a large share of a start. Both give the same ids, text
and chat prompts: the stored copy is the backend tokenizer ``transformers`` built, and the chat template is
rendered the way ``transformers`` renders it (a sandboxed Jinja environment, its ``tojson`` and helper functions,
the named special tokens as variables). Start-up measured:
benchmarks/history/serving-and-footprint.md#start-up-without-transformers-the-weights-read-while-torch-imports-2026-12-05
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from datetime import datetime
from pathlib import Path

from ..errors import UserError
from .source import ModelSource

# The named special tokens a chat template may read (``bos_token`` ...), as transformers passes them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
BACKEND_FILE = "tokenizer.json"
CONFIG_FILE = "sparsespec_tokenizer.json"


class Tokenizer:
    """Text to token ids and back, and chat messages to a prompt.

    The subset of a ``transformers`` fast tokenizer's interface the engine uses, with the same results: ``encode``,
    ``decode``, ``__call__`` with offsets, ``apply_chat_template``, ``get_vocab``, ``len()``, ``chat_template``,
    ``bos_token_id`` / ``eos_token_id``.
    """

    def __init__(self, backend, special_tokens: dict[str, str], chat_template: str | None,
                 digest: str | None = None):
        self.backend = backend  # a tokenizers.Tokenizer
        self.special_tokens = {name: text for name, text in special_tokens.items() if text is not None}
        self.chat_template = chat_template
        # sha256 of the stored backend it was read from (None when built here): equal digests, equal token ids
        self.digest = digest
        self._template = None  # compiled on first use
        self._specials = None  # a pattern matching any special token's text, built on first use
        # Encoding reads the backend's encode_special_tokens switch, which content tokenized as text flips.
        self._encode_lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ building, storing
    @classmethod
    def from_transformers(cls, hf_tokenizer) -> "Tokenizer":
        """The backend, named special tokens and chat template of a ``transformers`` fast tokenizer."""
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise UserError(f"The tokenizer of this model is a slow (Python) one ({type(hf_tokenizer).__name__}); "
                            "sparsespec needs a fast tokenizer (a tokenizer.json).")
        special = {name: getattr(hf_tokenizer, name, None) for name in SPECIAL_TOKEN_NAMES}
        template = hf_tokenizer.chat_template if isinstance(hf_tokenizer.chat_template, str) else None
        return cls(backend, {name: str(text) for name, text in special.items() if text is not None}, template)

    @classmethod
    def from_folder(cls, folder: Path) -> "Tokenizer":
        """A tokenizer stored with :meth:`save` (raises when a file is missing, unreadable or of another format)."""
        from tokenizers import Tokenizer as Backend

        backend_bytes, config_bytes = (folder / BACKEND_FILE).read_bytes(), (folder / CONFIG_FILE).read_bytes()
        config = json.loads(config_bytes)
        special = config["special_tokens"]
        if not isinstance(special, dict) or not all(isinstance(v, str) for v in special.values()):
            raise ValueError(f"{folder / CONFIG_FILE}: special_tokens is not a map of names to strings")
        template = config.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{folder / CONFIG_FILE}: chat_template is not a string")
        return cls(Backend.from_str(backend_bytes.decode("utf-8")), special, template,
                   hashlib.sha256(backend_bytes).hexdigest())

    def save(self, folder: Path) -> None:
        """Write ``tokenizer.json`` (the backend) and ``sparsespec_tokenizer.json`` (special tokens, chat template)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / BACKEND_FILE))
        config = {"special_tokens": self.special_tokens, "chat_template": self.chat_template}
        (folder / CONFIG_FILE).write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")

    # ------------------------------------------------------------------------------------------------- the interface
    def encode(self, text: str, add_special_tokens: bool = True, specials_as_text: bool = False) -> list[int]:
        """Token ids of ``text`` (with the BOS or other tokens the tokenizer adds when ``add_special_tokens``).

        Special tokens written in ``text`` (``<|im_end|>`` …) become those tokens, unless ``specials_as_text``: then
        they are tokenized as the characters they are written with. Safe to call from several threads; the backend
        runs without Python's global lock, so a long text tokenized on one thread leaves the others running."""
        return self._encode(text, add_special_tokens, specials_as_text).ids

    def _encode(self, text: str, add_special_tokens: bool, specials_as_text: bool = False):
        with self._encode_lock:
            self.backend.encode_special_tokens = specials_as_text
            try:
                if len(text) < LONG_TEXT_CHARS:
                    return self.backend.encode(text, add_special_tokens=add_special_tokens)
                # encode_batch gives the same encoding and releases Python's global lock (encode holds it)
                return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            finally:
                self.backend.encode_special_tokens = False

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False) -> dict:
        """``{"input_ids": [...]}`` and, when asked, ``"offset_mapping"``: each token's ``(start, end)`` characters."""
        encoding = self._encode(text, add_special_tokens)
        out = {"input_ids": encoding.ids}
        if return_offsets_mapping:
            out["offset_mapping"] = encoding.offsets
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (a list of ints or one int)."""
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        """Every token (added tokens included) and its id."""
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, name: str) -> int | None:
        """The id of the named special token (``"eos_token"`` ...), or None."""
        text = self.special_tokens.get(name)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id("eos_token")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True) -> list[int] | str:
        """The chat prompt of ``messages`` (dicts with ``role`` and ``content``): its ids, or its text when not
        ``tokenize``. The template writes the special tokens itself, so none are added when encoding.

        **Message content is text**: a special token's text inside a message's content (``<|im_end|>`` typed by a
        user) is tokenized as those characters, never as the control token, so no message can end its turn or open
        another; the template's own special tokens stay control tokens. Prompts whose contents hold no special
        token's text are tokenized exactly as ``transformers`` tokenizes them. Raises :class:`ContentNotText` when
        a content that holds one is changed by the template as it renders it (then its place in the prompt is not
        known)."""
        text = self._render(messages, add_generation_prompt)
        if not tokenize:
            return text
        guarded = {i for i, m in enumerate(messages) if isinstance(m.get("content"), str)
                   and self._special_pattern().search(m["content"])}
        if not guarded:
            return self.encode(text, add_special_tokens=False)
        # Render again with each guarded content replaced by a marker, to learn where the contents lie.
        marked = [dict(m, content=f"{_MARK}{i}{_MARK}") if i in guarded else m for i, m in enumerate(messages)]
        pieces = re.split(f"{_MARK}([0-9]+){_MARK}", self._render(marked, add_generation_prompt))
        contents = [messages[int(index)]["content"] for index in pieces[1::2]]
        rebuilt = "".join(part for pair in zip(pieces[::2], contents + [""]) for part in pair)
        if rebuilt != text or len(set(pieces[1::2])) != len(guarded):
            first = min(guarded)
            raise ContentNotText(f"message {first}'s content holds the text of a special token "
                                 f"({self._special_pattern().search(messages[first]['content']).group(0)!r}), and "
                                 "this model's chat template changes message content as it renders it, so that "
                                 "text cannot be kept apart as plain text; remove it from the message.")
        ids = []
        for template_text, content in zip(pieces[::2], contents + [None]):
            ids += self.encode(template_text, add_special_tokens=False)
            if content is not None:
                ids += self.encode(content, add_special_tokens=False, specials_as_text=True)
        return ids

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=None, documents=None, **self.special_tokens)

    def _special_pattern(self) -> re.Pattern:
        """A pattern matching the text of any special token (longest first)."""
        if self._specials is None:
            texts = sorted((t.content for t in self.backend.get_added_tokens_decoder().values() if t.special),
                           key=len, reverse=True)
            self._specials = re.compile("|".join(map(re.escape, texts)) if texts else "(?!)")
        return self._specials


# Texts at least this long are tokenized without holding Python's global lock (tens of milliseconds and up), so a
# server's event loop answers while a long prompt is tokenized on another thread. Shorter ones take the plain call:
# the batch call may start the backend's thread pool, after which a fork makes the backend print a warning.
LONG_TEXT_CHARS = 65536
# Brackets the index of a message in the marked rendering (a private-use character, never in a template).
_MARK = "\ue000"


class ContentNotText(UserError):
    """A message's content holds a special token's text that cannot be kept apart as plain text."""


def stored_tokenizer_digest(folder: Path) -> str | None:
    """The sha256 of the backend stored in ``folder`` (as :attr:`Tokenizer.digest`), or None when absent."""
    try:
        return hashlib.sha256((folder / BACKEND_FILE).read_bytes()).hexdigest()
    except OSError:
        return None


def compile_chat_template(source: str):
    """A chat template compiled as ``transformers`` compiles it: an immutable sandbox, blocks trimmed, loop
    controls, ``{% generation %}`` blocks rendered as their body, ``tojson`` without HTML escaping, and the helpers
    ``raise_exception`` and ``strftime_now``."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): just its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The model's tokenizer, built with ``transformers`` (offline, from the GGUF metadata for ``.gguf`` files)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        if source.kind == "gguf":
            hf_tokenizer = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
        else:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(source.path))
    except Exception as exc:
        raise UserError(f"Cannot build a tokenizer for {source.path} ({exc}).") from None
    return Tokenizer.from_transformers(hf_tokenizer)


def eos_token_ids(tokenizer: Tokenizer) -> set[int]:
    """Token ids that end generation: the tokenizer's EOS plus chat end-of-turn markers it knows."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for marker in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
        marker_id = tokenizer.backend.token_to_id(marker)
        if marker_id is not None:
            ids.add(marker_id)
    return ids
