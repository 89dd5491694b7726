"""Recall from a cold tier: what a budgeted cache evicts is kept compactly, and each decode row reads back the pages
its query points at (Quest's page selection, over compact int4 pages as ShadowKV and InfLLM keep them).

The tier is a native object that owns its memory (``kernels.cold_tier``, ``kernels/csrc/recall.h``): the arena's
native commit moves what it evicts there, and the native attention's rows recall from it, so nothing of it crosses
into Python per step. Storage, per layer, the entries in the order they left the arena (by the in-flight row that
evicted them, then by position); every KV head has the same number of them::

    entries     [n_layers, capacity, n_kv, width]                uint8: per entry, the int4 codes of its key and of
                                                                 its value (``head_dim / 2`` bytes each, ``quant.py``'s
                                                                 nibble order), then their float16 (scale, zero) per
                                                                 group of 16 channels, as bytes
    positions   [n_layers, capacity, n_kv]                       int64 true positions
    summaries   [n_layers, capacity // PAGE, n_kv, 2 * head_dim]  float32 max, then min, per channel of each complete
                                                                 page's keys as rows score them

Keys are stored unrotated (the original mode's arena keys are turned back by their positions as they leave) and minus
the model's key bias (the offset ``quant.py`` takes out of in-cache keys, without which 4 bits fail on Qwen2's keys).
A recalled key is read as dequantized + bias, rotated by its true position in the ``original`` position mode. In the
``in-cache`` mode the recalled entries of a row take the ranks from the tier's first rank (the policy's sink count)
on, in position order: they sit just after the sinks, as the oldest
entries of the cache, in the order they were written (a number's digits keep their order), and no rank passes the
cache's. The page summaries there are of keys rotated by that first rank, so their bounds are estimates of a page's
q · k rather than bounds; in the ``original`` mode they bound it.

A row of a row-by-row block (decode steps, verification rows, draft steps; prefill chunks read the resident entries
only) recalls in three steps, in the native attention op after its attention over the resident entries:

1. its view of the tier: the committed entries, then those evicted by in-flight rows before it, in the order an
   autoregressive run would have committed them; pages are runs of :data:`PAGE` consecutive entries of that view,
   and the last, incomplete page is its tail;
2. every complete page gets an upper bound of the row's ``q · k`` over the page from the summaries,
   ``Σ_d max(q_d · min_d, q_d · max_d)``, the largest over the query heads of each KV head (GQA-aware: each KV head
   recalls its own pages);
3. the ``pages`` pages with the highest bounds (ties: the older page) and the tail are dequantized and attended
   together with the resident entries: the row's output is softmax attention over the union, merged from the two
   parts by their log-sum-exps.

The reference of these steps is a naive float64 implementation in ``tests/test_recall.py``, which shares no code
with the library.

Recalled entries gain no heavy-hitter score and never return to the arena: the resident cache keeps and evicts
exactly what it would without recall. Exactness: everything a row reads is decided by the committed tier, the
entries evicted before it and its own query, never by rows after it, so a verification row recalls what the
autoregressive step at its position recalls (tested, both position modes).

What a row reads, per layer and KV head: the resident budget, ``pages * PAGE`` recalled entries and the tail at
int4, and the summaries, ``2 * head_dim`` float32 per page: per evicted entry an eighth of a bfloat16 key and value.
The tier's memory per token that left the arena is :func:`bytes_per_entry` per layer and KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..errors import ConfigError
from ..rope import Rope
from .policy import CachePolicy
from .quant import group_size

PAGE = 16  # entries per page (Quest's page size)
DEFAULT_PAGES = 8  # pages a row recalls: 128 entries, an eighth of a 1024-entry budget
# The most pages a row may recall: 16,384 entries, more than any budget this engine is run with; a row's recall
# allocates and reads that many entries for every layer.
MAX_PAGES = 1024
BITS = 4


@dataclass(frozen=True)
class Recall:
    """How many pages of the cold tier each decode row reads back."""

    pages: int = DEFAULT_PAGES


def recalled_entries(pages: int) -> int:
    """The most entries one row reads back with ``pages`` pages: theirs and the newest, incomplete page."""
    return pages * PAGE + PAGE


def recall_for(pages: int | None, policy: CachePolicy) -> Recall | None:
    """The recall of ``recall_pages`` = ``pages`` (None: no cold tier). Raises :class:`ConfigError` for a page count
    below 1 or a policy that evicts nothing."""
    if pages is None:
        return None
    if not 1 <= pages <= MAX_PAGES:
        raise ConfigError("{recall_pages} must be from 1 to {most} (got {value}); drop it to keep no cold tier.",
                          most=MAX_PAGES, value=pages)
    if policy.is_full:
        raise ConfigError("{recall_pages} reads back what a budgeted cache evicted, and the full cache evicts "
                          "nothing; choose a budgeted {policy} or drop {recall_pages}.")
    return Recall(pages)


def cold_tier(n_layers: int, n_kv: int, head_dim: int, rope: Rope, scale: float, key_offset: torch.Tensor | None,
              rank: int | None, recall: Recall):
    """An empty cold tier (``kernels.cold_tier``, which owns its memory) for an arena of ``n_layers`` x ``n_kv`` heads:
    ``rope`` the model's rotary embedding, ``scale`` the softmax scale, ``key_offset [n_layers, n_kv, head_dim]`` the
    model's key bias or None, ``rank`` the rank recalled keys take from (the in-cache mode) or None: their true
    positions."""
    return kernels.cold_tier(n_layers, n_kv, head_dim, rope.inv_freq, rope.attention_factor, scale,
                             None if key_offset is None else key_offset.float().contiguous(),
                             -1 if rank is None else rank, recall.pages, PAGE)


def bytes_per_entry(head_dim: int) -> int:
    """Bytes of one cold entry in one layer and KV head: int4 key and value codes with their float16 scales and
    zeros, its position, and its share of its page's summary."""
    groups = head_dim // group_size(head_dim, BITS)
    return 2 * (head_dim * BITS // 8 + groups * 4) + 8 + 2 * head_dim * 4 // PAGE
