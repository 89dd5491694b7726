"""Speculative decoding with the draft's full head against ``--draft-vocab N``: speed, acceptance, cost ratio.

Speculative decoding with the draft's head over its full vocabulary against ``--draft-vocab N`` (the first N
token ids), in one run: speed, acceptance and the draft / target cost ratio, then the target alone.

    python benchmarks/bench_draft_vocab.py --vocab 32768
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench_llamacpp import bench_prompts, ours_greedy
from common import emit, load_settled, machine, median, results_dir

from sparsespec.engine import CacheOptions, DraftOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--prompts", default="py-lru-class,prose-lighthouse")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "draft_vocab.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_settled(args.target, torch.bfloat16, "native")
    prompts = bench_prompts(target.tokenizer, args.prompts)
    for label, limit in (("full-head", None), (f"vocab-{args.vocab}", args.vocab)):
        draft = load_settled(args.draft, torch.bfloat16, "native", role="draft")
        if limit:
            draft.model.limit_vocabulary(limit)
        options = DraftOptions(draft, CacheOptions(), args.gamma)
        for pid, ids in prompts:
            ours_greedy(target, ids, 8, options)  # warm-up
            runs = [ours_greedy(target, ids, args.new_tokens, options) for _ in range(args.runs)]
            s = runs[0][0].speculative
            emit({"bench": "draft_vocab", "draft_head": label, "prompt": pid,
                  "spec_tok_s": round(median([r[0].tokens_per_s for r in runs]), 2),
                  "acceptance": round(s.acceptance_rate, 3), "cost_ratio": round(s.draft_target_cost_ratio, 3),
                  "draft_head_bytes": draft.model.lm_head.nbytes, **machine()}, args.out)
    for pid, ids in prompts:
        ar = [ours_greedy(target, ids, args.new_tokens)[0].tokens_per_s for _ in range(args.runs)]
        emit({"bench": "draft_vocab", "model": args.target, "prompt": pid, "ar_tok_s": round(median(ar), 2),
              **machine()}, args.out)


if __name__ == "__main__":
    main()
