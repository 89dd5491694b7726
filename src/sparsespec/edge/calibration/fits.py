"""What a calibration derives from its timings (:mod:`.probes`): the read-bandwidth plateaus, the attention op's
rates from its two shapes, and the engine's own costs from the probe models' steps. Pure arithmetic: nothing here
times anything."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from .settings import ATTENTION_NARROW_SHAPE, ATTENTION_SHAPE, CalibrationSettings


def slope(x0: float, y0: float, x1: float, y1: float) -> float:
    """The slope of the line through ``(x0, y0)`` and ``(x1, y1)``."""
    return (y1 - y0) / (x1 - x0)


def plateau(curve: list[dict[str, float]], low: float, high: float) -> tuple[float | None, list[int]]:
    """The median rate of the read-bandwidth ``curve``'s points (``{"bytes", "bytes_per_s"}``) whose size is in
    ``[low, high]``, and those sizes; ``(None, [])`` where no point is."""
    picked = [p for p in curve if low <= p["bytes"] <= high]
    if not picked:
        return None, []
    return statistics.median(p["bytes_per_s"] for p in picked), [int(p["bytes"]) for p in picked]


def fit_attention_rates(wide: tuple[float, float], narrow: tuple[float, float], entries: tuple[int, int],
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


@dataclass(frozen=True)
class ProbeTimes:
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


@dataclass(frozen=True)
class Overheads:
    """The engine's own costs in seconds, as the profile's ``overhead_s``, ``per_layer_overhead_s``,
    ``stream_overhead_fraction`` (a fraction of the layer's streaming time, not seconds),
    ``per_row_layer_overhead_s``, ``evict_layer_overhead_s`` and ``evict_row_layer_overhead_s``."""

    overhead_s: float
    per_layer_s: float
    stream_fraction: float
    per_row_layer_s: float
    evict_layer_s: float
    evict_row_layer_s: float


def fit_overheads(s: CalibrationSettings, probes: list[ProbeTimes], pass_s: float, native: dict[str, dict[str, Any]],
                  per_vocab: float, attention: dict[str, float], head_reads: dict[str, float]) -> Overheads:
    """The engine's own costs from the streaming probes: each step less its weights' streaming time at the
    ``native`` rates (the time the simulator gives them), the pass's fixed cost ``pass_s``, its sampling at
    ``per_vocab`` seconds per vocabulary entry and the attention op's time over its entries at the measured
    ``attention`` and ``head_reads`` rates, per layer: a fixed part and a part in proportion to the pass's streaming
    time (the layer's other work runs in caches its weights just went through), a line through the narrow and the
    wide probe. What a narrow layer's small calls cost beyond their bytes at the rates (measured over large calls)
    lands in that line, where the simulator adds it; a line through the projections' own measured time would leave
    it out. The extra rows' and the eviction's costs come from beside the same passes alone, less the attention
    op's own difference."""
    rows, ctx = s.rows, s.probe_context
    decoding = ctx + s.probe_steps * s.probe_rounds / 2  # mean entries of a decode step over the full cache

    def attend(p: ProbeTimes, path: str, entries: float, n_rows: int = 1) -> float:
        """Seconds of one layer's attention op beyond its fixed cost, at the measured rates."""
        rate, reads = attention.get(path), head_reads.get(path)
        if not rate:
            return 0.0
        per_entry = 4.0 * p.shape[2] * p.shape[4] / rate + (p.shape[3] * p.shape[4] / reads if reads else 0.0)
        return per_entry * entries * n_rows

    layer_rate, head_rate = native[s.probe_type]["bytes_per_s"], native["Q8_0"]["bytes_per_s"]

    def around(p: ProbeTimes) -> tuple[float, float]:  # (the pass's streaming at the rates, other work) per layer
        streaming = (p.layers * p.layer_bytes / layer_rate + p.head_bytes / head_rate) / p.layers
        step = p.times["stream_1"] + p.times["around"]
        other = (step - pass_s - p.vocab * per_vocab) / p.layers - streaming - attend(p, "single", decoding)
        return streaming, other

    points = sorted(around(p) for p in probes)
    (x0, y0), (x1, y1) = points[0], points[-1]
    fraction = max(0.0, slope(x0, y0, x1, y1)) if x1 > x0 else 0.0
    per_layer = y0 - fraction * x0
    if per_layer < 0:  # noise tilted the line: through the origin and the wide probe instead
        per_layer, fraction = 0.0, max(0.0, y1 / x1)

    def per_row(p: ProbeTimes) -> float:
        extra = p.times["extra_rows"] / p.layers
        return (extra - attend(p, "multi", ctx, rows) + attend(p, "single", ctx)) / (rows - 1)

    def evicting(p: ProbeTimes) -> float:
        return p.times["evicting"] / p.layers - attend(p, "evicting", ctx) + attend(p, "single", decoding)

    per_row_layer = max(0.0, statistics.mean(per_row(p) for p in probes))
    evict_layer = max(0.0, statistics.mean(evicting(p) for p in probes))

    def evicting_rows(p: ProbeTimes) -> float:
        extra = p.times["evicting_rows"] / p.layers - evict_layer
        return (extra - attend(p, "evicting", ctx, rows) + attend(p, "multi", ctx, rows)) / (rows - 1)

    evict_row_layer = max(0.0, statistics.mean(evicting_rows(p) for p in probes))
    return Overheads(pass_s, per_layer, fraction, per_row_layer, evict_layer, evict_row_layer)

