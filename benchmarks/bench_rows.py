"""One whole forward pass against its number of rows (a verification block), sparsespec and llama.cpp in one run.

Cost of one whole forward pass against the number of rows it carries (a verification block of M rows), in the
same run for sparsespec (native weights) and llama.cpp, on the same GGUF file and thread count.

For each M in ``--rows``: the model has read a ``--context``-token prefix; one pass feeds M more tokens and is
timed (median of ``--runs``); the cache is put back to the prefix between passes (sparsespec: ``rollback``;
llama.cpp: ``n_tokens`` reset, so its KV cache is overwritten). Reported: milliseconds per pass and the ratio to a
one-row pass, per engine. One JSON line per (engine, M) and a summary line (stdout and ``--out``).

    python benchmarks/bench_rows.py --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from common import emit, fixture_path, load_settled, machine, median, results_dir

from sparsespec.cache.arena import KVArena
from sparsespec.cache.policy import make_policy


def sparsespec_pass_ms(loaded, prefix: list[int], rows: list[int], runs: int) -> float:
    model = loaded.model
    arena = KVArena(loaded.config, make_policy("full"), dtype=model.dtype, max_tokens=len(prefix) + 32,
                    max_block=len(prefix), max_inflight=17)
    model.forward(torch.tensor(prefix), arena, per_block=True, last_only=True)
    arena.commit(len(prefix))
    block = torch.tensor(rows)
    times = []
    for _ in range(runs + 1):
        started = time.perf_counter()
        model.forward(block, arena)
        times.append(time.perf_counter() - started)
        arena.rollback()
    return 1000 * median(times[1:])


def llama_pass_ms(llm, prefix: list[int], rows: list[int], runs: int) -> float:
    llm.reset()
    llm.eval(prefix)
    times = []
    for _ in range(runs + 1):
        llm.n_tokens = len(prefix)
        started = time.perf_counter()
        llm.eval(rows)
        times.append(time.perf_counter() - started)
    return 1000 * median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,10,12,16")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "rows.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_settled(args.model, torch.bfloat16, "native")
    vocab = loaded.config.vocab_size
    prefix = [(7919 * i + 13) % vocab for i in range(args.context)]
    counts = [int(m) for m in args.rows.split(",")]
    engines = {"sparsespec": lambda rows: sparsespec_pass_ms(loaded, prefix, rows, args.runs)}
    if not args.skip_llamacpp:
        from bench_llamacpp import open_llama

        llm = open_llama(fixture_path(args.model), args.threads, n_ctx=args.context + 64)
        engines["llama.cpp"] = lambda rows: llama_pass_ms(llm, prefix, rows, args.runs)
    summary = {"bench": "rows_summary", "model": args.model, "weights": loaded.weights, "context": args.context}
    for engine, measure in engines.items():
        base = None
        table = {}
        for m in counts:
            rows = [(104729 * (i + 1)) % vocab for i in range(m)]
            ms = measure(rows)
            base = base if base is not None else ms
            table[m] = round(ms / base, 3)
            emit({"bench": "rows", "engine": engine, "model": args.model, "rows": m, "ms": round(ms, 2),
                  "vs_one_row": table[m]}, args.out)
        summary[engine] = table
    emit({**summary, **machine()}, args.out)


if __name__ == "__main__":
    main()
