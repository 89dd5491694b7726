"""``sparsespec calibrate``: measure this machine and write the ``host`` device profile of the edge simulator.

The edge simulator (:mod:`sparsespec.edge`) predicts decode speed from a device profile. For this machine the
profile is measured here, with torch on the CPU at ``--threads`` threads:

- **read bandwidth** — an fp32 ``sum`` over buffers from 256 KiB to 1 GiB gives a curve; the DRAM rate is the
  plateau of the sizes at least 4× the last-level cache (L3), the SRAM rate the plateau of the sizes that fit the
  L3 but not the L2 caches (small sizes include the per-call cost of a threaded reduction);
- **matmul peak** — a square bf16 and fp32 GEMM (compute-bound) gives ``peak_flops``;
- **decode streaming** — one-row bf16 ``F.linear`` over layer-shaped weights much larger than the L3 gives the rate
  at which decoding streams weights; over the DRAM read rate it is ``dram_efficiency``. The same weights with R
  rows give the cost of the extra rows of a verification pass (``extra_row_flops``);
- **KV residency** — whether a KV-sized buffer stays in the L3 while a stream of weights passes through it sets
  ``sram_kv_fraction``;
- **the engine's own costs** — a random model of SmolLM2's width runs through the engine's decode loop
  (:func:`sparsespec.generate.generate_tokens`) with few and many layers (both streaming their weights from DRAM):
  the intercept and slope over layers of the step time, less the weights' streaming time at the rate measured
  above, give ``overhead_s`` and ``per_layer_overhead_s``; multi-row passes give
  ``per_row_layer_overhead_s``; a full budgeted (hybrid) cache gives ``evict_layer_overhead_s``; sampling over a
  small and a large vocabulary gives ``per_vocab_overhead_s``; the KV arena's attention at two cache sizes gives
  ``attention_flops`` for its three paths (one row over the full cache, several rows, a full budgeted cache).

Hardware capacities (read bandwidth, GEMM peak, cache residency) are the best of several trials: a trial that lost
the CPU to another process says nothing about the hardware. The engine's own costs (weight streaming, decode steps,
verification passes, attention, sampling) are medians: the simulator predicts the sustained speed of a whole run,
and on a shared machine the typical step is slower than the best one by 10–30%. Run it on an idle machine all the
same.

The profile goes to ``$SPARSESPEC_HOME/devices/host.json`` (default ``~/.cache/sparsespec/devices/host.json``),
which ``edge.profile.load_profile("host")`` prefers over the packaged placeholder; ``--out`` writes elsewhere.
Progress goes to stderr; ``--json`` prints a JSON summary (profile, curve, raw timings) to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from ..config import ModelConfig
from ..errors import UserError
from .profile import DeviceProfile, save_profile, user_devices_dir

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# Fallbacks when the operating system does not report cache sizes.
DEFAULT_L2_PER_CORE = 1 * MIB
DEFAULT_L3 = 32 * MIB

# Shapes of one decoder layer's projections for the streaming test (Qwen2.5-1.5B: hidden 1536, MLP 8960, 2 KV
# heads of 128): qkv, o, gate+up, down, as [out, in].
STREAM_LAYER_SHAPES = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))

# The attention shape the arena is timed with: query heads, KV heads, head width.
ATTENTION_SHAPE = (12, 2, 64)


@dataclass(frozen=True)
class CalibrationSettings:
    """How much to measure. :data:`FULL` is the default, :data:`QUICK` is ``--quick``; tests use tinier ones."""

    sizes: tuple[int, ...]  # read-bandwidth buffer sizes, bytes
    min_seconds: float  # time spent per timed quantity (at least `trials` trials)
    trials: int
    gemm_n: int  # square GEMM size
    stream_bytes: int  # weight bytes of the streaming test (at least 4x the L3 for a DRAM figure)
    stream_shapes: tuple[tuple[int, int], ...] = STREAM_LAYER_SHAPES
    rows: int = 5  # rows of the multi-row tests (γ + 1 for γ = 4)
    # The probe model whose decode steps are timed: hidden, MLP width, query heads, KV heads, head width (SmolLM2's).
    probe_shape: tuple[int, int, int, int, int] = (576, 1536, 9, 3, 64)
    probe_layers: tuple[int, int] | None = None  # None: the fewest layers whose weights fill 4x the L3, and twice that
    probe_steps: int = 40  # steps timed per probe run
    probe_rounds: int = 3  # interleaved repetitions of the probe runs (the median of each is kept)
    probe_context: int = 48  # tokens in the probe's cache
    probe_budget: int = 16  # budget of the probe's evicting cache
    attention_entries: tuple[int, int] = (256, 2048)  # cache sizes of the attention test
    vocab_sizes: tuple[int, int] = (4096, 151936)  # vocabularies of the sampling test
    residency_fractions: tuple[float, ...] = (1 / 16, 1 / 8, 1 / 4, 1 / 2)


FULL = CalibrationSettings(
    sizes=tuple(256 * KIB << k for k in range(13)),  # 256 KiB … 1 GiB
    min_seconds=0.3,
    trials=5,
    gemm_n=1024,
    stream_bytes=384 * MIB,
    probe_steps=40,
)

QUICK = CalibrationSettings(
    sizes=(256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB),
    min_seconds=0.15,
    trials=3,
    gemm_n=1024,
    stream_bytes=192 * MIB,
    probe_steps=16,
    attention_entries=(256, 1024),
    residency_fractions=(1 / 8, 1 / 2),
)


@dataclass
class Calibration:
    """Everything one calibration measured (SI units), with the machine facts it read."""

    date: str
    threads: int
    loadavg_before: float
    loadavg_after: float
    seconds: float
    cpu: str
    cores: int
    hypervisor: bool
    flags: list[str]
    memory_bytes: int
    caches: dict[str, int]
    cache_source: str
    bandwidth_curve: list[dict[str, float]]
    dram_bandwidth: float
    dram_sizes: list[int]
    sram_bandwidth: float
    sram_sizes: list[int]
    peak_flops: dict[str, float]
    stream_bandwidth: float
    stream_bytes: int
    extra_row_flops: float | None
    residency: dict[str, float]
    sram_kv_fraction: float
    overhead_s: float
    per_layer_overhead_s: float
    per_row_layer_overhead_s: float
    evict_layer_overhead_s: float
    evict_row_layer_overhead_s: float
    per_vocab_overhead_s: float
    attention_flops: dict[str, float]
    raw: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# ----------------------------------------------------------------------------------------------- machine facts
def loadavg() -> float:
    """The 1-minute load average (NaN where the OS does not report it)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def _cpuinfo() -> tuple[str, list[str], bool]:
    """CPU model name, feature flags and whether a hypervisor is reported, from /proc/cpuinfo."""
    name, flags = "unknown CPU", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and name == "unknown CPU":
                name = value.strip()
            elif key == "flags" and not flags:
                flags = value.split()
    except OSError:
        pass
    return name, flags, "hypervisor" in flags


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, factor in (("K", KIB), ("M", MIB), ("G", GIB)):
        if text.endswith(suffix):
            return int(float(text[:-1]) * factor)
    return int(text)


