"""``sparsespec calibrate``: the profile it writes loads, cites every figure, and becomes ``host``; and the edge
simulator's byte counts agree with the engine's."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import tiny_config, tiny_model

from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import make_policy
from sparsespec import kernels
from sparsespec.edge.calibration import measure
from sparsespec.edge.calibration.fits import ProbeTimes, fit_attention_rates, fit_overheads
from sparsespec.edge.calibration.host_profile import build_profile, default_output_path
from sparsespec.edge.calibration.machine import cpu_cache_sizes, read_machine
from sparsespec.edge.calibration.measure import calibrate
from sparsespec.edge.calibration.probes import (
    file_bytes,
    probe_config,
    probe_parts,
    random_native_weight,
    time_native_streaming,
)
from sparsespec.edge.calibration.settings import ATTENTION_NARROW_SHAPE, ATTENTION_SHAPE, KIB, MIB, QUICK
from sparsespec.edge.commands import add_calibrate_arguments, run_calibrate
from sparsespec.edge import list_profiles, load_profile
from sparsespec.edge.profile import DeviceProfile
from sparsespec.errors import UserError
from sparsespec.edge.roofline import forward_pass, kv_bytes_per_token, weight_bytes

# GGUF block types: (weights per block, bytes per block).
BLOCK_SIZES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
               "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}

# Small enough for a unit test (about a second); the figures it measures mean nothing.
TINY = replace(
    QUICK,
    sizes=(256 * KIB, 1 * MIB, 8 * MIB),
    min_seconds=0.0,
    trials=2,
    gemm_n=64,
    stream_bytes=2 * MIB,
    stream_rounds=1,
    stream_shapes=((256, 256), (512, 256), (256, 512)),
    native_types=("Q8_0", "Q4_K"),
    tiny_probe_shape=(64, 128, 4, 2, 16),
    tiny_probe_layers=(1, 3),
    probe_shapes=((256, 512, 4, 2, 64), (512, 1024, 4, 2, 128)),
    probe_bytes=1 * MIB,
    probe_steps=4,
    probe_rounds=1,
    probe_context=8,
    attention_trials=2,
    flush_bytes=1 * MIB,
    attention_entries=(32, 96),
    kv_dtypes=("int8",),
    vocab_sizes=(256, 4096),
    residency_fractions=(1 / 8,),
)


def _args(*argv: str) -> argparse.Namespace:
    args = add_calibrate_arguments(argparse.ArgumentParser()).parse_args(list(argv))
    args.settings = TINY
    args.quiet = True
    return args


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, native_kernels):
    """One tiny calibration, written to the default place under a private SPARSESPEC_HOME."""
    home = tmp_path_factory.mktemp("sparsespec-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARSESPEC_HOME", str(home))
        cal = calibrate(TINY, threads=1, quiet=True)
    return home, cal


def test_profile_has_every_figure_and_cites_it(calibrated):
    _, cal = calibrated
    profile = build_profile(cal, TINY)
    assert profile.name == "host"
    assert profile.missing_sources() == []
    for figure in profile.figures():
        assert "sparsespec calibrate on " + cal.date in profile.sources[figure], figure
    read = ("memory_bytes", "sram_bytes", "threads")
    measured = [f for f in profile.figures() if not f.startswith("caches.") and f not in read]
    for figure in measured:
        assert profile.sources[figure].startswith("measured by sparsespec calibrate on "), figure
    assert profile.dram_bandwidth > 0 and profile.sram_bandwidth >= profile.dram_bandwidth
    assert 0 < profile.dram_efficiency <= 1 and 0 < profile.sram_kv_fraction <= 1
    assert set(profile.peak_flops) == {"bf16", "fp32"}
    assert profile.per_layer_overhead_s >= 0 and profile.overhead_s >= 0
    assert len(cal.bandwidth_curve) == len(TINY.sizes)
    assert [p["bytes"] for p in cal.bandwidth_curve] == list(TINY.sizes)
    assert set(profile.native_stream) == {"Q8_0", "Q4_K"}
    assert profile.threads == 1


@pytest.mark.usefixtures("native_kernels")
def test_time_native_streaming_times_the_kernels_in_the_files_bytes():
    """As many layers as make the bytes asked for, counted as the file stores them (a Q4_K weight of [512, 256]
    holds 512 rows of one 144-byte block), and the extra rows' rate from paired passes."""
    shapes = ((512, 256), (256, 512))
    layer_bytes = 512 * 144 + 256 * 2 * 144
    measured = time_native_streaming("Q4_K", 3 * layer_bytes, shapes, 3, trials=2)
    assert measured["working_set_bytes"] == 3 * layer_bytes
    assert measured["bytes_per_s"] == pytest.approx(3 * layer_bytes / measured["one_row_s"])
    assert measured["extra_row_bytes_per_s"] is None or measured["extra_row_bytes_per_s"] > 0


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_random_native_weights_are_blocks_the_kernels_read(kind):
    """Random codes with a scale of 0.01: the kernels read them as finite weights of the right size, and their
    matmul agrees with the dequantized weight."""
    kernel_type, blob, padded, file_bytes = random_native_weight(kind, 32, 256)
    assert padded == 256 and blob.numel() == kernels.weight_bytes(kernel_type, 256, 32)
    assert file_bytes == 32 * 256 // BLOCK_SIZES[kind][0] * BLOCK_SIZES[kind][1]
    weight = kernels.gguf_dequantize(blob, kernel_type, 256, torch.arange(32))
    assert torch.isfinite(weight).all() and 0 < weight.abs().max() <= 127 * 32 * 0.01  # Q6_K: int8 scale × 6-bit code
    x = torch.randn(1, 256)
    got = kernels.gguf_linear(x, [blob], [kernel_type], [32], 256)
    assert torch.allclose(got, x @ weight.T, rtol=0.05, atol=0.05 * weight.abs().sum(1).max().item())


