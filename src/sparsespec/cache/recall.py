"""Recall from a cold tier: what a budgeted cache evicts is kept compactly, and each decode row reads back the pages
its query points at (Quest's page selection, over compact int4 pages as ShadowKV and InfLLM keep them).

Storage, per layer, the entries in the order they left the arena (by the in-flight row that evicted them, then by
position); every KV head has the same number of them::

    key_codes, value_codes     [n_layers, capacity, n_kv, head_dim // 2]        uint8 int4 codes (``quant.py``)
    key_params, value_params   [n_layers, capacity, n_kv, head_dim // 16, 2]    float16 (scale, zero) per group
    positions                  [n_layers, capacity, n_kv]                       int64 true positions
    summaries                  [n_layers, capacity // PAGE, n_kv, 2, head_dim]  float32 min and max per channel of
                                                                                each complete page's keys

Keys are stored unrotated and minus the model's key bias (the offset ``quant.py`` takes out of in-cache keys, without
which 4 bits fail on Qwen2's keys). A recalled key is read as dequantized + bias, rotated by its true position in the
``original`` position mode, or in the ``in-cache`` mode by the fixed rank :attr:`ColdTier.rank` (the policy's sink
count: recalled entries sit just after the sinks, as the oldest entries of the cache, so no rank passes the cache's
and the page summaries, taken of the rotated keys, stay valid while the resident ranks move).

A row of a row-by-row block (decode steps, verification rows, draft steps; prefill chunks read the resident entries
only) recalls in three steps (:meth:`ColdTier.attend_row`):

1. its view of the tier: the committed entries, then those evicted by in-flight rows before it, in the order an
   autoregressive run would have committed them; pages are runs of :data:`PAGE` consecutive entries of that view,
   and the last, incomplete page is its tail;
2. every complete page gets an upper bound of the row's ``q · k`` over the page from the summaries,
   ``Σ_d max(q_d · min_d, q_d · max_d)``, the largest over the query heads of each KV head (GQA-aware: each KV head
   recalls its own pages);
3. the ``pages`` pages with the highest bounds (ties: the older page) and the tail are dequantized and attended
   together with the resident entries: the row's output is softmax attention over the union, merged from the two
   parts by their log-sum-exps (:func:`merge_attention`).

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

from ..errors import UserError
from ..rope import Rope
from .policy import CachePolicy
from .quant import dequantize, group_size, quantize

PAGE = 16  # entries per page (Quest's page size)
DEFAULT_PAGES = 8  # pages a row recalls: 128 entries, an eighth of a 1024-entry budget
BITS = 4
MAX_ORDER = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class Recall:
    """How many pages of the cold tier each decode row reads back."""

    pages: int = DEFAULT_PAGES


def recall_for(pages: int | None, policy: CachePolicy) -> Recall | None:
    """The recall of ``--recall-pages PAGES`` (None: no cold tier). Raises :class:`UserError` for a page count
    below 1 or a policy that evicts nothing."""
    if pages is None:
        return None
    if pages < 1:
        raise UserError(f"--recall-pages must be at least 1 (got {pages}); drop it to keep no cold tier.")
    if policy.is_full:
        raise UserError("--recall-pages reads back what a budgeted cache evicted, and the full cache evicts nothing; "
                        "choose a budgeted --policy or drop --recall-pages.")
    return Recall(pages)


@dataclass
class Entries:
    """Cold entries of one layer in the tier's format, ``n`` of them per KV head (entry-major)."""

    key_codes: torch.Tensor  # [n, n_kv, head_dim // 2] uint8
    key_params: torch.Tensor  # [n, n_kv, groups, 2] float16
    value_codes: torch.Tensor
    value_params: torch.Tensor
    positions: torch.Tensor  # [n, n_kv] int64

    def __len__(self) -> int:
        return self.positions.shape[0]


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the union of two disjoint sets of entries from each set's own: ``out_*: [..., d]``
    outputs, ``lse_*: [...]`` log-sum-exps of their scaled logits; float32 ``[..., d]``."""
    total = torch.logaddexp(lse_a, lse_b)
    return (lse_a - total).exp_()[..., None] * out_a.float() + (lse_b - total).exp_()[..., None] * out_b.float()


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
        self.count = 0  # entries per layer and KV head
        self._allocate(0)

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate room for ``capacity`` entries per layer and KV head, keeping the first :attr:`count`."""
        L, n_kv, hd = self.n_layers, self.n_kv, self.head_dim
        codes, groups = hd * BITS // 8, hd // group_size(hd, BITS)
        shapes = {"key_codes": ((codes,), torch.uint8), "value_codes": ((codes,), torch.uint8),
                  "key_params": ((groups, 2), torch.float16), "value_params": ((groups, 2), torch.float16),
                  "positions": ((), torch.int64)}
        for name, (tail, dtype) in shapes.items():
            new = torch.zeros(L, capacity, n_kv, *tail, dtype=dtype)
            if self.count:
                new[:, : self.count] = getattr(self, name)[:, : self.count]
            setattr(self, name, new)
        summaries = torch.zeros(L, capacity // PAGE, n_kv, 2, hd)
        if self.count >= PAGE:
            summaries[:, : self.count // PAGE] = self.summaries[:, : self.count // PAGE]
        self.summaries = summaries
        self.capacity = capacity

    def reset(self) -> None:
        """Forget every entry (the buffers stay)."""
        self.count = 0

    @property
    def nbytes(self) -> int:
        """Bytes the tier holds in use: its entries and page summaries."""
        per_entry = self.bytes_per_entry(self.head_dim) * self.n_layers * self.n_kv
        return self.count * per_entry

    @staticmethod
    def bytes_per_entry(head_dim: int) -> int:
        """Bytes of one cold entry in one layer and KV head: int4 key and value codes with their float16 scales and
        zeros, its position, and its share of its page's summary."""
        groups = head_dim // group_size(head_dim, BITS)
        return 2 * (head_dim * BITS // 8 + groups * 4) + 8 + 2 * head_dim * 4 // PAGE

    # ---------------------------------------------------------------------------------------------- entries
    def encode(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, layer: int) -> Entries:
        """``keys, values: [n, n_kv, head_dim]`` (keys unrotated, bias in), ``positions [n, n_kv]`` of ``layer`` in
        the tier's format."""
        if self.key_offset is not None:
            keys = keys.float() - self.key_offset[layer]
        key_codes, key_params = quantize(keys, BITS)
        value_codes, value_params = quantize(values, BITS)
        return Entries(key_codes, key_params, value_codes, value_params, positions)

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Add ``n`` entries per layer and KV head: ``keys, values: [n_layers, n, n_kv, head_dim]`` (keys unrotated,
        bias in), ``positions [n_layers, n, n_kv]``; summarise the pages they complete."""
        n = positions.shape[1]
        if not n:
            return
        if self.count + n > self.capacity:
            self._allocate(max(2 * self.capacity, self.count + n, 4 * PAGE))
        stop = self.count + n
        for layer in range(self.n_layers):
            new = self.encode(keys[layer], values[layer], positions[layer], layer)
            for name in ("key_codes", "key_params", "value_codes", "value_params", "positions"):
                getattr(self, name)[layer, self.count : stop] = getattr(new, name)
        first_page, end_page = self.count // PAGE, stop // PAGE
        self.count = stop
        for layer in range(self.n_layers):
            if end_page > first_page:
                stored = self.stored(layer, first_page * PAGE, end_page * PAGE)
                self.summaries[layer, first_page:end_page] = self.summarise(stored, layer)

    def stored(self, layer: int, start: int, stop: int) -> Entries:
        """The committed entries ``[start, stop)`` of ``layer``."""
        return Entries(*(getattr(self, name)[layer, start:stop] for name in
                         ("key_codes", "key_params", "value_codes", "value_params", "positions")))

    def keys(self, entries: Entries, layer: int) -> torch.Tensor:
        """``[n, n_kv, head_dim]`` float32: the entries' keys as rows score them (dequantized, bias in, rotated)."""
        keys = dequantize(entries.key_codes, entries.key_params, BITS, torch.float32)
        if self.key_offset is not None:
            keys = keys + self.key_offset[layer]
        rotate_by = entries.positions if self.rank is None else torch.full_like(entries.positions, self.rank)
        return self.rope.rotate(keys.transpose(0, 1), rotate_by.T).transpose(0, 1)

    def summarise(self, entries: Entries, layer: int) -> torch.Tensor:
        """``[n / PAGE, n_kv, 2, head_dim]``: each page's channel-wise min and max of its keys (``n`` a multiple of
        :data:`PAGE`)."""
        keys = self.keys(entries, layer).unflatten(0, (-1, PAGE))
        return torch.stack((keys.amin(dim=1), keys.amax(dim=1)), dim=2)

    # ---------------------------------------------------------------------------------------------- a row
    def attend_row(self, layer: int, query: torch.Tensor, pending: Entries | None):
        """Attention of one row over what it recalls from ``layer``.

        Args:
            query: ``[n_kv, group, head_dim]`` float32, rotated as the row attends (the in-cache mode: by its rank).
            pending: the entries evicted by in-flight rows before this one (in eviction order), or None.

        Returns:
            ``(out [n_kv, group, head_dim], lse [n_kv, group])`` float32 over the recalled entries, or None when the
            row's view of the tier is empty.
        """
        n_committed = self.count
        n_pending = len(pending) if pending is not None else 0
        total = n_committed + n_pending
        if not total:
            return None
        stored_pages = n_committed // PAGE
        # Entries after the stored pages: the committed tail, then the pending ones; their complete pages are
        # summarised here, as a commit would summarise them.
        extra = self.stored(layer, stored_pages * PAGE, n_committed)
        if n_pending:
            extra = Entries(*(torch.cat((getattr(extra, name), getattr(pending, name))) for name in
                              ("key_codes", "key_params", "value_codes", "value_params", "positions")))
        extra_pages = len(extra) // PAGE
        n_pages = stored_pages + extra_pages
        read = torch.arange(n_pages * PAGE, total).expand(self.n_kv, -1)  # the tail: always read
        if n_pages:
            bounds = [self._bounds(query, self.summaries[layer, :stored_pages])] if stored_pages else []
            if extra_pages:
                summaries = self.summarise(Entries(*(getattr(extra, name)[: extra_pages * PAGE] for name in
                                                     ("key_codes", "key_params", "value_codes", "value_params",
                                                      "positions"))), layer)
                bounds.append(self._bounds(query, summaries))
            bound = torch.cat(bounds, dim=-1)  # [n_kv, n_pages]
            chosen = torch.sort(bound, dim=-1, descending=True, stable=True).indices[:, : self.pages]
            chosen = chosen.sort(dim=-1).values  # page order
            entries = (chosen[..., None] * PAGE + torch.arange(PAGE)).flatten(1)
            read = torch.cat((entries, read), dim=-1)
        entries = self._gather(layer, extra, stored_pages * PAGE, read)
        keys = self.keys(entries, layer).transpose(0, 1)  # [n_kv, R, hd]
        values = dequantize(entries.value_codes, entries.value_params, BITS, torch.float32).transpose(0, 1)
        logits = torch.matmul(query, keys.transpose(1, 2)) * self.scale  # [n_kv, group, R]
        lse = torch.logsumexp(logits, dim=-1)
        out = torch.matmul((logits - lse[..., None]).exp_(), values)
        return out, lse

    @staticmethod
    def _bounds(query: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
        """``[n_kv, pages]``: for ``query [n_kv, group, hd]`` and ``summaries [pages, n_kv, 2, hd]``, the largest over
        the group of ``Σ_d max(q_d · min_d, q_d · max_d)`` (an upper bound of q · k for any key of the page)."""
        low, high = summaries[:, :, 0].permute(1, 2, 0), summaries[:, :, 1].permute(1, 2, 0)  # [n_kv, hd, pages]
        bound = torch.matmul(query.clamp(min=0), high) + torch.matmul(query.clamp(max=0), low)
        return bound.amax(dim=1)

    def _gather(self, layer: int, extra: Entries, extra_start: int, index: torch.Tensor) -> Entries:
        """Entries ``index [n_kv, R]`` of the row's view (entry-major ``[R, n_kv, ...]``): below ``extra_start`` from
        the stored tier, from there on from ``extra``."""
        heads = torch.arange(self.n_kv)[:, None]
        in_extra = index >= extra_start
        stored_index = index.clamp(max=max(extra_start - 1, 0))
        extra_index = (index - extra_start).clamp(min=0)
        parts = []
        for name in ("key_codes", "key_params", "value_codes", "value_params", "positions"):
            extra_part = getattr(extra, name)[extra_index, heads] if len(extra) else None
            if extra_start:
                part = getattr(self, name)[layer][stored_index, heads]
                if extra_part is not None:
                    mask = in_extra.view(*in_extra.shape, *([1] * (part.dim() - 2)))
                    part = torch.where(mask, extra_part, part)
            else:
                part = extra_part
            parts.append(part.transpose(0, 1))
        return Entries(*parts)