def cache_sizes(root: Path = Path("/sys/devices/system/cpu")) -> tuple[dict[str, int], str]:
    """CPU cache sizes from sysfs: ``cpu_l1d_per_core``, ``cpu_l2_per_core``, ``cpu_l3`` (total over instances).

    Returns the sizes and a description of where they came from; missing levels are left out.
    """
    caches: dict[str, int] = {}
    l3_instances: dict[str, int] = {}
    for cpu in sorted(root.glob("cpu[0-9]*")):
        for index in sorted((cpu / "cache").glob("index*")):
            try:
                level = int((index / "level").read_text())
                kind = (index / "type").read_text().strip()
                size = _parse_size((index / "size").read_text())
                shared = (index / "shared_cpu_list").read_text().strip()
            except (OSError, ValueError):
                continue
            if kind not in ("Data", "Unified"):
                continue
            if level == 1:
                caches.setdefault("cpu_l1d_per_core", size)
            elif level == 2:
                caches.setdefault("cpu_l2_per_core", size)
            elif level == 3:
                l3_instances[shared] = size
    if l3_instances:
        caches["cpu_l3"] = sum(l3_instances.values())
    return caches, f"{root}/cpu*/cache/index*/size"


def memory_bytes() -> int:
    """Physical memory of the machine (``sysconf(SC_PHYS_PAGES) × SC_PAGE_SIZE``)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        import psutil

        return int(psutil.virtual_memory().total)


# --------------------------------------------------------------------------------------------------- timing
def time_calls(fn: Callable[[], Any], *, calls: int = 1, trials: int = 3, min_seconds: float = 0.0) -> list[float]:
    """Seconds per call of ``fn``: one value per trial of ``calls`` calls, after one warm-up call.

    Runs at least ``trials`` trials and keeps going until ``min_seconds`` have passed (at most 200 trials).
    """
    fn()
    out: list[float] = []
    started = time.perf_counter()
    while len(out) < trials or (time.perf_counter() - started < min_seconds and len(out) < 200):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    return out


def _slope(x0: float, y0: float, x1: float, y1: float) -> float:
    return (y1 - y0) / (x1 - x0)


# ------------------------------------------------------------------------------------------------- kernels
def read_bandwidth(size_bytes: int, *, trials: int = 3, min_seconds: float = 0.05) -> float:
    """Bytes/s an fp32 ``sum`` reads from a buffer of ``size_bytes`` (best trial; the buffer is written first)."""
    import torch

    x = torch.ones(max(size_bytes // 4, 256), dtype=torch.float32)
    calls = max(1, int(16 * MIB // x.nbytes))
    times = time_calls(x.sum, calls=calls, trials=trials, min_seconds=min_seconds)
    return x.nbytes / min(times)


def matmul_flops(dtype_name: str, n: int, *, trials: int = 3, min_seconds: float = 0.05) -> float:
    """FLOP/s of an ``n × n`` by ``n × n`` matrix product (``2n³`` FLOPs) in ``bf16`` or ``fp32`` (best trial)."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    times = time_calls(lambda: torch.mm(a, b), trials=trials, min_seconds=min_seconds)
    return 2.0 * n**3 / min(times)


def stream_weights(
    total_bytes: int,
    shapes: tuple[tuple[int, int], ...],
    rows: int,
    *,
    trials: int = 3,
    min_seconds: float = 0.05,
) -> dict[str, float]:
    """Decode-style weight streaming: bf16 ``F.linear`` of 1 and of ``rows`` rows over layer-shaped weights.

    Builds as many layers of ``shapes`` as fill ``total_bytes`` and times one pass over all of them (median trial).
    Returns ``bytes``, ``parameters``, ``one_row_s``, ``rows_s`` and ``bytes_per_s`` (of the one-row pass).
    """
    import torch
    import torch.nn.functional as F

    per_layer = sum(o * i for o, i in shapes) * 2
    layers = max(1, math.ceil(total_bytes / per_layer))
    weights = [torch.full((o, i), 0.01, dtype=torch.bfloat16) for _ in range(layers) for o, i in shapes]
    params = sum(w.numel() for w in weights)
    inputs = {w.shape[1]: None for w in weights}

    def run(n_rows: int) -> Callable[[], None]:
        xs = {k: torch.full((n_rows, k), 0.5, dtype=torch.bfloat16) for k in inputs}

        def step() -> None:
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        return step

    one = statistics.median(time_calls(run(1), trials=trials, min_seconds=min_seconds))
    many = statistics.median(time_calls(run(rows), trials=trials, min_seconds=min_seconds))
    return {
        "bytes": float(params * 2),
        "parameters": float(params),
        "one_row_s": one,
        "rows_s": many,
        "bytes_per_s": params * 2 / one,
    }


