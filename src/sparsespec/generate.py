"""Prefill and autoregressive decoding as decoding programs (``passes.py``), and streaming of the text they spell."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from .cache.arena import KVArena
from .model import Transformer
from .passes import Program, forward_pass, run_alone, run_to_end
from .sampling import SamplingParams, next_token


def prefill(model: Transformer, cache: KVArena, token_ids: list[int], chunk: int) -> None:
    """Feed ``token_ids`` in chunks of ``chunk``, committing (and evicting) after each (:func:`prefill_steps`)."""
    run_to_end(prefill_steps(model, cache, token_ids, chunk))


def prefill_steps(model: Transformer, cache: KVArena, token_ids: list[int], chunk: int, *,
                  draft: bool = False) -> Program:
    """The program that feeds ``token_ids`` in chunks of ``chunk``, committing (and evicting) after each.

    Without retention, peak KV memory is the arena's budget plus one chunk, whatever the prompt length. With it
    (``cache/retention.py``) the prompt's last ``cache.tokens_to_hold`` tokens are held whole, their last rows (the
    observation window) read as a block of their own, and the selection made there shrinks the arena back.
    ``draft``: the passes are a draft model's (see :class:`~sparsespec.passes.Pass`).
    """
    held = cache.tokens_to_hold(len(token_ids))
    before = len(token_ids) - held
    yield from _feed(model, cache, token_ids[:before], chunk, draft)
    if held:
        window = cache.observation_rows(held)
        with cache.hold(held):
            yield from _feed(model, cache, token_ids[before : len(token_ids) - window], chunk, draft)
            yield from _feed(model, cache, token_ids[len(token_ids) - window :], chunk, draft)


def _feed(model: Transformer, cache: KVArena, token_ids: list[int], chunk: int, draft: bool) -> Program:
    """Feed ``token_ids`` as per-block chunks of at most ``chunk`` rows, committing after each."""
    for start in range(0, len(token_ids), chunk):
        block = token_ids[start : start + chunk]
        yield forward_pass(model, block, cache, per_block=True, last_only=True, draft=draft)
        cache.commit(len(block))


def generate_tokens(model: Transformer, cache: KVArena, prompt_ids: list[int], **options) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` new token ids, one forward pass each (:func:`decode_steps` run alone)."""
    return run_alone(decode_steps(model, cache, prompt_ids, **options))


def decode_steps(
    model: Transformer,
    cache: KVArena,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    eos_ids: Iterable[int] = (),
    prefill_chunk: int = 512,
    on_prefilled: Callable[[], None] | None = None,
) -> Program:
    """The program of autoregressive decoding: up to ``max_new_tokens`` new tokens, one forward pass each, stopping
    after an EOS id.

    The prompt's last token is fed like a generated one (a single row), so that this loop and speculative
    decoding see the same cache at every step. ``on_prefilled`` is called once the rest of the prompt is read.
    """
    eos = set(eos_ids)
    *context, token = prompt_ids
    yield from prefill_steps(model, cache, context, prefill_chunk)
    if on_prefilled is not None:
        on_prefilled()
    for step in range(max_new_tokens):
        logits = (yield forward_pass(model, [token], cache))[-1]
        cache.commit(1)
        token = next_token(logits, sampling, generator)
        yield token
        if token in eos or step == max_new_tokens - 1:
            return


def stream_text(
    tokens: Iterable[int], tokenizer, *, stop_strings: Iterable[str] = (), eos_ids: Iterable[int] = ()
) -> Iterator[str]:
    """Turn a stream of token ids into text pieces, ending at the first stop string (which is not emitted); see
    :class:`TextStream`."""
    text = TextStream(tokenizer, stop_strings=stop_strings, eos_ids=eos_ids)
    for token in tokens:
        yield from text.push(token)
        if text.ended:
            return
    yield from text.finish()


class TextStream:
    """Text pieces from token ids pushed one at a time, ending at the first stop string (not emitted) or EOS.

    EOS tokens are not printed. Pieces are emitted once they decode to complete characters; text that might be
    the start of a stop string is held back until it is known not to be.
    """

    def __init__(self, tokenizer, *, stop_strings: Iterable[str] = (), eos_ids: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stop_strings if s]
        self.eos = set(eos_ids)
        self.ended = False  # an EOS or a stop string was met: the text is complete
        self._pending: list[int] = []  # tokens that do not decode to complete characters yet
        self._held = ""  # decoded text not yet emitted (a possible stop-string prefix)

    def push(self, token: int) -> list[str]:
        """The pieces of text ``token`` completes (none once :attr:`ended`)."""
        if self.ended:
            return []
        if token in self.eos:
            self.ended = True
            return self.finish()
        self._pending.append(token)
        piece = self.tokenizer.decode(self._pending, skip_special_tokens=False)
        if piece.endswith("\ufffd"):
            return []  # an incomplete UTF-8 sequence: wait for the next byte token
        self._pending = []
        self._held += piece
        for stop in self.stops:
            at = self._held.find(stop)
            if at >= 0:
                self.ended = True
                before, self._held = self._held[:at], ""
                return [before] if before else []
        keep = max((k for s in self.stops for k in range(1, len(s)) if self._held.endswith(s[:k])), default=0)
        if len(self._held) > keep:
            piece, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
            return [piece]
        return []

    def finish(self) -> list[str]:
        """What is left once no token follows (held text, an incomplete character's bytes)."""
        if self._pending:
            self._held += self.tokenizer.decode(self._pending, skip_special_tokens=False)
            self._pending = []
        held, self._held = self._held, ""
        return [held] if held else []
