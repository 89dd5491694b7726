"""``sparsespec calibrate``: measure this machine and write the ``host`` device profile of the edge simulator.

The edge simulator (:mod:`sparsespec.edge`) predicts decode speed from a device profile. For this machine the
profile is measured here, on the engine that decodes by default (the native kernels over the GGUF files' own
blocks, bfloat16 compute), at ``--threads`` threads:

- **read bandwidth** — an fp32 ``sum`` over buffers from 256 KiB to 1 GiB gives a curve; the DRAM rate is the
  plateau of the sizes at least 4× the last-level cache (L3; the two largest sizes when the reported L3 is larger
  than a quarter of the largest, as a virtual machine's may be), the SRAM rate the plateau of the sizes that fit the
  L3 but not the L2 caches;
- **matmul peak** — a square bf16 and fp32 GEMM (compute-bound) gives ``peak_flops``;
- **native weight streaming** — the native kernels' one-row matmul over layer-shaped weights of each GGUF block type
  (random blocks, the kernels' own layout), more of them than the caches hold, gives ``native_stream``: the rate in
  the file's bytes (a real model's weights come from DRAM: within a decode step its attention, cache and activations
  share the caches, so even a 96 MB model streams at this rate), and the same weights with R rows the rate at which
  each extra row of a verification pass goes through them;
- **torch weight streaming** — one-row bf16 ``F.linear`` over the same shapes, for the torch weight formats
  (``--weights dense|int8|int4``): over the DRAM read rate it is ``dram_efficiency``, and R rows give
  ``extra_row_flops``;
- **KV residency** — whether a KV-sized buffer stays in the L3 while a stream of weights passes through it sets
  ``sram_kv_fraction``;
- **the attention op** — one layer of the KV arena's attention at two cache sizes, for one row and R rows, over the
  full cache and over a full budgeted (hybrid) cache, and at each KV dtype, with a large buffer read before each
  call (in a decode step the whole model streams between two visits of a layer's cache), with 6 query heads per KV
  head and with 1: the two slopes give ``attention_flops`` (the query heads' FLOPs) and ``attention_head_reads`` (the
  KV heads' own work) per path (and ``path:int8`` / ``path:int4``);
- **the engine's own costs** — a tiny random model whose weights stay in the caches, run through the engine's
  decode loop (:func:`sparsespec.generate.generate_tokens`) with few and many layers, gives the pass's fixed cost
  ``overhead_s`` (its intercept, less its sampling); two random models with native weights streaming from memory,
  one with narrow and one with wide layers, each timed beside a pass over its projections alone, give what a layer
  costs beyond its weights' bytes at the streaming rates above (so a narrow layer's small calls, slower than those
  rates, count there): a fixed part (``per_layer_overhead_s``) and a part in proportion to its streaming time
  (``stream_overhead_fraction``: the layer's other work runs in caches its weights just went through); their
  multi-row passes and their steps over a full budgeted cache give ``per_row_layer_overhead_s`` and the eviction's
  costs (``evict_layer_overhead_s``, ``evict_row_layer_overhead_s``), the attention op's own time taken out at the
  rates above; sampling over a small and a large vocabulary gives ``per_vocab_overhead_s``.

Hardware capacities (read bandwidth, GEMM peak, cache residency) are the best of several trials: a trial that lost
the CPU to another process says nothing about the hardware. The engine's own costs (weight streaming, decode steps,
verification passes, attention, sampling) are medians: the simulator predicts the sustained speed of a whole run,
and on a shared machine the typical step is slower than the best one. Run it on an idle machine all the same.

Not measured, so not modelled: the torch weight formats' own per-layer overheads (their passes are priced with the
native engine's), float activations (``--activations float``, the small models' default: priced as 8-bit ones),
retention's and recall's costs, and several requests sharing passes (``serve --parallel``).

The profile goes to ``$SPARSESPEC_HOME/devices/host.json`` (default ``~/.cache/sparsespec/devices/host.json``),
which ``edge.profile.load_profile("host")`` prefers over the packaged placeholder; ``--out`` writes elsewhere.
A progress bar and one line per measurement go to stderr; ``--json`` prints a JSON summary (profile, curve, raw
timings) to stdout.
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

# Shapes of one decoder layer's projections for the streaming tests, as [out, in] (qkv, o, gate+up, down): a
# 1024-wide layer with 2 KV heads of 128 and a 4096-wide MLP, whose inputs fill whole 256-weight chunks (8 MiB in
# Q4_K).
STREAM_LAYER_SHAPES = ((1536, 1024), (1024, 1024), (8192, 1024), (1024, 4096))

# The GGUF block types the native kernels read (kernels/repack.py), by name.
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

# The attention shapes the arena is timed with (query heads, KV heads, head width): many query heads per KV head,
# and one, so that the query heads' FLOPs and each KV head's own work separate.
ATTENTION_SHAPE = (12, 2, 64)
ATTENTION_NARROW_SHAPE = (2, 2, 64)

# KV dtypes whose attention is timed besides the compute dtype's (cache/quant.py).
QUANTIZED_KV = ("int8", "int4")


@dataclass(frozen=True)
class CalibrationSettings:
    """How much to measure. :data:`FULL` is the default, :data:`QUICK` is ``--quick``; tests use tinier ones."""

    sizes: tuple[int, ...]  # read-bandwidth buffer sizes, bytes
    min_seconds: float  # time spent per timed quantity (at least `trials` trials)
    trials: int
    gemm_n: int  # square GEMM size
    stream_bytes: int  # weight bytes of the streaming tests: more than the caches hold
    stream_rounds: int = 5  # rounds over every block type (the median per type is kept)
    stream_shapes: tuple[tuple[int, int], ...] = STREAM_LAYER_SHAPES
    native_types: tuple[str, ...] = NATIVE_TYPES
    rows: int = 5  # rows of the multi-row tests (γ + 1 for γ = 4)
    # The probe models whose decode steps are timed, as (hidden, MLP width, query heads, KV heads, head width):
    # a tiny one whose weights stay in the caches, at two layer counts (the pass's fixed cost), and two with narrow
    # and wide layers of random native weights (`probe_type`) that stream from DRAM as a real model's do
    # (`probe_bytes` each; the engine's per-layer costs around the weights).
    tiny_probe_shape: tuple[int, int, int, int, int] = (128, 256, 4, 2, 32)
    tiny_probe_layers: tuple[int, int] = (4, 16)
    probe_shapes: tuple[tuple[int, int, int, int, int], ...] = ((512, 1536, 8, 2, 64), (1536, 8192, 12, 2, 128))
    probe_type: str = "Q4_K"
    probe_bytes: int = 256 * MIB
    probe_steps: int = 40  # steps timed per run of the tiny probe (median of each run)
    probe_rounds: int = 3  # its runs per layer count (median); the streaming probes take steps × rounds turns
    probe_context: int = 256  # tokens in the probe's cache, and the budget of its evicting (hybrid) cache
    flush_bytes: int = 256 * MIB  # read between two timed attention calls, as a pass's weights pass between them
    attention_entries: tuple[int, int] = (256, 2048)  # cache sizes of the attention test
    attention_trials: int = 15  # cold calls of each size
    kv_dtypes: tuple[str, ...] = QUANTIZED_KV  # quantized KV dtypes whose attention is timed too
    vocab_sizes: tuple[int, int] = (4096, 151936)  # vocabularies of the sampling test
    residency_fractions: tuple[float, ...] = (1 / 16, 1 / 8, 1 / 4, 1 / 2)

    def __post_init__(self) -> None:
        # The probes' weights and heads are priced at these types' measured rates (_fit_overheads).
        for kind in (self.probe_type, "Q8_0"):
            if kind not in self.native_types:
                raise ValueError(f"native_types must include {kind} (the streaming probes' weights are priced at "
                                 "its rate)")


FULL = CalibrationSettings(
    sizes=tuple(256 * KIB << k for k in range(13)),  # 256 KiB … 1 GiB
    min_seconds=0.3,
    trials=5,
    gemm_n=1024,
    stream_bytes=384 * MIB,
    probe_steps=40,
)

QUICK = CalibrationSettings(
    sizes=(256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB),
    min_seconds=0.1,
    trials=3,
    gemm_n=1024,
    stream_bytes=256 * MIB,
    stream_rounds=2,
    native_types=("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"),
    probe_bytes=128 * MIB,
    probe_steps=16,
    probe_rounds=2,
    attention_entries=(256, 1024),
    attention_trials=7,
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


# Offsets of the float16 scales in each block type's GGUF block (ggml's block layouts): random codes, scales of 0.01.
_F16_SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                      "Q5_K": (0, 2), "Q6_K": (208,)}


def random_native_weight(kind: str, out_features: int, in_features: int, seed: int = 0):
    """A weight of GGUF block type ``kind`` with random codes, in the kernels' layout: ``(kernel type, repacked
    bytes, padded in_features, the file's bytes)``."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    from .. import kernels
    from ..kernels.repack import BLOCK_TYPES, pack

    ggml_type = int(GGMLQuantizationType[kind])
    _, block, block_bytes = BLOCK_TYPES[ggml_type]
    if in_features % block:
        raise UserError(f"A {kind} weight needs inputs in whole blocks of {block}, got {in_features}.")
    raw = np.random.default_rng(seed).integers(0, 256, (out_features, in_features // block, block_bytes), np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    for offset in _F16_SCALE_OFFSETS[kind]:
        raw[..., offset:offset + 2] = scale
    kernel_type, packed, padded = pack(ggml_type, raw.reshape(out_features, -1), in_features,
                                       kernels.tiles_preferred())
    return kernel_type, torch.from_numpy(packed.reshape(-1)), padded, raw.size


def in_engine_memory(blobs: list):
    """Copies of the byte tensors ``blobs`` in one mapping of the memory the engine's weights stream from
    (:func:`~sparsespec.loading.huge_pages.anonymous_memory`: huge pages), each 64-byte aligned; their rates are
    the engine's (decoding runs faster from it than from one allocation per tensor:
    benchmarks/history/decode.md#weights-in-huge-pages-native-decoding-10-20-faster-2026-12-05-evening)."""
    import torch

    from ..loading.huge_pages import anonymous_memory

    offsets, end = [], 0
    for blob in blobs:
        offsets.append(end)
        end += -(-blob.numel() // 64) * 64
    memory = anonymous_memory(end)
    copies = []
    for blob, offset in zip(blobs, offsets):
        copy = torch.frombuffer(memory, dtype=torch.uint8, count=blob.numel(), offset=offset)
        copy.copy_(blob)
        copies.append(copy)
    return copies


def native_streaming(kind: str, total_bytes: int, shapes: tuple[tuple[int, int], ...], rows: int, *,
                     trials: int = 3, min_seconds: float = 0.05) -> dict[str, Any]:
    """The native kernels' matmul over as many layers of ``shapes`` as make ``total_bytes`` of weights of GGUF
    type ``kind`` (random blocks): one pass on one row (median trial), and the extra time of ``rows`` rows.

    Returns ``bytes_per_s`` (the file's bytes of the pass over its one-row time), ``extra_row_bytes_per_s`` (the
    same bytes over the extra time per extra row; None when ``rows`` rows took no longer), ``working_set_bytes``
    and the timings.
    """
    import torch

    from .. import kernels

    layer = [random_native_weight(kind, n, k, seed=i) for i, (n, k) in enumerate(shapes)]
    layer_bytes = sum(w[3] for w in layer)
    layers = max(1, round(total_bytes / layer_bytes))
    weights = [(kt, blob, padded, n) for _ in range(layers) for (kt, blob, padded, _), (n, _k) in zip(layer, shapes)]
    copies = in_engine_memory([blob for _, blob, _, _ in weights])
    weights = [(kt, copy, padded, n) for (kt, _, padded, n), copy in zip(weights, copies)]

    def run(n_rows: int) -> Callable[[], None]:
        xs = {padded: torch.full((n_rows, padded), 0.5, dtype=torch.bfloat16) for _, _, padded, _ in weights}

        def step() -> None:
            for kernel_type, blob, padded, n in weights:
                kernels.gguf_linear(xs[padded], [blob], [kernel_type], [n], padded)

        return step

    one, many = run(1), run(rows)
    seconds = statistics.median(time_calls(one, trials=trials, min_seconds=min_seconds))
    # The extra rows add little to a pass that streams from DRAM: one-row and many-row passes alternate, and the
    # median of their paired differences is kept, so that a drift of the machine's speed cancels.
    many()
    differences = []
    started = time.perf_counter()
    while len(differences) < 2 * trials or (time.perf_counter() - started < 2 * min_seconds and len(differences) < 200):
        t0 = time.perf_counter()
        one()
        t1 = time.perf_counter()
        many()
        differences.append(time.perf_counter() - t1 - (t1 - t0))
    extra = statistics.median(differences) / (rows - 1)
    total = layers * layer_bytes
    return {
        "bytes_per_s": total / seconds,
        "extra_row_bytes_per_s": total / extra if extra > 0 else None,
        "working_set_bytes": total,
        "one_row_s": seconds,
        "extra_row_s": extra,
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
def probe_config(layers: int, shape: tuple[int, int, int, int, int] = (128, 256, 4, 2, 32),
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


def probe_parts(shape: tuple[int, int, int, int, int]) -> dict[str, tuple[int, int]]:
    """A probe layer's projections of ``shape`` (hidden, MLP width, query heads, KV heads, head width), as
    ``{name: (out_features, in_features)}``."""
    h, i, heads, kv_heads, hd = shape
    q, kv = heads * hd, kv_heads * hd
    return {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def file_bytes(kind: str, out_features: int, in_features: int) -> float:
    """Bytes of an ``out_features × in_features`` weight of GGUF block type ``kind`` in the file."""
    from gguf import GGMLQuantizationType

    from ..kernels.repack import BLOCK_TYPES

    _, block, block_bytes = BLOCK_TYPES[int(GGMLQuantizationType[kind])]
    return out_features * in_features / block * block_bytes


def native_probe_model(shape: tuple[int, int, int, int, int], kind: str, total_bytes: int):
    """A :class:`Transformer` of ``shape`` with as many layers as make ``total_bytes`` of random native weights of
    GGUF type ``kind`` (the file's bytes; at least 2 layers; one layer's blocks copied into every layer, so each
    streams its own memory) and a random Q8_0 head over a 512-entry vocabulary."""
    import torch

    from ..linear import NativeLinear
    from ..model import Transformer

    h = shape[0]
    parts = probe_parts(shape)
    blocks = {part: random_native_weight(kind, n, k, seed=j) for j, (part, (n, k)) in enumerate(parts.items())}
    layers = max(2, math.ceil(total_bytes / sum(block[3] for block in blocks.values())))
    config = probe_config(layers, shape)
    linears: dict[str, object] = {}
    copies = iter(in_engine_memory([blob for _ in range(layers) for _, blob, _, _ in blocks.values()]))
    for layer in range(layers):
        for part, (kernel_type, _, padded, _) in blocks.items():
            n, k = parts[part]
            linears[f"layers.{layer}.{part}"] = NativeLinear([(kernel_type, next(copies), n)], k, padded)
    kernel_type, blob, padded, _ = random_native_weight("Q8_0", config.vocab_size, h)
    linears["lm_head"] = NativeLinear([(kernel_type, blob, config.vocab_size)], h, padded)
    ones = torch.ones(h, dtype=torch.bfloat16)
    state = {"model.embed_tokens.weight": torch.randn(config.vocab_size, h).to(torch.bfloat16) / h**0.5,
             "model.norm.weight": ones}
    for layer in range(layers):
        state[f"model.layers.{layer}.input_layernorm.weight"] = ones
        state[f"model.layers.{layer}.post_attention_layernorm.weight"] = ones
    return Transformer(config, state, torch.bfloat16, "native", linears=linears)


def linears_pass(model, rows: int) -> Callable[[], None]:
    """A pass that calls every projection of ``model`` once, in model order, on ``rows`` rows and does nothing else:
    the weights' streaming alone, as in a decode step; as a call."""
    import torch

    items = [linear for _, linear in model.linear_items()]
    xs = {lin.in_features: torch.full((rows, lin.in_features), 0.5, dtype=torch.bfloat16) for lin in items}

    def step() -> None:
        for lin in items:
            lin(xs[lin.in_features])

    return step


def _arena(model, policy, max_tokens: int, max_inflight: int):
    import torch

    from ..cache.arena import KVArena

    return KVArena(model.config, policy, dtype=torch.bfloat16, max_tokens=max_tokens, max_block=64,
                   max_inflight=max_inflight)


def decode_steps(model, policy, context: int, steps: int) -> Callable[[], None]:
    """The engine's decode loop (forward, commit, greedy sampling) after a ``context``-token prompt, as a call that
    runs its next step (at most ``steps`` calls)."""
    from ..generate import generate_tokens
    from ..sampling import SamplingParams

    arena = _arena(model, policy, context + steps + 4, 1)
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(context + 1)]
    tokens = generate_tokens(model, arena, prompt, max_new_tokens=steps + 2, sampling=SamplingParams(),
                             prefill_chunk=64)
    next(tokens)  # the prompt's pass
    return lambda: next(tokens)


def decode_step_seconds(model, policy, context: int, steps: int) -> float:
    """Seconds of the median step of the engine's decode loop (forward, commit, greedy sampling)."""
    step = decode_steps(model, policy, context, steps)
    return statistics.median(time_calls(step, trials=steps - 1))


def block_pass(model, policy, context: int, rows: int) -> Callable[[], None]:
    """A ``rows``-row pass (forward, greedy choice of every row, rollback) over ``context`` tokens, as a greedy
    verification pass does it, as a call."""
    import torch

    from ..generate import prefill

    arena = _arena(model, policy, context + rows + 2, rows + 1)
    prefill(model, arena, [(5 * i + 1) % model.config.vocab_size for i in range(context)], 64)
    block = torch.tensor([(3 * i + 2) % model.config.vocab_size for i in range(rows)])

    def step() -> None:
        model.forward(block, arena).argmax(dim=-1).tolist()
        arena.commit(0)

    return step


def paired_seconds(calls: dict[str, Callable[[], Any]], trials: int) -> dict[str, list[float]]:
    """Seconds of every call, the calls made in turn ``trials`` times: entry ``i`` of each list comes from the same
    turn, so that differences between calls taken turn by turn leave the machine's drift out."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(trials):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return times


def median_difference(a: list[float], b: list[float]) -> float:
    """The median of ``a[i] − b[i]``: how much longer ``a`` took than ``b`` in the same turn."""
    return statistics.median(x - y for x, y in zip(a, b))


def sampling_seconds(vocab: int, *, trials: int = 5, min_seconds: float = 0.05) -> float:
    """Seconds to turn one row of float32 logits over ``vocab`` entries into the greedy token (median trial)."""
    import torch

    from ..sampling import SamplingParams, next_token

    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams()
    return statistics.median(time_calls(lambda: next_token(logits, greedy, None), trials=trials,
                                        min_seconds=min_seconds))


def attention_step(entries: int, rows: int, *, evicting: bool, shape: tuple[int, int, int] = ATTENTION_SHAPE,
                   kv_dtype: str = "auto") -> Callable[[], None]:
    """One layer of :meth:`KVArena.attend` for ``rows`` rows over ``entries`` cached entries, as a call to time
    (rolled back after each call), keys and values at ``kv_dtype`` (``auto``: bfloat16, the compute dtype).

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
                    max_inflight=rows + 1, kv_dtype=kv_dtype)
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

    return step


def cold_pair_seconds(small: Callable[[], Any], large: Callable[[], Any], flush, trials: int) -> tuple[float, float]:
    """Seconds of ``small`` and ``large`` after reading ``flush`` (a tensor larger than the caches, as a decode
    step's weights pass between two visits of a layer's cache): the median of each, the two called in turn so that
    the machine's drift falls on both alike, and the median of their paired differences added to the small one."""
    small()
    large()
    first, differences = [], []
    for _ in range(trials):
        flush.sum()
        t0 = time.perf_counter()
        small()
        t1 = time.perf_counter()
        flush.sum()
        t2 = time.perf_counter()
        large()
        differences.append(time.perf_counter() - t2 - (t1 - t0))
        first.append(t1 - t0)
    base = statistics.median(first)
    return base, base + statistics.median(differences)


def attention_rates(wide: tuple[float, float], narrow: tuple[float, float], entries: tuple[int, int],
                    rows: int) -> tuple[float | None, float | None]:
    """``(attention_flops, attention_head_reads)`` from the seconds at the two cache sizes ``entries`` of the
    :data:`ATTENTION_SHAPE` op (``wide``) and the :data:`ATTENTION_NARROW_SHAPE` one (``narrow``): per cached entry
    and row the first costs ``4·H·d / flops + n_kv·d / reads``, the second the same with its own H. Where the two
    slopes do not separate the terms (noise), the FLOP rate from the wide shape alone and no head figure; None
    for both when its slope is not positive."""
    (heads, kv_heads, hd), narrow_heads = ATTENTION_SHAPE, ATTENTION_NARROW_SHAPE[0]
    assert ATTENTION_NARROW_SHAPE[1:] == (kv_heads, hd)
    n = (entries[1] - entries[0]) * rows
    slope, narrow_slope = (wide[1] - wide[0]) / n, (narrow[1] - narrow[0]) / n
    if slope <= 0:
        return None, None
    if slope > narrow_slope > 0:
        flops = 4.0 * hd * (heads - narrow_heads) / (slope - narrow_slope)
        head_s = narrow_slope - 4.0 * hd * narrow_heads / flops
        if head_s > 0:
            return flops, kv_heads * hd / head_s
    return 4.0 * heads * hd / slope, None


# ------------------------------------------------------------------------------------------------ calibrate
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
    steps = len(settings.sizes) + len(settings.native_types) + 6
    progress = _Progress(steps, quiet)
    try:
        return _calibrate(settings, torch.get_num_threads(), progress)
    finally:
        progress.close()
        torch.set_num_threads(previous_threads)


def _calibrate(settings: CalibrationSettings, threads: int, progress: _Progress) -> Calibration:
    """The measurements in order; each step reports its progress and keeps its raw timings in ``raw``."""
    started = time.perf_counter()
    machine = _machine(threads, progress)
    raw: dict[str, Any] = {}
    memory = _memory_rates(settings, machine, progress)
    peaks = _compute_peaks(settings, progress)
    stream, extra_row_flops = _weight_streaming(settings, raw, progress)
    residency, kv_fraction = _kv_residency_fraction(settings, machine, progress)
    native = _native_streaming(settings, progress)
    per_vocab = _sampling_cost(settings, raw, progress)
    pass_s, cached_layer_s = _tiny_probe_overhead(settings, stream["bytes_per_s"], native, per_vocab, raw)
    probes = _probe_engine(settings, raw, progress)
    attention, head_reads = _attention_rates(settings, raw, progress)
    overheads = _fit_overheads(settings, probes, pass_s, cached_layer_s, native, per_vocab, attention, head_reads,
                               progress)
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


def _machine(threads: int, progress: _Progress) -> _Machine:
    cpu, flags, hypervisor = _cpuinfo()
    caches, cache_source = cache_sizes()
    machine = _Machine(datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), loadavg(), cpu, flags, hypervisor,
                       os.cpu_count() or 1, threads, caches, cache_source)
    progress.line(f"{cpu}, {machine.cores} cores, {threads} threads, load average {machine.load_before:.2f}")
    return machine


@dataclass(frozen=True)
class _MemoryRates:
    curve: list[dict[str, float]]
    dram: float
    dram_sizes: list[int]
    sram: float
    sram_sizes: list[int]


def _memory_rates(s: CalibrationSettings, machine: _Machine, progress: _Progress) -> _MemoryRates:
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
    dram, dram_sizes = _plateau(curve, dram_from, math.inf)
    if dram is None:
        size = max(4 * machine.l3, max(s.sizes))
        dram, dram_sizes = read_bandwidth(size, **kw), [size]
    sram, sram_sizes = _plateau(curve, 2 * machine.l2 * min(machine.threads, machine.cores), machine.l3 / 2)
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


def _native_streaming(s: CalibrationSettings, progress: _Progress) -> dict[str, dict[str, Any]]:
    """The native kernels' streaming curve and extra-row rate of every block type (``native_stream``); none where
    the kernels are not available (the profile then describes the torch path)."""
    from .. import kernels

    out: dict[str, dict[str, Any]] = {}
    if not kernels.available():
        progress.line(f"native kernels unavailable ({kernels.unavailable_reason()}): measuring the torch path")
        for _ in s.native_types:
            progress.done("native streaming")
        return out
    # Every type once per round, rounds in turn: a slow moment of the machine spoils one round of one type, and the
    # median over the rounds leaves it out.
    rounds: dict[str, list[dict[str, Any]]] = {kind: [] for kind in s.native_types}
    for _ in range(s.stream_rounds):
        for kind in s.native_types:
            rounds[kind].append(native_streaming(kind, s.stream_bytes, s.stream_shapes, s.rows, trials=s.trials,
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


def _kv_residency_fraction(s: CalibrationSettings, machine: _Machine,
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
    return max(0.0, _slope(vocab_small, sample_small, vocab_large, sample_large))


def _tiny_probe_overhead(s: CalibrationSettings, torch_rate: float, native: dict[str, dict[str, Any]],
                         per_vocab: float, raw: dict) -> tuple[float, float]:
    """The pass's fixed cost and the cost of a layer whose weights stay in the caches: the intercept and the slope
    over layers of the decode step of a tiny model (native Q8_0; bf16 on the torch path), less its weights'
    streaming and its sampling."""
    import torch

    from .. import kernels
    from ..cache.policy import make_policy
    from ..model import Transformer

    lo, hi = s.tiny_probe_layers
    use_native = kernels.available()
    state = random_state(probe_config(hi, s.tiny_probe_shape))
    models = {n: Transformer(probe_config(n, s.tiny_probe_shape), state, torch.bfloat16,
                             "native" if use_native else "dense") for n in (lo, hi)}
    per_weight = 34 / 32 if use_native else 2.0
    head = models[lo].lm_head
    head_bytes = head.out_features * head.in_features * per_weight
    q8 = native.get("Q8_0")
    rate = q8["bytes_per_s"] if q8 else torch_rate
    steps = {n: statistics.median(decode_step_seconds(m, make_policy("full"), s.probe_context, s.probe_steps)
                                  for _ in range(s.probe_rounds)) for n, m in models.items()}
    slope = _slope(lo, steps[lo], hi, steps[hi])
    layer_bytes = sum(lin.out_features * lin.in_features * per_weight for lin in (
        models[lo].layers[0].qkv, models[lo].layers[0].o_proj, models[lo].layers[0].gate_up, models[lo].layers[0].down))
    overhead = steps[lo] - lo * slope - head_bytes / rate - models[lo].config.vocab_size * per_vocab
    raw["tiny_probe"] = {"layers": [lo, hi], "shape": list(s.tiny_probe_shape),
                         "step_seconds": {str(n): t for n, t in steps.items()}}
    return max(0.0, overhead), max(0.0, slope - layer_bytes / rate)


@dataclass(frozen=True)
class _Probe:
    """One streaming probe model's shape, layer count, and median seconds: ``stream_1`` (a pass over its projections
    alone, one row), and, each taken turn by turn against its reference, ``around`` (a decode step less
    ``stream_1``), ``evicting`` (a step over a full hybrid cache less one over the full cache), ``extra_rows``
    (a ``rows``-row pass less a 1-row pass, less the same difference of the projections alone) and
    ``evicting_rows`` (a ``rows``-row pass over the full hybrid cache less one over the full cache)."""

    shape: tuple[int, int, int, int, int]
    layers: int
    times: dict[str, float]
    layer_bytes: float  # one layer's projections, in the file's bytes of the probe's type
    head_bytes: float  # its Q8_0 head, in the file's bytes
    vocab: int


def _probe_engine(s: CalibrationSettings, raw: dict, progress: _Progress) -> list[_Probe]:
    """The streaming probe models' decode steps and passes, every kind in turn with the pass over its projections
    alone, ``probe_steps × probe_rounds`` turns (medians of the turn-by-turn differences: the machine's drift falls
    on both sides of each). On the torch path (no native kernels) there are none."""
    from .. import kernels
    from ..cache.policy import make_policy

    if not kernels.available():
        progress.done("engine overheads")
        return []
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
        probes.append(_Probe(shape, model.config.num_hidden_layers, times, layer_bytes, head_bytes,
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


def _attention_rates(s: CalibrationSettings, raw: dict, progress: _Progress) -> tuple[dict[str, float],
                                                                                     dict[str, float]]:
    """FLOP rates and KV-head rates (:func:`attention_rates`) of the arena's attention paths, from two cache sizes
    and two shapes each, at every KV dtype (quantized ones only with the native kernels, which alone store them),
    the cache read from memory (a buffer of ``flush_bytes`` is read before each call)."""
    import torch

    from .. import kernels

    flush = torch.ones(max(s.flush_bytes // 4, 256), dtype=torch.float32)
    entries = s.attention_entries
    rates: dict[str, float] = {}
    head_rates: dict[str, float] = {}
    raw["attention_seconds"] = {}
    paths = (("single", 1, False), ("multi", s.rows, False), ("evicting", 1, True))
    for kv_dtype in ("auto", *(s.kv_dtypes if kernels.available() else ())):
        for path, rows, evicting in paths:
            key = path if kv_dtype == "auto" else f"{path}:{kv_dtype}"
            seconds = {}
            for name, shape in (("wide", ATTENTION_SHAPE), ("narrow", ATTENTION_NARROW_SHAPE)):
                steps = [attention_step(n, rows, evicting=evicting, shape=shape, kv_dtype=kv_dtype) for n in entries]
                seconds[name] = cold_pair_seconds(*steps, flush, s.attention_trials)
            raw["attention_seconds"][key] = {name: {str(n): t for n, t in zip(entries, pair)}
                                             for name, pair in seconds.items()} | {"rows": rows}
            flops, head_reads = attention_rates(seconds["wide"], seconds["narrow"], entries, rows)
            if flops is not None:
                rates[key] = flops
            if head_reads is not None:
                head_rates[key] = head_reads
    progress.line("attention: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in rates.items()))
    progress.line("attention per KV head: " + ", ".join(f"{k} {v / 1e9:.2f} G channels/s"
                                                         for k, v in head_rates.items()))
    progress.done("attention")
    return rates, head_rates


@dataclass(frozen=True)
class _Overheads:
    overhead_s: float
    per_layer_s: float
    stream_fraction: float
    per_row_layer_s: float
    evict_layer_s: float
    evict_row_layer_s: float


def _fit_overheads(s: CalibrationSettings, probes: list[_Probe], pass_s: float, cached_layer_s: float,
                   native: dict[str, dict[str, Any]], per_vocab: float, attention: dict[str, float],
                   head_reads: dict[str, float], progress: _Progress) -> _Overheads:
    """The engine's own costs from the streaming probes: each step less its weights' streaming time at the
    ``native`` rates (the time the simulator gives them), the pass's fixed cost ``pass_s``, its sampling at
    ``per_vocab`` seconds per vocabulary entry and the attention op's time over its entries at the measured
    ``attention`` and ``head_reads`` rates, per layer: a fixed part and a part in proportion to the pass's streaming
    time (the layer's other work runs in caches its weights just went through), a line through the narrow and the
    wide probe. What a narrow layer's small calls cost beyond their bytes at the rates (measured over large calls)
    lands in that line, where the simulator adds it; a line through the projections' own measured time would leave
    it out. The extra rows' and the eviction's costs come from beside the same passes alone, less the attention
    op's own difference. Without probes (the torch path), a layer costs what the tiny probe's did
    (``cached_layer_s``)."""
    if not probes:
        progress.line(f"overheads (torch path): {pass_s * 1e3:.3f} ms per pass + {cached_layer_s * 1e6:.1f} µs per "
                      "layer")
        return _Overheads(pass_s, cached_layer_s, 0.0, 0.0, 0.0, 0.0)
    rows, ctx = s.rows, s.probe_context
    decoding = ctx + s.probe_steps * s.probe_rounds / 2  # mean entries of a decode step over the full cache

    def attend(p: _Probe, path: str, entries: float, n_rows: int = 1) -> float:
        """Seconds of one layer's attention op beyond its fixed cost, at the measured rates."""
        rate, reads = attention.get(path), head_reads.get(path)
        if not rate:
            return 0.0
        per_entry = 4.0 * p.shape[2] * p.shape[4] / rate + (p.shape[3] * p.shape[4] / reads if reads else 0.0)
        return per_entry * entries * n_rows

    layer_rate, head_rate = native[s.probe_type]["bytes_per_s"], native["Q8_0"]["bytes_per_s"]

    def around(p: _Probe) -> tuple[float, float]:  # (the pass's streaming at the rates, other work) per layer
        streaming = (p.layers * p.layer_bytes / layer_rate + p.head_bytes / head_rate) / p.layers
        step = p.times["stream_1"] + p.times["around"]
        other = (step - pass_s - p.vocab * per_vocab) / p.layers - streaming - attend(p, "single", decoding)
        return streaming, other

    points = sorted(around(p) for p in probes)
    (x0, y0), (x1, y1) = points[0], points[-1]
    fraction = max(0.0, _slope(x0, y0, x1, y1)) if x1 > x0 else 0.0
    per_layer = y0 - fraction * x0
    if per_layer < 0:  # noise tilted the line: through the origin and the wide probe instead
        per_layer, fraction = 0.0, max(0.0, y1 / x1)

    def per_row(p: _Probe) -> float:
        extra = p.times["extra_rows"] / p.layers
        return (extra - attend(p, "multi", ctx, rows) + attend(p, "single", ctx)) / (rows - 1)

    def evicting(p: _Probe) -> float:
        return p.times["evicting"] / p.layers - attend(p, "evicting", ctx) + attend(p, "single", decoding)

    per_row_layer = max(0.0, statistics.mean(per_row(p) for p in probes))
    evict_layer = max(0.0, statistics.mean(evicting(p) for p in probes))

    def evicting_rows(p: _Probe) -> float:
        extra = p.times["evicting_rows"] / p.layers - evict_layer
        return (extra - attend(p, "evicting", ctx, rows) + attend(p, "multi", ctx, rows)) / (rows - 1)

    evict_row_layer = max(0.0, statistics.mean(evicting_rows(p) for p in probes))
    progress.line(
        f"overheads: {pass_s * 1e3:.3f} ms per pass + {per_layer * 1e6:.1f} µs per layer + {fraction:.3f} of the "
        f"weights' streaming time; +{per_row_layer * 1e6:.1f} µs per layer and extra row; when evicting "
        f"+{evict_layer * 1e6:.1f} µs per layer and +{evict_row_layer * 1e6:.1f} µs per layer and extra row"
    )
    return _Overheads(pass_s, per_layer, fraction, per_row_layer, evict_layer, evict_row_layer)


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
    lo, hi = cal.raw["tiny_probe"]["layers"]
    h, i, heads, kv_heads, hd = cal.raw["tiny_probe"]["shape"]
    native = bool(cal.native_stream)
    tiny = (f"a tiny random model with {'native Q8_0' if native else 'bf16 (torch path: no native kernels)'} "
            f"weights (hidden {h}, MLP {i}, {heads} query / {kv_heads} KV heads of {hd}) with {lo} and {hi} layers, "
            f"its weights in the caches, run through the engine's decode loop (median step of "
            f"{settings.probe_steps}, median of {settings.probe_rounds} rounds)")
    probes = "; ".join(f"{p['layers']} layers of hidden {p['shape'][0]}, MLP {p['shape'][1]}, {p['shape'][2]} "
                       f"query / {p['shape'][3]} KV heads of {p['shape'][4]}" for p in cal.raw.get("probes", []))
    streaming = (f"two random models with native {settings.probe_type} weights streaming from memory ({probes}) run "
                 f"through the engine's decode loop and passes (median step of {settings.probe_steps}, median of "
                 f"{settings.probe_rounds} rounds), each beside a pass over its projections alone")
    isa = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "avx2", "fma", "asimd", "sve")
           if f in cal.flags]
    sources = {
        "memory_bytes": f"{read}: sysconf SC_PHYS_PAGES × SC_PAGE_SIZE.",
        "dram_bandwidth": f"{stamp}: fp32 sum over buffers of {_sizes(cal.dram_sizes)} (the largest sizes), "
                          "median of the best trial per size"
                          + (f" ({cal.dram_bandwidth / 1e9:.1f} GB/s), raised to the decode streaming rate, which "
                             "was higher" if dram > cal.dram_bandwidth else "") + ".",
        "dram_efficiency": f"{stamp}: one-row bf16 F.linear (torch, the dense weight format) over "
                           f"{cal.stream_bytes / MIB:.0f} MiB of layer-shaped weights streams "
                           f"{cal.stream_bandwidth / 1e9:.1f} GB/s; over the DRAM figure {dram / 1e9:.1f} GB/s that "
                           f"is {efficiency:.3f}. The native format streams at native_stream's rates instead.",
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
        "overhead_s": f"{stamp}: intercept over layers of the decode-step time of {tiny}, less its head's "
                      "streaming and its sampling cost.",
        "per_layer_overhead_s": (f"{stamp}: per layer, the decode step less its weights' streaming time at "
                                 f"native_stream's rates, the pass's fixed cost and the attention op's time over its "
                                 f"entries at attention_flops, for "
                                 f"{streaming}: the part that does not grow with the layer's streaming time (a line "
                                 "through the narrow and the wide model)." if native else
                                 f"{stamp}: slope per layer of the decode-step time of {tiny}, less its weights' "
                                 "streaming time."),
        "stream_overhead_fraction": (f"{stamp}: the same line's slope against the layer's streaming time." if native
                                     else f"{read}: not measured on the torch path (no native kernels)."),
        "per_row_layer_overhead_s": f"{stamp}: ({settings.rows}-row pass − 1-row pass), less the same difference of "
                                    "the projections alone and of the attention op at attention_flops, per layer "
                                    f"and extra row, mean over {streaming}."
                                    if native else f"{read}: not measured on the torch path.",
        "evict_layer_overhead_s": f"{stamp}: (decode step over a full hybrid cache of {settings.probe_context} − "
                                  f"over the full cache of about as many entries) per layer, less the attention "
                                  f"op's difference at attention_flops, mean over {streaming}."
                                  if native else f"{read}: not measured on the torch path.",
        "evict_row_layer_overhead_s": f"{stamp}: ({settings.rows}-row pass over the full hybrid cache − over the "
                                      "full cache) per layer, less evict_layer_overhead_s, per extra row, for the same "
                                      "models." if native else f"{read}: not measured on the torch path.",
        "threads": f"{read}: the torch threads it measured with (--threads); the engine decodes with as many.",
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
    for key in cal.attention_flops:
        path, _, kv_dtype = key.partition(":")
        timed = (f"{stamp}: one layer of KVArena.attend ({heads} and {ATTENTION_NARROW_SHAPE[0]} query heads, "
                 f"{kv_heads} KV heads of {hd}; {kv_dtype or 'bfloat16'} keys and values), {paths[path]}, at "
                 f"{settings.attention_entries[0]} and {settings.attention_entries[1]} entries, "
                 f"{settings.flush_bytes // MIB} MiB read before each call: per entry and row the extra time is "
                 "4·H·d / attention_flops + n_kv·d / attention_head_reads, solved from the two shapes")
        sources[f"attention_flops.{key}"] = timed + "."
        if key in cal.attention_head_reads:
            sources[f"attention_head_reads.{key}"] = timed + "."
        else:
            sources[f"attention_flops.{key}"] = timed + " (they did not separate: the first shape's 4·H·d alone)."
    for kind, curve in cal.native_stream.items():
        sources[f"native_stream.{kind}"] = (
            f"{stamp}: the native kernels' one-row matmul over random {kind} blocks of layers shaped "
            f"{list(settings.stream_shapes)} ([out, in]), {curve['working_set_bytes'] / MIB:.0f} MiB in all (median "
            f"trial; the file's bytes over the time); extra_row_bytes_per_s: the same bytes over the extra time per "
            f"extra row of {settings.rows}-row passes (median of one-row and {settings.rows}-row passes in turn)."
        )
    caches = {}
    for key, label in (("cpu_l1d_per_core", "L1d per core"), ("cpu_l2_per_core", "L2 per core"), ("cpu_l3", "L3")):
        if key in cal.caches:
            caches[key] = cal.caches[key]
            sources[f"caches.{key}"] = f"{read} from {cal.cache_source}: {label}."
    vm = " under a hypervisor" if cal.hypervisor else ""
    return DeviceProfile(
        name=name,
        description=f"This machine: {cal.cores} × {cal.cpu}{vm}, decoding with sparsespec's "
                    f"{'native kernels' if native else 'torch path'} on the CPU at {cal.threads} threads",
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
        stream_overhead_fraction=cal.stream_overhead_fraction,
        threads=cal.threads,
        extra_row_flops=cal.extra_row_flops,
        per_row_layer_overhead_s=cal.per_row_layer_overhead_s,
        evict_layer_overhead_s=cal.evict_layer_overhead_s,
        evict_row_layer_overhead_s=cal.evict_row_layer_overhead_s,
        per_vocab_overhead_s=cal.per_vocab_overhead_s,
        attention_flops=dict(cal.attention_flops),
        attention_head_reads=dict(cal.attention_head_reads),
        native_stream={kind: {k: entry[k] for k in ("bytes_per_s", "extra_row_bytes_per_s")}
                       for kind, entry in cal.native_stream.items()},
        caches=caches,
        sources=sources,
        note=f"Measured by sparsespec calibrate on {cal.date} in {cal.seconds:.0f} s at {cal.threads} threads "
             f"(load average {cal.loadavg_before:.2f} before, {cal.loadavg_after:.2f} after). The overheads, "
             "native streaming, extra-row, sampling and attention figures describe sparsespec's own engine (native "
             "kernels, bfloat16 compute), not the chip alone; the torch weight formats are priced with the same "
             "overheads, which they do not have. Read bandwidth by buffer size (bytes: GB/s): "
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
                        help="fewer sizes, block types and trials (about a minute; noisier)")
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
        "torch extra rows "
        + (f"{cal.extra_row_flops / 1e9:.0f} GFLOP/s" if cal.extra_row_flops else "free"),
        "  native streaming (GB/s; each extra row): " + ", ".join(
            f"{kind} {curve['bytes_per_s'] / 1e9:.1f}"
            + (f" ({curve['extra_row_bytes_per_s'] / 1e9:.0f})" if curve["extra_row_bytes_per_s"] else "")
            for kind, curve in cal.native_stream.items()),
        f"  overheads: {cal.overhead_s * 1e3:.3f} ms per pass, {cal.per_layer_overhead_s * 1e6:.1f} µs per layer "
        f"+ {cal.stream_overhead_fraction:.3f} of the weights' streaming time, "
        f"{cal.per_row_layer_overhead_s * 1e6:.1f} µs per layer and extra row, "
        f"{cal.evict_layer_overhead_s * 1e6:.1f} + {cal.evict_row_layer_overhead_s * 1e6:.1f} µs per layer and "
        "evicting pass + extra row, "
        f"{cal.per_vocab_overhead_s * 1e9:.2f} ns per vocabulary entry",
        "  attention: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in cal.attention_flops.items()),
        "  attention per KV head: " + ", ".join(f"{k} {v / 1e9:.2f} G channels/s"
                                                 for k, v in cal.attention_head_reads.items()),
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

