"""How much a calibration measures (:class:`CalibrationSettings`: :data:`FULL`, :data:`QUICK`), and the shapes and
sizes its probes use."""

from __future__ import annotations

from dataclasses import dataclass

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
        # The probes' weights and heads are priced at these types' measured rates (fits.fit_overheads).
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

