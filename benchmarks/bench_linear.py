"""Weight formats on decode-sized inputs: bf16 dense (float rows), int8 (Q8_0) and int4 (Q4_1), by activations.

Prints one JSON object whose ``formats`` list gives, for each weight shape (``[out, in]``), format, what the
activations are (``int8``: quantized per block in the kernel; ``float``: as they are; dense rows always take them as
they are) and row count: median time per call, effective weight bandwidth (``nbytes / time``) and the time relative
to a 1-row call.

Each call uses the next of several identical copies of the layer, enough that together they are many times the
last-level cache, so weights are streamed from memory as in decoding a real model.

    python benchmarks/bench_linear.py --calls 40
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

from sparsespec import kernels
from sparsespec.linear import make_linear

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


def bench_formats(calls: int, pool_bytes: int) -> list[dict]:
    results = []
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f) * 0.02
        for fmt, activations in (("dense", "float"), ("int8", "int8"), ("int8", "float"), ("int4", "int8"),
                                 ("int4", "float")):
            lin = make_linear(w, None, torch.bfloat16, fmt)
            lin.float_activations = activations == "float"
            pool = _pool(lin, pool_bytes)
            base = None
            for rows in ROWS:
                x = torch.randn(rows, in_f).to(torch.bfloat16)
                ms, best = _times_ms(pool, x, calls)
                base = ms if rows == 1 else base
                results.append({
                    "shape": [out_f, in_f],
                    "format": fmt if fmt != "dense" else "bf16",
                    "activations": activations,
                    "rows": rows,
                    "nbytes": lin.nbytes,
                    "median_ms": round(ms, 4),
                    "min_ms": round(best, 4),
                    "GB_per_s": round(lin.nbytes / (ms * 1e-3) / 1e9, 2),
                    "ratio_vs_rows1": round(ms / base, 2),
                })
            del pool
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="timed calls per measurement (>= 20)")
    parser.add_argument("--pool-mb", type=int, default=256, help="total bytes of layer copies cycled through")
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    pool_bytes = args.pool_mb * 2**20
    report = {
        "threads": 2,
        "kernels": kernels.isa_name(),
        "calls": args.calls,
        "pool_mb": args.pool_mb,
        "loadavg_1min_start": os.getloadavg()[0],
        "formats": bench_formats(args.calls, pool_bytes),
    }
    # other processes competing for the 2 cores show up as a raised load average and medians far
    # above the minima
    report["loadavg_1min_end"] = os.getloadavg()[0]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
