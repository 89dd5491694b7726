"""Weight-format benchmark: bf16 dense (native float rows) vs int8 vs int4 linears on decode-sized inputs.

Prints one JSON object:

* ``formats``: for each weight shape (``[out, in]``), format and row count: median time per call,
  effective weight bandwidth (``nbytes / time``) and the time relative to a 1-row call.
* ``int4_group_size``: the int4 group-size trade-off: relative RMS weight error on Gaussian and on
  heavier-tailed (Student-t, 4 dof) weights, bytes, and 1-row / 5-row call times.
* ``float32_1row``: 1-row call times with float32 activations (the weight-only kernels have no
  vectorised float32 path) and with float32 models that run the kernel in bfloat16.

Each call uses the next of several identical copies of the layer, enough that together they are many
times the last-level cache, so weights are streamed from memory as in decoding a real model.

Usage: ``PYTHONPATH=src python3 benchmarks/bench_linear.py [--calls N] [--pool-mb MB]``
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import time

import torch

from sparsespec.linear import INT4_GROUP_SIZES, Int4Linear, make_linear

SHAPES = [(8960, 1536), (1536, 8960)]
ROWS = [1, 2, 3, 4, 5, 8]


def _clone_layer(lin):
    """An independent copy of a linear (same values, separate tensor storage; a native linear's blocks too)."""
    dup = copy.copy(lin)
    for name, value in vars(lin).items():
        if isinstance(value, torch.Tensor):
            setattr(dup, name, value.clone())
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            setattr(dup, name, [t.clone() for t in value])
    return dup


def _pool(lin, pool_bytes: int) -> list:
    count = max(2, math.ceil(pool_bytes / lin.nbytes))
    return [lin] + [_clone_layer(lin) for _ in range(count - 1)]


def _times_ms(pool: list, x: torch.Tensor, calls: int) -> tuple[float, float]:
    """(median, minimum) milliseconds per call, cycling through ``pool``."""
    for i in range(len(pool)):  # warm-up: one pass over the pool
        pool[i](x)
    times = []
    for i in range(calls):
        lin = pool[i % len(pool)]
        t0 = time.perf_counter()
        lin(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def _median_ms(pool: list, x: torch.Tensor, calls: int) -> float:
    return _times_ms(pool, x, calls)[0]


def bench_formats(calls: int, pool_bytes: int) -> list[dict]:
    results = []
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f) * 0.02
        for fmt in ("dense", "int8", "int4"):
            lin = make_linear(w, None, torch.bfloat16, fmt)
            pool = _pool(lin, pool_bytes)
            base = None
            for rows in ROWS:
                x = torch.randn(rows, in_f).to(torch.bfloat16)
                ms, best = _times_ms(pool, x, calls)
                base = ms if rows == 1 else base
                results.append({
                    "shape": [out_f, in_f],
                    "format": fmt if fmt != "dense" else "bf16",
                    "rows": rows,
                    "nbytes": lin.nbytes,
                    "median_ms": round(ms, 4),
                    "min_ms": round(best, 4),
                    "GB_per_s": round(lin.nbytes / (ms * 1e-3) / 1e9, 2),
                    "ratio_vs_rows1": round(ms / base, 2),
                })
            del pool
    return results


def bench_group_sizes(calls: int, pool_bytes: int) -> list[dict]:
    results = []
    gen = torch.Generator().manual_seed(0)
    for out_f, in_f in SHAPES:
        gauss = torch.randn(out_f, in_f, generator=gen) * 0.02
        heavy = torch.distributions.StudentT(4.0).sample((out_f, in_f)) * 0.02
        for g in INT4_GROUP_SIZES:
            lin = Int4Linear(gauss, None, torch.bfloat16, group_size=g)
            err_g = ((lin.dequantized_weight() - gauss).norm() / gauss.norm()).item()
            lin_h = Int4Linear(heavy, None, torch.bfloat16, group_size=g)
            err_h = ((lin_h.dequantized_weight() - heavy).norm() / heavy.norm()).item()
            del lin_h
            pool = _pool(lin, pool_bytes)
            entry = {
                "shape": [out_f, in_f],
                "group_size": lin.group_size,
                "nbytes": lin.nbytes,
                "rel_rms_err_gauss": round(err_g, 4),
                "rel_rms_err_student_t4": round(err_h, 4),
            }
            for rows in (1, 5):
                x = torch.randn(rows, in_f).to(torch.bfloat16)
                entry[f"median_ms_rows{rows}"] = round(_median_ms(pool, x, calls), 4)
            results.append(entry)
            del pool
    return results


def bench_float32(calls: int, pool_bytes: int) -> list[dict]:
    results = []
    out_f, in_f = SHAPES[0]
    w = torch.randn(out_f, in_f) * 0.02
    x = torch.randn(1, in_f)
    configs = [
        ("fp32 dense", "dense", {}),
        ("int8, fp32 kernel", "int8", {}),
        ("int4, fp32 kernel", "int4", {}),
        ("int8, bf16 kernel", "int8", {"kernel_dtype": torch.bfloat16}),
        ("int4, bf16 kernel", "int4", {"kernel_dtype": torch.bfloat16}),
    ]
    for label, fmt, options in configs:
        lin = make_linear(w, None, torch.float32, fmt, **options)
        pool = _pool(lin, pool_bytes)
        ms = _median_ms(pool, x, calls)
        results.append({"shape": [out_f, in_f], "config": label, "rows": 1, "nbytes": lin.nbytes,
                        "median_ms": round(ms, 4)})
        del pool
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="timed calls per measurement (>= 20)")
    parser.add_argument("--pool-mb", type=int, default=256, help="total bytes of layer copies cycled through")
    parser.add_argument("--skip-group-sizes", action="store_true")
    parser.add_argument("--skip-float32", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    pool_bytes = args.pool_mb * 2**20
    report = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "calls": args.calls,
        "pool_mb": args.pool_mb,
        "loadavg_1min_start": os.getloadavg()[0],
        "formats": bench_formats(args.calls, pool_bytes),
    }
    if not args.skip_group_sizes:
        report["int4_group_size"] = bench_group_sizes(args.calls, pool_bytes)
    if not args.skip_float32:
        report["float32_1row"] = bench_float32(max(20, args.calls // 2), pool_bytes)
    # other processes competing for the 2 cores show up as a raised load average and medians far
    # above the minima
    report["loadavg_1min_end"] = os.getloadavg()[0]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
