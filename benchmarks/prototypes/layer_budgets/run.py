"""Streaming perplexity with per-layer KV budgets (PerLayerArena) at an equal total number of entries.

    python benchmarks/prototypes/layer_budgets/run.py --model smollm2-135m --tokens 2048 --budget 256 --schedule linear:1.5 \
        --kv-dtype int8 --policy hybrid-decay --chunk 64

Prints one JSON line. Every schedule keeps sum(budget_l) == n_layers * budget, so the bytes a real per-layer arena
would hold are the same as the uniform one's (``kv_bytes_entries``: the budgets' entries; ``kv_bytes_with_staging``:
plus ``chunk`` staging slots per layer, what ``sparsespec ppl`` reports as kv_cache_bytes for the uniform arena).
This prototype allocates max(budget_l) + chunk slots in every layer (``kv_bytes_allocated``); only quality counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from perlayer_arena import analytic_kv_bytes, make_perlayer_arena, schedule_budgets  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=int, required=True, help="B: the uniform per-layer budget (total = L * B)")
    ap.add_argument("--schedule", default="uniform", help="uniform | linear:R | pyramid[:beta]")
    ap.add_argument("--kv-dtype", default="int8")
    ap.add_argument("--policy", default="hybrid-decay")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--text", default="corpus:paradise_lost")
    ap.add_argument("--positions", default="in-cache")
    ap.add_argument("--min-budget", type=int, default=8, help="floor of any layer's budget (linear:2.0 reaches 0)")
    ap.add_argument("--native", action="store_true",
                    help="use the native attention op instead of the torch path (faster; see the report)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--nll-out", default=None, help="save the per-token NLLs (torch.save) here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from sparsespec.eval.perplexity import nll_summary, streaming_nll
    from sparsespec.eval.texts import text_token_ids
    from sparsespec.loading.load import load_model

    loaded = load_model(args.model, torch.bfloat16, "native")
    ids = text_token_ids(loaded.tokenizer, args.text, args.tokens)
    n = len(ids)
    chunk = max(1, min(args.chunk, n - 1))
    cfg = loaded.config
    budgets = schedule_budgets(args.schedule, args.budget, cfg.num_hidden_layers, args.min_budget)
    arena = make_perlayer_arena(loaded, args.policy, budgets, n_tokens=n, chunk=chunk, kv_dtype=args.kv_dtype,
                                positions=args.positions, native=args.native)
    started = time.perf_counter()
    nll = streaming_nll(loaded.model, arena, ids, chunk)
    seconds = time.perf_counter() - started
    visible = arena.visible_per_layer()
    seen = arena.next_position
    evictions = [seen - v for v in visible]
    summary = nll_summary(nll, 256)
    dtype = loaded.model.dtype
    out = {
        "model": args.model, "text": args.text, "tokens": n, "chunk": chunk, "schedule": args.schedule,
        "policy": args.policy, "kv_dtype": arena.kv_dtype, "positions": args.positions,
        "path": "native" if arena.native_attention else "torch",
        "budget": args.budget, "budgets": budgets, "total_entries": sum(budgets),
        "splits": [[p.sinks, p.heavy, p.window] for p in arena.policies],
        "ppl": summary["ppl"], "mean_nll": summary["mean_nll"], "predicted_tokens": summary["predicted_tokens"],
        "evictions": sum(evictions), "evictions_per_layer": evictions, "visible_per_layer_at_end": visible,
        "kv_bytes_entries": analytic_kv_bytes(cfg, budgets, arena.kv_dtype, dtype),
        "kv_bytes_with_staging": analytic_kv_bytes(cfg, budgets, arena.kv_dtype, dtype, staging=arena.staging),
        "kv_bytes_allocated": arena.nbytes,
        "seconds": round(seconds, 2),
    }
    if args.nll_out:
        torch.save(nll, args.nll_out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
