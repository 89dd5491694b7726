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
from sparsespec.edge.calibrate import (
    KIB,
    MIB,
    QUICK,
    add_calibrate_arguments,
    build_profile,
    cache_sizes,
    calibrate,
    default_output_path,
    run_calibrate,
)
from sparsespec.edge import list_profiles, load_profile
from sparsespec.edge.roofline import kv_bytes_per_token, weight_bytes

# Small enough for a unit test (about a second); the figures it measures mean nothing.
TINY = replace(
    QUICK,
    sizes=(256 * KIB, 1 * MIB, 8 * MIB),
    min_seconds=0.0,
    trials=2,
    gemm_n=64,
    stream_bytes=2 * MIB,
    stream_shapes=((256, 256), (512, 256), (256, 512)),
    probe_shape=(64, 128, 4, 2, 16),
    probe_layers=(1, 3),
    probe_steps=4,
    probe_rounds=1,
    probe_context=8,
    probe_budget=8,
    attention_entries=(32, 96),
    vocab_sizes=(256, 4096),
    residency_fractions=(1 / 8,),
)


def _args(*argv: str) -> argparse.Namespace:
    args = add_calibrate_arguments(argparse.ArgumentParser()).parse_args(list(argv))
    args.settings = TINY
    args.quiet = True
    return args


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
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
    measured = [f for f in profile.figures() if not f.startswith("caches.") and f not in ("memory_bytes", "sram_bytes")]
    for figure in measured:
        assert profile.sources[figure].startswith("measured by sparsespec calibrate on "), figure
    assert profile.dram_bandwidth > 0 and profile.sram_bandwidth >= profile.dram_bandwidth
    assert 0 < profile.dram_efficiency <= 1 and 0 < profile.sram_kv_fraction <= 1
    assert set(profile.peak_flops) == {"bf16", "fp32"}
    assert profile.per_layer_overhead_s >= 0 and profile.overhead_s >= 0
    assert len(cal.bandwidth_curve) == len(TINY.sizes)
    assert [p["bytes"] for p in cal.bandwidth_curve] == list(TINY.sizes)


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
    caches, source = cache_sizes(tmp_path)
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
