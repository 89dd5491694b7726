"""``hybrid-age``: heavy hitters ranked by attention per row that saw them (the naive reference covers the arena)."""

from __future__ import annotations

import pytest
import torch

from sparsespec import kernels
from sparsespec.cache.policy import make_policy

# Skipped without the kernels, failed where they must build (conftest.py: native_kernels).
pytestmark = pytest.mark.usefixtures("native_kernels")
NEVER = torch.iinfo(torch.int32).max


def test_age_normalisation_evicts_the_old_token_that_hybrid_keeps():
    """A row at position 9 enters an arena of positions 0..8 with these scores (one KV head of two query heads, a
    zero query: each of the 10 entries gets 0.2 more) and the policy evicts down to 5."""
    # Positions 0..9 visible, newest 9; 1 sink, 2 heavy, window 2 (positions 8, 9): candidates are 1..7.
    scores = [0.5] * 9
    scores[1] = 3.0  # old: the largest total (9 rows saw it), a mean of 1/3
    scores[6] = 2.0  # recent: a smaller total (4 rows), a mean of 1/2
    scores[7] = 1.5  # recent: 3 rows, a mean of 1/2
    outcome = {}
    for name in ("hybrid", "hybrid-age"):
        policy = make_policy(name, 5, sinks=1, heavy=2, window=2)
        hd, cap = 8, 10
        arena = kernels.native_arena(n_layers=1, n_kv=1, head_dim=hd, capacity=cap, scores=True, sinks=policy.sinks,
                                     heavy=policy.heavy, window=policy.window, age_normalised=policy.age_normalised,
                                     inv_freq=[0.0] * (hd // 2), budget=policy.budget)  # no rotation
        arena.buffer("positions").copy_(torch.arange(cap).view(1, 1, cap))
        arena.buffer("scores").copy_(torch.tensor(scores + [0.0]).view(1, 1, cap))
        arena.assume(9, 9)  # the slots written above: 9 committed tokens
        arena.begin(1, False, None)
        kernels.arena_attention(arena, 0, torch.zeros(2, 1, hd), torch.zeros(1, 1, hd), torch.zeros(1, 1, hd))
        outcome[name] = set((arena.buffer("evicted_at")[0, 0] == NEVER).nonzero().flatten().tolist())
    assert outcome["hybrid"] == {0, 1, 6, 8, 9}
    assert outcome["hybrid-age"] == {0, 6, 7, 8, 9}


def test_hybrid_age_splits_like_hybrid():
    age, plain = make_policy("hybrid-age", 100), make_policy("hybrid", 100)
    assert (age.sinks, age.heavy, age.window) == (plain.sinks, plain.heavy, plain.window)
    assert age.age_normalised and not plain.age_normalised and age.needs_scores
