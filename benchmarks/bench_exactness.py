"""Speculative == autoregressive over an evicting cache, in the default configuration, on real weights.

For each prompt, position mode and γ: the greedy tokens of the target alone and of the target with a draft, both
with the same budgeted cache (bfloat16, native weights, native attention: what `sparsespec generate` runs by
default); records whether they are equal, where they first differ, the acceptance and the evictions. The budget
is small so that the cache evicts within the run. One JSON line per run, a summary table at the end. Not a speed
benchmark: nothing is timed.

    python benchmarks/bench_exactness.py                      # 1.5B target, 0.5B draft, hybrid 64, γ 1-5
    python benchmarks/bench_exactness.py --target smollm2-135m --draft self --draft-policy streaming --draft-budget 32
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import emit, machine, results_dir

from sparsespec.cache.policy import make_policy
from sparsespec.engine import CacheOptions, DraftOptions, RunStats, run_generation
from sparsespec.eval.prompts import load_prompts, prompt_ids
from sparsespec.loading.load import load_model
from sparsespec.sampling import SamplingParams


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where the two runs differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="a model, or 'self'")
    parser.add_argument("--draft-policy", default="full")
    parser.add_argument("--draft-budget", type=int, default=None)
    parser.add_argument("--policy", default="hybrid", help="the target's policy (both runs)")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--positions", default="original,in-cache")
    parser.add_argument("--gammas", default="1,2,3,4,5")
    parser.add_argument("--kinds", default="prose,code")
    parser.add_argument("--per-kind", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "exactness.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(args.target, torch.bfloat16, "auto", role="target")
    draft_model = target if args.draft == "self" else load_model(args.draft, torch.bfloat16, "auto", role="draft")
    sampling = SamplingParams()  # greedy
    prompts = load_prompts(args.kinds.split(","), per_kind=args.per_kind)
    summary: dict[tuple[str, int], list[bool]] = {}
    for prompt in prompts:
        ids = prompt_ids(target.tokenizer, prompt)
        for positions in args.positions.split(","):
            cache = CacheOptions(make_policy(args.policy, args.budget), positions)
            draft_cache = CacheOptions(make_policy(args.draft_policy, args.draft_budget),
                                       positions if args.draft_budget else "original")
            expected = list(run_generation(target, ids, max_new_tokens=args.new_tokens, sampling=sampling,
                                           cache=cache, seed=0))
            for gamma in (int(g) for g in args.gammas.split(",")):
                stats = RunStats()
                draft = DraftOptions(draft_model, draft_cache, gamma, is_self=args.draft == "self")
                got = list(run_generation(target, ids, max_new_tokens=args.new_tokens, sampling=sampling,
                                          cache=cache, seed=0, draft=draft, stats=stats))
                differs_at = first_difference(got, expected)
                summary.setdefault((positions, gamma), []).append(differs_at is None)
                emit({"bench": "exactness", "target": args.target, "weights": target.weights, "draft": args.draft,
                      "draft_policy": args.draft_policy, "draft_budget": args.draft_budget, "prompt": prompt.id,
                      "kind": prompt.kind, "prompt_tokens": len(ids), "policy": args.policy, "budget": args.budget,
                      "positions": positions, "gamma": gamma, "new_tokens": len(got), "equal": differs_at is None,
                      "first_difference": differs_at, "acceptance": stats.speculative.acceptance_rate,
                      "evicted_tokens": stats.evicted_tokens, **machine()}, args.out)
    print(f"\n{args.target} + {args.draft}, {args.policy} {args.budget}, greedy, {args.new_tokens} new tokens: "
          "texts equal to the target alone")
    for (positions, gamma), equal in summary.items():
        print(f"  {positions:9s} γ = {gamma}: {sum(equal)}/{len(equal)}")


if __name__ == "__main__":
    main()
