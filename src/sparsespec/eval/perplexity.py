"""Long-context perplexity through a budgeted KV cache, as in StreamingLLM's long-text experiment.

The text flows through the model once, in order, in blocks of ``chunk`` tokens: each block is one
``model.forward(block, arena, per_block=True)`` followed by ``arena.commit(len(block))``, so the cache evicts as it
goes and never holds more than ``budget + chunk`` entries. Row i of the logits predicts token i + 1; its negative
log-likelihood is collected in float64.

Chunk size and exactness:

- ``chunk = 1`` is token-by-token: every token sees exactly the cache that autoregressive decoding with the same
  policy would show it (same evictions, same heavy-hitter scores), so the perplexity measures the model that
  ``sparsespec generate`` runs.
- ``chunk > 1`` evicts once per chunk (the arena's per-block prefill mode): all rows of a chunk see the cache as it
  was before the chunk plus the causal part of the chunk, so a token inside a chunk can see up to ``chunk - 1``
  more entries than the budget allows, and the heavy-hitter scores that pick evictions are accumulated over the
  whole chunk before any eviction. Perplexity is usually a little lower (more context) and much cheaper to
  compute. With the full cache nothing is evicted and every chunk size gives the same numbers.

The arena must be built with ``max_block >= chunk`` (and, for the full cache, room for the whole text).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import torch

from ..cache.arena import KVArena
from ..model import Transformer


def streaming_nll(
    model: Transformer, arena: KVArena, token_ids: Sequence[int], chunk: int, progress: bool = False
) -> torch.Tensor:
    """Per-token negative log-likelihoods of ``token_ids`` under ``model`` reading through ``arena``.

    Args:
        model: the decoder.
        arena: an empty KV arena for ``model`` with ``max_block >= chunk`` (it is filled and committed as it goes).
        token_ids: the N tokens of the text.
        chunk: tokens per forward pass (1 = exact token-by-token decoding; see the module notes).
        progress: show a tqdm bar (on stderr) counting tokens.

    Returns:
        ``[N - 1]`` float64: entry i is ``-log p(token[i + 1] | tokens[≤ i])``.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 (got {chunk})")
    if chunk > arena.max_block:
        raise ValueError(f"chunk {chunk} exceeds the arena's max_block of {arena.max_block}")
    if arena.n_committed or arena.n_inflight or arena.next_position:
        raise ValueError("streaming_nll needs an empty arena")
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    n_inputs = ids.numel() - 1  # the last token is only ever predicted, never fed
    nll = torch.empty(max(n_inputs, 0), dtype=torch.float64)
    bar = None
    if progress:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=max(n_inputs, 0), unit="tok", desc="perplexity", file=sys.stderr, leave=False)
    try:
        for start in range(0, n_inputs, chunk):
            stop = min(start + chunk, n_inputs)
            logits = model.forward(ids[start:stop], arena, per_block=True)
            arena.commit(stop - start)
            logprobs = torch.log_softmax(logits.double(), dim=-1)
            targets = ids[start + 1 : stop + 1]
            nll[start:stop] = -logprobs.gather(1, targets[:, None])[:, 0]
            if bar is not None:
                bar.update(stop - start)
    finally:
        if bar is not None:
            bar.close()
    return nll


def ppl_arena(loaded, cache, n_tokens: int, chunk: int) -> KVArena:
    """An empty arena for reading ``n_tokens`` tokens in chunks of ``chunk`` with ``cache`` (a CacheOptions)."""
    from ..engine import make_arena

    return make_arena(loaded, replace(cache, prefill_chunk=chunk), max_tokens=max(n_tokens - 1, 1), max_inflight=1)


