"""A model's native weight matmuls by kind, streamed from memory as in a decode step.

Loads a fixture with its GGUF's own blocks (``--weights native``; ``--vocab N`` cuts the head to the first N ids,
as ``--draft-vocab`` does), then times each kind of linear (q/k/v, output projection, gate/up, down, head) called
once in every layer in turn on ``--rows`` random rows, so that the weights come from memory as in a pass. Prints one
JSON line per kind: block types, MB read, milliseconds per pass (median of ``--runs``), effective GB/s and
microseconds per call; then one line with the fixed cost of a call on a 16-column cut of the first output
projection (cached, so nearly no bytes).

    python benchmarks/bench_model_linears.py --model qwen2.5-coder-0.5b --vocab 32768
    python benchmarks/bench_model_linears.py --model qwen2.5-coder-1.5b --rows 5
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from common import emit, load_settled, machine, median, results_dir



def pass_seconds(linears: list, rows: int) -> float:
    """Seconds to call every linear once on ``rows`` random rows."""
    x = torch.randn(rows, linears[0].in_features).bfloat16()
    started = time.perf_counter()
    for linear in linears:
        linear(x)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--vocab", type=int, default=0, help="the head over the first N token ids (0: all)")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "model_linears.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_settled(args.model, torch.bfloat16, "native").model
    if args.vocab:
        model.limit_vocabulary(args.vocab)
    layers = model.layers
    kinds = {"qkv": [layer.qkv for layer in layers], "o_proj": [layer.o_proj for layer in layers],
             "gate_up": [layer.gate_up for layer in layers], "down": [layer.down for layer in layers],
             "head": [model.lm_head]}
    seconds = {kind: [] for kind in kinds}
    for _ in range(args.runs):  # kinds interleaved, so drift on the host spreads over all of them
        for kind, linears in kinds.items():
            seconds[kind].append(pass_seconds(linears, args.rows))
    facts = machine()
    for kind, linears in kinds.items():
        s = median(seconds[kind])
        nbytes = sum(linear.nbytes for linear in linears)
        emit({"bench": "model_linears", "model": args.model, "vocab": args.vocab or None, "rows": args.rows,
              "kind": kind, "types": linears[0].types, "mb": round(nbytes / 1e6, 1), "ms": round(s * 1e3, 3),
              "gb_s": round(nbytes / s / 1e9, 1), "us_per_call": round(s / len(linears) * 1e6, 1), **facts}, args.out)
    narrow = layers[0].o_proj.first_rows(16)
    x = torch.randn(args.rows, narrow.in_features).bfloat16()
    for _ in range(100):
        narrow(x)
    calls = 2000
    started = time.perf_counter()
    for _ in range(calls):
        narrow(x)
    emit({"bench": "model_linears", "model": args.model, "rows": args.rows, "kind": "16-column call",
          "us_per_call": round((time.perf_counter() - started) / calls * 1e6, 2), **facts}, args.out)


if __name__ == "__main__":
    main()
