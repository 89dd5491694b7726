"""Evaluation texts: ``--text FILE`` or ``--text corpus:NAME`` (a text of the fetched corpus), read and tokenized."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, UserError

CORPUS_PREFIX = "corpus:"


def resolve_text(text: str) -> Path:
    """The file ``text`` names (a path or ``corpus:NAME``); :class:`UserError` when it does not exist or the corpus
    name is unknown."""
    if text.startswith(CORPUS_PREFIX):
        from ..loading.fetch import corpus_text_path

        name = text[len(CORPUS_PREFIX):].strip()
        if not name:
            raise ConfigError("{text} corpus: needs a text name after the colon, e.g. corpus:hamlet.")
        return corpus_text_path(name)
    path = Path(text).expanduser()
    if not path.is_file():
        what = "is a folder, not a text file" if path.is_dir() else "does not exist"
        raise UserError(f"Text file {path} {what}.")
    return path


def read_text(text: str) -> str:
    """The contents of the file ``text`` names (UTF-8; undecodable bytes become U+FFFD)."""
    path = resolve_text(text)
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UserError(f"Cannot read text file {path}: {exc.strerror}.") from None


def text_token_ids(tokenizer, text: str, max_tokens: int | None = None, min_tokens: int = 2) -> list[int]:
    """The first ``max_tokens`` token ids of the text ``text`` names (all of them when None), with the tokenizer's
    BOS.

    Raises :class:`UserError` when fewer than ``min_tokens`` tokens result.
    """
    if max_tokens is not None and max_tokens < min_tokens:
        raise ConfigError("{max_tokens} must be at least {least} (got {value}).", least=min_tokens, value=max_tokens)
    contents = read_text(text)
    if max_tokens is not None:
        # Tokenizing a prefix is enough: no token of these tokenizers spans more than a few dozen characters.
        prefix = contents[: max_tokens * 32 + 1024]
        ids = list(tokenizer.encode(prefix, add_special_tokens=True))
        if len(ids) < max_tokens and len(prefix) < len(contents):
            ids = list(tokenizer.encode(contents, add_special_tokens=True))
        ids = ids[:max_tokens]
    else:
        ids = list(tokenizer.encode(contents, add_special_tokens=True))
    if len(ids) < min_tokens:
        raise UserError(f"The text {text} has {len(ids)} token(s); perplexity needs at least {min_tokens}.")
    return ids