def measure_perplexity(
    loaded, cache, token_ids: Sequence[int], chunk: int, window: int = 256, progress: bool = False
) -> tuple[torch.Tensor, dict]:
    """Run :func:`streaming_nll` for a loaded model and CacheOptions; return the NLLs and a JSON-ready summary.

    ``chunk`` is capped at the number of predicted tokens. The summary holds :func:`nll_summary`'s fields plus
    ``chunk``, ``tokens``, ``cache`` and ``budget`` (the arena's policy: with ``cache.kv_bytes`` its budget comes
    from the bytes), ``kv_dtype``, ``kv_recent`` (positions read in full precision), ``kv_cache_bytes`` (peak =
    fixed arena size), ``kv_metadata_bytes`` and ``seconds``.
    """
    n = len(token_ids)
    chunk = max(1, min(chunk, n - 1))
    arena = ppl_arena(loaded, cache, n, chunk)
    started = time.perf_counter()
    nll = streaming_nll(loaded.model, arena, token_ids, chunk, progress=progress)
    seconds = time.perf_counter() - started
    summary = nll_summary(nll, window)
    summary.update(
        tokens=n, chunk=chunk, cache=arena.policy.describe(), budget=arena.policy.budget, kv_dtype=arena.kv_dtype,
        kv_recent=arena.recent_window, kv_cache_bytes=kv_peak_bytes(arena), kv_metadata_bytes=arena.metadata_nbytes,
        evicted_tokens=arena.evicted_tokens, seconds=round(seconds, 3),
        tokens_per_s=round((n - 1) / seconds, 2) if seconds > 0 else 0.0,
    )
    return nll, summary


def nll_from_logits(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """``[T - 1]`` float64 NLLs from ``[T, vocab]`` logits of one full pass over ``token_ids`` (row i → token i+1)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    return -logprobs.gather(1, ids[1:, None])[:, 0]


def perplexity(nll: torch.Tensor) -> float:
    """exp(mean NLL); ``nan`` for an empty tensor."""
    if nll.numel() == 0:
        return math.nan
    return math.exp(float(nll.double().mean()))


def window_perplexities(nll: torch.Tensor, window: int) -> list[float]:
    """Perplexity of each consecutive window of ``window`` predicted tokens (the last window may be shorter)."""
    if window < 1:
        raise ValueError(f"window must be at least 1 (got {window})")
    return [perplexity(nll[start : start + window]) for start in range(0, nll.numel(), window)]


def moving_average(values: torch.Tensor, window: int) -> torch.Tensor:
    """``[N]`` float64 trailing mean: entry i averages ``values[max(0, i - window + 1) : i + 1]``."""
    if window < 1:
        raise ValueError(f"window must be at least 1 (got {window})")
    x = values.double()
    if x.numel() == 0:
        return x
    csum = torch.cat([torch.zeros(1, dtype=torch.float64), x.cumsum(0)])
    idx = torch.arange(1, x.numel() + 1)
    lo = (idx - window).clamp(min=0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def kv_peak_bytes(arena: KVArena) -> int:
    """Peak bytes of the KV buffers: the arena is allocated once and never grows, so this is its size."""
    return arena.nbytes


def nll_summary(nll: torch.Tensor, window: int) -> dict:
    """Perplexity, mean NLL and per-window perplexities of one run, as plain numbers (for JSON)."""
    return {
        "ppl": round(perplexity(nll), 6),
        "mean_nll": round(float(nll.mean()), 8) if nll.numel() else math.nan,
        "predicted_tokens": int(nll.numel()),
        "window": window,
        "window_ppl": [round(p, 4) for p in window_perplexities(nll, window)] if nll.numel() else [],
    }


def plot_nll(curves: Mapping[str, torch.Tensor], path: str | Path, window: int = 256) -> Path:
    """Write a PNG of the moving-average NLL (over ``window`` tokens) against token position, one line per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, nll in curves.items():
        avg = moving_average(nll, window)
        ax.plot(torch.arange(1, avg.numel() + 1).numpy(), avg.numpy(), label=f"{label} (ppl {perplexity(nll):.2f})",
                linewidth=1.2)
    ax.set_xlabel("token position")
    ax.set_ylabel(f"NLL, moving average over {window} tokens")
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
