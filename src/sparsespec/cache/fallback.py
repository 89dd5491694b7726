"""The arena's attention without native kernels: the torch fallback.

The native op (:func:`sparsespec.kernels.arena_attention`) is the arena's attention wherever the kernels are built;
this module runs instead where they are not (no compiler, an unsupported CPU: ``kernels.available()`` is False).
It keeps the fallback thin: entries stored in the compute dtype or bfloat16 only (int8 / int4 entries are written
and read by the native op alone; the arena refuses them without it), plain dense torch ops, and one rule for every
block, written once (:func:`attend_rows`); a block whose rows evict between them runs as one-row blocks.

Neither path is the other's reference. Both are proven against the naive decoder of
``tests/test_arena_reference.py``, which shares no code with the library (every policy, both position modes,
prefill chunks, verification blocks with partial commits), and against each other in
``tests/test_attention_native.py`` (outputs to float32 rounding, evictions, positions and stored entries exact after
every layer of random blocks).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .policy import choose_evictions

if TYPE_CHECKING:
    from .arena import KVArena

NEVER = torch.iinfo(torch.int32).max  # evicted_at of a live slot (as arena.py)


def attend(arena: "KVArena", layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, first: int,
           start: int, visible_before: int, per_block: bool, per_row: bool, budget: int | None,
           lse: torch.Tensor | None) -> torch.Tensor:
    """What :meth:`KVArena.attend` asks of the native op, in torch: store the block's rows in slots ``[start,
    start + T)`` and attend.

    Args:
        q: ``[n_heads, T, head_dim]`` queries, not rotated.
        k, v: ``[n_kv_heads, T, head_dim]`` the new rows' keys (not rotated) and values.
        first: the block's first in-flight row; start: its first slot; visible_before: entries visible before it.
        per_block: a prefill chunk (no score snapshots for partial commits).
        per_row: rows evict between them (each sees the evictions of the rows before it), down to ``budget``.
        budget: evict down to it after the block (None: nothing is evicted).
        lse: ``[T, n_heads]`` receives each row's log-sum-exps, or None.

    Returns:
        ``[T, n_heads * head_dim]`` in the dtype of the stored values.
    """
    n_heads, n_rows, hd = q.shape
    first_position = arena.next_position + first
    if arena.positions_mode == "original":
        k = arena.rope.rotate_range(k, first_position)
    arena._keys.write(layer, start, start + n_rows, k)
    arena._values.write(layer, start, start + n_rows, v)
    arena.positions[layer][:, start : start + n_rows] = torch.arange(n_rows) + first_position
    arena.evicted_at[layer][:, start : start + n_rows] = NEVER
    if arena.policy.needs_scores:
        arena.scores[layer][:, start : start + n_rows] = 0.0
    if not per_row:
        out = attend_rows(arena, layer, q, first, start, visible_before, per_block, budget, lse)
    else:
        outs = []
        for i in range(n_rows):
            outs.append(attend_rows(arena, layer, q[:, i : i + 1], first + i, start + i, visible_before, False,
                                    budget, None if lse is None else lse[i : i + 1]))
            visible_before = min(visible_before + 1, budget)
        out = torch.cat(outs, dim=1)
    return out.transpose(0, 1).reshape(n_rows, n_heads * hd)


def attend_rows(arena: "KVArena", layer: int, q: torch.Tensor, first: int, start: int, visible_before: int,
                per_block: bool, budget: int | None, lse: torch.Tensor | None) -> torch.Tensor:
    """Rows that see the same evictions (stored already): each attends to the visible entries and the rows up to
    it; their attention adds to the heavy-hitter scores (snapshots kept for partial commits); then, if the
    entries exceed ``budget``, the policy evicts down to it, marked as the last row's evictions.

    ``q: [n_heads, T, head_dim]`` not rotated; ``lse: [T, n_heads]`` or None. Returns ``[n_heads, T, head_dim]``.
    """
    n_heads, n_rows, hd = q.shape
    n_kv = arena.config.num_key_value_heads
    group = n_heads // n_kv
    stop = start + n_rows
    new_positions = torch.arange(n_rows) + (arena.next_position + first)
    visible = arena.evicted_at[layer][:, :stop] == NEVER  # [n_kv, S]
    causal = arena._slot_index[:stop][None, :] <= torch.arange(start, stop)[:, None]  # [T, S]
    mask = visible[:, None, :] & causal[None]  # [n_kv, T, S]
    ranks = new_positions if arena.positions_mode == "original" else torch.arange(n_rows) + visible_before
    q = arena.rope.rotate(q, ranks)
    keys = arena._keys_for_attention(layer, visible)
    values = arena._values.read(layer, stop)
    policy = arena.policy
    if not policy.needs_scores and lse is None:
        # A single row of the full cache sees every slot: no mask needed (the common decode step).
        head_mask = None if policy.is_full and n_rows == 1 else mask.repeat_interleave(group, dim=0)[None]
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=head_mask, enable_gqa=True)
        out = out[0]
    else:
        q = q.reshape(n_kv, group * n_rows, hd)
        logits = torch.matmul(q, keys.transpose(1, 2)).float().view(n_kv, group, n_rows, stop)
        logits = logits.mul_(arena.scale).masked_fill_(~mask[:, None], -math.inf)
        if lse is not None:
            lse.copy_(torch.logsumexp(logits, dim=-1).view(n_heads, n_rows).T)
        probs = torch.softmax(logits, dim=-1)  # [n_kv, group, T, S]
        out = torch.matmul(probs.to(values.dtype).view(n_kv, group * n_rows, stop), values)
        out = out.view(n_heads, n_rows, hd)
    if policy.needs_scores:
        received = probs.sum(dim=1)  # [n_kv, T, S]: attention each slot received from each row
        scores = arena.scores[layer][:, :stop]
        snapshots = 0 if per_block else min(n_rows, arena.max_inflight - 1 - first)
        for i in range(n_rows):  # score = decay * score + attention received, row by row
            if policy.score_decay != 1.0:
                scores.mul_(policy.score_decay)
            scores += received[:, i]
            if i < snapshots:
                arena.row_scores[first + i, layer][:, :stop] = scores
    if budget is not None and visible_before + n_rows > budget:
        scores = arena.scores[layer][:, :stop] if policy.needs_scores else None
        evict = choose_evictions(scores, arena.positions[layer][:, :stop], visible, int(new_positions[-1]), policy,
                                 n_visible=visible_before + n_rows)
        arena.evicted_at[layer][:, :stop].masked_fill_(evict, first + n_rows - 1)
    return out
