"""Checks of PerLayerArena on tiny random models (the repo's tests/conftest.py builders).

    python -m pytest -q benchmarks/prototypes/layer_budgets   (not part of the default suite)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from perlayer_arena import DEAD, PerLayerArena, layer_policies, schedule_budgets  # noqa: E402
from sparsespec import kernels  # noqa: E402
from sparsespec.cache.arena import NEVER, KVArena  # noqa: E402
from sparsespec.cache.policy import make_policy  # noqa: E402
from sparsespec.eval.perplexity import streaming_nll  # noqa: E402

_spec = importlib.util.spec_from_file_location("sparsespec_tests_conftest", str(Path(__file__).resolve().parents[3] / "tests" / "conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
tiny_model = _conftest.tiny_model

N_TOKENS = 300
N_LAYERS = 4
CHUNK = 16


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param, num_hidden_layers=N_LAYERS)


@pytest.fixture(scope="module")
def token_ids(model):
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, model.config.vocab_size, (N_TOKENS,), generator=g).tolist()


def stock_arena(model, policy, kv_dtype, positions, chunk=CHUNK):
    arena = KVArena(model.config, policy, dtype=model.dtype, max_block=chunk, positions=positions, kv_dtype=kv_dtype,
                    key_offset=model.key_biases())
    arena.native_attention = False
    return arena


def perlayer_arena(model, budgets, kv_dtype, positions, name="hybrid-decay", native=False, chunk=CHUNK):
    return PerLayerArena(model.config, layer_policies(name, budgets), native=native, dtype=model.dtype,
                         max_block=chunk, positions=positions, kv_dtype=kv_dtype, key_offset=model.key_biases())


CASES = [("hybrid-decay", "auto", "in-cache"), ("hybrid-decay", "int8", "in-cache"),
         ("hybrid-decay", "int8", "original"), ("hybrid", "int8", "in-cache"), ("streaming", "int8", "in-cache")]


# ---------------------------------------------------------------------------------------------- (1) uniform
@pytest.mark.parametrize("name,kv_dtype,positions", CASES)
def test_uniform_schedule_equals_stock_arena(model, token_ids, name, kv_dtype, positions):
    budget = 40
    ref_arena = stock_arena(model, make_policy(name, budget), kv_dtype, positions)
    ref = streaming_nll(model, ref_arena, token_ids, CHUNK)
    arena = perlayer_arena(model, schedule_budgets("uniform", budget, N_LAYERS), kv_dtype, positions, name)
    got = streaming_nll(model, arena, token_ids, CHUNK)
    assert torch.equal(got, ref)
    assert arena.evicted_tokens == ref_arena.evicted_tokens
    assert torch.equal(arena.positions[..., : arena.n_committed], ref_arena.positions[..., : ref_arena.n_committed])
    assert bool((arena.evicted_at[..., : arena.n_committed] == NEVER).all())


# ------------------------------------------------------------------------- (2) counts and (3) sinks / window
class Checked(PerLayerArena):
    """Checks every layer's visible set after each commit."""

    def commit(self, n_rows):
        super().commit(n_rows)
        self.checks = getattr(self, "checks", 0) + 1
        seen = self.next_position
        n = self.n_committed
        assert n == min(seen, max(self.budgets))
        visible = self.evicted_at[..., :n] == NEVER  # [L, H, n]
        # nothing but NEVER / DEAD below n_committed
        assert bool(((self.evicted_at[..., :n] == NEVER) | (self.evicted_at[..., :n] == DEAD)).all())
        for layer, policy in enumerate(self.policies):
            counts = visible[layer].sum(dim=-1)
            assert counts.tolist() == [min(seen, policy.budget)] * counts.numel(), (layer, counts, seen)
            pos = self.positions[layer, :, :n]
            for h in range(pos.shape[0]):
                kept = pos[h][visible[layer, h]]
                assert kept.unique().numel() == kept.numel()  # no duplicates
                assert bool((kept < seen).all())
                must = set(range(min(policy.sinks, seen))) | set(range(max(seen - policy.window, 0), seen))
                assert must <= set(kept.tolist()), (layer, h, sorted(must - set(kept.tolist())))


