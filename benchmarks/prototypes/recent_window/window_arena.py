"""A recent window of full-precision KV entries on top of an int4 KVArena (experiment prototype, not the package).

``RecentWindowArena(config, policy, full_window=W, rule="row", kv_dtype="int4", ...)`` keeps the stock quantized
KVStores exactly as ``KVArena`` does (same codes, same scales, same key offset) and, next to them, a *shadow* copy
of every slot in bfloat16 (a ``KVStore`` of kv_dtype ``"bf16"``): exactly what ``_write_rows`` receives, i.e. in the
in-cache mode keys unrotated WITH the key bias, in the original mode keys rotated (bias in); values as given. That
is the frame ``KVStore.read`` returns for the quantized keys too (it adds the offset back), and the frame a
``kv_dtype="bf16"`` arena stores, so a slot read from the shadow is bit for bit what a bf16 arena would read.

Reads: an entry at stored position ``p`` is read from the shadow when it is among the W most recent positions, else
dequantized from the int4 codes. "Most recent" (the policy window's own test, ``positions > newest - window``):

- ``rule="row"`` (default): ``newest`` is the position of the *row* that reads, so every row sees its W most recent
  positions (itself included) in full precision. This is what autoregressive decoding with a W-entry bf16 ring does
  at every step, so a chunked perplexity run approximates decoding (chunk 1 is exact decoding, where both rules
  coincide); a real chunked op can do the same with W bf16 slots, because the block's own rows reach it in the
  compute dtype anyway (its k / v inputs).
- ``rule="block"``: ``newest`` is the block's last row for every row of the block (the first design tried). With
  a prefill chunk larger than W, the early rows of a chunk then see no full-precision entry at all (row j of a
  64-row chunk sees max(0, j - 63 + W) of them), which understates the window's benefit at decode time.

The torch path only: ``native_attention`` is forced off (the native op knows nothing of the shadow). The override is
``_attend_block`` (per-block chunks, single rows, multi-row blocks that need no eviction between rows): logits are
computed against both the dequantized and the shadow keys (rotated by the same in-cache ranks) and selected per
(row, slot) with ``torch.where``; the output is ``P_quant @ V_quant + P_shadow @ V_shadow`` with the probabilities
split by the same mask. With no slot recent (W = 0) that is bit for bit the stock ``_attend_block``; with every slot
recent it is bit for bit a bf16 arena's. Multi-row blocks that evict between rows (``_attend_row_by_row``:
speculative verification that fills the budget) are not supported. Policies without heavy hitters go through the
same explicit softmax (the stock path uses SDPA there, so those agree with stock only to rounding).

Compaction: ``_compact`` moves the shadow slots first, pairing holes and movers exactly as ``KVArena._compact``
does (computed from ``evicted_at`` before the stock ``_compact`` resets it), then calls the stock one.

Bytes: this prototype allocates the int4 stores plus a full bf16 shadow (``allocated_nbytes``). A real implementation
holds W bf16 slots and ``budget + staging - W`` int4 slots per layer and KV head: :func:`analytic_kv_bytes`;
:func:`budget_at_equal_bytes` inverts it.
"""

from __future__ import annotations

import math

import torch

from sparsespec.cache.arena import NEVER, KVArena
from sparsespec.cache.policy import CachePolicy, choose_evictions
from sparsespec.cache.quant import KVStore

RULES = ("row", "block")
SHADOW_DTYPE = "bf16"


