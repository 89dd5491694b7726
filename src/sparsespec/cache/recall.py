"""Recall from a cold tier: what a budgeted cache evicts is kept compactly, and each decode row reads back the pages
its query points at (Quest's page selection, over compact int4 pages as ShadowKV and InfLLM keep them).

Storage, per layer, the entries in the order they left the arena (by the in-flight row that evicted them, then by
position); every KV head has the same number of them::

    entries     [n_layers, capacity, n_kv, width]                uint8: per entry, the int4 codes of its key and of
                                                                 its value (``head_dim / 2`` bytes each, ``quant.py``'s
                                                                 nibble order), then their float16 (scale, zero) per
                                                                 group of 16 channels, as bytes
    positions   [n_layers, capacity, n_kv]                       int64 true positions
    summaries   [n_layers, capacity // PAGE, n_kv, 2 * head_dim]  float32 max, then min, per channel of each complete
                                                                 page's keys as rows score them

Keys are stored unrotated and minus the model's key bias (the offset ``quant.py`` takes out of in-cache keys, without
which 4 bits fail on Qwen2's keys). A recalled key is read as dequantized + bias, rotated by its true position in the
``original`` position mode. In the ``in-cache`` mode the recalled entries of a row take the ranks from
:attr:`ColdTier.rank` (the policy's sink count) on, in position order: they sit just after the sinks, as the oldest
entries of the cache, in the order they were written (a number's digits keep their order), and no rank passes the
cache's. The page summaries there are of keys rotated by that first rank, so their bounds are estimates of a page's
q · k rather than bounds; in the ``original`` mode they bound it.

A row of a row-by-row block (decode steps, verification rows, draft steps; prefill chunks read the resident entries
only) recalls in three steps, in the native op ``kernels.recall_attention`` (:meth:`ColdTier.merge_native`):

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
The tier's memory per token that left the arena is :meth:`ColdTier.bytes_per_entry` per layer and KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..errors import ConfigError
from ..rope import Rope
from .policy import CachePolicy
from .quant import group_size, quantize

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


@dataclass
class Entries:
    """Cold entries in the tier's format: ``packed [..., width]`` uint8 (see the top) and ``positions [...]``."""

    packed: torch.Tensor
    positions: torch.Tensor

    def __len__(self) -> int:
        return self.positions.shape[0]

    def __getitem__(self, index) -> "Entries":
        return Entries(self.packed[index], self.positions[index])

    def transposed(self) -> "Entries":
        """Entry-major ``[n, n_kv]`` as head-major ``[n_kv, n]`` (or back)."""
        return Entries(self.packed.transpose(0, 1), self.positions.T)

    def cat(self, other: "Entries") -> "Entries":
        return Entries(torch.cat((self.packed, other.packed)), torch.cat((self.positions, other.positions)))