def kv_residency(
    l3_bytes: int, fractions: tuple[float, ...], stream_bytes: int, *, trials: int = 3
) -> dict[str, float]:
    """Share of a buffer of ``f × l3_bytes`` still cached after ``stream_bytes`` of other data were read.

    This is what happens to a KV cache between two decode steps while the weights stream through the same cache.
    Per fraction: 1 when re-reading the buffer after the stream is as fast as reading it hot, 0 when it is as slow
    as reading the stream's first bytes (evicted by the rest of the stream) — best trial of each.
    """
    import torch

    big = torch.ones(max(stream_bytes // 4, 256), dtype=torch.float32)
    out: dict[str, float] = {}
    for f in fractions:
        n = max(int(l3_bytes * f) // 4, 256)
        buf = torch.ones(n, dtype=torch.float32)
        head = big[:n]
        hot = min(time_calls(buf.sum, trials=trials * 2))
        after, cold = [], []
        for _ in range(trials * 2):
            big.sum()
            t0 = time.perf_counter()
            buf.sum()
            after.append(time.perf_counter() - t0)
            big.sum()
            t0 = time.perf_counter()
            head.sum()
            cold.append(time.perf_counter() - t0)
        slow, kept = min(cold), min(after)
        share = (slow - kept) / (slow - hot) if slow > hot else 0.0
        out[f"{f:.4g}"] = max(0.0, min(1.0, share))
    return out


# ----------------------------------------------------------------------------------------- engine timings
def probe_config(layers: int, shape: tuple[int, int, int, int, int] = (576, 1536, 9, 3, 64),
                 vocab: int = 512) -> ModelConfig:
    """A random decoder of ``shape`` (hidden, MLP width, query heads, KV heads, head width) and a small vocabulary."""
    hidden, intermediate, heads, kv_heads, head_dim = shape
    return ModelConfig(
        architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=1 << 20, tie_word_embeddings=True,
        attention_bias=False,
    )


def random_state(config: ModelConfig, seed: int = 0) -> dict:
    """A Hugging Face-named state dict of random bf16 weights for ``config``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)

    ones = torch.ones(h, dtype=torch.bfloat16)
    state = {"model.embed_tokens.weight": w(config.vocab_size, h), "model.norm.weight": ones}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        state[p + "input_layernorm.weight"] = ones
        state[p + "post_attention_layernorm.weight"] = ones
        for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
            state[p + f"self_attn.{name}.weight"] = w(*shape)
        state[p + "mlp.gate_proj.weight"] = w(i, h)
        state[p + "mlp.up_proj.weight"] = w(i, h)
        state[p + "mlp.down_proj.weight"] = w(h, i)
    return state


def probe_layer_counts(shape: tuple[int, int, int, int, int], l3_bytes: int) -> tuple[int, int]:
    """The fewest layers whose bf16 weights fill 4x the L3 (so they stream from DRAM), and twice that."""
    per_layer = 2 * (probe_config(2, shape).num_parameters() - probe_config(1, shape).num_parameters())
    lo = max(2, math.ceil(4 * l3_bytes / per_layer))
    return lo, 2 * lo


def _arena(model, policy, max_tokens: int, max_inflight: int):
    import torch

    from ..cache.arena import KVArena

    return KVArena(model.config, policy, dtype=torch.bfloat16, max_tokens=max_tokens, max_block=64,
                   max_inflight=max_inflight, positions="original")


def decode_step_seconds(model, policy, context: int, steps: int) -> float:
    """Seconds of the median step of the engine's decode loop (forward, commit, greedy sampling)."""
    from ..generate import generate_tokens
    from ..sampling import SamplingParams

    arena = _arena(model, policy, context + steps + 2, 1)
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(context + 1)]
    stamps = []
    for _ in generate_tokens(model, arena, prompt, max_new_tokens=steps + 1, sampling=SamplingParams(),
                             prefill_chunk=64):
        stamps.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def block_pass_seconds(model, policy, context: int, rows: int, steps: int) -> float:
    """Seconds of the median ``rows``-row pass (forward, greedy choice of every row, rollback) over ``context``
    tokens, as a greedy verification pass does it."""
    import torch

    from ..generate import prefill

    arena = _arena(model, policy, context + rows + 2, rows + 1)
    prefill(model, arena, [(5 * i + 1) % model.config.vocab_size for i in range(context)], 64)
    block = torch.tensor([(3 * i + 2) % model.config.vocab_size for i in range(rows)])

    def step() -> None:
        model.forward(block, arena).argmax(dim=-1).tolist()
        arena.commit(0)

    return statistics.median(time_calls(step, trials=steps))


def sampling_seconds(vocab: int, *, trials: int = 5, min_seconds: float = 0.05) -> float:
    """Seconds to turn one row of float32 logits over ``vocab`` entries into the greedy token (median trial)."""
    import torch

    from ..sampling import SamplingParams, next_token

    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams()
    return statistics.median(time_calls(lambda: next_token(logits, greedy, None), trials=trials,
                                        min_seconds=min_seconds))


def attention_seconds(
    entries: int, rows: int, *, evicting: bool, shape: tuple[int, int, int] = ATTENTION_SHAPE,
    trials: int = 5, min_seconds: float = 0.05,
) -> float:
    """Seconds of one layer of :meth:`KVArena.attend` for ``rows`` rows over ``entries`` cached entries (median
    trial).

    ``evicting``: a hybrid cache of budget ``entries``, filled past it, so every row evicts; else the full cache.
    """
    import torch

    from ..cache.arena import KVArena
    from ..cache.policy import make_policy

    heads, kv_heads, hd = shape
    config = ModelConfig(
        architecture="llama", vocab_size=16, hidden_size=heads * hd, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=1 << 20, tie_word_embeddings=True, attention_bias=False,
    )
    policy = make_policy("hybrid", entries) if evicting else make_policy("full")
    fill = entries + 64 if evicting else entries
    arena = KVArena(config, policy, dtype=torch.bfloat16, max_tokens=fill + rows + 2, max_block=64,
                    max_inflight=rows + 1, positions="original")
    g = torch.Generator().manual_seed(0)

    def rnd(h: int, n: int) -> torch.Tensor:
        return torch.randn(h, n, hd, generator=g).to(torch.bfloat16)

    left = fill
    while left:
        n = min(64, left)
        arena.begin(n, per_block=True)
        arena.attend(0, rnd(heads, n), rnd(kv_heads, n), rnd(kv_heads, n))
        arena.end()
        arena.commit(n)
        left -= n
    q, k, v = rnd(heads, rows), rnd(kv_heads, rows), rnd(kv_heads, rows)

    def step() -> None:
        arena.begin(rows)
        arena.attend(0, q, k, v)
        arena.end()
        arena.commit(0)

    return statistics.median(time_calls(step, trials=trials, min_seconds=min_seconds))


def attention_rate(seconds_small: float, seconds_large: float, entries: tuple[int, int], rows: int,
                   shape: tuple[int, int, int] = ATTENTION_SHAPE) -> float | None:
    """FLOP/s per cached entry (``4·H·d`` per entry and row) from two timings; None when the slope is not positive."""
    heads, _, hd = shape
    extra = seconds_large - seconds_small
    if extra <= 0:
        return None
    return 4.0 * heads * hd * (entries[1] - entries[0]) * rows / extra


# ------------------------------------------------------------------------------------------------ calibrate
def _progress(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[calibrate] {message}", file=sys.stderr, flush=True)


def _plateau(curve: list[dict[str, float]], low: float, high: float) -> tuple[float | None, list[int]]:
    picked = [p for p in curve if low <= p["bytes"] <= high]
    if not picked:
        return None, []
    return statistics.median(p["bytes_per_s"] for p in picked), [int(p["bytes"]) for p in picked]


def calibrate(settings: CalibrationSettings = FULL, *, threads: int | None = None, quiet: bool = False) -> Calibration:
    """Run every measurement at ``threads`` torch threads (default: torch's current setting) and return them."""
    import torch

    previous_threads = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads must be at least 1 (got {threads}).")
        torch.set_num_threads(threads)
    try:
        return _calibrate(settings, torch.get_num_threads(), quiet)
    finally:
        torch.set_num_threads(previous_threads)


def _calibrate(settings: CalibrationSettings, threads: int, quiet: bool) -> Calibration:
    """The measurements in order; each step reports its progress and keeps its raw timings in ``raw``."""
    started = time.perf_counter()
    machine = _machine(threads, quiet)
    raw: dict[str, Any] = {}
    memory = _memory_rates(settings, machine, quiet)
    peaks = _compute_peaks(settings, quiet)
    stream, extra_row_flops = _weight_streaming(settings, raw, quiet)
    residency, kv_fraction = _kv_residency_fraction(settings, machine, quiet)
    per_vocab = _sampling_cost(settings, raw)
    probe = _probe_engine(settings, machine, raw, quiet)
    overheads = _fit_overheads(settings, probe, stream["bytes_per_s"], extra_row_flops, per_vocab, quiet)
    attention = _attention_rates(settings, raw, quiet)
    return Calibration(
        date=machine.date, threads=threads, loadavg_before=machine.load_before, loadavg_after=loadavg(),
        seconds=time.perf_counter() - started, cpu=machine.cpu, cores=machine.cores, hypervisor=machine.hypervisor,
        flags=machine.flags, memory_bytes=memory_bytes(), caches=machine.caches, cache_source=machine.cache_source,
        bandwidth_curve=memory.curve, dram_bandwidth=memory.dram, dram_sizes=memory.dram_sizes,
        sram_bandwidth=memory.sram, sram_sizes=memory.sram_sizes, peak_flops=peaks,
        stream_bandwidth=stream["bytes_per_s"], stream_bytes=int(stream["bytes"]), extra_row_flops=extra_row_flops,
        residency=residency, sram_kv_fraction=kv_fraction, overhead_s=overheads.overhead_s,
        per_layer_overhead_s=overheads.per_layer_s, per_row_layer_overhead_s=overheads.per_row_layer_s,
        evict_layer_overhead_s=overheads.evict_layer_s, evict_row_layer_overhead_s=overheads.evict_row_layer_s,
        per_vocab_overhead_s=per_vocab, attention_flops=attention, raw=raw,
    )


@dataclass(frozen=True)
class _Machine:
    """What the machine says about itself before any measurement."""

    date: str
    load_before: float
    cpu: str
    flags: list[str]
    hypervisor: bool
    cores: int
    threads: int
    caches: dict[str, int]
    cache_source: str

    @property
    def l2(self) -> int:
        return self.caches.get("cpu_l2_per_core", DEFAULT_L2_PER_CORE)

    @property
    def l3(self) -> int:
        return self.caches.get("cpu_l3", DEFAULT_L3)


def _machine(threads: int, quiet: bool) -> _Machine:
    cpu, flags, hypervisor = _cpuinfo()
    caches, cache_source = cache_sizes()
    machine = _Machine(datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), loadavg(), cpu, flags, hypervisor,
                       os.cpu_count() or 1, threads, caches, cache_source)
    _progress(f"{cpu}, {machine.cores} cores, {threads} threads, load average {machine.load_before:.2f}", quiet)
    return machine


@dataclass(frozen=True)
class _MemoryRates:
    curve: list[dict[str, float]]
    dram: float
    dram_sizes: list[int]
    sram: float
    sram_sizes: list[int]


def _memory_rates(s: CalibrationSettings, machine: _Machine, quiet: bool) -> _MemoryRates:
    """The read-bandwidth curve and its DRAM and L3 plateaus (measured at one more size where the curve has none)."""
    kw = dict(trials=s.trials, min_seconds=s.min_seconds)
    curve = []
    for size in s.sizes:
        rate = read_bandwidth(size, **kw)
        curve.append({"bytes": float(size), "bytes_per_s": rate})
        _progress(f"read {size / MIB:9.2f} MiB: {rate / 1e9:7.1f} GB/s", quiet)
    dram, dram_sizes = _plateau(curve, 4 * machine.l3, math.inf)
    if dram is None:
        size = max(4 * machine.l3, max(s.sizes))
        dram, dram_sizes = read_bandwidth(size, **kw), [size]
    sram, sram_sizes = _plateau(curve, 2 * machine.l2 * min(machine.threads, machine.cores), machine.l3 / 2)
    if sram is None:
        size = max(machine.l3 // 4, 1)
        sram, sram_sizes = read_bandwidth(size, **kw), [size]
    sram = max(sram, dram)
    _progress(f"DRAM {dram / 1e9:.1f} GB/s, L3 {sram / 1e9:.1f} GB/s", quiet)
    return _MemoryRates(curve, dram, dram_sizes, sram, sram_sizes)


def _compute_peaks(s: CalibrationSettings, quiet: bool) -> dict[str, float]:
    peaks = {dt: matmul_flops(dt, s.gemm_n, trials=s.trials, min_seconds=s.min_seconds) for dt in ("bf16", "fp32")}
    _progress(f"GEMM {s.gemm_n}: bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s, fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s", quiet)
    return peaks


def _weight_streaming(s: CalibrationSettings, raw: dict, quiet: bool) -> tuple[dict[str, float], float | None]:
    """Decode-style weight streaming, and the FLOP rate of the extra rows of a multi-row pass (None: free)."""
    stream = stream_weights(s.stream_bytes, s.stream_shapes, s.rows, trials=s.trials, min_seconds=s.min_seconds)
    raw["stream"] = stream
    extra = stream["rows_s"] - stream["one_row_s"]
    extra_row_flops = (s.rows - 1) * 2.0 * stream["parameters"] / extra if extra > 0 else None
    _progress(
        f"bf16 matrix-vector over {stream['bytes'] / MIB:.0f} MiB: {stream['bytes_per_s'] / 1e9:.1f} GB/s; "
        f"{s.rows} rows take {stream['rows_s'] / stream['one_row_s']:.2f}x one row",
        quiet,
    )
    return stream, extra_row_flops


def _kv_residency_fraction(s: CalibrationSettings, machine: _Machine, quiet: bool) -> tuple[dict[str, float], float]:
    """KV residency while weights stream through the cache, and the largest fraction of the L3 that stays."""
    residency = kv_residency(machine.l3, s.residency_fractions, max(4 * machine.l3, 64 * MIB), trials=s.trials)
    resident = [float(f) for f, share in residency.items() if share >= 0.5]
    kv_fraction = max(resident) if resident else min(s.residency_fractions) / 2
    _progress(f"KV residency after streaming 4x L3: {residency} -> sram_kv_fraction {kv_fraction:.3g}", quiet)
    return residency, kv_fraction


def _sampling_cost(s: CalibrationSettings, raw: dict) -> float:
    """Sampling seconds per vocabulary entry (the slope between a small and a large vocabulary)."""
    vocab_small, vocab_large = s.vocab_sizes
    sample_small = sampling_seconds(vocab_small, trials=s.trials, min_seconds=s.min_seconds)
    sample_large = sampling_seconds(vocab_large, trials=s.trials, min_seconds=s.min_seconds)
    raw["sampling_seconds"] = {str(vocab_small): sample_small, str(vocab_large): sample_large}
    return max(0.0, _slope(vocab_small, sample_small, vocab_large, sample_large))


@dataclass(frozen=True)
class _Probe:
    """Median seconds of the probe model's decode steps and passes, by kind and layer count."""

    lo: int
    hi: int
    times: dict[str, dict[int, float]]
    weights: dict[int, int]  # weight bytes streamed per token
    head_bytes: int
    vocab: int


def _probe_engine(s: CalibrationSettings, machine: _Machine, raw: dict, quiet: bool) -> _Probe:
    """Decode steps and passes of a probe model with few and many layers, in interleaved rounds (median of each: a
    burst of contention spoils one at most). Its weights stream from DRAM as a real model's do."""
    import torch

    from ..cache.policy import make_policy
    from ..model import Transformer

    lo, hi = s.probe_layers or probe_layer_counts(s.probe_shape, machine.l3)
    full, evict = make_policy("full"), make_policy("hybrid", s.probe_budget)
    state = random_state(probe_config(hi, s.probe_shape))
    models = {n: Transformer(probe_config(n, s.probe_shape), state, torch.bfloat16) for n in (lo, hi)}
    del state
    weights = {n: m.bytes_read_per_token() for n, m in models.items()}
    head_bytes = models[lo].lm_head.nbytes
    ctx, steps = s.probe_context, s.probe_steps
    measures = {
        "ar_full": lambda m: decode_step_seconds(m, full, ctx, steps),
        "ar_evict": lambda m: decode_step_seconds(m, evict, ctx, steps),
        "pass_1": lambda m: block_pass_seconds(m, full, ctx, 1, steps),
        "pass_rows": lambda m: block_pass_seconds(m, full, ctx, s.rows, steps),
        "pass_rows_evict": lambda m: block_pass_seconds(m, evict, ctx, s.rows, steps),
    }
    rounds: dict[str, dict[int, list[float]]] = {k: {} for k in measures}
    for _ in range(s.probe_rounds):
        for layers, model in models.items():
            for kind, measure in measures.items():
                rounds[kind].setdefault(layers, []).append(measure(model))
    times = {kind: {layers: statistics.median(values) for layers, values in by_layers.items()}
             for kind, by_layers in rounds.items()}
    for layers in (lo, hi):
        _progress(
            f"probe model, {layers} layers ({weights[layers] / MIB:.0f} MiB): decode step "
            f"{times['ar_full'][layers] * 1e3:.2f} ms (evicting {times['ar_evict'][layers] * 1e3:.2f} ms); "
            f"{s.rows}-row pass {times['pass_rows'][layers] * 1e3:.2f} ms vs 1-row "
            f"{times['pass_1'][layers] * 1e3:.2f} ms",
            quiet,
        )
    raw["probe"] = {
        "layers": [lo, hi],
        "shape": list(s.probe_shape),
        "weight_bytes": {str(k): v for k, v in weights.items()},
        "seconds": {k: {str(n): v for n, v in d.items()} for k, d in times.items()},
    }
    return _Probe(lo, hi, times, weights, head_bytes, probe_config(lo, s.probe_shape).vocab_size)


@dataclass(frozen=True)
class _Overheads:
    overhead_s: float
    per_layer_s: float
    per_row_layer_s: float
    evict_layer_s: float
    evict_row_layer_s: float


def _fit_overheads(s: CalibrationSettings, probe: _Probe, rate: float, extra_row_flops: float | None,
                   per_vocab: float, quiet: bool) -> _Overheads:
    """The engine's own costs from the probe's times: intercept and slope over layers, less the weights' streaming
    time at ``rate`` (bytes/s) and the sampling cost."""
    lo, hi, times = probe.lo, probe.hi, probe.times
    layer_bytes = (probe.weights[hi] - probe.weights[lo]) / (hi - lo)

    def slope(kind: str, minus: str | None = None) -> float:
        y = {n: times[kind][n] - (times[minus][n] if minus else 0.0) for n in (lo, hi)}
        return _slope(lo, y[lo], hi, y[hi])

    step_slope = slope("ar_full")
    per_layer = max(0.0, step_slope - layer_bytes / rate)
    overhead = times["ar_full"][lo] - lo * step_slope - probe.head_bytes / rate - probe.vocab * per_vocab
    if overhead < 0:  # noise tilted the line: put it through the origin and the larger probe instead
        overhead = 0.0
        per_layer = max(0.0, (times["ar_full"][hi] - probe.weights[hi] / rate - probe.vocab * per_vocab) / hi)
    # Extra rows cost little and mostly per layer (small-M products and masks); their slope over layers is too
    # small to separate from noise, so each probe's extra time is spread over its layers and the two are averaged.
    extra_rows_per_layer = (s.rows - 1) * layer_bytes / extra_row_flops if extra_row_flops else 0.0  # 2·P FLOPs/row
    per_row_layer = statistics.mean(
        max(0.0, (times["pass_rows"][n] - times["pass_1"][n]) / n - extra_rows_per_layer) / (s.rows - 1)
        for n in (lo, hi)
    )
    evict_layer = max(0.0, slope("ar_evict", "ar_full"))
    evict_row_layer = max(0.0, (slope("pass_rows_evict", "pass_rows") - evict_layer) / (s.rows - 1))
    _progress(
        f"overheads: {overhead * 1e3:.3f} ms per pass + {per_layer * 1e6:.1f} µs per layer; "
        f"+{per_row_layer * 1e6:.1f} µs per layer and extra row; when evicting +{evict_layer * 1e6:.1f} µs per "
        f"layer and +{evict_row_layer * 1e6:.1f} µs per layer and extra row; sampling {per_vocab * 1e9:.2f} ns per "
        "vocabulary entry",
        quiet,
    )
    return _Overheads(overhead, per_layer, per_row_layer, evict_layer, evict_row_layer)


def _attention_rates(s: CalibrationSettings, raw: dict, quiet: bool) -> dict[str, float]:
    """FLOP rates of the arena's attention paths, from two cache sizes each."""
    entries = s.attention_entries
    attention: dict[str, float] = {}
    raw["attention_seconds"] = {}
    for path, rows, evicting in (("single", 1, False), ("multi", s.rows, False), ("evicting", 1, True)):
        small = attention_seconds(entries[0], rows, evicting=evicting, trials=s.trials, min_seconds=s.min_seconds)
        large = attention_seconds(entries[1], rows, evicting=evicting, trials=s.trials, min_seconds=s.min_seconds)
        raw["attention_seconds"][path] = {str(entries[0]): small, str(entries[1]): large, "rows": rows}
        flops = attention_rate(small, large, entries, rows)
        if flops is not None:
            attention[path] = flops
    _progress("attention: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in attention.items()), quiet)
    return attention


# -------------------------------------------------------------------------------------------------- profile
def _sizes(sizes: list[int]) -> str:
    return ", ".join(f"{n / MIB:g} MiB" for n in sizes)


def build_profile(cal: Calibration, settings: CalibrationSettings = FULL, name: str = "host") -> DeviceProfile:
    """The device profile for the measurements in ``cal``; every figure's source says how it was obtained."""
    stamp = f"measured by sparsespec calibrate on {cal.date} ({cal.threads} threads, load average " \
            f"{cal.loadavg_before:.2f} before, {cal.loadavg_after:.2f} after)"
    read = f"read by sparsespec calibrate on {cal.date}"
    l3 = cal.caches.get("cpu_l3", DEFAULT_L3)
    # Decoding may stream faster than the sum reads (another moment on a shared machine, other kernels): the
    # DRAM figure is then raised to the streaming rate, so that bandwidth × efficiency is always what was measured.
    dram = max(cal.dram_bandwidth, cal.stream_bandwidth)
    efficiency = cal.stream_bandwidth / dram
    lo, hi = cal.raw["probe"]["layers"]
    h, i, heads, kv_heads, hd = cal.raw["probe"]["shape"]
    probe = (f"a random bf16 model (hidden {h}, MLP {i}, {heads} query / {kv_heads} KV heads of {hd}) with {lo} and "
             f"{hi} layers run through the engine's decode loop (median step of {settings.probe_steps}, median of "
             f"{settings.probe_rounds} rounds)")
    streaming = f"less its weights' streaming time at {cal.stream_bandwidth / 1e9:.1f} GB/s"
    isa = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "avx2", "fma", "asimd", "sve")
           if f in cal.flags]
    sources = {
        "memory_bytes": f"{read}: sysconf SC_PHYS_PAGES × SC_PAGE_SIZE.",
        "dram_bandwidth": f"{stamp}: fp32 sum over buffers of {_sizes(cal.dram_sizes)} (at least 4x the L3), "
                          "median of the best trial per size"
                          + (f" ({cal.dram_bandwidth / 1e9:.1f} GB/s), raised to the decode streaming rate, which "
                             "was higher" if dram > cal.dram_bandwidth else "") + ".",
        "dram_efficiency": f"{stamp}: one-row bf16 F.linear over {cal.stream_bytes / MIB:.0f} MiB of layer-shaped "
                           f"weights streams {cal.stream_bandwidth / 1e9:.1f} GB/s; over the DRAM figure "
                           f"{dram / 1e9:.1f} GB/s that is {efficiency:.3f}.",
        "sram_bytes": f"{read} from {cal.cache_source}: the L3 (last-level cache)"
                      + ("" if "cpu_l3" in cal.caches else f"; not reported, {DEFAULT_L3 // MIB} MiB assumed") + ".",
        "sram_bandwidth": f"{stamp}: fp32 sum over buffers of {_sizes(cal.sram_sizes)} (fit the L3, not the L2s), "
                          "median of the best trial per size.",
        "sram_kv_fraction": f"{stamp}: share of a buffer still cached after 4x the L3 of other data was read "
                            f"(per fraction of the L3: {cal.residency}); the largest fraction at least half "
                            "resident" + ("" if any(v >= 0.5 for v in cal.residency.values())
                                          else "; none was, so half the smallest fraction tested") + ".",
        "peak_flops.bf16": f"{stamp}: {settings.gemm_n}x{settings.gemm_n} bf16 torch.mm, best trial.",
        "peak_flops.fp32": f"{stamp}: {settings.gemm_n}x{settings.gemm_n} fp32 torch.mm, best trial.",
        "overhead_s": f"{stamp}: intercept over layers of the decode-step time of {probe}, {streaming} and its "
                      "sampling cost.",
        "per_layer_overhead_s": f"{stamp}: slope per layer of the decode-step time of {probe}, {streaming}.",
        "per_row_layer_overhead_s": f"{stamp}: ({settings.rows}-row pass − 1-row pass) / ({settings.rows - 1} × "
                                    f"layers), less the extra rows' products at extra_row_flops, mean over the two "
                                    f"layer counts of {probe}.",
        "evict_layer_overhead_s": f"{stamp}: slope per layer of (decode step over a full hybrid cache of "
                                  f"{settings.probe_budget} − over the full cache) for {probe}.",
        "evict_row_layer_overhead_s": f"{stamp}: slope per layer of ({settings.rows}-row pass over the full hybrid "
                                      f"cache − over the full cache), less evict_layer_overhead_s, over "
                                      f"{settings.rows - 1} extra rows, for {probe}.",
        "per_vocab_overhead_s": f"{stamp}: greedy choice (argmax) over one row of logits, slope between vocabularies of "
                                f"{settings.vocab_sizes[0]} and {settings.vocab_sizes[1]} entries.",
    }
    if cal.extra_row_flops is not None:
        sources["extra_row_flops"] = (
            f"{stamp}: bf16 F.linear over the same weights with {settings.rows} rows vs 1 row: "
            f"({settings.rows}−1)·2·P FLOPs over the extra time."
        )
    heads, kv_heads, hd = ATTENTION_SHAPE
    paths = {"single": "1 row over the full cache", "multi": f"{settings.rows} rows over the full cache",
             "evicting": "1 row over a full hybrid cache"}
    for path in cal.attention_flops:
        sources[f"attention_flops.{path}"] = (
            f"{stamp}: one layer of KVArena.attend ({heads} query heads, {kv_heads} KV heads of {hd}), {paths[path]}, "
            f"at {settings.attention_entries[0]} and {settings.attention_entries[1]} entries: 4·H·d per entry and "
            "row "
            "over the extra time."
        )
    caches = {}
    for key, label in (("cpu_l1d_per_core", "L1d per core"), ("cpu_l2_per_core", "L2 per core"), ("cpu_l3", "L3")):
        if key in cal.caches:
            caches[key] = cal.caches[key]
            sources[f"caches.{key}"] = f"{read} from {cal.cache_source}: {label}."
    vm = " under a hypervisor" if cal.hypervisor else ""
    return DeviceProfile(
        name=name,
        description=f"This machine: {cal.cores} × {cal.cpu}{vm}, decoding with sparsespec's torch engine on the CPU "
                    f"at {cal.threads} threads",
        compute_unit=f"CPU: {cal.cores} cores" + (f" ({', '.join(isa)})" if isa else ""),
        memory_bytes=cal.memory_bytes,
        dram_bandwidth=dram,
        dram_efficiency=efficiency,
        sram_level="CPU last-level cache (L3)",
        sram_bytes=l3,
        sram_bandwidth=max(cal.sram_bandwidth, dram),
        sram_kv_fraction=cal.sram_kv_fraction,
        peak_flops=dict(cal.peak_flops),
        overhead_s=cal.overhead_s,
        per_layer_overhead_s=cal.per_layer_overhead_s,
        extra_row_flops=cal.extra_row_flops,
        per_row_layer_overhead_s=cal.per_row_layer_overhead_s,
        evict_layer_overhead_s=cal.evict_layer_overhead_s,
        evict_row_layer_overhead_s=cal.evict_row_layer_overhead_s,
        per_vocab_overhead_s=cal.per_vocab_overhead_s,
        attention_flops=dict(cal.attention_flops),
        caches=caches,
        sources=sources,
        note=f"Measured by sparsespec calibrate on {cal.date} in {cal.seconds:.0f} s at {cal.threads} threads "
             f"(load average {cal.loadavg_before:.2f} before, {cal.loadavg_after:.2f} after). The overheads, "
             "extra-row, sampling and attention figures describe sparsespec's own engine (bf16, original "
             "positions), not the chip alone. Read bandwidth by buffer size (bytes: GB/s): "
             + ", ".join(f"{int(p['bytes'])}: {p['bytes_per_s'] / 1e9:.1f}" for p in cal.bandwidth_curve) + ".",
    )


def default_output_path() -> Path:
    """Where ``sparsespec calibrate`` writes by default: ``$SPARSESPEC_HOME/devices/host.json``."""
    return user_devices_dir() / "host.json"


# ---------------------------------------------------------------------------------------------------- command
def add_calibrate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``calibrate`` options to ``parser`` and return it."""
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads to measure with (default: torch's choice, as `generate` uses)")
    parser.add_argument("--out", default=None, metavar="PATH",
                        help=f"where to write the profile (default: {default_output_path()}, which "
                             "`simulate --device host` then uses)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes and shorter timings (about 10 s; noisier)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary to stdout")
    return parser


def summary(cal: Calibration, profile: DeviceProfile, path: Path) -> dict[str, Any]:
    """The ``--json`` output: where the profile went, the profile, and every raw measurement."""
    data = cal.to_dict()
    data.pop("flags")
    return {"profile_path": str(path), "profile": profile.to_dict(), "measurements": data}


def format_summary(cal: Calibration, profile: DeviceProfile, path: Path) -> str:
    lines = [
        f"Wrote {path}",
        f"  {cal.cpu}, {cal.threads} threads, load average {cal.loadavg_before:.2f} → {cal.loadavg_after:.2f}, "
        f"{cal.seconds:.1f} s",
        f"  DRAM read {cal.dram_bandwidth / 1e9:.1f} GB/s; decode streaming {cal.stream_bandwidth / 1e9:.1f} GB/s "
        f"(efficiency {profile.dram_efficiency:.2f}); L3 {cal.sram_bandwidth / 1e9:.1f} GB/s "
        f"({profile.sram_bytes / MIB:.0f} MiB, KV fraction {profile.sram_kv_fraction:.3g})",
        f"  GEMM bf16 {cal.peak_flops['bf16'] / 1e9:.0f} GFLOP/s, fp32 {cal.peak_flops['fp32'] / 1e9:.0f} GFLOP/s; "
        "extra rows "
        + (f"{cal.extra_row_flops / 1e9:.0f} GFLOP/s" if cal.extra_row_flops else "free"),
        f"  overheads: {cal.overhead_s * 1e3:.3f} ms per pass, {cal.per_layer_overhead_s * 1e6:.1f} µs per layer, "
        f"{cal.per_row_layer_overhead_s * 1e6:.1f} µs per layer and extra row, "
        f"{cal.evict_layer_overhead_s * 1e6:.1f} + {cal.evict_row_layer_overhead_s * 1e6:.1f} µs per layer and "
        "evicting pass + extra row, "
        f"{cal.per_vocab_overhead_s * 1e9:.2f} ns per vocabulary entry",
        "  attention: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in cal.attention_flops.items()),
        "  read bandwidth curve: " + ", ".join(
            f"{p['bytes'] / MIB:g} MiB {p['bytes_per_s'] / 1e9:.0f}" for p in cal.bandwidth_curve) + " (GB/s)",
    ]
    return "\n".join(lines)


def run_calibrate(args: argparse.Namespace) -> int:
    """Run ``sparsespec calibrate`` from parsed arguments; returns the exit status."""
    settings = QUICK if getattr(args, "quick", False) else FULL
    settings = getattr(args, "settings", None) or settings  # a CalibrationSettings (tests pass tiny ones)
    path = Path(args.out).expanduser() if getattr(args, "out", None) else default_output_path()
    cal = calibrate(settings, threads=getattr(args, "threads", None), quiet=getattr(args, "quiet", False))
    profile = build_profile(cal, settings)
    try:
        save_profile(profile, path)
    except OSError as exc:
        raise UserError(f"Cannot write the device profile to {path}: {exc.strerror or exc}.") from None
    if getattr(args, "json", False):
        print(json.dumps(summary(cal, profile, path), indent=2))
    else:
        print(format_summary(cal, profile, path))
    return 0

