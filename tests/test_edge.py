"""The edge simulator: formulas against hand-computed cases, device profiles, the simulate command, no torch."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sparsespec.config import ModelConfig
from sparsespec.edge import (
    DeviceProfile,
    best_budget,
    best_gamma,
    best_gamma_on_device,
    expected_tokens_per_pass,
    forward_pass,
    list_profiles,
    load_profile,
    predict,
    predict_autoregressive,
    predict_speculative,
    save_profile,
    speculative_speedup,
)
from sparsespec.edge.commands import (
    SimulateOptions,
    add_simulate_arguments,
    native_streamed_bytes,
    run_simulate,
    simulate,
)
from sparsespec.edge.roofline import bytes_by_type, kv_bytes_per_token, place_kv, streamed_parameters, weight_bytes
from sparsespec.errors import UserError
from sparsespec.flags import DEFAULT_DRAFT_BUDGET

SHIPPED = {
    "host",
    "jetson-agx-orin-64gb",
    "jetson-orin-nano-8gb",
    "jetson-orin-nano-8gb-super",
    "jetson-orin-nx-16gb",
    "raspberry-pi-5",
}


@pytest.fixture(autouse=True)
def _empty_user_profiles(tmp_path, monkeypatch):
    """Profiles looked up by name see an empty user folder, whatever this machine has calibrated."""
    monkeypatch.setenv("SPARSESPEC_HOME", str(tmp_path / "sparsespec-home"))


def toy_model(**changes) -> ModelConfig:
    """2 layers, hidden 8, 2 query heads sharing 1 KV head of width 4, vocab 16, tied embeddings."""
    fields = dict(
        architecture="llama",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        attention_bias=False,
    )
    fields.update(changes)
    return ModelConfig(**fields)


def toy_device(**changes) -> DeviceProfile:
    """DRAM 1000 B/s, SRAM 1000 bytes at 10000 B/s (all of it for KV), 1e6 FLOP/s, 0.5 s per forward."""
    fields = dict(
        name="toy",
        description="toy device",
        compute_unit="toy",
        memory_bytes=10**9,
        dram_bandwidth=1000.0,
        sram_level="toy SRAM",
        sram_bytes=1000,
        sram_bandwidth=10000.0,
        peak_flops={"bf16": 1e6, "fp32": 5e5},
        overhead_s=0.5,
        per_layer_overhead_s=0.0,
        dram_efficiency=1.0,
        sram_kv_fraction=1.0,
    )
    fields.update(changes)
    return DeviceProfile(**fields)


# --- speculative-decoding formulas ---------------------------------------------------------------------------


def test_expected_tokens_per_pass_hand_values():
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(0.5, 3) == pytest.approx((1 - 0.5**4) / 0.5) == pytest.approx(1.875)
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.7, 0) == 1.0
    # continuous at α → 1
    assert expected_tokens_per_pass(1 - 1e-9, 4) == pytest.approx(5.0, rel=1e-6)


def test_speculative_speedup_formula():
    assert speculative_speedup(0.5, 3, 0.1) == pytest.approx(1.875 / 1.3)
    assert speculative_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)
    assert speculative_speedup(0.0, 4, 0.0) == 1.0


@pytest.mark.parametrize("alpha,gamma", [(-0.1, 2), (1.5, 2), (0.5, -1), (0.5, 1.5)])
def test_formula_inputs_checked(alpha, gamma):
    with pytest.raises(UserError):
        expected_tokens_per_pass(alpha, gamma)


def test_best_gamma_sensible():
    # α = 0.8, c = 0.05: the speedup peaks at γ = 8 (3.09×; γ=7: 3.08, γ=9: 3.08)
    assert best_gamma(0.8, 0.05) == 8
    brute = max(range(17), key=lambda g: speculative_speedup(0.8, g, 0.05))
    assert best_gamma(0.8, 0.05) == brute
    assert best_gamma(0.0, 0.1) == 0  # nothing is ever accepted: do not speculate
    assert best_gamma(0.9, 1.0) == 0  # a draft as slow as the target never pays
    assert best_gamma(1.0, 0.0, max_gamma=10) == 10  # free, perfect draft: as long as allowed
    # better drafts and cheaper drafts never shorten the best draft length
    assert best_gamma(0.9, 0.05) >= best_gamma(0.8, 0.05) >= best_gamma(0.6, 0.05)
    assert best_gamma(0.8, 0.02) >= best_gamma(0.8, 0.05) >= best_gamma(0.8, 0.2)


# --- roofline -------------------------------------------------------------------------------------------------


def test_toy_sizes_by_hand():
    m = toy_model()
    # embedding 16·8 = 128; per layer: q 64 + k,v 2·32 + o 64 + MLP 3·8·16 = 384 + norms 2·8 → 592; final norm 8
    assert m.num_parameters() == 128 + 2 * 592 + 8 == 1320
    assert streamed_parameters(m) == 1320  # tied: the embedding is the head and is read whole
    assert streamed_parameters(toy_model(tie_word_embeddings=False)) == 1320  # +128 head, −128 gathered table
    assert kv_bytes_per_token(m, "bf16") == 2 * 2 * 1 * 4 * 2 == 32 == m.kv_bytes_per_token()
    assert kv_bytes_per_token(m, "fp32") == 64


def test_roofline_time_by_hand_kv_in_sram():
    cost = forward_pass(toy_model(), toy_device(), tokens=1, kv_entries=10)
    # KV: 11 slots × 32 B = 352 B ≤ 1000 B → SRAM.
    assert cost.kv_in_sram
    assert cost.dram_bytes == {"weights": 2640.0, "kv": 0.0}  # 1320 params × 2 B
    # activations: 2 B × 1 token × 2 layers × (4·8 + 3·16) = 320 B
    assert cost.sram_bytes == {"kv": 352.0, "activations": 320.0}
    assert cost.memory_s == pytest.approx(2640 / 1000 + 672 / 10000)  # 2.7072 s
    # FLOPs: 2·1320·1 + 4·L2·H2·d4·N10·T1 = 2640 + 640
    assert cost.flops == 3280
    assert cost.compute_s == pytest.approx(3280 / 1e6)
    assert cost.bound == "memory"
    assert cost.time_s == pytest.approx(2.7072 + 0.5)


def test_roofline_kv_spills_to_dram():
    cost = forward_pass(toy_model(), toy_device(), tokens=1, kv_entries=40)
    # 41 slots × 32 B = 1312 B > 1000 B → the cache streams from DRAM
    assert not cost.kv_in_sram
    assert cost.dram_bytes == {"weights": 2640.0, "kv": 1312.0}
    assert cost.sram_bytes["kv"] == 0.0
    assert cost.time_s == pytest.approx((2640 + 1312) / 1000 + 320 / 10000 + 0.5)


def test_kv_fits_sram_switch_at_the_budget():
    dev = toy_device()
    # 31 entries + 1 staged = 32 slots × 32 B = 1024 B > 1000; 30 + 1 = 31 slots = 992 B fits
    assert forward_pass(toy_model(), dev, tokens=1, kv_entries=30).kv_in_sram
    assert not forward_pass(toy_model(), dev, tokens=1, kv_entries=31).kv_in_sram
    # half the SRAM kept for KV moves the switch
    assert not forward_pass(toy_model(), toy_device(sram_kv_fraction=0.5), tokens=1, kv_entries=30).kv_in_sram
    sparse = predict_autoregressive(toy_model(), dev, context=1000, budget=16)
    full = predict_autoregressive(toy_model(), dev, context=1000)
    assert sparse.kv_in_sram and not full.kv_in_sram
    assert sparse.tokens_per_second > full.tokens_per_second


def test_compute_bound_and_overheads():
    dev = toy_device(peak_flops={"bf16": 100.0}, overhead_s=0.25, per_layer_overhead_s=0.125)
    cost = forward_pass(toy_model(), dev, tokens=4, kv_entries=0)
    assert cost.bound == "compute"
    assert cost.flops == 2 * 1320 * 4
    assert cost.time_s == pytest.approx(2 * 1320 * 4 / 100 + 0.25 + 2 * 0.125)
    # a dtype the profile lacks runs at the fp32 rate (or the lowest listed)
    assert dev.peak("int8") == 100.0


def test_engine_terms_by_hand():
    # Free SRAM and compute, so only weights, the engine terms and the overheads count.
    dev = toy_device(
        sram_bandwidth=1e30, peak_flops={"bf16": 1e30}, overhead_s=0.5, per_layer_overhead_s=0.125,
        extra_row_flops=1000.0, per_row_layer_overhead_s=0.01, evict_layer_overhead_s=0.02,
        evict_row_layer_overhead_s=0.005, per_vocab_overhead_s=0.001,
        attention_flops={"single": 100.0, "multi": 200.0, "evicting": 50.0},
    )
    m = toy_model()  # L=2, H=2, d=4, vocab 16, 1320 streamed parameters: 2640 B of weights → 2.64 s
    fixed = 0.5 + 2 * 0.125 + 16 * 0.001
    one = forward_pass(m, dev, tokens=1, kv_entries=10)
    assert one.attention_s == pytest.approx(4 * 2 * 2 * 4 * 10 / 100)  # 640 FLOP on the single-row path
    assert one.extra_rows_s == 0.0
    assert one.overhead_s == pytest.approx(fixed)
    assert one.time_s == pytest.approx(2.64 + 6.4 + fixed)
    three = forward_pass(m, dev, tokens=3, kv_entries=10)
    assert three.extra_rows_s == pytest.approx(2 * 2 * 1320 / 1000)  # two extra rows of 2·P FLOPs
    assert three.attention_s == pytest.approx(4 * 2 * 2 * 4 * 10 * 3 / 200)  # multi-row path
    assert three.overhead_s == pytest.approx(fixed + 2 * 2 * 0.01)
    assert three.time_s == pytest.approx(2.64 + 5.28 + 9.6 + fixed + 0.04)
    evicting = forward_pass(m, dev, tokens=1, kv_entries=10, evicting=True)
    assert evicting.attention_s == pytest.approx(640 / 50)
    assert evicting.overhead_s == pytest.approx(fixed + 2 * 0.02)
    # a 3-row pass over an evicting cache: the first row's eviction cost per layer, then the cheaper further rows
    evicting3 = forward_pass(m, dev, tokens=3, kv_entries=10, evicting=True)
    assert evicting3.attention_s == pytest.approx(1920 / 50)
    assert evicting3.overhead_s == pytest.approx(fixed + 2 * 2 * 0.01 + 2 * (0.02 + 2 * 0.005))
    # a profile without the engine figures leaves the plain roofline
    plain = forward_pass(m, toy_device(), tokens=3, kv_entries=10, evicting=True)
    assert plain.extra_rows_s == plain.attention_s == 0.0 and plain.overhead_s == 0.5


def test_budgeted_cache_evicts_once_full():
    dev = toy_device(evict_layer_overhead_s=0.25)
    m = toy_model()
    assert predict_autoregressive(m, dev, context=100, budget=16).passes["target"].evicting
    assert not predict_autoregressive(m, dev, context=10, budget=16).passes["target"].evicting
    assert not predict_autoregressive(m, dev, context=100).passes["target"].evicting
    spec = predict_speculative(m, dev, context=100, gamma=2, acceptance=0.5, draft_budget=8)
    assert spec.passes["draft"].evicting and not spec.passes["target"].evicting
    comb = predict_speculative(m, dev, context=100, gamma=2, acceptance=0.5, budget=32, draft=toy_model())
    assert comb.passes["target"].evicting and comb.passes["draft"].evicting  # the draft follows the target's budget


def test_measured_tokens_per_pass_replaces_the_formula():
    dev, m = toy_device(), toy_model()
    base = predict_speculative(m, dev, context=50, gamma=4, acceptance=0.5, draft_budget=8)
    measured = predict_speculative(m, dev, context=50, gamma=4, acceptance=0.5, draft_budget=8, tokens_per_pass=3.0)
    assert base.tokens_per_pass == pytest.approx(expected_tokens_per_pass(0.5, 4))
    assert measured.tokens_per_pass == 3.0
    assert measured.tokens_per_second == pytest.approx(base.tokens_per_second * 3.0 / base.tokens_per_pass)
    with pytest.raises(UserError):
        predict_speculative(m, dev, context=50, gamma=4, acceptance=0.5, draft_budget=8, tokens_per_pass=6.0)


def test_weight_formats_and_efficiency():
    m = toy_model()
    dev = toy_device(sram_bandwidth=1e30, overhead_s=0.0, peak_flops={"bf16": 1e30})
    t = {w: forward_pass(m, dev, tokens=1, kv_entries=0, weights=w).time_s for w in ("bf16", "int8", "int4")}
    assert t["bf16"] == pytest.approx(1320 * 2 / 1000)
    # The toy's in_features (8, 16) are padded to one block of 32: int8 (Q8_0) 34 bytes a row, int4 (Q4_1) 20, over
    # Σ out = 144 rows; the 40 norm weights stay bf16.
    assert t["int8"] == pytest.approx((144 * 34 + 80) / 1000)
    assert t["int4"] == pytest.approx((144 * 20 + 80) / 1000)
    half = toy_device(sram_bandwidth=1e30, overhead_s=0.0, peak_flops={"bf16": 1e30}, dram_efficiency=0.5)
    assert forward_pass(m, half, tokens=1, kv_entries=0).time_s == pytest.approx(2 * t["bf16"])
    with pytest.raises(UserError):
        forward_pass(m, dev, tokens=1, kv_entries=0, weights="int3")


def test_weight_bytes_are_the_engine_formats():
    """Without padding: int4 (Q4_1) is 0.625 bytes per weight (4 bits + fp16 scale and minimum per 32), int8 (Q8_0)
    1.0625 (8 bits + an fp16 scale per 32); norms stay bf16. The quantized formats are priced as the native format's
    blocks of their types."""
    m = toy_model(hidden_size=64, intermediate_size=128, num_hidden_layers=1, head_dim=32, vocab_size=32)
    matrix_weights = 128 * 64 + 64 * 64 + 256 * 64 + 64 * 128 + 32 * 64  # qkv, o, gate_up, down, head
    assert matrix_weights == 38912 and streamed_parameters(m) == matrix_weights + 192
    assert weight_bytes(m, "bf16") == 2 * (38912 + 192)
    assert weight_bytes(m, "int4") == 38912 * 0.625 + 2 * 192
    assert weight_bytes(m, "int8") == 38912 * 34 / 32 + 2 * 192
    assert bytes_by_type(m, "int8") == {"Q8_0": 38912 * 34 / 32, "BF16": 2 * 192}
    assert bytes_by_type(m, "int4") == {"Q4_1": 38912 * 0.625, "BF16": 2 * 192}
    assert weight_bytes(m, 1.5) == 1.5 * (38912 + 192)  # a format known by its bytes per streamed parameter
    assert weight_bytes(m, {"Q4_K": 10.0, "F32": 2.0}) == 12.0  # native: the file's streamed bytes by block type


def test_native_weights_stream_at_each_types_rate():
    """Each block type streams at its own rate, a type without one at the DRAM rate; each extra row goes through a
    type's bytes at its extra-row rate, else by the FLOP rule on the type's share of the bytes. The layers' other
    work adds ``stream_overhead_fraction`` of the streaming time."""
    dev = toy_device(sram_bandwidth=1e30, peak_flops={"bf16": 1e30}, overhead_s=0.0, extra_row_flops=2640.0,
                     native_stream={"Q4_K": {"bytes_per_s": 300.0, "extra_row_bytes_per_s": 1000.0}})
    assert dev.weight_stream_rate("Q4_K") == 300.0 and dev.extra_row_stream_rate("Q4_K") == 1000.0
    assert dev.weight_stream_rate("F32") is None and dev.extra_row_stream_rate("F32") is None
    weights = {"Q4_K": 900.0, "F32": 100.0}
    m = toy_model()
    one = forward_pass(m, dev, tokens=1, kv_entries=0, weights=weights)
    assert one.dram_bytes["weights"] == 1000.0
    assert one.time_s == pytest.approx(900 / 300 + 100 / 1000)  # F32 at the DRAM rate of 1000 B/s
    three = forward_pass(m, dev, tokens=3, kv_entries=0, weights=weights)
    # per extra row: Q4_K's bytes at its extra-row rate, and F32's tenth of 2·P / extra_row_flops = 1 s
    assert three.extra_rows_s == pytest.approx(2 * (900 / 1000 + 0.1 * 1.0))
    # the same bytes as one number of bytes per parameter stream at the DRAM rate
    assert forward_pass(m, dev, tokens=1, kv_entries=0, weights=1000 / 1320).time_s == pytest.approx(1.0)
    cold = replace(dev, stream_overhead_fraction=0.25)
    assert forward_pass(m, cold, tokens=1, kv_entries=0, weights=weights).overhead_s == pytest.approx(0.25 * 3.1)


def test_native_weights_are_not_bound_by_the_torch_gemm_peak():
    """A host without a bf16 GEMM (AVX2: torch's bf16 matmul about 1 GFLOP/s) prices a pass on native weights by
    the kernels' measured rates alone; dense weights, whose products are torch's, stay bound by the peak."""
    m = toy_model()
    fast, slow = (toy_device(sram_bandwidth=1e30, overhead_s=0.0, peak_flops={"bf16": peak},
                             native_stream={"Q8_0": {"bytes_per_s": 300.0}}) for peak in (1e30, 1.0))
    for tokens in (1, 4):
        native = [forward_pass(m, dev, tokens=tokens, kv_entries=8, weights={"Q8_0": 900.0}) for dev in (fast, slow)]
        assert native[1].time_s == native[0].time_s and native[1].bound == "memory"
    dense = forward_pass(m, slow, tokens=1, kv_entries=8, weights="bf16")
    assert dense.bound == "compute" and dense.time_s == pytest.approx(dense.flops)


def test_measured_attention_stands_for_its_kv_reads():
    """Where the profile has the attention op's rate, the op's time holds its reads of the cache: the KV bytes are
    reported, not timed again. int8 / int4 keys use their own rate where the profile has one."""
    m = toy_model()  # KV per token: 2 layers × 1 KV head × 4 × (K, V) × 2 bytes = 32 bytes in bf16
    base = dict(sram_bytes=0, sram_bandwidth=1e30, peak_flops={"bf16": 1e30}, overhead_s=0.0)  # KV in DRAM
    plain = forward_pass(m, toy_device(**base), tokens=1, kv_entries=10)
    assert plain.memory_s == pytest.approx(2.64 + 11 * 32 / 1000) and plain.attention_s == 0.0
    timed_dev = toy_device(**base, attention_flops={"single": 100.0, "single:int8": 50.0})
    timed = forward_pass(m, timed_dev, tokens=1, kv_entries=10)
    assert timed.dram_bytes["kv"] == 11 * 32
    assert timed.memory_s == pytest.approx(2.64)
    assert timed.attention_s == pytest.approx(640 / 100)
    assert forward_pass(m, timed_dev, tokens=1, kv_entries=10, kv_dtype="int8").attention_s == pytest.approx(6.4 * 2)
    assert forward_pass(m, timed_dev, tokens=1, kv_entries=10, kv_dtype="int4").attention_s == pytest.approx(6.4)


def test_each_kv_head_costs_its_own_work_besides_the_query_heads_flops():
    """With ``attention_head_reads`` the op costs 4·L·H·d·N·T FLOPs at ``attention_flops`` plus L·n_kv·d·N·T KV-head
    channels at that rate: a model with fewer query heads per KV head costs more per FLOP. int8 keys take their own
    figure where the profile has one; a path without one prices FLOPs alone."""
    base = dict(sram_bandwidth=1e30, peak_flops={"bf16": 1e30}, overhead_s=0.0,
                attention_flops={"single": 100.0, "evicting": 50.0})
    dev = toy_device(**base, attention_head_reads={"single": 10.0, "single:int8": 5.0})
    m = toy_model()  # L=2, H=2, n_kv=1, d=4: per entry and row 64 FLOPs and 8 KV-head channels
    assert forward_pass(m, dev, tokens=1, kv_entries=10).attention_s == pytest.approx(640 / 100 + 80 / 10)
    int8 = forward_pass(m, dev, tokens=1, kv_entries=10, kv_dtype="int8").attention_s
    assert int8 == pytest.approx(640 / 100 + 80 / 5)
    assert forward_pass(m, dev, tokens=1, kv_entries=10, evicting=True).attention_s == pytest.approx(640 / 50)
    narrow = toy_model(num_attention_heads=2, num_key_value_heads=2)  # twice the KV heads for the same FLOPs
    assert forward_pass(narrow, dev, tokens=1, kv_entries=10).attention_s == pytest.approx(640 / 100 + 160 / 10)
    with pytest.raises(UserError, match="attention_head_reads.paged"):
        toy_device(attention_head_reads={"paged": 1e9})
    with pytest.raises(UserError, match="attention_head_reads.single must be a positive"):
        toy_device(attention_head_reads={"single": 0.0})


def test_attention_waits_for_the_busiest_thread():
    """The op gives each thread whole KV heads while a head holds fewer than 4,096 slots: 3 heads on 2 threads take
    as long as 2 heads on one, 4/3 of an even share; heads that divide, more threads than heads, long caches and
    profiles without threads are even."""
    base = dict(sram_bandwidth=1e30, peak_flops={"bf16": 1e30}, overhead_s=0.0, attention_flops={"single": 100.0})
    m3 = toy_model(num_attention_heads=6, num_key_value_heads=3)
    even = forward_pass(m3, toy_device(**base), tokens=1, kv_entries=10).attention_s
    assert forward_pass(m3, toy_device(**base, threads=2), tokens=1, kv_entries=10).attention_s == pytest.approx(
        even * 4 / 3)
    assert forward_pass(m3, toy_device(**base, threads=3), tokens=1, kv_entries=10).attention_s == pytest.approx(even)
    assert forward_pass(m3, toy_device(**base, threads=4), tokens=1, kv_entries=10).attention_s == pytest.approx(even)
    long = forward_pass(m3, toy_device(**base, threads=2), tokens=1, kv_entries=5000).attention_s
    assert long == pytest.approx(forward_pass(m3, toy_device(**base), tokens=1, kv_entries=5000).attention_s)
    with pytest.raises(UserError, match="threads"):
        toy_device(threads=0)


def test_speculative_simulation_matches_the_speedup_formula():
    # Weight streaming only (free SRAM and compute, no overhead, empty caches): a (γ+1)-token verification costs
    # one target pass, so the simulated gain must equal (1 − α^(γ+1)) / ((1 − α)(γc + 1)).
    dev = toy_device(sram_bandwidth=1e30, peak_flops={"bf16": 1e30}, overhead_s=0.0, sram_bytes=10**9)
    target = toy_model(hidden_size=16, intermediate_size=64, head_dim=8)
    draft = toy_model()
    for alpha, gamma in [(0.0, 3), (0.5, 3), (0.8, 5), (1.0, 4)]:
        ar = predict_autoregressive(target, dev, context=1)
        spec = predict_speculative(target, dev, context=1, gamma=gamma, acceptance=alpha, draft=draft)
        c = streamed_parameters(draft) / streamed_parameters(target)
        assert spec.cost_ratio == pytest.approx(c)
        assert spec.tokens_per_pass == pytest.approx(expected_tokens_per_pass(alpha, gamma))
        assert spec.tokens_per_second / ar.tokens_per_second == pytest.approx(speculative_speedup(alpha, gamma, c))


def test_speculative_bytes_per_token_divides_weight_traffic():
    dev = toy_device(sram_bandwidth=1e30, peak_flops={"bf16": 1e30}, overhead_s=0.0, sram_bytes=10**9)
    target = toy_model(hidden_size=16, intermediate_size=64, head_dim=8)
    spec = predict_speculative(target, dev, context=1, gamma=3, acceptance=1.0, draft=toy_model())
    # α = 1, γ = 3: 4 tokens per round, each round reads the target's weights once and the draft's three times
    expected = (streamed_parameters(target) * 2 + 3 * streamed_parameters(toy_model()) * 2) / 4
    assert spec.bytes_per_token["dram"]["weights"] == pytest.approx(expected)


def test_modes_and_self_speculation():
    m, dev = toy_model(), toy_device()
    kw = dict(context=500, gamma=2, acceptance=0.7)
    assert predict("full", m, dev, context=500, budget=8).mode == "full"
    assert predict("sparse", m, dev, context=500, budget=8).kv_entries == 8
    spec = predict("speculative", m, dev, draft_budget=8, **kw)
    comb = predict("combined", m, dev, budget=16, draft_budget=8, **kw)
    assert spec.mode == "speculative" and spec.draft == "self" and spec.kv_entries == 500
    assert comb.mode == "combined" and comb.kv_entries == 16 and comb.draft_kv_entries == 8
    with pytest.raises(UserError):
        predict_speculative(m, dev, **kw)  # self-speculation needs a draft budget
    with pytest.raises(UserError):
        predict("nonsense", m, dev, **kw)


def test_place_kv_prefers_the_most_read_cache():
    assert place_kv([600, 300], [1, 4], 1000) == [True, True]
    assert place_kv([800, 300], [1, 4], 1000) == [False, True]  # 300·4 saves more than 800·1
    assert place_kv([800, 300], [1, 2], 1000) == [True, False]
    assert place_kv([2000, 3000], [1, 1], 1000) == [False, False]


def test_best_budget_by_hand():
    m, dev = toy_model(), toy_device(sram_bytes=10_000)
    # (N + 1)·32 ≤ 10000 → N ≤ 311 → multiple of 16: 304
    assert best_budget(m, dev) == 304
    assert best_budget(m, dev, multiple=1) == 311
    assert best_budget(m, dev, staging=5, reserve_bytes=2000) == 240  # (N + 5)·32 ≤ 8000 → N ≤ 245
    assert best_budget(m, dev, tracking_kv_bytes_per_token=32) == 144  # 64·N + 32 + 32 ≤ 10000 → 155
    assert best_budget(m, dev, context=100) == 100
    assert best_budget(m, toy_device(sram_bytes=100)) is None


def test_best_gamma_on_device():
    dev = toy_device(sram_bandwidth=1e30, peak_flops={"bf16": 1e30}, overhead_s=0.0, sram_bytes=10**9)
    target = toy_model(hidden_size=32, intermediate_size=128, head_dim=16)
    g, pred = best_gamma_on_device(target, dev, context=1, acceptance=0.8, draft=toy_model())
    c = streamed_parameters(toy_model()) / streamed_parameters(target)
    assert g == best_gamma(0.8, c)
    assert pred.tokens_per_second >= predict_autoregressive(target, dev, context=1).tokens_per_second
    # a draft as costly as the target: plain decoding wins
    g, pred = best_gamma_on_device(target, dev, context=1, acceptance=0.8, draft=target)
    assert g == 0 and pred.mode == "full"


# --- device profiles ------------------------------------------------------------------------------------------


def test_shipped_profiles_load_and_cite_every_figure():
    assert set(list_profiles()) == SHIPPED
    for name in SHIPPED:
        p = load_profile(name)
        assert p.name == name
        assert p.missing_sources() == [], name
        assert p.dram_bandwidth > 1e9 and p.sram_bytes > 0 and p.peak("bf16") > 0
    assert load_profile("jetson-orin-nano-8gb").dram_bandwidth == 68e9
    assert load_profile("jetson-orin-nano-8gb-super").dram_bandwidth == 102e9
    assert load_profile("jetson-orin-nx-16gb").dram_bandwidth == 102.4e9
    assert load_profile("jetson-agx-orin-64gb").dram_bandwidth == 204.8e9
    assert load_profile("raspberry-pi-5").dram_bandwidth == pytest.approx(17.07e9, rel=1e-3)
    assert "sparsespec calibrate" in load_profile("host").sources["dram_bandwidth"]


def test_board_figures_say_what_kind_of_source_they_have():
    """Every figure of a board's profile says whether it is a datasheet value, a published benchmark, derived, an
    estimate, an assumption, or carried from the host's calibration."""
    labels = ("Datasheet: ", "Published benchmark: ", "Derived: ", "Estimate: ", "Assumption: ",
              "Carried from the host: ")
    for name in SHIPPED - {"host"}:
        for figure, source in load_profile(name).sources.items():
            assert source.startswith(labels), (name, figure, source[:40])
    pi = load_profile("raspberry-pi-5")
    assert pi.threads == 4 and pi.sources["per_layer_overhead_s"].startswith("Carried from the host: ")


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(UserError) as err:
        load_profile("jetson-tx9")
    message = str(err.value)
    assert "jetson-tx9" in message
    for name in SHIPPED:
        assert name in message


def test_profile_round_trip_and_validation(tmp_path: Path):
    dev = toy_device(sources={"memory_bytes": "test"}, caches={"l2": 512})
    path = save_profile(dev, tmp_path / "sub" / "toy.json")
    loaded = load_profile(path)
    assert loaded == dev
    assert "caches.l2" in loaded.missing_sources() and "memory_bytes" not in loaded.missing_sources()
    bad = json.loads(path.read_text())
    bad["dram_bandwith"] = bad.pop("dram_bandwidth")
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match="unknown keys"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(UserError):
        toy_device(sram_kv_fraction=0.0)


def test_engine_figures_validated_and_cited(tmp_path: Path):
    dev = toy_device(extra_row_flops=1e9, attention_flops={"single": 1e9}, sources={"attention_flops.single": "x"})
    assert "extra_row_flops" in dev.missing_sources() and "attention_flops.single" not in dev.missing_sources()
    assert "evict_layer_overhead_s" not in dev.figures()  # None: not given, not a figure
    assert load_profile(save_profile(dev, tmp_path / "d.json")) == dev
    with pytest.raises(UserError, match="attention_flops.paged"):
        toy_device(attention_flops={"paged": 1e9})
    with pytest.raises(UserError, match="attention_flops.single:fp8"):
        toy_device(attention_flops={"single:fp8": 1e9})
    with pytest.raises(UserError):
        toy_device(evict_layer_overhead_s=-1.0)
    with pytest.raises(UserError):
        toy_device(extra_row_flops=0.0)


def test_native_stream_round_trips_and_is_cited(tmp_path: Path):
    dev = toy_device(native_stream={"Q4_K": {"bytes_per_s": 2e10, "extra_row_bytes_per_s": 1.5e11}},
                     sources={"native_stream.Q4_K": "measured"})
    assert "native_stream.Q4_K" in dev.figures() and "native_stream.Q4_K" not in dev.missing_sources()
    assert load_profile(save_profile(dev, tmp_path / "d.json")) == dev


@pytest.mark.parametrize("entry", [
    {"bytes_per_s": -1.0},
    {"bytes_per_s": 1.0, "working_set_bytes": [1e6]},
    {"bytes_per_s": 1.0, "extra_row_bytes_per_s": 0.0},
    {"extra_row_bytes_per_s": 1.0},
    [1.0],
])
def test_native_stream_refuses_a_bad_entry(entry):
    with pytest.raises(UserError, match="native_stream.Q4_K"):
        toy_device(native_stream={"Q4_K": entry})


def test_user_profiles_come_first(tmp_path: Path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("SPARSESPEC_HOME", str(home))
    packaged = load_profile("host")
    assert "Placeholder" in packaged.sources["dram_bandwidth"]
    save_profile(toy_device(name="host"), home / "devices" / "host.json")
    save_profile(toy_device(name="bench-box"), home / "devices" / "bench-box.json")
    assert load_profile("host").name == "host" and load_profile("host").dram_bandwidth == 1000.0
    assert load_profile("bench-box").name == "bench-box"
    assert set(list_profiles()) == SHIPPED  # the packaged names; a user file overrides, it does not add
    assert load_profile("jetson-orin-nano-8gb").dram_bandwidth == 68e9


# --- command --------------------------------------------------------------------------------------------------


def _args(*argv: str, model=None, draft=None) -> argparse.Namespace:
    args = add_simulate_arguments(argparse.ArgumentParser()).parse_args(["--model", "x", *argv])
    args.model = model if model is not None else toy_model()
    args.draft = draft
    return args


def test_run_simulate_json(capsys):
    target = toy_model(hidden_size=32, intermediate_size=128, head_dim=16, num_hidden_layers=4)
    code = run_simulate(
        _args("--device", "jetson-orin-nano-8gb", "--json", "--context", "16384", "--acceptance", "0.9", model=target)
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "jetson-orin-nano-8gb"
    assert set(report["modes"]) == {"full", "sparse", "speculative", "combined"}
    assert report["draft"] == "self" and report["settings"]["draft_budget"] == DEFAULT_DRAFT_BUDGET
    full, sparse = report["modes"]["full"], report["modes"]["sparse"]
    assert all(m["tokens_per_second"] > 0 for m in report["modes"].values())
    # the default budget is the largest SRAM-resident one, so sparse keeps its KV on chip and full does not
    assert sparse["kv_in_sram"] and not full["kv_in_sram"]
    assert sparse["kv_entries"] == report["best_budget"]["autoregressive"] == report["settings"]["budget"]
    assert sparse["bytes_per_token"]["dram"]["kv"] == 0 < full["bytes_per_token"]["dram"]["kv"]
    combined = report["modes"]["combined"]
    assert combined["kv_entries"] == report["settings"]["combined_budget"] == report["best_budget"]["combined"]
    assert combined["kv_in_sram"] and combined["draft_kv_in_sram"]
    assert report["model_info"]["fits_memory"]
    assert report["best_gamma"]["speculative"]["gamma"] >= 0


def test_run_simulate_with_draft_and_all_devices(capsys):
    target = toy_model(hidden_size=64, intermediate_size=256, head_dim=32, num_hidden_layers=4)
    args = _args("--device", "all", "--json", "--budget", "64", "--weights", "int4", model=target, draft=toy_model())
    assert run_simulate(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["device"] for r in out["devices"]} == SHIPPED
    for r in out["devices"]:
        assert r["draft"] == "draft" and r["modes"]["combined"]["kv_entries"] == 64


def test_run_simulate_text_and_policy_full(capsys):
    assert run_simulate(_args("--device", "raspberry-pi-5", "--policy", "full")) == 0
    text = capsys.readouterr().out
    assert "raspberry-pi-5" in text and "Best γ" in text and "KV in SRAM" in text
    assert "sparse" not in text.split("KV in SRAM", 1)[1].split("Best")[0]
    with pytest.raises(UserError):
        run_simulate(_args("--policy", "full", "--budget", "32"))
    with pytest.raises(UserError):
        run_simulate(_args("--device", "nope"))
    with pytest.raises(UserError, match="vocabulary"):
        simulate(toy_model(), load_profile("host"), draft=toy_model(vocab_size=32))


def test_plot_writes_png(tmp_path: Path):
    out = tmp_path / "sweep.png"
    target = toy_model(max_position_embeddings=512)
    assert run_simulate(_args("--device", "host", "--plot", str(out), model=target)) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_edge_imports_no_torch():
    src = Path(__file__).resolve().parents[1] / "src"
    code = (
        "import sys, sparsespec.edge, sparsespec.edge.profile, sparsespec.edge.roofline, sparsespec.edge.commands; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    env = dict(os.environ, PYTHONPATH=str(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_native_weights_are_the_gguf_files_bytes(smollm2_path, capsys):
    """``--weights native`` streams what the GGUF file holds: SmolLM2 ties its head, so every tensor is streamed and
    the bytes per forward are the tensors' bytes, which fill the file but for its header and alignment."""
    args = _args("--weights", "native", "--json", model=str(smollm2_path))
    assert run_simulate(args) == 0
    report = json.loads(capsys.readouterr().out)
    per_forward = report["model_info"]["weight_bytes_per_forward"]
    assert 0.97 * smollm2_path.stat().st_size < per_forward < smollm2_path.stat().st_size
    assert report["settings"]["weights"] == "native"
    by_type = native_streamed_bytes(str(smollm2_path))  # Q4_1 layers, the tied Q8_0 table, float32 norms
    assert set(by_type) == {"Q4_1", "Q8_0", "F32"} and sum(by_type.values()) == per_forward
    with pytest.raises(UserError, match="GGUF"):
        run_simulate(_args("--weights", "native"))  # a ModelConfig, not a file



def test_quantized_formats_stream_at_their_block_types_rate():
    """The engine runs int8 / int4 as native Q8_0 / Q4_1 blocks, so the simulator prices them at those types' rates:
    a slower Q8_0 rate slows int8 and leaves int4 as it was."""
    m = toy_model()

    def speed(weights: str, q8_rate: float) -> float:
        dev = toy_device(sram_bandwidth=1e30, peak_flops={"bf16": 1e30}, overhead_s=0.0,
                         native_stream={"Q8_0": {"bytes_per_s": q8_rate}})
        report = simulate(m, dev, SimulateOptions(policy="full", weights=weights))
        return report["modes"]["full"]["tokens_per_second"]

    assert speed("int8", 10.0) < speed("int8", 1000.0) / 2
    assert speed("int4", 10.0) == speed("int4", 1000.0)


def test_quantized_blocks_are_the_types_the_engine_quantizes_to():
    """The simulator's table of int8 / int4 blocks names the GGML types ``linear.make_linear`` builds, with GGUF's
    own block sizes."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from sparsespec.edge.roofline import QUANTIZED_BLOCK, QUANTIZED_BLOCKS
    from sparsespec.linear import QUANTIZED_TYPES

    assert set(QUANTIZED_BLOCKS) == set(QUANTIZED_TYPES)
    for fmt, (kind, nbytes) in QUANTIZED_BLOCKS.items():
        ggml_type = GGMLQuantizationType(QUANTIZED_TYPES[fmt])
        assert ggml_type.name == kind and GGML_QUANT_SIZES[ggml_type] == (QUANTIZED_BLOCK, nbytes)
