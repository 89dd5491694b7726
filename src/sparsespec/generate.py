"""Autoregressive decoding as a Python generator of token ids, and streaming of the text they spell."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from .cache.arena import KVArena
from .model import Transformer
from .sampling import SamplingParams, next_token


def prefill(model: Transformer, cache: KVArena, token_ids: list[int], chunk: int) -> None:
    """Feed ``token_ids`` in chunks of ``chunk``, committing (and evicting) after each.

    Without retention, peak KV memory is the arena's budget plus one chunk, whatever the prompt length. With it
    (``cache/retention.py``) the prompt's last ``cache.tokens_to_hold`` tokens are held whole, their last rows (the
    observation window) read as a block of their own, and the selection made there shrinks the arena back.
    """
    held = cache.tokens_to_hold(len(token_ids))
    before = len(token_ids) - held
    _feed(model, cache, token_ids[:before], chunk)
    if held:
        window = cache.observation_rows(held)
        with cache.hold(held):
            _feed(model, cache, token_ids[before : len(token_ids) - window], chunk)
            _feed(model, cache, token_ids[len(token_ids) - window :], chunk)


def _feed(model: Transformer, cache: KVArena, token_ids: list[int], chunk: int) -> None:
    """Feed ``token_ids`` as per-block chunks of at most ``chunk`` rows, committing after each."""
    for start in range(0, len(token_ids), chunk):
        block = torch.tensor(token_ids[start : start + chunk], dtype=torch.long)
        model.forward(block, cache, per_block=True, last_only=True)
        cache.commit(len(block))


def generate_tokens(
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
) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` new token ids, one forward pass each, stopping after an EOS id.

    The prompt's last token is fed like a generated one (a single row), so that this loop and speculative
    decoding see the same cache at every step. ``on_prefilled`` is called once the rest of the prompt is read.
    """
    eos = set(eos_ids)
    *context, token = prompt_ids
    prefill(model, cache, context, prefill_chunk)
    if on_prefilled is not None:
        on_prefilled()
    for step in range(max_new_tokens):
        logits = model.forward(torch.tensor([token]), cache)[-1]
        cache.commit(1)
        token = next_token(logits, sampling, generator)
        yield token
        if token in eos or step == max_new_tokens - 1:
            return


def stream_text(
    tokens: Iterable[int], tokenizer, *, stop_strings: Iterable[str] = (), eos_ids: Iterable[int] = ()
) -> Iterator[str]:
    """Turn a stream of token ids into text pieces, ending at the first stop string (which is not emitted).

    EOS tokens are not printed. Pieces are emitted once they decode to complete characters; text that might be
    the start of a stop string is held back until it is known not to be.
    """
    stops = [s for s in stop_strings if s]
    eos = set(eos_ids)
    pending: list[int] = []
    held = ""  # decoded text not yet emitted (a possible stop-string prefix)
    for token in tokens:
        if token in eos:
            break
        pending.append(token)
        piece = tokenizer.decode(pending, skip_special_tokens=False)
        if piece.endswith("\ufffd"):
            continue  # an incomplete UTF-8 sequence: wait for the next byte token
        pending = []
        held += piece
        for stop in stops:
            at = held.find(stop)
            if at >= 0:
                if held[:at]:
                    yield held[:at]
                return
        keep = max((k for s in stops for k in range(1, len(s)) if held.endswith(s[:k])), default=0)
        if len(held) > keep:
            yield held[: len(held) - keep]
            held = held[len(held) - keep :]
    if pending:
        held += tokenizer.decode(pending, skip_special_tokens=False)
    if held:
        yield held
