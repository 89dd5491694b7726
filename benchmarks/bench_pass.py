"""A forward pass's fixed cost: a pass of M rows against its projections alone, and a draft's against its target's.

A forward pass's fixed cost: each model's pass of ``--rows`` rows (one native call for every layer) against its
projections alone, and a draft's cost against its target's.

Per model (default configuration: native weights, bfloat16, ``--activations auto``, full cache; ``name:N`` cuts the
head to the first N ids, as ``--draft-vocab N`` does): a 64-token context is read, then ``--steps`` passes of
``--rows`` rows over it are timed (each rolled back, so every pass sees the same cache); then the projections alone, every layer's q/k/v, output, gate/up and down and the head called
once on ``--rows`` random rows in the native kernels, less the fixed cost of a call (a 16-column cut of a projection
called alone). ``--rounds`` rounds, the models alternated within each; medians with their spread.

    python benchmarks/bench_pass.py --models smollm2-135m,qwen2.5-coder-0.5b:32768,qwen2.5-coder-1.5b,gemma3-270m
    python benchmarks/bench_pass.py --models qwen2.5-coder-1.5b --rows 1,5,16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from common import emit, load_settled, machine, median, results_dir


def pass_seconds(loaded, arena, rows: int, steps: int) -> float:
    """Median seconds of one pass of ``rows`` random rows over ``arena`` (rolled back after each)."""
    from sparsespec.model import Block

    model = loaded.model
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, model.vocab_limit, (rows,), generator=g)
        started = time.perf_counter()
        model.forward_blocks([Block(tokens, arena)])
        times.append(time.perf_counter() - started)
        arena.rollback()
    return median(times)


def projections_seconds(model, rows: int, repeats: int = 5) -> float:
    """Median seconds of every projection and the head on ``rows`` random rows, less each call's fixed cost."""
    linears = [linear for _, linear in model.linear_items()]
    x = {linear.in_features: torch.randn(rows, linear.in_features).bfloat16() for linear in linears}
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for linear in linears:
            linear(x[linear.in_features])
        times.append(time.perf_counter() - started)
    narrow = model.layers[0].o_proj.first_rows(16)
    small = torch.randn(rows, narrow.in_features).bfloat16()
    for _ in range(50):
        narrow(small)
    started = time.perf_counter()
    for _ in range(500):
        narrow(small)
    per_call = (time.perf_counter() - started) / 500
    return median(times) - per_call * len(linears)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b:32768,qwen2.5-coder-1.5b,gemma3-270m")
    parser.add_argument("--rows", default="1", help="rows per pass, comma-separated")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "pass.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from sparsespec.engine import CacheOptions, make_arena

    models = {}
    for entry in args.models.split(","):
        name, _, vocab = entry.partition(":")
        loaded = load_settled(name, torch.bfloat16, "auto")
        if vocab:
            loaded.model.limit_vocabulary(int(vocab))
        arena = make_arena(loaded, CacheOptions(), max_tokens=512, max_inflight=32)
        loaded.model.forward(torch.arange(64) % loaded.model.vocab_limit, arena)
        arena.commit(64)
        models[entry] = (loaded, arena)
    rows_list = [int(r) for r in args.rows.split(",")]
    samples: dict[tuple[str, int], dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for entry, (loaded, arena) in models.items():
            for rows in rows_list:
                s = samples.setdefault((entry, rows), {"native": [], "projections": []})
                s["native"].append(pass_seconds(loaded, arena, rows, args.steps))
                s["projections"].append(projections_seconds(loaded.model, rows))
    facts = machine()
    for (entry, rows), s in samples.items():
        native, projections = (median(s[k]) for k in ("native", "projections"))
        ratios = [n / p for n, p in zip(s["native"], s["projections"])]
        emit({"bench": "pass", "model": entry, "rows": rows, "native_ms": round(native * 1e3, 3),
              "projections_ms": round(projections * 1e3, 3),
              "native_over_projections": round(native / projections, 3),
              "native_over_projections_range": [round(min(ratios), 3), round(max(ratios), 3)],
              "rounds": args.rounds,
              "steps": args.steps, "threads": args.threads, **facts}, args.out)
    targets = [e for e in models if e.startswith("qwen2.5-coder-1.5b")]
    drafts = [e for e in models if e.startswith("qwen2.5-coder-0.5b")]
    if targets and drafts:
        for rows in rows_list:
            t, d = samples[(targets[0], rows)]["native"], samples[(drafts[0], 1)]["native"]
            per_round = [dd / tt for dd, tt in zip(d, t)]
            emit({"bench": "pass", "draft_cost_ratio": round(median(per_round), 3),
                  "range": [round(min(per_round), 3), round(max(per_round), 3)], "draft": drafts[0],
                  "target": targets[0], "target_rows": rows, **facts}, args.out)


if __name__ == "__main__":
    main()