class RecentWindowArena(KVArena):
    """A KVArena whose W most recent positions are read in bfloat16 (a shadow copy), the rest from its quantized
    store."""

    def __init__(self, config, policy: CachePolicy, *, full_window: int, rule: str = "row", **kwargs) -> None:
        if full_window < 0:
            raise ValueError(f"full_window must be >= 0 (got {full_window})")
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES} (got {rule!r})")
        if policy.is_full:
            raise ValueError("RecentWindowArena needs a budgeted policy")
        super().__init__(config, policy, **kwargs)
        self.full_window = full_window
        self.rule = rule
        self.native_attention = False
        shape = (*self.positions.shape, config.head_dim)
        self._shadow_keys = KVStore(shape, SHADOW_DTYPE, self.dtype)
        self._shadow_values = KVStore(shape, SHADOW_DTYPE, self.dtype)

    @property
    def allocated_nbytes(self) -> int:
        """What this prototype allocates: the quantized stores plus the full shadow."""
        return self.nbytes + self._shadow_keys.nbytes + self._shadow_values.nbytes

    # ------------------------------------------------------------------------------------------------ writes
    def _write_rows(self, layer, start, stop, k, v):
        super()._write_rows(layer, start, stop, k, v)
        self._shadow_keys.write(layer, start, stop, k)
        self._shadow_values.write(layer, start, stop, v)

    def _compact(self, n_rows, extent, survivors):
        # Same pairing as KVArena._compact (which resets evicted_at, so compute it first).
        alive = self.evicted_at[..., :extent] >= n_rows
        holes = (~alive[..., :survivors]).nonzero(as_tuple=True)
        movers = alive[..., survivors:].nonzero(as_tuple=True)
        if holes[0].numel():
            src = (movers[0], movers[1], movers[2] + survivors)
            for t in (*self._shadow_keys.tensors, *self._shadow_values.tensors):
                t[holes] = t[src]
        super()._compact(n_rows, extent, survivors)

    # ------------------------------------------------------------------------------------------------- reads
    def attend(self, layer, q, k, v):
        if self.native_attention:
            raise RuntimeError("RecentWindowArena runs on the torch path only")
        return super().attend(layer, q, k, v)

    def recent_mask(self, layer: int, stop: int, new_positions: torch.Tensor) -> torch.Tensor:
        """``[n_kv, T, stop]`` bool: slot s is read from the shadow by row t."""
        positions = self.positions[layer][:, :stop]  # [n_kv, S]
        newest = new_positions if self.rule == "row" else new_positions[-1:].expand_as(new_positions)  # [T]
        return positions[:, None, :] > (newest - self.full_window)[None, :, None]

    def _attend_row_by_row(self, *args, **kwargs):
        raise NotImplementedError("RecentWindowArena: blocks that evict between rows are not supported")

    def _attend_block(self, layer, q, first, start, stop, new_positions, visible_before, per_block):
        """KVArena._attend_block with each (row, slot) logit and value taken from the shadow or the quantized store."""
        n_heads, n_rows, hd = q.shape
        n_kv = self.config.num_key_value_heads
        group = n_heads // n_kv
        visible = self.evicted_at[layer][:, :stop] == NEVER  # [n_kv, S]
        causal = self._slot_index[:stop][None, :] <= torch.arange(start, stop)[:, None]  # [T, S]
        mask = visible[:, None, :] & causal[None]  # [n_kv, T, S]
        q_positions = new_positions if self.positions_mode == "original" else torch.arange(n_rows) + visible_before
        q = self.rope.rotate(q, q_positions)
        keys_q = self._layer_keys(layer, stop)
        keys_s = self._shadow_keys.read(layer, stop)
        if self.positions_mode != "original":
            ranks = self._ranks(layer, visible)
            keys_q = self.rope.rotate(keys_q, ranks)
            keys_s = self.rope.rotate(keys_s, ranks)
        values_q = self._layer_values(layer, stop)
        values_s = self._shadow_values.read(layer, stop)
        recent = self.recent_mask(layer, stop, new_positions)[:, None]  # [n_kv, 1, T, S]

        q2 = q.reshape(n_kv, group * n_rows, hd)
        logits_q = torch.matmul(q2, keys_q.transpose(1, 2)).float().view(n_kv, group, n_rows, stop)
        logits_s = torch.matmul(q2, keys_s.transpose(1, 2)).float().view(n_kv, group, n_rows, stop)
        logits = torch.where(recent, logits_s, logits_q)
        logits = logits.mul_(self.scale).masked_fill_(~mask[:, None], -math.inf)
        probs = torch.softmax(logits, dim=-1)
        p_q = probs.masked_fill(recent, 0.0).to(values_q.dtype).view(n_kv, group * n_rows, stop)
        p_s = probs.masked_fill(~recent, 0.0).to(values_s.dtype).view(n_kv, group * n_rows, stop)
        out = torch.matmul(p_q, values_q) + torch.matmul(p_s, values_s)
        out = out.view(n_heads, n_rows, hd)

        if self.policy.needs_scores:  # verbatim from KVArena._attend_block
            received = probs.sum(dim=1)  # [n_kv, T, S]
            scores = self.scores[layer][:, :stop]
            snapshots = 0 if per_block else min(n_rows, self.max_inflight - 1 - first)
            decay = self.policy.score_decay
            if decay == 1.0:
                cumulative = received.cumsum(dim=1)
                for i in range(snapshots):
                    self.row_scores[first + i, layer][:, :stop] = scores + cumulative[:, i]
                scores += received.sum(dim=1)
            else:
                for i in range(n_rows):
                    scores.mul_(decay).add_(received[:, i])
                    if i < snapshots:
                        self.row_scores[first + i, layer][:, :stop] = scores

        budget = self.policy.budget
        if budget is not None and visible_before + n_rows > budget:
            scores = self.scores[layer][:, :stop] if self.policy.needs_scores else None
            evict = choose_evictions(
                scores, self.positions[layer][:, :stop], visible, int(new_positions[-1]), self.policy,
                n_visible=visible_before + n_rows,
            )
            self.evicted_at[layer][:, :stop].masked_fill_(evict, first + n_rows - 1)
        return out