class ColdTier:
    """The entries a budgeted arena evicted, for every layer, as int4 pages with key summaries (see the top)."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, rope: Rope, scale: float,
                 key_offset: torch.Tensor | None, rank: int | None, recall: Recall) -> None:
        """
        Args:
            rope: the model's rotary embedding.
            scale: the softmax scale (1 / sqrt(head_dim)).
            key_offset: ``[n_layers, n_kv, head_dim]`` the model's key bias, or None.
            rank: the rank recalled keys are rotated by (the in-cache mode), or None: by their true positions.
            recall: how many pages a row reads back.
        """
        self.n_layers, self.n_kv, self.head_dim = n_layers, n_kv, head_dim
        self.rope, self.scale, self.rank, self.pages = rope, scale, rank, recall.pages
        self.key_offset = None if key_offset is None else key_offset.float()
        self.groups = head_dim // group_size(head_dim, BITS)
        self.codes_width = head_dim * BITS // 8  # bytes of one vector's codes
        self.width = 2 * self.codes_width + 2 * self.groups * 4  # codes, then float16 (scale, zero) per group
        # In the in-cache mode the summaries' keys all turn by the first rank: its cos / sin rows, once.
        self._rank_rotation = None if rank is None else rope.cos_sin(torch.tensor(rank))
        self.count = 0  # entries per layer and KV head
        self.capacity = 0
        self.highest_position = -1  # of every entry appended (the RoPE tables the native op needs reach it)
        self.entries = torch.zeros(n_layers, 0, n_kv, self.width, dtype=torch.uint8)
        self.positions = torch.zeros(n_layers, 0, n_kv, dtype=torch.int64)
        self.summaries = torch.zeros(n_layers, 0, n_kv, 2 * head_dim)

    def _grow(self, capacity: int) -> None:
        """Reallocate room for ``capacity`` entries per layer and KV head, keeping the first :attr:`count`."""
        n, pages = self.count, self.count // PAGE
        for name, size in (("entries", capacity), ("positions", capacity), ("summaries", capacity // PAGE)):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], size, *old.shape[2:])
            new[:, : n if name != "summaries" else pages] = old[:, : n if name != "summaries" else pages]
            setattr(self, name, new)
        self.capacity = capacity

    def reset(self) -> None:
        """Forget every entry (the buffers stay)."""
        self.count = 0

    @property
    def nbytes(self) -> int:
        """Bytes the tier holds in use: its entries and page summaries."""
        return self.count * self.bytes_per_entry(self.head_dim) * self.n_layers * self.n_kv

    @staticmethod
    def bytes_per_entry(head_dim: int) -> int:
        """Bytes of one cold entry in one layer and KV head: int4 key and value codes with their float16 scales and
        zeros, its position, and its share of its page's summary."""
        groups = head_dim // group_size(head_dim, BITS)
        return 2 * (head_dim * BITS // 8 + groups * 4) + 8 + 2 * head_dim * 4 // PAGE

    # ---------------------------------------------------------------------------------------------- entries
    def encode(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               layer: int | None = None) -> Entries:
        """``keys, values: [n, n_kv, head_dim]`` (keys unrotated, bias in), ``positions [n, n_kv]`` of ``layer`` in
        the tier's format; with ``layer`` None, of every layer: ``[n_layers, n, n_kv, ...]``."""
        if self.key_offset is not None:
            keys = keys.float() - (self.key_offset[:, None] if layer is None else self.key_offset[layer])
        key_codes, key_params = quantize(keys, BITS)
        value_codes, value_params = quantize(values, BITS)
        params = torch.stack((key_params, value_params), dim=-3).view(torch.uint8).flatten(-3)
        return Entries(torch.cat((key_codes, value_codes, params), dim=-1), positions)

    def decode(self, entries: Entries, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values) [n_kv, n, head_dim]`` float32 of head-major ``entries [n_kv, n]``: keys dequantized, bias
        in, rotated as the summaries rotate them (by their positions in the original mode, else by the first rank);
        values dequantized."""
        packed = entries.packed
        codes = packed[..., : 2 * self.codes_width].unflatten(-1, (2, self.codes_width))  # [n_kv, n, k/v, hd / 2]
        codes = torch.cat((codes & 15, codes >> 4), dim=-1).unflatten(-1, (self.groups, -1))
        params = packed[..., 2 * self.codes_width :].view(torch.float16).unflatten(-1, (2, self.groups, 2)).float()
        both = torch.addcmul(params[..., 1:], codes.float(), params[..., :1]).flatten(-2)  # [n_kv, n, k/v, hd]
        keys, values = both[..., 0, :], both[..., 1, :]
        if self.key_offset is not None:
            keys = keys + self.key_offset[layer][:, None]
        cos, sin = self.rope.cos_sin(entries.positions) if self.rank is None else self._rank_rotation
        half = self.head_dim // 2
        keys = keys * cos + torch.cat((-keys[..., half:], keys[..., :half]), dim=-1) * sin
        return keys, values

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Add ``n`` entries per layer and KV head: ``keys, values: [n_layers, n, n_kv, head_dim]`` (keys unrotated,
        bias in), ``positions [n_layers, n, n_kv]``; summarise the pages they complete."""
        n = positions.shape[1]
        if not n:
            return
        if self.count + n > self.capacity:
            self._grow(max(2 * self.capacity, self.count + n, 4 * PAGE))
        stop = self.count + n
        first_page, end_page = self.count // PAGE, stop // PAGE
        self.highest_position = max(self.highest_position, int(positions.max()))
        new = self.encode(keys, values, positions)
        self.entries[:, self.count : stop] = new.packed
        self.positions[:, self.count : stop] = new.positions
        for layer in range(self.n_layers if end_page > first_page else 0):
            self.summaries[layer, first_page:end_page] = self.summarise(
                self.stored(layer)[first_page * PAGE : end_page * PAGE], layer)
        self.count = stop

    def stored(self, layer: int) -> Entries:
        """The buffers of ``layer`` as entries (the first :attr:`count` are committed)."""
        return Entries(self.entries[layer], self.positions[layer])

    def summarise(self, entries: Entries, layer: int) -> torch.Tensor:
        """``[n / PAGE, n_kv, 2 * head_dim]``: each page's channel-wise max, then min, of its keys (``n`` entries, a
        multiple of :data:`PAGE`)."""
        keys = self.decode(entries.transposed(), layer)[0].unflatten(1, (-1, PAGE))  # [n_kv, pages, PAGE, hd]
        return torch.cat((keys.amax(dim=2), keys.amin(dim=2)), dim=-1).transpose(0, 1)

    # ---------------------------------------------------------------------------------------------- a row
    def view(self, layer: int, pending: Entries | None) -> tuple[int, Entries, torch.Tensor | None, int]:
        """A row's view of ``layer``: the committed entries, then ``pending`` (those evicted by in-flight rows before
        the row, ``[n, n_kv]`` in eviction order, or None). Returns ``(extra_start, extra, extra_summaries,
        total)``: the view's entries from ``extra_start`` (the end of the stored pages) on, the committed tail then
        the pending ones, with the summaries of their complete pages (None: no such page), summarised here as a
        commit would summarise them; ``total`` entries in all."""
        n_committed = self.count
        total = n_committed + (len(pending) if pending is not None else 0)
        extra_start = n_committed // PAGE * PAGE
        extra = self.stored(layer)[extra_start:n_committed]
        if pending is not None:
            extra = extra.cat(pending)
        complete = total // PAGE * PAGE - extra_start
        return extra_start, extra, self.summarise(extra[:complete], layer) if complete else None, total

    def merge_native(self, layer: int, query: torch.Tensor, query_row: int, pending: Entries | None,
                     out_row: torch.Tensor, lse_row: torch.Tensor) -> None:
        """One row's recall through the native op, merged into its resident attention in place.

        Args:
            query: ``[n_kv, group, head_dim]`` float32 before RoPE; it rotates by ``query_row`` (position or rank).
            pending: the entries evicted by in-flight rows before this one (``[n, n_kv]``, in eviction order), or
                None.
            out_row: ``[n_kv * group * head_dim]`` the row's attention over the resident entries, replaced by the
                attention over the union; ``lse_row [n_kv * group]`` its log-sum-exps over the resident entries (read
                only).
        """
        pending_given = pending is not None
        if not pending_given:  # the view is the stored tier
            extra_start, extra, extra_summaries, total = 0, None, None, self.count
        else:
            extra_start, extra, extra_summaries, total = self.view(layer, pending)
        recalled = recalled_entries(self.pages)  # the most entries a row reads, which take the ranks from self.rank on
        highest = max(self.rank + recalled if self.rank is not None else self.highest_position, query_row)
        if pending_given:
            highest = max(highest, int(extra.positions.max()))
        cos, sin = self.rope.tables(highest + 1)
        kernels.recall_attention(
            query, query_row, self.entries[layer], self.positions[layer], self.summaries[layer], total,
            extra=extra.packed.contiguous() if pending_given else None,
            extra_positions=extra.positions.contiguous() if pending_given else None,
            extra_summaries=extra_summaries, extra_start=extra_start,
            key_offset=None if self.key_offset is None else self.key_offset[layer], cos=cos, sin=sin,
            rank=-1 if self.rank is None else self.rank, pages=self.pages, page_size=PAGE, scale=self.scale,
            out_row=out_row, lse_row=lse_row)
