"""Per-layer KV budgets on top of sparsespec's KVArena (experiment prototype, not part of the package).

``PerLayerArena(config, policies, ...)`` takes one CachePolicy per layer (same name, each with its own budget and
the sinks / heavy / window split ``make_policy(name, budget_l)`` gives it). Storage stays uniform: every layer has
``max(budget_l) + staging`` slots, so the bytes are NOT saved here; report them analytically as
``sum(budget_l) * bytes per entry`` (:func:`analytic_kv_bytes`).

How it differs from the stock arena:

- ``self.policy`` is the largest layer's policy outside ``attend`` (so ``begin`` / ``end`` / ``commit`` keep the
  uniform bookkeeping: ``n_committed`` = the largest survivor count over layers, ``min(seen, max budget)``), and
  the layer's own policy inside ``attend`` (budget, split, decay: what the torch path and the native op evict by).
- ``n_visible`` inside ``attend`` is the layer's own count of visible committed slots (``evicted_at == NEVER`` over
  ``[0, n_committed)``): it is ``visible_before``, the in-cache rank of the first new row and the eviction trigger.
- ``_compact`` pairs holes and movers per (layer, head): a layer that evicted more than the largest one keeps
  holes below ``n_committed``; those stay invisible forever, marked ``DEAD`` (-1) in ``evicted_at`` (anything but
  NEVER is invisible to the torch path and to the native op; -1 is also below every in-flight row index, so a
  rollback keeps them dead).

Only blocks that start from a committed state and evict once at their end are supported: per-block chunks
(``model.forward(ids, arena, per_block=True)`` then ``commit(len)``, what ``streaming_nll`` does) and single rows
committed one at a time. Speculative multi-row blocks with partial commits are not.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from sparsespec.cache.arena import NEVER, KVArena
from sparsespec.cache.policy import CachePolicy, make_policy

DEAD = -1  # evicted_at of a slot below n_committed that a layer holds no token in (never visible again)


class PerLayerArena(KVArena):
    """A KVArena whose layers each keep their own budget (uniform storage of ``max(budget_l) + staging`` slots)."""

    def __init__(self, config, policies: Sequence[CachePolicy], *, native: bool = False, **kwargs) -> None:
        policies = list(policies)
        if len(policies) != config.num_hidden_layers:
            raise ValueError(f"need one policy per layer ({config.num_hidden_layers}), got {len(policies)}")
        if any(p.is_full for p in policies):
            raise ValueError("per-layer budgets need budgeted policies")
        if len({p.name for p in policies}) != 1 or len({p.needs_scores for p in policies}) != 1:
            raise ValueError("every layer must use the same policy name (and all or none need scores)")
        if len({p.score_decay for p in policies}) != 1:
            raise ValueError("every layer must use the same score decay")
        self.policies = policies
        self.max_policy = max(policies, key=lambda p: p.budget)
        self._layer: int | None = None
        self._budget_tensor = torch.tensor([p.budget for p in policies])
        super().__init__(config, self.max_policy, **kwargs)
        # The torch path is the reference; the native op reads the same (swapped) policy and visible_before
        # and treats evicted_at != NEVER as invisible too, so it can be switched on with native=True.
        self.native_attention = native

    # ------------------------------------------------------------------------------------------- accounting
    @property
    def budgets(self) -> list[int]:
        return [p.budget for p in self.policies]

    def layer_visible(self, layer: int) -> int:
        """Committed tokens visible in ``layer`` (the same in every KV head; checked)."""
        counts = (self.evicted_at[layer, :, : self.n_committed] == NEVER).sum(dim=-1)
        if not bool((counts == counts[0]).all()):
            raise AssertionError(f"layer {layer}: heads hold different counts {counts.tolist()}")
        return int(counts[0])

    def visible_per_layer(self) -> list[int]:
        return [self.layer_visible(layer) for layer in range(self.config.num_hidden_layers)]

    @property
    def n_visible(self) -> int:
        if self._layer is not None:
            return self._layer_visible_before
        return super().n_visible

    # ---------------------------------------------------------------------------------------------- attention
    def attend(self, layer, q, k, v):
        first, n_rows, per_block = self._block
        if first != 0 or not (per_block or n_rows == 1):
            raise NotImplementedError("PerLayerArena supports per-block chunks and committed single rows only")
        self._layer_visible_before = self.layer_visible(layer)
        self._layer = layer
        self.policy = self.policies[layer]
        try:
            return super().attend(layer, q, k, v)
        finally:
            self.policy = self.max_policy
            self._layer = None

    # ---------------------------------------------------------------------------------------------- commit
    def _compact(self, n_rows: int, extent: int, survivors: int) -> None:
        """As KVArena._compact, but per (layer, head): the k-th hole below ``survivors`` takes the k-th live slot at or
        beyond it; holes left over (a layer holding fewer than ``survivors`` tokens) are marked DEAD."""
        alive = self.evicted_at[..., :extent] >= n_rows  # alive after the last accepted row (DEAD = -1 never is)
        if self.policy.needs_scores:
            if n_rows == self.n_inflight:
                final = self.scores
            elif n_rows:
                final = self.row_scores[n_rows - 1]
            else:
                final = self.committed_scores
            if final is not self.scores:
                self.scores[..., :extent] = final[..., :extent]
        below = alive[..., :survivors]
        beyond = alive[..., survivors:]
        n_alive = alive.sum(dim=-1)  # [L, H]
        if bool((n_alive > survivors).any()):
            raise AssertionError("a layer holds more tokens than the uniform survivor count")
        if bool((n_alive > self._budget_tensor[:, None]).any()):
            raise AssertionError("a layer holds more tokens than its budget after commit")
        hole = ~below
        n_movers = beyond.sum(dim=-1)  # [L, H]
        hole_rank = hole.cumsum(dim=-1) - 1
        filled = hole & (hole_rank < n_movers[..., None])  # the first n_movers holes of each (layer, head)
        holes = filled.nonzero(as_tuple=True)
        movers = beyond.nonzero(as_tuple=True)
        # Both list (layer, head) in the same order, with equal counts per (layer, head): they pair up.
        if holes[0].numel():
            src = (movers[0], movers[1], movers[2] + survivors)
            tensors = [*self._keys.tensors, *self._values.tensors, self.positions]
            if self.policy.needs_scores:
                tensors.append(self.scores)
            for t in tensors:
                t[holes] = t[src]
        if self.policy.needs_scores:
            self.committed_scores[..., :survivors] = self.scores[..., :survivors]
        self.evicted_at[..., :extent].fill_(NEVER)
        self.evicted_at[..., :survivors].masked_fill_(hole & ~filled, DEAD)


# ------------------------------------------------------------------------------------------------- schedules
def schedule_budgets(schedule: str, budget: int, n_layers: int, min_budget: int = 8) -> list[int]:
    """Per-layer budgets summing to exactly ``n_layers * budget``.

    - ``uniform``: ``budget`` everywhere.
    - ``linear:R``: from ``R * budget`` at layer 0 linearly down to ``(2 - R) * budget`` at the last layer
      (R in [1, 2]; ``linear:2.0`` goes down to 0 and is clamped to ``min_budget``).
    - ``pyramid[:beta]``: PyramidKV's arithmetic schedule: the top layer keeps ``budget / beta``, the bottom
      ``2 * budget - budget / beta`` (beta 20 by default), i.e. ``linear:(2 - 1/beta)``. (PyramidKV applies it to
      the budget minus its 32-token observation window, which is kept in every layer; here the window is part of
      each layer's policy.)

    Rounding: largest remainders, then clamping to ``min_budget`` (taken back from the largest layers).
    """
    target = n_layers * budget
    if schedule == "uniform":
        return [budget] * n_layers
    kind, _, arg = schedule.partition(":")
    if kind == "linear":
        ratio = float(arg)
    elif kind == "pyramid":
        beta = float(arg) if arg else 20.0
        ratio = 2.0 - 1.0 / beta
    else:
        raise ValueError(f"unknown schedule {schedule!r} (uniform, linear:R, pyramid[:beta])")
    if not 0.0 <= ratio <= 2.0:
        raise ValueError("linear:R needs 0 <= R <= 2")
    if min_budget * n_layers > target:
        raise ValueError(f"min budget {min_budget} x {n_layers} layers exceeds the total {target}")
    if n_layers == 1:
        return [budget]
    raw = [budget * (ratio + (2.0 - 2.0 * ratio) * layer / (n_layers - 1)) for layer in range(n_layers)]
    out = [math.floor(x) for x in raw]
    # Largest remainders (ties: the earlier layer) take the units left.
    order = sorted(range(n_layers), key=lambda i: (-(raw[i] - out[i]), i))
    for i in order[: target - sum(out)]:
        out[i] += 1
    out = [max(b, min_budget) for b in out]
    while sum(out) > target:  # take clamped-in units back from the largest layers (earliest first)
        i = max(range(n_layers), key=lambda j: (out[j], -j))
        out[i] -= 1
    assert sum(out) == target and min(out) >= min_budget, out
    return out


def layer_policies(name: str, budgets: Sequence[int], sinks: int | None = None) -> list[CachePolicy]:
    return [make_policy(name, b, sinks=sinks) for b in budgets]


def make_perlayer_arena(loaded, policy_name: str, budgets: Sequence[int], *, n_tokens: int, chunk: int,
                        kv_dtype: str = "int8", positions: str = "in-cache", native: bool = False) -> PerLayerArena:
    """A PerLayerArena for ``loaded`` built as ``perplexity.ppl_arena`` / ``engine.make_arena`` build theirs
    (max_block = min(chunk, n_tokens - 1), max_inflight 1, key_offset = the model's key biases, and the in-cache rank
    check against the model's context for the largest layer)."""
    from sparsespec.engine import CacheOptions, arena_staging, check_in_cache_ranks

    policies = layer_policies(policy_name, budgets)
    max_tokens = max(n_tokens - 1, 1)
    cache = CacheOptions(policy=max(policies, key=lambda p: p.budget), positions=positions,
                         prefill_chunk=chunk, kv_dtype=kv_dtype)
    staging = arena_staging(cache, max_tokens, 1)
    check_in_cache_ranks(loaded, cache, staging)
    return PerLayerArena(
        loaded.config, policies, native=native, dtype=loaded.model.dtype, max_tokens=max_tokens,
        max_block=min(chunk, max_tokens), max_inflight=1, positions=positions, kv_dtype=kv_dtype,
        key_offset=loaded.model.key_biases(),
    )


def analytic_kv_bytes(config, budgets: Sequence[int], kv_dtype: str, dtype: torch.dtype, staging: int = 0) -> int:
    """Bytes a real per-layer arena would hold: ``sum_l (budget_l + staging)`` slots per KV head."""
    per_slot = KVArena.bytes_per_slot(config, kv_dtype, dtype) * config.num_key_value_heads
    return per_slot * (sum(budgets) + staging * len(budgets))
