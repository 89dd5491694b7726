"""Decode speed at long context, in the same run: llama.cpp's full cache against sparsespec's full cache and
budgeted caches, on the same GGUF file, the same prompt ids (the first N tokens of a corpus text) and threads.

For each context length: the prompt is read (prefill, timed), then ``--new-tokens`` tokens are decoded greedily
(EOS ignored); decode tok/s counts the tokens after the first over the time after the first. sparsespec runs with
native weights; each ``--caches`` entry is ``full`` or ``POLICY:BUDGET`` (in-cache positions for budgeted caches).
Optionally with a draft (``--draft``). One JSON line per (engine, cache, context), stdout and ``--out``.

    python benchmarks/bench_context.py --model smollm2-135m --contexts 1024,8192 --caches full,hybrid:1024
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from common import RESULTS_DIR, emit, fixture_path, machine

from sparsespec.cache.policy import make_policy
from sparsespec.engine import CacheOptions, DraftOptions, RunStats, run_generation
from sparsespec.eval.texts import text_token_ids
from sparsespec.loading.load import load_model
from sparsespec.sampling import SamplingParams


def cache_options(spec: str) -> CacheOptions:
    if spec == "full":
        return CacheOptions()
    name, budget = spec.split(":")
    return CacheOptions(make_policy(name, int(budget)), positions="in-cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--caches", default="full,hybrid:1024")
    parser.add_argument("--text", default="corpus:paradise_lost")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft", default=None, help="a draft model (native weights, hybrid 1024 in-cache cache)")
    parser.add_argument("--gamma", default="auto")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "context.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, torch.bfloat16, "native")
    contexts = [int(c) for c in args.contexts.split(",")]
    ids = text_token_ids(loaded.tokenizer, args.text, max_tokens=max(contexts))
    draft = None
    if args.draft:
        gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
        draft = DraftOptions(load_model(args.draft, torch.bfloat16, "native", role="draft"),
                             cache_options("hybrid:1024"), gamma)
    for context in contexts:
        prompt = ids[:context]
        if not args.skip_llamacpp:
            from bench_llamacpp import llama_greedy, open_llama

            llm = open_llama(fixture_path(args.model), args.threads, n_ctx=context + args.new_tokens + 16)
            prefill_s, decode_s, _ = llama_greedy(llm, prompt, args.new_tokens)
            emit({"bench": "context", "engine": "llama.cpp", "model": args.model, "cache": "full",
                  "context": context, "new_tokens": args.new_tokens, "prefill_s": round(prefill_s, 2),
                  "decode_tok_s": round((args.new_tokens - 1) / decode_s, 3), **machine()}, args.out)
            llm.close()
            del llm
        for spec in args.caches.split(","):
            stats = RunStats()
            started = time.perf_counter()
            list(run_generation(loaded, prompt, max_new_tokens=args.new_tokens, sampling=SamplingParams(),
                                cache=cache_options(spec), draft=draft, stats=stats))
            record = {"bench": "context", "engine": "sparsespec", "model": args.model, "cache": spec,
                      "draft": args.draft, "context": context, "new_tokens": stats.new_tokens,
                      "prefill_s": round(stats.prefill_seconds, 2), "decode_tok_s": round(stats.tokens_per_s, 3),
                      "kv_cache_bytes": stats.kv_cache_bytes, "wall_s": round(time.perf_counter() - started, 2)}
            if stats.speculative is not None:
                record.update(acceptance_rate=round(stats.speculative.acceptance_rate, 3),
                              final_gamma=stats.final_gamma)
            emit({**record, **machine()}, args.out)


if __name__ == "__main__":
    main()
