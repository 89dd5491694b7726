"""Where a decode step's time goes: the native matmuls, and the rest (norms, attention, adds, Python) per layer.

Loads each model (native weights, bfloat16, ``--activations``), decodes greedily after an 8-token prompt with a
full cache and times ``--steps`` steps, with every call of ``kernels.gguf_linear`` (the projections and the head)
timed as it runs. The rest of a step, divided by the model's layers, is what a layer costs around its weights:
with cold caches, as the weights have just streamed through them. Median of ``--runs`` runs per round.

``--baseline-src DIR`` also runs another checkout's ``src`` (a ``git worktree`` of an older commit) in the same
rounds, the two taking turns, as the before of a before/after. Prints one JSON line per model, round and source.

    python benchmarks/bench_step_glue.py --models smollm2-135m,qwen2.5-coder-1.5b --rounds 5 --baseline-src /tmp/base/src
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import emit, machine, median, results_dir


def measure(model: str, activations: str, steps: int, runs: int, threads: int) -> dict:
    """``{step_ms, matmul_ms, rest_ms, rest_us_per_layer}``: medians over ``runs`` runs of ``steps`` steps each."""
    import torch

    from common import load_settled
    from sparsespec import kernels
    from sparsespec.engine import CacheOptions, make_arena
    from sparsespec.generate import generate_tokens
    from sparsespec.sampling import SamplingParams

    torch.set_num_threads(threads)
    inside = [0.0]
    untimed = kernels.gguf_linear

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return untimed(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - started

    kernels.gguf_linear = timed  # the linears call it through the module
    loaded = load_settled(model, torch.bfloat16, "native", activations=activations)
    layers = loaded.config.num_hidden_layers
    records = []
    for _ in range(runs):
        arena = make_arena(loaded, CacheOptions(), max_tokens=steps + 64, max_inflight=1)
        tokens = generate_tokens(loaded.model, arena, list(range(100, 108)), max_new_tokens=steps + 3,
                                 sampling=SamplingParams(temperature=0.0))
        for _ in range(3):  # the first steps warm the caches and the allocator
            next(tokens)
        inside[0] = 0.0
        started = time.perf_counter()
        for _ in range(steps):
            next(tokens)
        step = (time.perf_counter() - started) / steps
        records.append((step, inside[0] / steps))
    step, matmul = (median(list(values)) for values in zip(*records))
    return {"step_ms": round(step * 1e3, 3), "matmul_ms": round(matmul * 1e3, 3),
            "rest_ms": round((step - matmul) * 1e3, 3), "rest_us_per_layer": round((step - matmul) / layers * 1e6, 1),
            "layers": layers, "activations": loaded.activations}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    parser.add_argument("--activations", default="auto", choices=["auto", "int8", "float"])
    parser.add_argument("--steps", type=int, default=0, help="steps timed per run (default: about a second's worth)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline-src", default=None, help="another checkout's src folder, run as 'baseline'")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's model: print its measure
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "step_glue.jsonl")
    args = parser.parse_args()
    steps_for = {"smollm2-135m": 120, "gemma3-270m": 100, "qwen2.5-coder-0.5b": 60}
    if args.one:
        print(json.dumps(measure(args.one, args.activations, args.steps or steps_for.get(args.one, 30), args.runs,
                                 args.threads)))
        return
    sources = {"this": None} | ({"baseline": args.baseline_src} if args.baseline_src else {})
    facts = machine()
    for model in args.models.split(","):
        for round_index in range(args.rounds):
            order = list(sources) if round_index % 2 == 0 else list(reversed(sources))
            for source in order:  # each measure in its own process, so the two builds never share one
                env = dict(os.environ) | ({"PYTHONPATH": sources[source]} if sources[source] else {})
                child = subprocess.run([sys.executable, __file__, "--one", model, "--activations", args.activations,
                                        "--steps", str(args.steps), "--runs", str(args.runs),
                                        "--threads", str(args.threads)],
                                       capture_output=True, text=True, check=True, env=env)
                result = json.loads(child.stdout.strip().splitlines()[-1])
                emit({"bench": "step_glue", "model": model, "round": round_index, "source": source, **result,
                      **facts}, args.out)


if __name__ == "__main__":
    main()
