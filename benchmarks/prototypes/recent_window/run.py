"""Streaming perplexity with int4 KV entries whose W most recent positions are read in bf16, at equal bytes.

    python benchmarks/prototypes/recent_window/run.py --model smollm2-135m --tokens 2048 --budget-bytes-of 256 --window 32

The byte target is the KV bytes (staging included, what ``sparsespec ppl`` reports as kv_cache_bytes) of a plain
arena of ``--budget-bytes-of B0`` entries in ``--bytes-dtype`` (default: the --kv-dtype, int4). The run's budget is
the largest one whose analytic bytes (W bf16 slots + budget + staging - W int4 slots per layer and KV head) fit
that target; W = 0 gives B0 back and runs the stock KVArena on the torch path (the same-path baseline).
``--budget B`` sets the budget directly instead (equal entries). Always the torch path (no native op). Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from window_arena import (  # noqa: E402
    RULES, RecentWindowArena, analytic_kv_bytes, budget_at_equal_bytes, plain_arena_bytes,
)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    size = ap.add_mutually_exclusive_group(required=True)
    size.add_argument("--budget-bytes-of", type=int, help="B0: match the bytes of a plain arena of B0 entries")
    size.add_argument("--budget", type=int, help="use this budget directly (equal entries, not equal bytes)")
    ap.add_argument("--bytes-dtype", default=None, help="kv dtype of the B0 arena whose bytes are matched "
                                                         "(default: --kv-dtype)")
    ap.add_argument("--window", type=int, default=0, help="W: recent positions read in bf16 (0: stock arena)")
    ap.add_argument("--rule", default="row", choices=RULES, help="recency measured from the reading row, or from "
                                                                 "the block's last row")
    ap.add_argument("--kv-dtype", default="int4")
    ap.add_argument("--policy", default="hybrid-decay")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--positions", default="in-cache")
    ap.add_argument("--text", default="corpus:paradise_lost")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--nll-out", default=None, help="save the per-token NLLs (torch.save) here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from sparsespec.cache.arena import KVArena
    from sparsespec.cache.policy import make_policy
    from sparsespec.engine import CacheOptions, arena_staging, check_in_cache_ranks
    from sparsespec.eval.perplexity import nll_summary, streaming_nll
    from sparsespec.eval.texts import text_token_ids
    from sparsespec.loading.load import load_model

    loaded = load_model(args.model, torch.bfloat16, "native")
    ids = text_token_ids(loaded.tokenizer, args.text, args.tokens)
    n = len(ids)
    max_tokens = max(n - 1, 1)
    chunk = max(1, min(args.chunk, max_tokens))
    cfg, dtype = loaded.config, loaded.model.dtype
    staging = arena_staging(CacheOptions(prefill_chunk=chunk), max_tokens, 1)
    bytes_dtype = args.bytes_dtype or args.kv_dtype
    if args.budget is not None:
        budget, target = args.budget, None
    else:
        target = plain_arena_bytes(cfg, args.budget_bytes_of, staging, bytes_dtype, dtype)
        budget = budget_at_equal_bytes(cfg, target, staging, args.window, args.kv_dtype, dtype)
    policy = make_policy(args.policy, budget)
    check_in_cache_ranks(loaded, CacheOptions(policy=policy, positions=args.positions, prefill_chunk=chunk,
                                              kv_dtype=args.kv_dtype), staging)
    common = dict(dtype=dtype, max_tokens=max_tokens, max_block=chunk, max_inflight=1, positions=args.positions,
                  kv_dtype=args.kv_dtype, key_offset=loaded.model.key_biases())
    if args.window == 0:
        arena = KVArena(cfg, policy, **common)
        arena.native_attention = False
        allocated = arena.nbytes
    else:
        arena = RecentWindowArena(cfg, policy, full_window=args.window, rule=args.rule, **common)
        allocated = arena.allocated_nbytes
    assert arena.staging == staging

    started = time.perf_counter()
    nll = streaming_nll(loaded.model, arena, ids, chunk)
    seconds = time.perf_counter() - started
    summary = nll_summary(nll, 256)
    out = {
        "model": args.model, "text": args.text, "tokens": n, "chunk": chunk, "policy": args.policy,
        "split": [policy.sinks, policy.heavy, policy.window], "kv_dtype": args.kv_dtype, "positions": args.positions,
        "path": "torch", "W": args.window, "rule": args.rule if args.window else None,
        "budget_bytes_of": args.budget_bytes_of, "bytes_dtype": bytes_dtype if target is not None else None,
        "target_bytes": target, "budget": budget,
        "kv_bytes_analytic": analytic_kv_bytes(cfg, budget, staging, args.window, args.kv_dtype, dtype),
        "kv_bytes_allocated": allocated,
        "ppl": summary["ppl"], "mean_nll": summary["mean_nll"], "predicted_tokens": summary["predicted_tokens"],
        "evictions": arena.evicted_tokens, "seconds": round(seconds, 2), "threads": torch.get_num_threads(),
    }
    if args.nll_out:
        torch.save(nll, args.nll_out)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
