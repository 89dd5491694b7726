"""``hybrid-decay``: every row multiplies the scores by the decay before adding its attention (the naive reference
test covers the arena over whole runs; this checks the arithmetic of the native op's scores)."""

from __future__ import annotations

import pytest
import torch

from sparsespec.cache import policy as policy_module
from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import make_policy

from conftest import tiny_config


def _scores_after_rows(name: str, blocks: tuple[int, ...]) -> list[torch.Tensor]:
    """Layer 0's scores ``[n_kv, 8]`` after each block of ``blocks`` rows (a budget no block reaches)."""
    config = tiny_config(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=1)
    arena = KVArena(config, make_policy(name, sinks=1, heavy=4, window=3), dtype=torch.float32, max_block=4)
    gen = torch.Generator().manual_seed(5)
    total = sum(blocks)
    q = torch.randn(4, total, 32, generator=gen)
    k, v = torch.randn(2, total, 32, generator=gen), torch.randn(2, total, 32, generator=gen)
    after = []
    start = 0
    for n_rows in blocks:
        rows = slice(start, start + n_rows)
        arena.begin(n_rows)
        arena.attend(0, q[:, rows], k[:, rows], v[:, rows])
        arena.end()
        arena.commit(n_rows)
        after.append(arena.buffer("scores")[0, :, :8].clone())
        start += n_rows
    assert arena.evicted_tokens == 0
    return after


@pytest.mark.usefixtures("native_kernels")
def test_each_row_decays_the_scores_before_adding_its_attention(monkeypatch):
    monkeypatch.setattr(policy_module, "SCORE_DECAY", 0.5)
    rows = (1, 1, 1, 1)  # one row per block: hybrid's score increments are each row's attention
    plain = _scores_after_rows("hybrid", rows)
    decayed = _scores_after_rows("hybrid-decay", rows)
    attention = [plain[0]] + [b - a for a, b in zip(plain, plain[1:])]
    expected = torch.zeros_like(plain[0])
    for received, got in zip(attention, decayed):
        expected = 0.5 * expected + received
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(decayed[-1], plain[-1])


@pytest.mark.usefixtures("native_kernels")
def test_a_block_of_rows_decays_once_per_row(monkeypatch):
    monkeypatch.setattr(policy_module, "SCORE_DECAY", 0.5)
    one_by_one = _scores_after_rows("hybrid-decay", (1, 1, 1, 1))
    in_a_block = _scores_after_rows("hybrid-decay", (1, 3))
    torch.testing.assert_close(in_a_block[-1], one_by_one[-1], rtol=1e-6, atol=1e-7)


def test_hybrid_decay_splits_like_hybrid():
    decay, plain = make_policy("hybrid-decay", 100), make_policy("hybrid", 100)
    assert (decay.sinks, decay.heavy, decay.window) == (plain.sinks, plain.heavy, plain.window)
    assert 0.0 < decay.score_decay < 1.0 and plain.score_decay == 1.0 and decay.needs_scores
    assert not decay.age_normalised