@pytest.mark.parametrize("schedule", ["linear:1.5", "linear:2.0", "pyramid"])
@pytest.mark.parametrize("name,kv_dtype,positions", CASES)
def test_each_layer_holds_its_budget_with_sinks_and_window(model, token_ids, schedule, name, kv_dtype, positions):
    budgets = schedule_budgets(schedule, 40, N_LAYERS)
    assert sum(budgets) == 40 * N_LAYERS and len(set(budgets)) > 1
    arena = Checked(model.config, layer_policies(name, budgets), dtype=model.dtype, max_block=CHUNK,
                    positions=positions, kv_dtype=kv_dtype, key_offset=model.key_biases())
    nll = streaming_nll(model, arena, token_ids, CHUNK)
    assert torch.isfinite(nll).all()
    assert arena.checks == -(-(N_TOKENS - 1) // CHUNK)
    assert arena.visible_per_layer() == [min(N_TOKENS - 1, b) for b in budgets]


# ------------------------------------------------------- layer 0 is independent of the other layers' caches
@pytest.mark.parametrize("name,kv_dtype,positions", CASES)
def test_layer0_matches_a_stock_arena_of_its_budget(model, token_ids, name, kv_dtype, positions):
    """Layer 0's input is the embedding, so its cache must equal a stock arena's layer 0 with budget_0 everywhere."""
    budgets = schedule_budgets("linear:1.5", 40, N_LAYERS)
    arena = perlayer_arena(model, budgets, kv_dtype, positions, name)
    ref_arena = stock_arena(model, make_policy(name, budgets[0]), kv_dtype, positions)
    ids = torch.tensor(token_ids)
    for start in range(0, N_TOKENS - 1, CHUNK):
        stop = min(start + CHUNK, N_TOKENS - 1)
        for a in (arena, ref_arena):
            model.forward(ids[start:stop], a, per_block=True)
            a.commit(stop - start)
        vis = arena.evicted_at[0] == NEVER
        ref_vis = ref_arena.evicted_at[0] == NEVER
        for h in range(vis.shape[0]):
            got = sorted(arena.positions[0, h, : arena.n_committed][vis[h, : arena.n_committed]].tolist())
            want = sorted(ref_arena.positions[0, h, : ref_arena.n_committed][ref_vis[h, : ref_arena.n_committed]].tolist())
            assert got == want


# ------------------------------------------------------------------------------------------- schedules
def test_schedules_sum_exactly():
    for L in (2, 4, 24, 28, 30):
        for B in (40, 256, 903, 1870):
            for s in ("uniform", "linear:1.0", "linear:1.25", "linear:1.5", "linear:2.0", "pyramid", "pyramid:5"):
                b = schedule_budgets(s, B, L)
                assert sum(b) == L * B and min(b) >= 8
                assert all(x >= y for x, y in zip(b, b[1:])), (s, B, L, b)  # earlier layers broader
    assert schedule_budgets("linear:1.0", 903, 28) == [903] * 28
    b = schedule_budgets("linear:2.0", 1870, 28)
    assert b[0] > 3700 and b[-1] == 8


# ------------------------------------------------------------------------------------ native op (optional)
@pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
@pytest.mark.parametrize("name,kv_dtype,positions", [("hybrid-decay", "auto", "in-cache"),
                                                     ("hybrid-decay", "int8", "in-cache")])
def test_native_path_matches_torch_path(model, token_ids, name, kv_dtype, positions):
    budgets = schedule_budgets("linear:2.0", 40, N_LAYERS)
    torch_arena = perlayer_arena(model, budgets, kv_dtype, positions, name)
    native_arena = perlayer_arena(model, budgets, kv_dtype, positions, name, native=True)
    a = streaming_nll(model, torch_arena, token_ids, CHUNK)
    b = streaming_nll(model, native_arena, token_ids, CHUNK)
    assert native_arena.visible_per_layer() == torch_arena.visible_per_layer()
    torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3)
    same = 0
    for layer in range(N_LAYERS):
        for h in range(model.config.num_key_value_heads):
            sets = []
            for ar in (torch_arena, native_arena):
                vis = ar.evicted_at[layer, h, : ar.n_committed] == NEVER
                sets.append(set(ar.positions[layer, h, : ar.n_committed][vis].tolist()))
            same += sets[0] == sets[1]
    assert same == N_LAYERS * model.config.num_key_value_heads


@pytest.mark.skipif(not kernels.available(), reason="native kernels not built")
@pytest.mark.parametrize("name,kv_dtype,positions", CASES)
def test_native_uniform_equals_stock_native(model, token_ids, name, kv_dtype, positions):
    """With --native the uniform schedule is exactly the stock arena's native path (what `sparsespec ppl` runs)."""
    budget = 40
    ref_arena = stock_arena(model, make_policy(name, budget), kv_dtype, positions)
    ref_arena.native_attention = True
    ref = streaming_nll(model, ref_arena, token_ids, CHUNK)
    arena = perlayer_arena(model, [budget] * N_LAYERS, kv_dtype, positions, name, native=True)
    assert torch.equal(streaming_nll(model, arena, token_ids, CHUNK), ref)
