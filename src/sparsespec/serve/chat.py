"""The terminal chat: read a message, stream the answer, keep the conversation in the cache between turns."""

from __future__ import annotations

import sys
from typing import Callable, TextIO

from ..engine import RunStats, Session
from ..errors import UserError, user_message
from ..flags import PARAMETER_FLAGS
from ..generate import stream_text
from ..loading.huge_pages import hold_slow_huge_page_moves, release_slow_huge_page_moves
from ..loading.tokenizer import eos_token_ids
from ..sampling import SamplingParams

HELP = """Commands:
  /reset   forget the conversation (and empty the cache)
  /stats   statistics of the last answer and of the conversation
  /help    this list
Start and end a message with \"\"\" to type several lines. Ctrl-C stops an answer; Ctrl-D (on an empty line) quits."""

BLOCK = '"""'


def read_message(read: Callable[[str], str]) -> str:
    """One message: a line, or the lines between two ``\"\"\"`` markers. Raises EOFError at the end of input."""
    line = read(">>> ")
    first = line.strip()
    if not first.startswith(BLOCK):
        return line
    first = first[len(BLOCK):]
    if first.endswith(BLOCK):  # a block opened and closed on one line
        return first[: -len(BLOCK)].strip()
    lines = [first]
    while not lines[-1].endswith(BLOCK):
        lines.append(read("... ").rstrip())
    lines[-1] = lines[-1][: -len(BLOCK)]
    return "\n".join(lines).strip("\n")


class Chat:
    """A conversation with one model through a :class:`Session` (the cache is kept between turns)."""

    def __init__(self, session: Session, *, sampling: SamplingParams, max_new_tokens: int, seed: int,
                 out: TextIO = sys.stdout):
        tokenizer = session.target.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{session.target.name} has no chat template, so it cannot chat.")
        self.session = session
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.out = out
        self.eos = eos_token_ids(tokenizer)
        self.messages: list[dict] = []
        self.last: RunStats | None = None
        self.turns = 0

    def reset(self) -> None:
        self.messages = []
        self.session.reset()
        self.last = None
        self.turns = 0

    def answer(self, text: str) -> None:
        """Stream the answer to ``text``; Ctrl-C stops it (what was said so far stays in the conversation)."""
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        stats = RunStats()
        tokens = self.session.run(ids, max_new_tokens=self.max_new_tokens, sampling=self.sampling,
                                  seed=self.seed + self.turns, eos_ids=self.eos, stats=stats)
        pieces = []
        hold_slow_huge_page_moves()  # a slow move of the weights waits for the next input (huge_pages.py)
        try:
            for piece in stream_text(tokens, self.tokenizer, eos_ids=self.eos):
                pieces.append(piece)
                self.out.write(piece)
                self.out.flush()
        except KeyboardInterrupt:
            self.out.write(" [stopped]")
        finally:
            release_slow_huge_page_moves()
            tokens.close()
            self.out.write("\n")
            self.out.flush()
        self.messages = messages + [{"role": "assistant", "content": "".join(pieces)}]
        self.last = stats
        self.turns += 1

    def stats_text(self) -> str:
        policy = self.session.cache.policy
        turns = f"{self.turns} turn{'' if self.turns == 1 else 's'}"
        lines = [f"conversation: {turns}, {self.session.held_tokens} tokens in the cache, "
                 f"{self.session.evicted_tokens} evicted, cache {policy.describe()}, "
                 f"{self.session.kv_cache_bytes / 2**20:.1f} MiB of KV"]
        if self.last is not None:
            s = self.last
            lines.append(f"last answer: {s.new_tokens} tokens at {s.tokens_per_s:.1f} tok/s, first after "
                         f"{s.prefill_seconds:.2f} s; prompt {s.prompt_tokens} tokens, {s.reused_tokens} of them "
                         f"resumed from the cache; {s.evicted_tokens} evicted")
            if s.speculative is not None:
                lines.append(f"speculative: acceptance {s.speculative.acceptance_rate:.2f}, "
                             f"{s.speculative.tokens_per_target_pass:.2f} tokens per target pass, γ {s.final_gamma}")
        return "\n".join(lines)

    def loop(self, read: Callable[[str], str] = input) -> int:
        """Read, answer, repeat until the input ends (Ctrl-D)."""
        self.out.write(f"sparsespec chat with {self.session.target.name}. /help lists commands; Ctrl-D quits.\n")
        while True:
            try:
                text = read_message(read)
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                self.out.write("\n(Ctrl-D quits)\n")
                continue
            command = text.strip()
            if not command:
                continue
            if command == "/reset":
                self.reset()
                self.out.write("(conversation forgotten)\n")
            elif command == "/stats":
                self.out.write(self.stats_text() + "\n")
            elif command == "/help":
                self.out.write(HELP + "\n")
            elif command.startswith("/") and " " not in command:
                self.out.write(f"Unknown command {command}; /help lists them.\n")
            else:
                try:
                    self.answer(text)
                except UserError as exc:
                    self.out.write(f"error: {user_message(exc, PARAMETER_FLAGS)}\n")
            self.out.flush()
