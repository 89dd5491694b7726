"""Speculative vs autoregressive on the real pair (target qwen2.5-coder-1.5b, draft qwen2.5-coder-0.5b), one run.

For each prompt of the project's prompt set and each mode — our autoregressive target, ours speculative with the
given γ values, and (optionally) transformers' assisted generation on the same pair — records tok/s, acceptance,
tokens per target pass and the draft/target cost ratio. ``--long-context N`` prefixes every prompt with N tokens
of corpus text and compares the full-cache target with a sparse target (hybrid) plus draft.

    python benchmarks/bench_speculative.py --gammas 2,4,6,auto --temperatures 0,0.7 --transformers
    python benchmarks/bench_speculative.py --target smollm2-135m --draft self --long-context 8192 --gammas 4,auto
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from common import emit, load_settled, load_transformers, machine, results_dir, transformers_decode_tok_s

from sparsespec.cache.policy import make_policy
from sparsespec.engine import CacheOptions, DraftOptions, RunStats, parse_gamma, run_generation
from sparsespec.flags import DEFAULT_GAMMA
from sparsespec.eval.prompts import load_prompts, prompt_ids
from sparsespec.loading.fetch import corpus_text_path
from sparsespec.sampling import SamplingParams


def select_prompts(kinds: str, per_kind: str) -> list:
    """The first N prompts of each kind (e.g. 4 code, 4 prose, 2 chat)."""
    chosen = []
    for kind, count in zip(kinds.split(","), per_kind.split(",")):
        chosen += load_prompts([kind])[: int(count)]
    return chosen


def run(target, ids, new_tokens, sampling, cache, draft=None) -> RunStats:
    stats = RunStats()
    list(run_generation(target, ids, max_new_tokens=new_tokens, sampling=sampling, cache=cache, seed=0,
                        draft=draft, stats=stats))
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="a model, or 'self'")
    parser.add_argument("--target-weights", default="dense", help="dense, int8, int4 or auto")
    parser.add_argument("--draft-weights", default="dense", help="dense, int8, int4 or auto")
    parser.add_argument("--draft-policy", default="full")
    parser.add_argument("--draft-budget", type=int, default=None)
    parser.add_argument("--gammas", default="2,4,6,auto",
                        help="γ values: N (every round), auto, or default (generate's: 3 while drafting pays)")
    parser.add_argument("--draft-vocab", type=int, default=None, help="the draft scores only the first N ids")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of each configuration per prompt, alternated (target alone, then each γ)")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--kinds", default="code,prose,chat")
    parser.add_argument("--per-kind", default="4,4,2", help="prompts taken from each kind, in --kinds order")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--long-context", type=int, default=0, help="prefix prompts with this many corpus tokens")
    parser.add_argument("--sparse-budget", type=int, default=1024, help="target budget for the sparse runs")
    parser.add_argument("--sparse-retention", default="auto", choices=("auto", "query", "off"),
                        help="retention of the sparse runs (off: the prompt is read faster, decoding is the same)")
    parser.add_argument("--speculate-on", default="all",
                        help="target caches the speculative modes run on: all, full or sparse (the full cache's "
                             "autoregressive baseline always runs; at long context 'sparse' saves its slow prefills)")
    parser.add_argument("--transformers", action="store_true", help="also time transformers' assisted generation")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "speculative.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_settled(args.target, torch.bfloat16, args.target_weights, role="target")
    if args.draft == "self":
        draft_model = target
    else:
        draft_model = load_settled(args.draft, torch.bfloat16, args.draft_weights, role="draft")
        if args.draft_vocab is not None:
            draft_model.model.limit_vocabulary(args.draft_vocab)
    draft_cache = CacheOptions(make_policy(args.draft_policy, args.draft_budget), "in-cache" if args.long_context else "original")
    context = ""
    if args.long_context:
        text = corpus_text_path("paradise_lost").read_text(encoding="utf-8", errors="replace")
        context = target.tokenizer.decode(target.tokenizer.encode(text)[: args.long_context])
    full = CacheOptions(force_context=True) if args.long_context else CacheOptions()
    sparse = CacheOptions(make_policy("hybrid", args.sparse_budget), "in-cache", retention=args.sparse_retention)
    target_caches = {"full": full, f"hybrid{args.sparse_budget}": sparse} if args.long_context else {"full": full}

    prompts = select_prompts(args.kinds, args.per_kind)
    for prompt in prompts:
        ids = prompt_ids(target.tokenizer, prompt, context)
        for temperature in [float(t) for t in args.temperatures.split(",")]:
            sampling = SamplingParams(temperature=temperature)
            for cache_name, cache in target_caches.items():
                speculate = args.speculate_on == "all" or (cache_name == "full") == (args.speculate_on == "full")
                modes = [None] + (args.gammas.split(",") if speculate else [])
                for round_ in range(1, args.rounds + 1):
                    # Modes take turns, their order reversed every other round (what runs first is not favoured).
                    results = {}
                    for gamma in modes if round_ % 2 else modes[::-1]:
                        draft = None
                        if gamma is not None:
                            paying = gamma == "default"  # generate's default: γ = 3 while drafting pays, measured
                            draft = DraftOptions(draft_model, draft_cache,
                                                 DEFAULT_GAMMA if paying else parse_gamma(gamma),
                                                 is_self=args.draft == "self", only_while_faster=paying)
                        results[gamma] = run(target, ids, args.new_tokens, sampling, cache, draft)
                    base = results[None]
                    common = {"prompt": prompt.id, "kind": prompt.kind, "temperature": temperature,
                              "target": args.target, "target_weights": args.target_weights,
                              "draft_weights": args.draft_weights, "target_cache": cache_name, "context": len(ids),
                              "round": round_}
                    emit({"bench": "speculative", "mode": "autoregressive", **common, **base.to_dict(),
                          **machine()}, args.out)
                    for gamma in modes[1:]:
                        stats = results[gamma]
                        emit({"bench": "speculative", "mode": f"gamma={gamma}", "draft": args.draft, **common,
                              **stats.to_dict(), "speedup_vs_autoregressive": stats.tokens_per_s / base.tokens_per_s,
                              **machine()}, args.out)

    if args.transformers and args.draft != "self":
        del target, draft_model
        gc.collect()
        reference, tokenizer = load_transformers(args.target, torch.bfloat16)
        assistant, _ = load_transformers(args.draft, torch.bfloat16)
        for prompt in prompts:
            ids = prompt_ids(tokenizer, prompt, context)
            plain = transformers_decode_tok_s(reference, ids, args.new_tokens)[0]
            assisted = transformers_decode_tok_s(reference, ids, args.new_tokens, assistant=assistant)[0]
            emit({"bench": "speculative", "mode": "transformers", "prompt": prompt.id, "kind": prompt.kind,
                  "temperature": 0.0, "target": args.target, "context": len(ids), "transformers_tok_s": plain, "transformers_assisted_tok_s": assisted,
                  **machine()}, args.out)


if __name__ == "__main__":
    main()
