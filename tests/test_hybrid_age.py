"""``hybrid-age``: heavy hitters ranked by attention per row that saw them (the naive reference covers the arena)."""

from __future__ import annotations

import torch

from sparsespec.cache.policy import choose_evictions, make_policy


def test_age_normalisation_evicts_the_old_token_that_hybrid_keeps():
    # Positions 0..9 visible, newest 9; 1 sink, 2 heavy, window 2 (positions 8, 9): candidates are 1..7.
    positions = torch.arange(10)[None]
    visible = torch.ones(1, 10, dtype=torch.bool)
    scores = torch.full((1, 10), 0.5)
    scores[0, 1] = 3.0  # old: the largest total (9 rows saw it), a mean of 1/3
    scores[0, 6] = 2.0  # recent: a smaller total (4 rows), a mean of 1/2
    scores[0, 7] = 1.5  # recent: 3 rows, a mean of 1/2
    outcome = {}
    for name in ("hybrid", "hybrid-age"):
        policy = make_policy(name, 5, sinks=1, heavy=2, window=2)
        evict = choose_evictions(scores, positions, visible, 9, policy)
        outcome[name] = set((~evict[0] & visible[0]).nonzero().flatten().tolist())
    assert outcome["hybrid"] == {0, 1, 6, 8, 9}
    assert outcome["hybrid-age"] == {0, 6, 7, 8, 9}


def test_hybrid_age_splits_like_hybrid():
    age, plain = make_policy("hybrid-age", 100), make_policy("hybrid", 100)
    assert (age.sinks, age.heavy, age.window) == (plain.sinks, plain.heavy, plain.window)
    assert age.age_normalised and not plain.age_normalised and age.needs_scores
