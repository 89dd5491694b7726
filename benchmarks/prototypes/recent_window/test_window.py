"""Checks of RecentWindowArena on tiny random models (the repo's tests/conftest.py builders).

    python -m pytest -q benchmarks/prototypes/recent_window   (not part of the default suite)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from window_arena import (  # noqa: E402
    RecentWindowArena, analytic_kv_bytes, budget_at_equal_bytes, plain_arena_bytes,
)
from sparsespec.cache.arena import NEVER, KVArena  # noqa: E402
from sparsespec.cache.policy import make_policy  # noqa: E402
from sparsespec.cache.quant import BITS, quantize  # noqa: E402
from sparsespec.eval.perplexity import streaming_nll  # noqa: E402

_spec = importlib.util.spec_from_file_location("sparsespec_tests_conftest", str(Path(__file__).resolve().parents[3] / "tests" / "conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
tiny_model, tiny_config = _conftest.tiny_model, _conftest.tiny_config

N_TOKENS = 300
N_LAYERS = 3
CHUNK = 16
BUDGET = 40
HUGE = 10**9  # every position is "recent"
HEAD_DIM = 16  # int4 groups of 16: one group per vector (the repo's tiny head_dim of 8 makes groups of 8)


@pytest.fixture(scope="module", params=[("llama", torch.float32), ("qwen2", torch.float32),
                                        ("qwen2", torch.bfloat16)], ids=["llama-f32", "qwen2-f32", "qwen2-bf16"])
def model(request):
    arch, dtype = request.param
    return tiny_model(arch, dtype=dtype, num_hidden_layers=N_LAYERS, head_dim=HEAD_DIM)


@pytest.fixture(scope="module")
def token_ids(model):
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, model.config.vocab_size, (N_TOKENS,), generator=g).tolist()


def stock(model, policy, kv_dtype, positions):
    arena = KVArena(model.config, policy, dtype=model.dtype, max_block=CHUNK, positions=positions, kv_dtype=kv_dtype,
                    key_offset=model.key_biases())
    arena.native_attention = False
    return arena


def window(model, policy, W, positions, rule="row", cls=RecentWindowArena, kv_dtype="int4"):
    return cls(model.config, policy, full_window=W, rule=rule, dtype=model.dtype, max_block=CHUNK,
               positions=positions, kv_dtype=kv_dtype, key_offset=model.key_biases())


def modes(model):
    # int4 keys in the original mode with a key bias are refused by the arena (check_key_storage)
    return ["in-cache"] if model.config.attention_bias else ["in-cache", "original"]


POLICIES = ["hybrid-decay", "hybrid"]


# ------------------------------------------------------------------------------------------ (1) W = 0 is stock
@pytest.mark.parametrize("rule", ["row", "block"])
@pytest.mark.parametrize("name", POLICIES)
def test_no_window_equals_stock_int4(model, token_ids, name, rule):
    for positions in modes(model):
        policy = make_policy(name, BUDGET)
        ref_arena = stock(model, policy, "int4", positions)
        ref = streaming_nll(model, ref_arena, token_ids, CHUNK)
        arena = window(model, policy, 0, positions, rule)
        got = streaming_nll(model, arena, token_ids, CHUNK)
        assert torch.equal(got, ref), positions
        assert torch.equal(arena.positions, ref_arena.positions)
        assert torch.equal(arena.keys, ref_arena.keys) and torch.equal(arena.values, ref_arena.values)


# ---------------------------------------------------------------- (2) everything recent is exactly a bf16 arena
@pytest.mark.parametrize("rule", ["row", "block"])
@pytest.mark.parametrize("name", POLICIES)
def test_everything_recent_equals_bf16_arena(model, token_ids, name, rule):
    """Recency is by position, so a window of budget + chunk does NOT cover the sinks and old heavy hitters; a window
    larger than the text does."""
    for positions in modes(model):
        policy = make_policy(name, BUDGET)
        ref_arena = stock(model, policy, "bf16", positions)
        ref = streaming_nll(model, ref_arena, token_ids, CHUNK)
        arena = window(model, policy, HUGE, positions, rule)
        got = streaming_nll(model, arena, token_ids, CHUNK)
        assert torch.equal(got, ref), positions
        assert torch.equal(arena.positions, ref_arena.positions)
        n = arena.n_committed
        assert torch.equal(arena._shadow_keys.data[..., :n, :], ref_arena.keys[..., :n, :])
        assert torch.equal(arena._shadow_values.data[..., :n, :], ref_arena.values[..., :n, :])
        # ... and a window of budget + chunk is not everything: it differs from the bf16 arena
        partial = window(model, policy, BUDGET + CHUNK, positions, rule)
        assert not torch.equal(streaming_nll(model, partial, token_ids, CHUNK), ref)


def test_window_changes_something_and_rules_differ(model, token_ids):
    policy = make_policy("hybrid-decay", BUDGET)
    base = streaming_nll(model, window(model, policy, 0, "in-cache"), token_ids, CHUNK)
    row = streaming_nll(model, window(model, policy, 8, "in-cache", "row"), token_ids, CHUNK)
    block = streaming_nll(model, window(model, policy, 8, "in-cache", "block"), token_ids, CHUNK)
    assert not torch.equal(row, base) and not torch.equal(block, base) and not torch.equal(row, block)
    # the first token is read by itself only: row rule reads it in bf16 (W >= 1), block rule in int4 (W < CHUNK)
    bf16 = streaming_nll(model, stock(model, policy, "bf16", "in-cache"), token_ids, CHUNK)
    assert row[0] == bf16[0] and block[0] == base[0]


def test_recent_mask_rules(model):
    policy = make_policy("hybrid-decay", BUDGET)
    arena = window(model, policy, 2, "in-cache", "row")
    arena.positions[0, :, :6] = torch.tensor([0, 1, 10, 11, 12, 13])
    new = torch.tensor([12, 13])  # causality is the attention mask's business, not the window's
    m = arena.recent_mask(0, 6, new)
    assert m[0].tolist() == [[False, False, False, True, True, True], [False, False, False, False, True, True]]
    arena.rule = "block"
    m = arena.recent_mask(0, 6, new)
    assert m[0].tolist() == [[False, False, False, False, True, True]] * 2


# ------------------------------------------------------------------------- (3) the shadow moves with compaction
class Recording(RecentWindowArena):
    """Records what each row was written with, and after every commit checks each visible slot's shadow and codes
    against the record of the token at its stored position."""

    def _write_rows(self, layer, start, stop, k, v):
        super()._write_rows(layer, start, stop, k, v)
        rec = self.__dict__.setdefault("record", {})
        first_position = self.next_position + self._block[0]
        for i in range(stop - start):
            rec[layer, first_position + i] = (k[:, i].clone(), v[:, i].clone())

    def commit(self, n_rows):
        super().commit(n_rows)
        self.checks = getattr(self, "checks", 0) + 1
        n = self.n_committed
        bits = BITS[self.kv_dtype]
        offset = self._keys.offset
        for layer in range(self.config.num_hidden_layers):
            for h in range(self.config.num_key_value_heads):
                assert bool((self.evicted_at[layer, h, :n] == NEVER).all())
                for s in range(n):
                    k, v = self.record[layer, int(self.positions[layer, h, s])]
                    k, v = k[h], v[h]
                    assert torch.equal(self._shadow_keys.data[layer, h, s], k.to(torch.bfloat16))
                    assert torch.equal(self._shadow_values.data[layer, h, s], v.to(torch.bfloat16))
                    kq = k.float() - offset[layer, h] if offset is not None else k
                    codes, params = quantize(kq, bits)
                    assert torch.equal(self._keys.data[layer, h, s], codes)
                    assert torch.equal(self._keys.params[layer, h, s], params)
                    codes, params = quantize(v, bits)
                    assert torch.equal(self._values.data[layer, h, s], codes)


@pytest.mark.parametrize("rule", ["row", "block"])
def test_shadow_follows_its_token(model, token_ids, rule):
    for positions in modes(model):
        arena = window(model, make_policy("hybrid-decay", BUDGET), 8, positions, rule, cls=Recording)
        streaming_nll(model, arena, token_ids, CHUNK)
        assert arena.checks == -(-(N_TOKENS - 1) // CHUNK)
        assert arena.evicted_tokens == N_TOKENS - 1 - BUDGET


def test_shadow_equals_bf16_arena_entries(model, token_ids):
    """Chunk by chunk, the shadow of each visible token equals a bf16 arena's stored entry of the same token: in
    every layer when everything is recent (both arenas identical), in layer 0 (whose keys and values depend on
    the embeddings only) for the tokens both hold when W = 8 (the arenas then evict differently)."""
    ids = torch.tensor(token_ids)
    policy = make_policy("hybrid-decay", BUDGET)
    for W, layers in ((HUGE, range(N_LAYERS)), (8, [0])):
        arena = window(model, policy, W, "in-cache")
        ref = stock(model, policy, "bf16", "in-cache")
        shared_total = 0
        for start in range(0, N_TOKENS - 1, CHUNK):
            stop = min(start + CHUNK, N_TOKENS - 1)
            for a in (arena, ref):
                model.forward(ids[start:stop], a, per_block=True)
                a.commit(stop - start)
            for layer in layers:
                for h in range(model.config.num_key_value_heads):
                    mine = {int(p): s for s, p in enumerate(arena.positions[layer, h, : arena.n_committed])}
                    theirs = {int(p): s for s, p in enumerate(ref.positions[layer, h, : ref.n_committed])}
                    shared = mine.keys() & theirs.keys()
                    shared_total += len(shared)
                    if W == HUGE:
                        assert mine.keys() == theirs.keys()
                    for p in shared:
                        assert torch.equal(arena._shadow_keys.data[layer, h, mine[p]], ref.keys[layer, h, theirs[p]])
                        assert torch.equal(arena._shadow_values.data[layer, h, mine[p]],
                                           ref.values[layer, h, theirs[p]])
        assert shared_total > 0


# --------------------------------------------------------------------------------------------------- (4) bytes
def qwen15b_config():
    return tiny_config("qwen2", num_hidden_layers=28, num_key_value_heads=2, num_attention_heads=12, head_dim=128,
                       hidden_size=1536, max_position_embeddings=32768)


def test_slot_ratio_and_1p5b_budgets():
    cfg = qwen15b_config()
    bf = KVArena.bytes_per_slot(cfg, "bf16", torch.bfloat16)
    i4 = KVArena.bytes_per_slot(cfg, "int4", torch.bfloat16)
    assert (bf, i4) == (512, 192)  # 2 x 256 vs 2 x (64 codes + 8 groups x 4 bytes): 2.67 int4 slots per bf16 slot
    staging = 64
    half_bf16_1024 = plain_arena_bytes(cfg, 1024, staging, "bf16") // 2
    assert KVArena.budget_for_bytes(cfg, "int4", torch.bfloat16, half_bf16_1024, staging) == 1386
    nbytes = plain_arena_bytes(cfg, 1386, staging, "int4")
    got = {W: budget_at_equal_bytes(cfg, nbytes, staging, W) for W in (0, 32, 128)}
    assert got == {0: 1386, 32: 1332, 128: 1172}
    assert KVArena.budget_for_bytes(cfg, "int4", torch.bfloat16, plain_arena_bytes(cfg, 1024, staging, "bf16"),
                                    staging) == 2837


@pytest.mark.parametrize("cfg", [qwen15b_config(), tiny_config("llama", head_dim=16),
                                 tiny_config("llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)])
def test_budget_at_equal_bytes_is_largest_fitting(cfg):
    for staging in (1, 16, 64):
        for B0 in (8, 40, 256, 1386):
            nbytes = plain_arena_bytes(cfg, B0, staging, "int4")
            assert budget_at_equal_bytes(cfg, nbytes, staging, 0) == B0
            for W in (0, 1, 8, 32, 128, 2000):
                B = budget_at_equal_bytes(cfg, nbytes, staging, W)
                assert analytic_kv_bytes(cfg, B, staging, W) <= nbytes < analytic_kv_bytes(cfg, B + 1, staging, W)


def test_analytic_bytes_match_real_arenas(model):
    policy = make_policy("hybrid-decay", BUDGET)
    cfg, dt = model.config, model.dtype
    for kv in ("int4", "bf16"):
        assert stock(model, policy, kv, "in-cache").nbytes == plain_arena_bytes(cfg, BUDGET, CHUNK, kv, dt)
    arena = window(model, policy, 8, "in-cache")
    assert analytic_kv_bytes(cfg, BUDGET, CHUNK, 0, "int4", dt) == arena.nbytes  # int4 part only
    # everything bf16 = a bf16 arena; the prototype allocates both
    bf16 = stock(model, policy, "bf16", "in-cache").nbytes
    assert analytic_kv_bytes(cfg, BUDGET, CHUNK, HUGE, "int4", dt) == bf16
    assert arena.allocated_nbytes == arena.nbytes + bf16
    W = 8
    per_head = W * KVArena.bytes_per_slot(cfg, "bf16", dt) + (BUDGET + CHUNK - W) * KVArena.bytes_per_slot(cfg, "int4", dt)
    assert analytic_kv_bytes(cfg, BUDGET, CHUNK, W, "int4", dt) == per_head * cfg.num_hidden_layers * cfg.num_key_value_heads