def test_dram_plateau_takes_the_largest_sizes_when_the_l3_is_reported_too_large(monkeypatch):
    """A virtual machine may report its host's L3 (here 480 MiB against a curve up to 8 MiB): the DRAM figure is
    then the two largest sizes' plateau, not a size measured beyond the curve."""
    rates = {256 * KIB: 100e9, 1 * MIB: 60e9, 8 * MIB: 20e9}
    monkeypatch.setattr(measure, "read_bandwidth", lambda size, **kw: rates[size])
    machine = replace(read_machine(1),
                      caches={"cpu_l2_per_core": 64 * KIB, "cpu_l3": 480 * MIB})
    memory = measure._memory_rates(TINY, machine, measure._Progress(3, True))
    assert memory.dram_sizes == [1 * MIB, 8 * MIB] and memory.dram == pytest.approx(40e9)


@pytest.mark.usefixtures("native_kernels")
def test_run_calibrate_writes_the_host_profile_that_load_profile_prefers(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("SPARSESPEC_HOME", str(tmp_path))
    assert "Placeholder" in load_profile("host").sources["dram_bandwidth"]  # packaged, before calibrating
    assert default_output_path() == tmp_path / "devices" / "host.json"
    assert run_calibrate(_args("--json", "--threads", "1")) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["profile_path"] == str(tmp_path / "devices" / "host.json")
    host = load_profile("host")
    assert host.sources["dram_bandwidth"].startswith("measured by sparsespec calibrate")
    assert host.to_dict() == summary["profile"]
    assert summary["measurements"]["threads"] == 1
    assert len(summary["measurements"]["bandwidth_curve"]) == len(TINY.sizes)
    assert "host" in list_profiles()


@pytest.mark.usefixtures("native_kernels")
def test_out_overrides_the_default(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("SPARSESPEC_HOME", str(tmp_path / "home"))
    out = tmp_path / "elsewhere" / "box.json"
    assert run_calibrate(_args("--out", str(out))) == 0
    assert f"Wrote {out}" in capsys.readouterr().out
    assert load_profile(out).missing_sources() == []
    assert not default_output_path().exists()


def test_flags():
    args = add_calibrate_arguments(argparse.ArgumentParser()).parse_args(["--quick", "--threads", "2"])
    assert args.quick and args.threads == 2 and args.out is None and not args.json


def test_cache_sizes_from_sysfs(tmp_path: Path):
    def index(cpu: int, i: int, level: int, kind: str, size: str, shared: str) -> None:
        d = tmp_path / f"cpu{cpu}" / "cache" / f"index{i}"
        d.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
            (d / name).write_text(f"{value}\n")

    for cpu in (0, 1):
        index(cpu, 0, 1, "Data", "48K", str(cpu))
        index(cpu, 1, 1, "Instruction", "32K", str(cpu))
        index(cpu, 2, 2, "Unified", "1024K", str(cpu))
        index(cpu, 3, 3, "Unified", "32768K", "0-1")
    caches, source = cpu_cache_sizes(tmp_path)
    assert caches == {"cpu_l1d_per_core": 48 * KIB, "cpu_l2_per_core": MIB, "cpu_l3": 32 * MIB}
    assert str(tmp_path) in source


# --- the simulator's byte counts are the engine's -------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # tied head without bias; untied head with q/k/v bias
def test_weight_bytes_are_what_the_engine_streams(architecture):
    model = tiny_model(architecture, dtype=torch.bfloat16)
    cfg = model.config
    norms = cfg.num_hidden_layers * 2 * cfg.hidden_size + cfg.hidden_size  # read too, left out by the engine's count
    assert weight_bytes(cfg, "bf16") == model.bytes_read_per_token() + 2 * norms


def test_kv_bytes_are_the_arena_s():
    cfg = tiny_config()
    arena = KVArena(cfg, make_policy("hybrid", 24), dtype=torch.bfloat16, max_inflight=5)
    assert arena.nbytes == arena.capacity * kv_bytes_per_token(cfg, "bf16")


def test_without_native_kernels_calibrate_refuses_in_one_sentence(monkeypatch):
    """No compiler: the engine it would measure cannot decode, and it says so before measuring anything."""
    monkeypatch.setattr(kernels, "available", lambda: False)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: "no compiler (test)")
    monkeypatch.setattr(measure, "measure_all", lambda *args: pytest.fail("measured without the kernels"))
    with pytest.raises(UserError) as refused:
        calibrate(TINY, threads=1, quiet=True)
    assert str(refused.value) == ("The KV cache's attention runs in the native kernels, which are not available here "
                                  "(no compiler (test)).")


def test_two_attention_shapes_separate_the_query_heads_flops_from_each_kv_heads_work():
    """Timings made from known rates give them back; timings the two terms cannot explain (the narrow shape as dear
    as the wide one, or dearer) fall back to the wide shape's FLOP rate alone."""
    (heads, kv_heads, hd), narrow_heads = ATTENTION_SHAPE, ATTENTION_NARROW_SHAPE[0]
    flops, reads, entries, rows = 40e9, 3e9, (256, 2048), 2

    def seconds(h):
        per_entry = 4 * h * hd / flops + kv_heads * hd / reads
        return 1e-5, 1e-5 + per_entry * (entries[1] - entries[0]) * rows

    got_flops, got_reads = fit_attention_rates(seconds(heads), seconds(narrow_heads), entries, rows)
    assert got_flops == pytest.approx(flops) and got_reads == pytest.approx(reads)
    wide = seconds(heads)
    assert fit_attention_rates(wide, wide, entries, rows) == (
        pytest.approx(4 * heads * hd * (entries[1] - entries[0]) * rows / (wide[1] - wide[0])), None)
    assert fit_attention_rates((1e-5, 1e-5), wide, entries, rows) == (None, None)


def test_the_fitted_overheads_price_each_streaming_probe_at_its_measured_step():
    """The per-layer line goes through both probes in the simulator's own terms: a probe model's decode step, as
    ``forward_pass`` prices it from the fitted figures and the type rates, is the step the probe measured, even where
    its projections alone ran slower than their bytes at the rates (a narrow layer's small calls)."""
    settings = replace(TINY, probe_context=64, probe_steps=4, probe_rounds=2)
    native = {"Q4_K": {"bytes_per_s": 20e9}, "Q8_0": {"bytes_per_s": 25e9}}
    attention, head_reads = {"single": 60e9}, {"single": 4e9}
    pass_s, per_vocab = 0.8e-3, 2e-9
    probes = []
    # about 256 MiB of Q4_K each; the narrow layers' projections alone 15 ms against 12.7 ms at the rate
    for shape, layers, stream_1, around in (((512, 1536, 8, 2, 64), 150, 15e-3, 12e-3),
                                            ((1536, 8192, 12, 2, 128), 11, 14e-3, 3.5e-3)):
        layer_bytes = sum(file_bytes("Q4_K", n, k)
                          for n, k in probe_parts(shape).values())
        head_bytes = file_bytes("Q8_0", 512, shape[0])
        times = {"stream_1": stream_1, "around": around, "evicting": 0.0, "extra_rows": 0.0, "evicting_rows": 0.0}
        probes.append(ProbeTimes(shape, layers, times, layer_bytes, head_bytes, 512))
    fit = fit_overheads(settings, probes, pass_s, native, per_vocab, attention, head_reads)
    assert fit.per_layer_s > 0 and fit.stream_fraction > 0  # the line's own figures, not a fallback
    profile = DeviceProfile(
        name="fit", description="", compute_unit="cpu", memory_bytes=1 << 34, dram_bandwidth=30e9, sram_level="L3",
        sram_bytes=1 << 20, sram_bandwidth=1e18, peak_flops={"bf16": 1e18}, overhead_s=fit.overhead_s,
        per_layer_overhead_s=fit.per_layer_s, stream_overhead_fraction=fit.stream_fraction,
        per_vocab_overhead_s=per_vocab, attention_flops=attention, attention_head_reads=head_reads,
        native_stream=native)
    entries = settings.probe_context + settings.probe_steps * settings.probe_rounds // 2
    for p in probes:
        config = probe_config(p.layers, p.shape)
        weights = {"Q4_K": p.layers * p.layer_bytes, "Q8_0": p.head_bytes}
        cost = forward_pass(config, profile, tokens=1, kv_entries=entries, weights=weights, kv_in_sram=True)
        assert cost.time_s == pytest.approx(p.times["stream_1"] + p.times["around"], rel=1e-6)
