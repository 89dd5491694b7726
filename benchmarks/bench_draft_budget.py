"""Acceptance against the draft's KV budget at long context, on the real pair (1.5B target, 0.5B draft).

The draft's default cache is hybrid with 64 entries: at a long prompt it sees almost nothing of the text. This
measures, for each context length (corpus text before each prompt) and each draft budget, the acceptance rate, the
tokens per target pass, the draft/target cost ratio and the decode speed of greedy speculative decoding at a fixed γ,
next to the target decoding alone on the same prompt. The target's cache is the same in every run (full by
default), so only the draft's budget moves acceptance.

    python benchmarks/bench_draft_budget.py                                  # 1k / 4k / 8k; budgets 64 … 1024, full
    python benchmarks/bench_draft_budget.py --contexts 8192 --draft-budgets 256,1024 --target-budget 1024
    python benchmarks/bench_draft_budget.py --smoke                          # SmolLM2 self-draft, seconds

Prints one JSON line per run (also appended to ``results/bench_draft_budget/draft_budget.jsonl``), then a summary
line per context and budget: the median over prompts of acceptance, tokens per target pass and speedup over the
target alone.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from common import emit, load_settled, machine, results_dir

from sparsespec.cache.policy import make_policy
from sparsespec.engine import CacheOptions, DraftOptions, RunStats, run_generation
from sparsespec.eval.prompts import load_prompts, prompt_ids
from sparsespec.loading.fetch import corpus_text_path
from sparsespec.sampling import SamplingParams


def parse_budgets(text: str) -> list[int | None]:
    """``"64,256,full"`` → ``[64, 256, None]`` (None: the draft's full cache)."""
    return [None if item == "full" else int(item) for item in text.split(",") if item]


def draft_cache(budget: int | None) -> CacheOptions:
    """The draft's cache: hybrid with in-cache positions (ranks stay small whatever the context), or full."""
    if budget is None:
        return CacheOptions(make_policy("full"), force_context=True)
    return CacheOptions(make_policy("hybrid", budget), "in-cache")


def decode(target, ids: list[int], new_tokens: int, cache: CacheOptions, draft: DraftOptions | None) -> RunStats:
    stats = RunStats()
    for _ in run_generation(target, ids, max_new_tokens=new_tokens, sampling=SamplingParams(), cache=cache,
                            eos_ids=frozenset(), draft=draft, stats=stats):
        pass
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="a model, or 'self'")
    parser.add_argument("--weights", default="auto",
                        help="the target's weight format (default: auto, native for a GGUF file)")
    parser.add_argument("--draft-weights", default="auto",
                        help="the draft's weight format (default: auto, native for a GGUF file)")
    parser.add_argument("--contexts", default="1024,4096,8192", help="tokens of corpus text before each prompt")
    parser.add_argument("--draft-budgets", default="64,256,1024,full", help="draft cache budgets ('full': no budget)")
    parser.add_argument("--target-budget", type=int, default=None,
                        help="a hybrid in-cache target budget (default: the full cache)")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--kinds", default="code,prose")
    parser.add_argument("--per-kind", type=int, default=2, help="prompts taken from each kind")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--text", default="paradise_lost", help="corpus text that fills the context")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true",
                        help="a few seconds' check of the script: SmolLM2 drafting for itself, tiny contexts")
    parser.add_argument("--out", type=Path, default=None,
                        help="also append the JSON lines here (default: results/bench_draft_budget/draft_budget.jsonl; "
                             "none with --smoke)")
    args = parser.parse_args()
    if args.smoke:
        args.target, args.draft, args.weights, args.draft_weights = "smollm2-135m", "self", "dense", "dense"
        args.contexts, args.draft_budgets, args.per_kind, args.new_tokens = "64", "16,full", 1, 8
    out = args.out if args.out is not None else (None if args.smoke else results_dir(__file__) / "draft_budget.jsonl")
    torch.set_num_threads(args.threads)

    target = load_settled(args.target, torch.bfloat16, args.weights, role="target")
    is_self = args.draft == "self"
    draft_model = target if is_self else load_settled(args.draft, torch.bfloat16, args.draft_weights, role="draft")
    target_cache = (CacheOptions(force_context=True) if args.target_budget is None
                    else CacheOptions(make_policy("hybrid", args.target_budget), "in-cache"))
    text_ids = target.tokenizer.encode(corpus_text_path(args.text).read_text(encoding="utf-8", errors="replace"))
    prompts = load_prompts(args.kinds.split(","), per_kind=args.per_kind)
    budgets = parse_budgets(args.draft_budgets)

    results: dict[tuple[int, int | None], list[dict]] = {}
    for context in (int(c) for c in args.contexts.split(",")):
        filler = target.tokenizer.decode(text_ids[:context], skip_special_tokens=True)
        for prompt in prompts:
            ids = prompt_ids(target.tokenizer, prompt, filler)
            alone = decode(target, ids, args.new_tokens, target_cache, None)
            common = {"bench": "draft_budget", "target": args.target, "draft": args.draft, "weights": args.weights,
                      "draft_weights": None if is_self else args.draft_weights, "target_budget": args.target_budget,
                      "gamma": args.gamma, "context": context, "prompt": prompt.id, "prompt_tokens": len(ids)}
            for budget in budgets:
                draft = DraftOptions(draft_model, draft_cache(budget), args.gamma, is_self=is_self)
                stats = decode(target, ids, args.new_tokens, target_cache, draft)
                record = {**common, "draft_budget": budget, **stats.to_dict(),
                          "target_alone_tokens_per_s": round(alone.tokens_per_s, 3),
                          "speedup": round(stats.tokens_per_s / alone.tokens_per_s, 4) if alone.tokens_per_s else 0.0,
                          **machine()}
                emit(record, out)
                results.setdefault((context, budget), []).append(record)

    for (context, budget), records in results.items():
        emit({"bench": "draft_budget_summary", "target": args.target, "draft": args.draft, "context": context,
              "draft_budget": budget, "prompts": len(records),
              **{key: statistics.median(r[key] for r in records)
                 for key in ("acceptance_rate", "tokens_per_target_pass", "speedup", "tokens_per_s")}}, out)


if __name__ == "__main__":
    main()
