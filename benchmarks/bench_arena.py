"""Budgeted vs full KV cache: decode tok/s, prefill time and RSS against context length, on real text.

For each model and context length (tokens of corpus text as the prompt), runs the full cache and hybrid caches
of the given budgets, greedy, bfloat16. Beyond the model's trained context the full cache runs with
``force_context`` (speed only: its text is meaningless there) and budgeted caches use in-cache positions.
Prints one JSON line per point with the process's peak RSS during the run (sampled by a thread; prefill
activations included); ``--plot`` draws tok/s, KV bytes and peak RSS against context.

    python benchmarks/bench_arena.py --models smollm2-135m --contexts 1024,4096,8192,16384 --budgets 256,1024
    python benchmarks/bench_arena.py --long-run 100000 --budgets 1024 --weights int4 \
        --plot benchmarks/results/bench_arena/arena_long_run.png   # flat-RSS generation; RSS and tok/s vs tokens
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import psutil
import torch

from common import emit, load_settled, machine, results_dir

from sparsespec.cache.policy import make_policy
from sparsespec.engine import CacheOptions, RunStats, make_arena, run_generation
from sparsespec.eval.sweep import RssMonitor
from sparsespec.generate import generate_tokens
from sparsespec.loading.fetch import corpus_text_path
from sparsespec.sampling import SamplingParams


def corpus_tokens(tokenizer, count: int) -> list[int]:
    ids: list[int] = []
    for name in ("paradise_lost", "hamlet"):
        ids += tokenizer.encode(corpus_text_path(name).read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= count:
            break
    if len(ids) < count:
        raise SystemExit(f"the corpus has only {len(ids)} tokens")
    return ids[:count]


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def cache_for(policy_name: str, budget: int | None, context: int, model_context: int) -> CacheOptions:
    if policy_name == "full":
        return CacheOptions(make_policy("full"), "original", 512, force_context=context > model_context)
    positions = "in-cache" if context > model_context else "original"
    return CacheOptions(make_policy("hybrid", budget), positions, 512)


def context_sweep(args) -> None:
    for name in args.models.split(","):
        loaded = load_settled(name, torch.bfloat16, args.weights)
        text = corpus_tokens(loaded.tokenizer, max(args.contexts))
        configs = [("full", None)] + [("hybrid", b) for b in args.budgets]
        for context in args.contexts:
            for policy_name, budget in configs:
                cache = cache_for(policy_name, budget, context + args.new_tokens, loaded.config.max_position_embeddings)
                stats = RunStats()
                gc.collect()
                before = rss_mb()
                with RssMonitor() as rss:
                    list(run_generation(loaded, text[:context], max_new_tokens=args.new_tokens,
                                        sampling=SamplingParams(), cache=cache, stats=stats))
                peak = rss.peak / 2**20
                emit({"bench": "arena_context", "model": name, "context": context, "policy": policy_name,
                      "budget": budget, "positions": cache.positions, **stats.to_dict(),
                      "rss_mb_before": round(before, 1), "rss_mb_peak": round(peak, 1),
                      "rss_mb_peak_growth": round(peak - before, 1), **machine()}, args.out)


def long_run(args) -> None:
    """Generate ``args.long_run`` tokens with a hybrid budget, sampling RSS as it goes."""
    name = args.models.split(",")[0]
    loaded = load_settled(name, torch.bfloat16, args.weights)
    budget = args.budgets[0]
    cache = CacheOptions(make_policy("hybrid", budget), "in-cache", 512)
    arena = make_arena(loaded, cache, args.long_run + 64, max_inflight=1)
    prompt = corpus_tokens(loaded.tokenizer, 64)
    samples = []
    started = time.perf_counter()
    tokens = generate_tokens(loaded.model, arena, prompt, max_new_tokens=args.long_run,
                             sampling=SamplingParams(temperature=1.0, top_p=0.95),
                             generator=torch.Generator().manual_seed(0))
    with RssMonitor() as rss:
        for i, _ in enumerate(tokens, start=1):
            if i % 1000 == 0:
                samples.append({"tokens": i, "rss_mb": round(rss_mb(), 1), "peak_rss_mb": round(rss.peak / 2**20, 1),
                                "seconds": round(time.perf_counter() - started, 1)})
                print(json.dumps(samples[-1]), flush=True)
    warm = [s["rss_mb"] for s in samples if s["tokens"] >= 2000]
    peak_after_warmup = [s["peak_rss_mb"] for s in samples if s["tokens"] >= 2000]
    emit({"bench": "arena_long_run", "model": name, "weights": args.weights, "budget": budget,
          "tokens": args.long_run, "kv_cache_bytes": arena.nbytes, "rss_mb_min_after_warmup": min(warm),
          "rss_mb_max_after_warmup": max(warm), "peak_rss_mb_at_2k_tokens": peak_after_warmup[0],
          "peak_rss_mb_at_end": round(rss.peak / 2**20, 1),
          "rss_growth_fraction": (max(warm) - min(warm)) / min(warm), "tok_s": args.long_run / samples[-1]["seconds"],
          "samples": samples, **machine()}, args.out)


def plot(path: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest = {}  # the newest record of each point, so a re-run replaces the older one
    for line in path.read_text().splitlines():
        if '"arena_context"' in line:
            r = json.loads(line)
            latest[(r["model"], r["context"], r["policy"], r["budget"])] = r
    rows = list(latest.values())
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for model in sorted({r["model"] for r in rows}):
        for label in sorted({(r["policy"], r["budget"]) for r in rows if r["model"] == model}, key=str):
            pts = sorted((r["context"], r["tokens_per_s"], r["kv_cache_bytes"] / 2**20, r.get("rss_mb_peak"))
                         for r in rows if r["model"] == model and (r["policy"], r["budget"]) == label)
            name = f"{model} {label[0]}" + (f" {label[1]}" if label[1] else "")
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name)
            rss = [(p[0], p[3]) for p in pts if p[3] is not None]
            axes[2].plot([p[0] for p in rss], [p[1] for p in rss], marker="o", label=name)
    axes[0].set(xscale="log", xlabel="context tokens", ylabel="decode tok/s", title="Decode speed vs context")
    axes[1].set(xscale="log", yscale="log", xlabel="context tokens", ylabel="KV cache buffers (MiB)",
                title="KV memory vs context")
    axes[2].set(xscale="log", xlabel="context tokens", ylabel="peak process RSS (MiB)",
                title="Peak RSS during the run (prefill included)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def plot_long_run(path: Path, out_png: Path) -> None:
    """Process RSS and decode speed against tokens generated, from the newest ``arena_long_run`` record."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(line) for line in path.read_text().splitlines() if '"arena_long_run"' in line]
    if not runs:
        raise SystemExit(f"{path} holds no arena_long_run record; run --long-run first.")
    r = runs[-1]
    tokens = [s["tokens"] for s in r["samples"]]
    seconds = [0.0] + [s["seconds"] for s in r["samples"]]
    steps = [0] + tokens
    speed = [(steps[i + 1] - steps[i]) / (seconds[i + 1] - seconds[i]) for i in range(len(tokens))]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].plot(tokens, [s["rss_mb"] for s in r["samples"]], label="RSS at the sample")
    axes[0].plot(tokens, [s["peak_rss_mb"] for s in r["samples"]], linestyle="--", label="peak RSS so far")
    axes[0].set(ylim=(0, None), xlabel="tokens generated", ylabel="process RSS (MiB)",
                title=f"{r['model']} {r['weights']}, hybrid {r['budget']}: memory over {r['tokens']:,} tokens")
    axes[0].legend()
    axes[1].plot(tokens, speed)
    axes[1].set(ylim=(0, None), xlabel="tokens generated", ylabel="tok/s (per 1000 tokens)", title="Decode speed")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm2-135m")
    parser.add_argument("--contexts", default="1024,4096,8192,16384")
    parser.add_argument("--budgets", default="256,1024")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", default="dense", choices=["dense", "int8", "int4"],
                        help="weight format of the projections (default: dense bf16)")
    parser.add_argument("--long-run", type=int, default=0, help="tokens of one long generation (0: context sweep)")
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "arena.jsonl")
    parser.add_argument("--plot", type=Path, default=None,
                        help="draw the context sweep (or, with --long-run, the long run) in --out to this PNG")
    parser.add_argument("--plot-only", action="store_true", help="only redraw --plot from --out")
    args = parser.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.budgets = [int(b) for b in args.budgets.split(",")]
    torch.set_num_threads(args.threads)
    if args.plot_only and not args.plot:
        parser.error("--plot-only needs --plot PNG")
    draw = plot_long_run if args.long_run else plot
    if not args.plot_only:
        (long_run if args.long_run else context_sweep)(args)
    if args.plot:
        draw(args.out, args.plot)


if __name__ == "__main__":
    main()
