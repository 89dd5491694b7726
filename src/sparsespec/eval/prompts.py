"""The prompt set of the speed / acceptance sweep (``prompts.json``, next to this file), and turning prompts into ids.

Each prompt has an ``id``, a ``kind`` (``code``, ``prose`` or ``chat``) and its ``text``; chat prompts also carry
``"chat": true`` and are wrapped in the tokenizer's chat template as one user message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..errors import ConfigError, UserError

PROMPTS_FILE = Path(__file__).with_name("prompts.json")
KINDS = ("code", "prose", "chat")


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str
    text: str
    chat: bool = False


def parse_kinds(text: str | None) -> tuple[str, ...] | None:
    """``"code,prose"`` → ``("code", "prose")``; ``None``, empty or ``all`` → ``None`` (every kind)."""
    if text is None or not text.strip() or text.strip() == "all":
        return None
    kinds = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise UserError(f"Unknown prompt kind {unknown[0]!r}; choose from {', '.join(KINDS)} (comma-separated).")
    return kinds


def load_prompts(
    kinds: Iterable[str] | None = None, path: str | Path = PROMPTS_FILE, *, per_kind: int | None = None
) -> list[Prompt]:
    """The prompts of the given kinds (all when ``kinds`` is None), in file order; with ``per_kind``, only the first
    ``per_kind`` prompts of each kind."""
    wanted = None if kinds is None else set(kinds)
    if wanted is not None:
        unknown = sorted(wanted - set(KINDS))
        if unknown:
            raise UserError(f"Unknown prompt kind {unknown[0]!r}; choose from {', '.join(KINDS)}.")
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    prompts = [
        Prompt(p["id"], p["kind"], p["text"], bool(p.get("chat", False)))
        for p in data["prompts"]
        if wanted is None or p["kind"] in wanted
    ]
    if per_kind is not None:
        prompts = [p for i, p in enumerate(prompts) if sum(q.kind == p.kind for q in prompts[:i]) < per_kind]
    return prompts


def prompt_ids(tokenizer, prompt: Prompt, context: str = "") -> list[int]:
    """Token ids of ``prompt``, preceded by ``context`` text (a long document to read first) when given.

    Plain prompts are encoded with the tokenizer's special tokens (a BOS where it adds one). Chat prompts become one
    user message (context, blank line, request) wrapped in the chat template with the assistant's turn opened.
    """
    text = f"{context}\n\n{prompt.text}" if context else prompt.text
    if prompt.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("The model's tokenizer has no chat template; leave chat prompts out ({kinds} "
                              "code,prose).")
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True))
    return list(tokenizer.encode(text, add_special_tokens=True))