# ------------------------------------------------------------------------------------------------------ bytes
def _slot_bytes(config, kv_dtype: str, dtype: torch.dtype) -> int:
    return KVArena.bytes_per_slot(config, kv_dtype, dtype)


def analytic_kv_bytes(config, budget: int, staging: int, window: int, kv_dtype: str = "int4",
                      dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a real implementation holds: per layer and KV head, ``min(W, budget + staging)`` bf16 slots and the
    rest of ``budget + staging`` in ``kv_dtype`` (W = 0: exactly ``KVArena.nbytes``)."""
    capacity = budget + staging
    w = min(window, capacity)
    per_head = w * _slot_bytes(config, SHADOW_DTYPE, dtype) + (capacity - w) * _slot_bytes(config, kv_dtype, dtype)
    return per_head * config.num_hidden_layers * config.num_key_value_heads


def plain_arena_bytes(config, budget: int, staging: int, kv_dtype: str = "int4",
                      dtype: torch.dtype = torch.bfloat16) -> int:
    """``KVArena.nbytes`` of a plain arena of ``budget + staging`` slots in ``kv_dtype``."""
    return (budget + staging) * _slot_bytes(config, kv_dtype, dtype) * config.num_hidden_layers \
        * config.num_key_value_heads


def budget_at_equal_bytes(config, nbytes: int, staging: int, window: int, kv_dtype: str = "int4",
                          dtype: torch.dtype = torch.bfloat16) -> int:
    """The largest budget B with ``analytic_kv_bytes(config, B, staging, window) <= nbytes`` (may be < 1)."""
    heads = config.num_hidden_layers * config.num_key_value_heads
    per_head = nbytes // heads  # floor((n/h - c) / q) == floor((floor(n/h) - c) / q) for integers
    full, quant = _slot_bytes(config, SHADOW_DTYPE, dtype), _slot_bytes(config, kv_dtype, dtype)
    budget = (per_head - window * full) // quant + window - staging
    if budget + staging < window:  # the window does not fit: every slot is bf16
        budget = per_head // full - staging
    return budget
