"""A calibration run: :func:`calibrate` runs the probes (:mod:`.probes`) in order, fits the profile's figures from
them (:mod:`.fits`) and returns everything as one :class:`Calibration`; a progress bar and one line per result go to
stderr unless ``quiet``."""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from .fits import Overheads, ProbeTimes, fit_attention_rates, fit_overheads, plateau, slope
from .machine import Machine, loadavg, memory_bytes, read_machine
from .probes import (
    attention_step,
    block_pass,
    cold_pair_seconds,
    decode_step_seconds,
    decode_steps,
    file_bytes,
    kv_residency,
    linears_pass,
    matmul_flops,
    median_difference,
    native_probe_model,
    paired_seconds,
    probe_config,
    probe_parts,
    random_state,
    read_bandwidth,
    sampling_seconds,
    stream_weights,
    time_native_streaming,
)
from .settings import ATTENTION_NARROW_SHAPE, ATTENTION_SHAPE, FULL, MIB, CalibrationSettings


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
    native_stream: dict[str, dict[str, Any]]
    residency: dict[str, float]
    sram_kv_fraction: float
    overhead_s: float
    per_layer_overhead_s: float
    stream_overhead_fraction: float
    per_row_layer_overhead_s: float
    evict_layer_overhead_s: float
    evict_row_layer_overhead_s: float
    per_vocab_overhead_s: float
    attention_flops: dict[str, float]
    attention_head_reads: dict[str, float]
    raw: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _Progress:
    """A progress bar over the measurements (stderr), with one line per result above it; silent when ``quiet``."""

    def __init__(self, total: int, quiet: bool) -> None:
        from tqdm import tqdm

        self.quiet = quiet
        self.bar = tqdm(total=total, desc="calibrate", unit="step", file=sys.stderr, disable=quiet, leave=False)

    def line(self, message: str) -> None:
        if not self.quiet:
            self.bar.write(f"[calibrate] {message}", file=sys.stderr)

    def done(self, what: str) -> None:
        self.bar.set_postfix_str(what, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def calibrate(settings: CalibrationSettings = FULL, *, threads: int | None = None, quiet: bool = False) -> Calibration:
    """Run every measurement at ``threads`` torch threads (default: torch's current setting) and return them. Raises
    :class:`ConfigError` where the native kernels are not available: the engine it measures decodes through them."""
    import torch

    from ...cache.arena import require_kernels

    require_kernels()
    previous_threads = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ConfigError("{threads} must be at least 1 (got {value}).", value=threads)
        torch.set_num_threads(threads)
    steps = len(settings.sizes) + len(settings.native_types) + 6
    progress = _Progress(steps, quiet)
    try:
        return measure_all(settings, torch.get_num_threads(), progress)
    finally:
        progress.close()
        torch.set_num_threads(previous_threads)


def measure_all(settings: CalibrationSettings, threads: int, progress: _Progress) -> Calibration:
    """The measurements in order; each step reports its progress and keeps its raw timings in ``raw``."""
    started = time.perf_counter()
    machine = read_machine(threads)
    progress.line(f"{machine.cpu}, {machine.cores} cores, {threads} threads, load average {machine.load_before:.2f}")
    raw: dict[str, Any] = {}
    memory = _memory_rates(settings, machine, progress)
    peaks = _compute_peaks(settings, progress)
    stream, extra_row_flops = _weight_streaming(settings, raw, progress)
    residency, kv_fraction = _kv_residency_fraction(settings, machine, progress)
    native = measure_native_streaming(settings, progress)
    per_vocab = _sampling_cost(settings, raw, progress)
    pass_s = _tiny_probe_overhead(settings, native, per_vocab, raw)
    probes = _probe_engine(settings, raw, progress)
    attention, head_reads = measure_attention_rates(settings, raw, progress)
    overheads = fit_overheads(settings, probes, pass_s, native, per_vocab, attention, head_reads)
    _report_overheads(overheads, progress)
    return Calibration(
        date=machine.date, threads=threads, loadavg_before=machine.load_before, loadavg_after=loadavg(),
        seconds=time.perf_counter() - started, cpu=machine.cpu, cores=machine.cores, hypervisor=machine.hypervisor,
        flags=machine.flags, memory_bytes=memory_bytes(), caches=machine.caches, cache_source=machine.cache_source,
        bandwidth_curve=memory.curve, dram_bandwidth=memory.dram, dram_sizes=memory.dram_sizes,
        sram_bandwidth=memory.sram, sram_sizes=memory.sram_sizes, peak_flops=peaks,
        stream_bandwidth=stream["bytes_per_s"], stream_bytes=int(stream["bytes"]), extra_row_flops=extra_row_flops,
        native_stream=native, residency=residency, sram_kv_fraction=kv_fraction, overhead_s=overheads.overhead_s,
        per_layer_overhead_s=overheads.per_layer_s, stream_overhead_fraction=overheads.stream_fraction,
        per_row_layer_overhead_s=overheads.per_row_layer_s, evict_layer_overhead_s=overheads.evict_layer_s,
        evict_row_layer_overhead_s=overheads.evict_row_layer_s, per_vocab_overhead_s=per_vocab,
        attention_flops=attention, attention_head_reads=head_reads, raw=raw,
    )


@dataclass(frozen=True)
class _MemoryRates:
    curve: list[dict[str, float]]
    dram: float
    dram_sizes: list[int]
    sram: float
    sram_sizes: list[int]


def _memory_rates(s: CalibrationSettings, machine: Machine, progress: _Progress) -> _MemoryRates:
    """The read-bandwidth curve and its DRAM and L3 plateaus (measured at one more size where the curve has none).

    The DRAM plateau is the sizes at least 4x the L3; where the L3 is reported larger than a quarter of the largest
    size (a virtual machine may report its host's), the two largest sizes."""
    kw = dict(trials=s.trials, min_seconds=s.min_seconds)
    curve = []
    for size in s.sizes:
        rate = read_bandwidth(size, **kw)
        curve.append({"bytes": float(size), "bytes_per_s": rate})
        progress.line(f"read {size / MIB:9.2f} MiB: {rate / 1e9:7.1f} GB/s")
        progress.done("read bandwidth")
    largest = sorted(s.sizes)
    dram_from = 4 * machine.l3 if 4 * machine.l3 <= largest[-1] else largest[max(0, len(largest) - 2)]
    dram, dram_sizes = plateau(curve, dram_from, math.inf)
    if dram is None:
        size = max(4 * machine.l3, max(s.sizes))
        dram, dram_sizes = read_bandwidth(size, **kw), [size]
    sram, sram_sizes = plateau(curve, 2 * machine.l2 * min(machine.threads, machine.cores), machine.l3 / 2)
    if sram is None:
        size = max(machine.l3 // 4, 1)
        sram, sram_sizes = read_bandwidth(size, **kw), [size]
    sram = max(sram, dram)
    progress.line(f"DRAM {dram / 1e9:.1f} GB/s, L3 {sram / 1e9:.1f} GB/s")
    return _MemoryRates(curve, dram, dram_sizes, sram, sram_sizes)


def _compute_peaks(s: CalibrationSettings, progress: _Progress) -> dict[str, float]:
    peaks = {dt: matmul_flops(dt, s.gemm_n, trials=s.trials, min_seconds=s.min_seconds) for dt in ("bf16", "fp32")}
    progress.line(f"GEMM {s.gemm_n}: bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s, fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s")
    progress.done("GEMM peak")
    return peaks


def _weight_streaming(s: CalibrationSettings, raw: dict, progress: _Progress) -> tuple[dict[str, float], float | None]:
    """Torch's decode-style weight streaming, and the FLOP rate of the extra rows of a multi-row pass (None: free)."""
    stream = stream_weights(s.stream_bytes, s.stream_shapes, s.rows, trials=s.trials, min_seconds=s.min_seconds)
    raw["stream"] = stream
    extra = stream["rows_s"] - stream["one_row_s"]
    extra_row_flops = (s.rows - 1) * 2.0 * stream["parameters"] / extra if extra > 0 else None
    progress.line(
        f"torch bf16 matrix-vector over {stream['bytes'] / MIB:.0f} MiB: {stream['bytes_per_s'] / 1e9:.1f} GB/s; "
        f"{s.rows} rows take {stream['rows_s'] / stream['one_row_s']:.2f}x one row"
    )
    progress.done("torch streaming")
    return stream, extra_row_flops


def measure_native_streaming(s: CalibrationSettings, progress: _Progress) -> dict[str, dict[str, Any]]:
    """The native kernels' streaming curve and extra-row rate of every block type (``native_stream``)."""
    out: dict[str, dict[str, Any]] = {}
    # Every type once per round, rounds in turn: a slow moment of the machine spoils one round of one type, and the
    # median over the rounds leaves it out.
    rounds: dict[str, list[dict[str, Any]]] = {kind: [] for kind in s.native_types}
    for _ in range(s.stream_rounds):
        for kind in s.native_types:
            rounds[kind].append(time_native_streaming(kind, s.stream_bytes, s.stream_shapes, s.rows, trials=s.trials,
                                                 min_seconds=s.min_seconds))
    for kind, measured in rounds.items():
        extras = [m["extra_row_bytes_per_s"] for m in measured]
        out[kind] = {
            "bytes_per_s": statistics.median(m["bytes_per_s"] for m in measured),
            "extra_row_bytes_per_s": statistics.median(extras) if None not in extras else None,
            "working_set_bytes": measured[0]["working_set_bytes"],
            "rounds": measured,
        }
        extra = out[kind]["extra_row_bytes_per_s"]
        progress.line(f"native {kind} over {measured[0]['working_set_bytes'] / MIB:.0f} MiB: "
                      f"{out[kind]['bytes_per_s'] / 1e9:.1f} GB/s (rounds: "
                      + ", ".join(f"{m['bytes_per_s'] / 1e9:.1f}" for m in measured) + "); each extra row "
                      + (f"{extra / 1e9:.0f} GB/s" if extra else "free"))
        progress.done(f"native {kind}")
    return out


def _kv_residency_fraction(s: CalibrationSettings, machine: Machine,
                           progress: _Progress) -> tuple[dict[str, float], float]:
    """KV residency while weights stream through the cache, and the largest fraction of the L3 that stays."""
    residency = kv_residency(machine.l3, s.residency_fractions, max(4 * machine.l3, 64 * MIB), trials=s.trials)
    resident = [float(f) for f, share in residency.items() if share >= 0.5]
    kv_fraction = max(resident) if resident else min(s.residency_fractions) / 2
    progress.line(f"KV residency after streaming 4x L3: {residency} -> sram_kv_fraction {kv_fraction:.3g}")
    progress.done("KV residency")
    return residency, kv_fraction


def _sampling_cost(s: CalibrationSettings, raw: dict, progress: _Progress) -> float:
    """Sampling seconds per vocabulary entry (the slope between a small and a large vocabulary)."""
    vocab_small, vocab_large = s.vocab_sizes
    sample_small = sampling_seconds(vocab_small, trials=s.trials, min_seconds=s.min_seconds)
    sample_large = sampling_seconds(vocab_large, trials=s.trials, min_seconds=s.min_seconds)
    raw["sampling_seconds"] = {str(vocab_small): sample_small, str(vocab_large): sample_large}
    progress.done("sampling")
    return max(0.0, slope(vocab_small, sample_small, vocab_large, sample_large))


def _tiny_probe_overhead(s: CalibrationSettings, native: dict[str, dict[str, Any]], per_vocab: float,
                         raw: dict) -> float:
    """The pass's fixed cost: the intercept over layers of the decode step of a tiny model with native Q8_0 weights
    (which stay in the caches), less its head's streaming and its sampling."""
    import torch

    from ...cache.policy import make_policy
    from ...model import Transformer

    lo, hi = s.tiny_probe_layers
    state = random_state(probe_config(hi, s.tiny_probe_shape))
    models = {n: Transformer(probe_config(n, s.tiny_probe_shape), state, torch.bfloat16, "native") for n in (lo, hi)}
    head = models[lo].lm_head
    head_bytes = head.out_features * head.in_features * 34 / 32  # Q8_0: 34 bytes per block of 32 weights
    steps = {n: statistics.median(decode_step_seconds(m, make_policy("full"), s.probe_context, s.probe_steps)
                                  for _ in range(s.probe_rounds)) for n, m in models.items()}
    layer_s = slope(lo, steps[lo], hi, steps[hi])
    overhead = (steps[lo] - lo * layer_s - head_bytes / native["Q8_0"]["bytes_per_s"]
                - models[lo].config.vocab_size * per_vocab)
    raw["tiny_probe"] = {"layers": [lo, hi], "shape": list(s.tiny_probe_shape),
                         "step_seconds": {str(n): t for n, t in steps.items()}}
    return max(0.0, overhead)


def _probe_engine(s: CalibrationSettings, raw: dict, progress: _Progress) -> list[ProbeTimes]:
    """The streaming probe models' decode steps and passes, every kind in turn with the pass over its projections
    alone, ``probe_steps × probe_rounds`` turns (medians of the turn-by-turn differences: the machine's drift falls
    on both sides of each)."""
    from ...cache.policy import make_policy

    ctx, rows = s.probe_context, s.rows
    turns = s.probe_steps * s.probe_rounds
    full, evict = make_policy("full"), make_policy("hybrid", ctx)
    over = ctx + 64  # a prompt that fills the hybrid cache of `ctx` entries, so that every row evicts
    probes = []
    for shape in s.probe_shapes:
        model = native_probe_model(shape, s.probe_type, s.probe_bytes)
        t = paired_seconds({
            "step": decode_steps(model, full, ctx, turns),
            "stream_1": linears_pass(model, 1),
            "step_evict": decode_steps(model, evict, over, turns),
            "pass_1": block_pass(model, full, ctx, 1),
            "pass_rows": block_pass(model, full, ctx, rows),
            "stream_rows": linears_pass(model, rows),
            "pass_rows_evict": block_pass(model, evict, over, rows),
        }, turns)
        times = {
            "stream_1": statistics.median(t["stream_1"]),
            "around": median_difference(t["step"], t["stream_1"]),
            "evicting": median_difference(t["step_evict"], t["step"]),
            "extra_rows": statistics.median((a - b) - (c - d) for a, b, c, d in
                                            zip(t["pass_rows"], t["pass_1"], t["stream_rows"], t["stream_1"])),
            "evicting_rows": median_difference(t["pass_rows_evict"], t["pass_rows"]),
        }
        layer_bytes = sum(file_bytes(s.probe_type, n, k) for n, k in probe_parts(shape).values())
        head_bytes = file_bytes("Q8_0", model.config.vocab_size, shape[0])
        probes.append(ProbeTimes(shape, model.config.num_hidden_layers, times, layer_bytes, head_bytes,
                             model.config.vocab_size))
        progress.line(
            f"probe {shape[0]} wide, {model.config.num_hidden_layers} layers: its projections alone "
            f"{times['stream_1'] * 1e3:.2f} ms, a decode step {times['around'] * 1e3:.2f} ms more; evicting "
            f"{times['evicting'] * 1e3:+.2f} ms; {rows} rows {times['extra_rows'] * 1e3:+.2f} ms beyond their "
            f"products, evicting {times['evicting_rows'] * 1e3:+.2f} ms"
        )
        del model
    raw["probes"] = [{"shape": list(p.shape), "type": s.probe_type, "layers": p.layers, "seconds": p.times}
                     for p in probes]
    progress.done("engine overheads")
    return probes


def measure_attention_rates(s: CalibrationSettings, raw: dict,
                            progress: _Progress) -> tuple[dict[str, float], dict[str, float]]:
    """FLOP rates and KV-head rates (:func:`~.fits.fit_attention_rates`) of the arena's attention paths, from two
    cache sizes and two shapes each, at every KV dtype, the cache read from memory (a buffer of ``flush_bytes`` is
    read before each call)."""
    import torch

    flush = torch.ones(max(s.flush_bytes // 4, 256), dtype=torch.float32)
    entries = s.attention_entries
    rates: dict[str, float] = {}
    head_rates: dict[str, float] = {}
    raw["attention_seconds"] = {}
    paths = (("single", 1, False), ("multi", s.rows, False), ("evicting", 1, True))
    for kv_dtype in ("auto", *s.kv_dtypes):
        for path, rows, evicting in paths:
            key = path if kv_dtype == "auto" else f"{path}:{kv_dtype}"
            seconds = {}
            for name, shape in (("wide", ATTENTION_SHAPE), ("narrow", ATTENTION_NARROW_SHAPE)):
                steps = [attention_step(n, rows, evicting=evicting, shape=shape, kv_dtype=kv_dtype) for n in entries]
                seconds[name] = cold_pair_seconds(*steps, flush, s.attention_trials)
            raw["attention_seconds"][key] = {name: {str(n): t for n, t in zip(entries, pair)}
                                             for name, pair in seconds.items()} | {"rows": rows}
            flops, head_reads = fit_attention_rates(seconds["wide"], seconds["narrow"], entries, rows)
            if flops is not None:
                rates[key] = flops
            if head_reads is not None:
                head_rates[key] = head_reads
    progress.line("attention: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in rates.items()))
    progress.line("attention per KV head: " + ", ".join(f"{k} {v / 1e9:.2f} G channels/s"
                                                         for k, v in head_rates.items()))
    progress.done("attention")
    return rates, head_rates


def _report_overheads(o: Overheads, progress: _Progress) -> None:
    """One line with the overheads fitted from the streaming probes."""
    progress.line(
        f"overheads: {o.overhead_s * 1e3:.3f} ms per pass + {o.per_layer_s * 1e6:.1f} µs per layer + "
        f"{o.stream_fraction:.3f} of the weights' streaming time; +{o.per_row_layer_s * 1e6:.1f} µs per layer and "
        f"extra row; when evicting +{o.evict_layer_s * 1e6:.1f} µs per layer and +{o.evict_row_layer_s * 1e6:.1f} µs "
        "per layer and extra row"
    )
