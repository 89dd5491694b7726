"""The quantized KV arena: the format's definition (a reference written here, which the native op's codes equal bit for
bit) with its round trips within the stated bound, bytes by the formula, and SmolLM2's logits."""

from __future__ import annotations

import math

import pytest
import torch

from sparsespec.cache import KVArena, make_policy
from sparsespec.cache.quant import BITS, MIN_SCALE, group_size
from sparsespec.errors import UserError

from conftest import layer_by_layer, rotate, tiny_config, tiny_model


def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and group parameters of ``x: [..., head_dim]`` as ``cache/quant.py`` defines them (computed in float32):
    ``codes`` uint8 ``[..., head_dim * bits / 8]`` (int4: channel c in the low nibble of byte c, c + head_dim/2 in
    the high one), ``params`` float16 ``[..., head_dim // group, 2]``, (scale, zero) per group."""
    head_dim = x.shape[-1]
    group = group_size(head_dim, bits)
    levels = 2**bits - 1
    grouped = x.float().unflatten(-1, (head_dim // group, group))
    low = grouped.amin(dim=-1)
    scale = ((grouped.amax(dim=-1) - low) / levels).clamp_min_(MIN_SCALE).half()
    zero = low.half()
    codes = (grouped - zero.float()[..., None]).div_(scale.float()[..., None]).round_().clamp_(0, levels)
    codes = codes.flatten(-2).to(torch.uint8)
    if bits == 4:
        half = head_dim // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)
    return codes, torch.stack((scale, zero), dim=-1)


def dequantize(codes: torch.Tensor, params: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., head_dim]`` float32 from :func:`quantize`'s codes and params: ``code · scale + zero``."""
    if bits == 4:
        codes = torch.cat((codes & 15, codes >> 4), dim=-1)
    n_groups = params.shape[-2]
    grouped = codes.unflatten(-1, (n_groups, codes.shape[-1] // n_groups)).float()
    params = params.float()
    return torch.addcmul(params[..., 1:], grouped, params[..., :1]).flatten(-2)


def _bound(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The module's stated bound per element: s/2 + 2^-11 (range + |min|), s = max(range / levels, 2^-14)."""
    grouped = x.float().unflatten(-1, (x.shape[-1] // group, group))
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    step = ((high - low) / (2**bits - 1)).clamp_min(2.0**-14)
    bound = step / 2 + 2.0**-11 * ((high - low) + low.abs())
    return bound.expand_as(grouped).flatten(-2)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_round_trip_within_the_stated_bound(bits, head_dim):
    g = torch.Generator().manual_seed(bits * head_dim)
    x = torch.randn(3, 2, 50, head_dim, generator=g)
    x[0] *= 100.0  # large magnitudes
    x[1, 0] += 40.0  # far from zero: the zero point matters
    x[1, 1, :, :] = 0.25  # constant groups
    x[2, 0, :, 3] = 30.0  # an outlier channel
    codes, params = quantize(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (*x.shape[:-1], head_dim * bits // 8)
    group = min({8: 32, 4: 16}[bits], head_dim)
    assert params.dtype == torch.float16 and params.shape == (*x.shape[:-1], head_dim // group, 2)
    back = dequantize(codes, params, bits)
    err = (back - x).abs()
    bound = _bound(x, bits, group)
    assert bool((err <= bound).all()), f"max error / bound = {float((err / bound).max()):.3f}"
    assert float(err[1, 1].max()) == 0.0  # a constant group comes back exactly
    # Relative error of Gaussian data: about a quarter of a step (uniform rounding), far below the bound.
    rel = float((back[2] - x[2]).norm() / x[2].norm())
    assert rel < (0.02 if bits == 8 else 0.2)


def test_int4_codes_pack_channel_c_and_c_plus_half():
    x = torch.arange(16.0).repeat(2)[None]  # head_dim 32: channels 0..15 then 0..15 again, one group of 16 each
    codes, params = quantize(x, 4)
    assert codes.shape == (1, 16)
    # Every group spans 0..15 with scale 1 and zero 0: channel c holds code c % 16.
    assert torch.equal(params[0, :, 0].float(), torch.ones(2)) and torch.equal(params[0, :, 1].float(), torch.zeros(2))
    assert torch.equal(codes[0] & 15, torch.arange(16, dtype=torch.uint8))
    assert torch.equal(codes[0] >> 4, torch.arange(16, dtype=torch.uint8))


@pytest.mark.parametrize(("kv_dtype", "per_vector"), [
    ("auto", lambda hd: hd * 4),  # float32 compute: the entries as they are
    ("bf16", lambda hd: hd * 2),
    ("int8", lambda hd: hd + hd // 32 * 4),
    ("int4", lambda hd: hd // 2 + hd // 16 * 4),
])
@pytest.mark.parametrize("policy", [("hybrid", 24), ("full", None)])
def test_arena_bytes_equal_the_formula(kv_dtype, per_vector, policy):
    """Bytes of every slot's key and value, plus (int4) a ring of 32 + 3 - 1 full-precision float32 entries."""
    config = tiny_config(num_hidden_layers=3, num_key_value_heads=2, head_dim=64)
    arena = KVArena(config, make_policy(*policy), dtype=torch.float32, max_tokens=100, max_block=8,
                    max_inflight=3, kv_dtype=kv_dtype)
    capacity = (24 if policy[1] else 100) + 8
    ring = 34 if kv_dtype == "int4" else 0
    assert arena.capacity == capacity and arena.recent_slots == ring
    assert arena.nbytes == 3 * 2 * (capacity * 2 * per_vector(64) + ring * 2 * 64 * 4)
    assert KVArena.bytes_per_slot(config, kv_dtype, torch.float32) == 2 * per_vector(64)


def test_a_window_refuses_to_drop_more_rows_than_its_ring_spares():
    """The ring holds recent_window + max_inflight - 1 entries: rolling back a larger block would have let its rows
    overwrite entries the next row reads, so it is refused; committing it whole is not."""
    config = tiny_config(num_hidden_layers=1)
    n_kv, hd = config.num_key_value_heads, config.head_dim
    arena = KVArena(config, make_policy("hybrid", 24), dtype=torch.float32, max_block=8, max_inflight=2,
                    kv_dtype="int4", recent_window=3)
    assert arena.recent_slots == 4
    rows = torch.randn(config.num_attention_heads, 8, hd), torch.randn(n_kv, 8, hd), torch.randn(n_kv, 8, hd)
    arena.begin(8, per_block=True)
    arena.attend(0, *rows)
    arena.end()
    with pytest.raises(ValueError, match="full-precision window"):
        arena.commit(0)
    arena.commit(8)
    assert arena.n_committed == 8


def test_unknown_kv_dtype_is_a_user_error():
    with pytest.raises(UserError, match="KV cache dtype"):
        KVArena(tiny_config(), make_policy("full"), dtype=torch.float32, max_tokens=8, kv_dtype="int2")


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("mode", ["original", "in-cache"])
def test_the_op_stores_the_codes_of_the_written_rows_and_they_move_with_their_slot(native_kernels, kv_dtype, mode):
    """The native op writes every row as the codes and group parameters ``quantize`` gives for it (the key rotated
    by its position in the original mode, unrotated in the in-cache mode), and after evictions, partial commits and
    compaction every committed slot still holds the codes of its own position's row."""
    model = tiny_model(num_hidden_layers=1)
    arena = KVArena(model.config, make_policy("h2o", 12), dtype=torch.float32, max_block=4, max_inflight=4,
                    positions=mode, kv_dtype=kv_dtype)
    written = {}
    attend = arena.attend

    def spy(layer, q, k, v):
        first = arena.next_position + arena.n_inflight
        stored = rotate(k, torch.arange(first, first + k.shape[1]), arena.rope) if mode == "original" else k
        for i in range(k.shape[1]):  # a rejected row's position is written again by the next block
            written[first + i] = (stored[:, i].clone(), v[:, i].clone())
        return attend(layer, q, k, v)

    arena.attend = spy
    ids = torch.randint(0, model.config.vocab_size, (60,), generator=torch.Generator().manual_seed(0))
    at = 0
    while at < 60:
        block = ids[at : at + 4]
        with layer_by_layer(model):
            model.forward(block, arena)
        accept = 1 + at % len(block)
        arena.commit(accept)
        at += accept
    assert arena.evicted_tokens > 0
    bits = 8 if kv_dtype == "int8" else 4
    for head in range(model.config.num_key_value_heads):
        for slot in range(arena.n_committed):
            k, v = written[int(arena.buffer("positions")[0, head, slot])]
            for stored, row in (("key", k), ("value", v)):
                codes, params = quantize(row[head], bits)
                assert torch.equal(arena.buffer(stored + "s")[0, head, slot], codes)
                assert torch.equal(arena.buffer(stored + "_params")[0, head, slot], params)


def _stored_keys(arena: KVArena, layer: int, n: int) -> torch.Tensor:
    """``[n_kv, n, head_dim]`` float32: the keys of slots ``[0, n)`` of ``layer`` as stored, dequantized, the offset
    added back."""
    keys = dequantize(arena.buffer("keys")[layer, :, :n], arena.buffer("key_params")[layer, :, :n],
                      BITS[arena.kv_dtype])
    offset = _key_offset(arena)
    return keys if offset is None else keys + offset[layer][:, None]


def _key_offset(arena: KVArena) -> torch.Tensor | None:
    """The offset the arena stores keys minus, or None."""
    return arena.buffers().get("key_offset")


@pytest.mark.parametrize("bits", [8, 4])
def test_keys_with_an_offset_are_stored_without_it_and_read_back_with_it(native_kernels, bits):
    """Keys with a large per-channel offset (as Qwen2's key bias) in the in-cache mode: the op keeps the codes of
    ``key - offset``, the store reads them back plus the offset, so the error is bounded by the range of ``key -
    offset``, not of the key."""
    config = tiny_config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    g = torch.Generator().manual_seed(bits)
    offset = torch.randn(2, 2, 64, generator=g)
    offset[:, :, 7] = 350.0
    x = torch.randn(2, 5, 64, generator=g) + offset[1][:, None]  # layer 1's rows: [n_kv, tokens, hd]
    kv_dtype = f"int{bits}"
    shifted, plain = (KVArena(config, make_policy("hybrid", 12, sinks=1), dtype=torch.float32, max_block=5,
                              positions="in-cache", kv_dtype=kv_dtype, key_offset=o, recent_window=0)
                      for o in (offset, None))
    for arena in (shifted, plain):
        arena.begin(5, per_block=True)
        for layer in range(2):
            arena.attend(layer, torch.randn(4, 5, 64, generator=g), x, x)
        arena.end()
        arena.commit(5)
    codes, params = quantize(x - offset[1][:, None], bits)
    assert torch.equal(shifted.buffer("keys")[1, :, :5], codes)
    assert torch.equal(shifted.buffer("key_params")[1, :, :5], params)
    back = _stored_keys(shifted, 1, 5)
    torch.testing.assert_close(back, dequantize(codes, params, bits) + offset[1][:, None])
    group = {8: 32, 4: 16}[bits]
    assert bool(((back - x).abs() <= _bound(x - offset[1][:, None], bits, group) * 1.001 + 1e-4).all())
    plain_error = float((_stored_keys(plain, 1, 5) - x).abs().max())
    assert float((back - x).abs().max()) < plain_error / 10  # the offset is what made the difference
    with pytest.raises(ValueError, match="offset"):
        KVArena(config, make_policy("hybrid", 12, sinks=1), dtype=torch.float32, positions="in-cache",
                kv_dtype=kv_dtype, key_offset=offset[:1])


def test_without_the_native_kernels_every_kv_dtype_is_refused_in_one_sentence(monkeypatch):
    """The native op is the arena's only attention: without the kernels no arena is built, whatever it stores."""
    from sparsespec import kernels

    monkeypatch.setattr(kernels, "available", lambda: False)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: "no C++ compiler found")
    for kv_dtype in ("auto", "bf16", "int8", "int4"):
        with pytest.raises(UserError) as refused:
            KVArena(tiny_config(), make_policy("hybrid", 16), dtype=torch.float32, kv_dtype=kv_dtype)
        assert str(refused.value) == ("The KV cache's attention runs in the native kernels, which are not available "
                                      "here (no C++ compiler found).")


def test_the_key_offset_is_the_models_key_bias_and_only_where_keys_are_stored_before_rope():
    from conftest import random_state
    from sparsespec.model import Transformer

    config = tiny_config("qwen2", num_hidden_layers=2)
    state = random_state(config, seed=3)
    model = Transformer(config, state, torch.float32)
    bias = model.key_biases()
    hd, n_kv = config.head_dim, config.num_key_value_heads
    for layer in range(2):
        want = state[f"model.layers.{layer}.self_attn.k_proj.bias"].float().view(n_kv, hd)
        assert torch.equal(bias[layer], want)
    assert Transformer(tiny_config(), random_state(tiny_config(), seed=3), torch.float32).key_biases() is None
    arenas = {mode: KVArena(config, make_policy("hybrid", 24), dtype=torch.float32, max_block=8, positions=mode,
                            kv_dtype="int8", key_offset=bias) for mode in ("original", "in-cache")}
    assert _key_offset(arenas["original"]) is None  # keys stored rotated: the bias rotates with them
    assert torch.equal(_key_offset(arenas["in-cache"]), bias)
    # The full cache, where the modes coincide, stores int4 keys before RoPE so the bias can be left out; other
    # keys rotated, once, as they are written.
    full = {kv_dtype: KVArena(config, make_policy("full"), dtype=torch.float32, max_tokens=64, positions="original",
                              kv_dtype=kv_dtype, key_offset=bias) for kv_dtype in ("int4", "int8", "bf16")}
    assert full["int4"].positions_mode == "in-cache" and torch.equal(_key_offset(full["int4"]), bias)
    for kv_dtype in ("int8", "bf16"):
        assert full[kv_dtype].positions_mode == "original" and _key_offset(full[kv_dtype]) is None


def test_int4_keys_that_would_keep_the_key_bias_in_are_refused():
    """A budgeted cache in the original mode stores keys rotated, the bias with them: int4 keys there are an error
    on a model with a key bias, and fine without one, in the in-cache mode, or as int8."""
    config = tiny_config("qwen2", num_hidden_layers=2)
    bias = torch.ones(2, config.num_key_value_heads, config.head_dim)

    def arena(kv_dtype, positions, key_offset):
        return KVArena(config, make_policy("hybrid", 24), dtype=torch.float32, max_block=8, positions=positions,
                       kv_dtype=kv_dtype, key_offset=key_offset)

    with pytest.raises(UserError, match="positions in-cache or int8 keys"):
        arena("int4", "original", bias)
    assert _key_offset(arena("int4", "in-cache", bias)) is not None
    assert _key_offset(arena("int8", "original", bias)) is None
    assert arena("int4", "original", None).positions_mode == "original"


# --------------------------------------------------------------------------------------------- SmolLM2
SMOLLM2_TOKENS = 256
# The stated tolerance of an int8 cache against a bf16 cache, both full, float32 compute: the mean KL divergence of
# the next-token distributions below 2e-3 nats and no logit further than 1.5 away (measured: ~2e-4 and ~0.5).
INT8_MEAN_KL = 2e-3
INT8_MAX_LOGIT_DIFF = 1.5


def test_int8_full_cache_logits_match_the_bf16_cache_on_smollm2(smollm2_f32):
    from sparsespec.eval.texts import text_token_ids

    ids = text_token_ids(smollm2_f32.tokenizer, "corpus:hamlet", SMOLLM2_TOKENS)
    logits = {}
    for kv_dtype in ("bf16", "int8"):
        arena = KVArena(smollm2_f32.config, make_policy("full"), dtype=torch.float32, max_tokens=len(ids),
                        max_block=len(ids), kv_dtype=kv_dtype)
        logits[kv_dtype] = smollm2_f32.model.forward(torch.tensor(ids), arena, per_block=True)
    ref, got = (torch.log_softmax(logits[k].double(), dim=-1) for k in ("bf16", "int8"))
    kl = float((ref.exp() * (ref - got)).sum(dim=-1).mean())
    diff = float((logits["int8"] - logits["bf16"]).abs().max())
    assert kl < INT8_MEAN_KL, kl
    assert diff < INT8_MAX_LOGIT_DIFF, diff
    assert 0 < diff and not math.isnan(kl)  # the caches differ: the int8 path was taken


# ------------------------------------------------------------------------------ bytes elsewhere: roofline, sweep
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_roofline_kv_bytes_per_token_are_the_arenas(kv_dtype):
    from sparsespec.edge.roofline import kv_bytes_per_token

    config = tiny_config(num_hidden_layers=5, num_key_value_heads=2, head_dim=128)
    per_slot = KVArena.bytes_per_slot(config, kv_dtype, torch.float32)
    assert kv_bytes_per_token(config, kv_dtype) == 5 * 2 * per_slot


def test_sized_policy_fills_the_bytes():
    from sparsespec.engine import sized_policy

    config = tiny_config(num_hidden_layers=3, num_key_value_heads=2, head_dim=64)
    slot = 3 * 2 * KVArena.bytes_per_slot(config, "int4", torch.float32)
    ring = 3 * 2 * 32 * KVArena.bytes_per_slot(config, "auto", torch.float32)  # int4's full-precision window
    policy = sized_policy("hybrid", None, config, torch.float32, "int4", 100 * slot + ring + slot - 1, staging=8)
    assert policy.budget == 92 and policy.sinks == 4
    arena = KVArena(config, policy, dtype=torch.float32, max_block=8, kv_dtype="int4")
    assert arena.nbytes == 100 * slot + ring
    with pytest.raises(UserError, match="no room"):
        sized_policy("window", None, config, torch.float32, "int4", 8 * slot + ring, staging=8)


def test_sweep_grid_in_bytes_has_a_budget_per_policy_and_dtype():
    from sparsespec.eval.sweep import SweepPoint, build_grid

    asked = []

    def budget_for(policy, kv, nbytes):
        asked.append((policy, kv, nbytes))
        return nbytes // {"auto": 400, "int8": 200, "int4": 100}[kv]

    points = build_grid(["full", "hybrid"], [], ["original"], kv_dtypes=["auto", "int8", "int4"],
                        kv_bytes=[4000, 8000], budget_for_bytes=budget_for)
    hybrid = {(p.kv_dtype, p.kv_bytes): p.budget for p in points if p.policy == "hybrid"}
    assert hybrid == {("auto", 4000): 10, ("auto", 8000): 20, ("int8", 4000): 20, ("int8", 8000): 40,
                      ("int4", 4000): 40, ("int4", 8000): 80}
    full = [p for p in points if p.policy == "full"]
    assert {p.kv_dtype for p in full} == {"auto", "int8", "int4"} and all(p.budget is None for p in full)
    assert len(asked) == 6
    with pytest.raises(UserError, match="not both"):
        build_grid(["hybrid"], [32], ["original"], kv_bytes=[4000], budget_for_bytes=budget_for)
    # Points of the float cache keep the keys they had before KV dtypes existed (resuming old files).
    old_key = "hybrid|budget=32|positions=original|draft=-|gamma=-|setup=s"
    assert SweepPoint("hybrid", 32, "original").key("s") == old_key
    assert "kv=int8" in SweepPoint("hybrid", 32, "original", kv_dtype="int8").key("s")
