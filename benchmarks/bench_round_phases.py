"""Where a speculative run's decode time goes: the draft's passes and the target's, by rows per pass, and commits.

Loads the target and the draft (native weights; the draft's head cut to ``--draft-vocab`` ids), reads the first
``--context`` tokens of a corpus text and one request of the prompt set, then decodes ``--new-tokens`` greedily with
a fixed γ, timing every forward pass of each model (grouped by its number of rows: a draft step is 1 row, or 2 after
a fully accepted round; a verification is γ + 1) and every arena commit, from the moment the first new token
arrives; decode tok/s counts the tokens after the first over the time after it (as ``bench_context.py`` does for
llama.cpp). Prints one JSON line per phase, and one for the run: decode tok/s and the seconds the phases account
for.

    python benchmarks/bench_round_phases.py --context 2048 --gamma 4 --new-tokens 160
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench_context import cache_options
from common import emit, load_settled, machine, results_dir

from sparsespec.cache.arena import KVArena
from sparsespec.engine import DraftOptions, RunStats, parse_gamma, run_generation
from sparsespec.eval.prompts import load_prompts, prompt_ids
from sparsespec.eval.texts import text_token_ids
from sparsespec.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--cache", default="hybrid:1024", help="the target's cache, POLICY:BUDGET (in-cache)")
    parser.add_argument("--draft-cache", default="hybrid:256", help="the draft's cache, POLICY:BUDGET (in-cache)")
    parser.add_argument("--draft-vocab", type=int, default=32768, help="the draft's head over the first N ids")
    parser.add_argument("--context", type=int, default=2048, help="tokens of the text before the request")
    parser.add_argument("--text", default="corpus:paradise_lost")
    parser.add_argument("--prompt", default="prose-lighthouse", help="a prompt id of the prompt set")
    parser.add_argument("--gamma", default="4")
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "round_phases.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_settled(args.model, torch.bfloat16, "native")
    draft = load_settled(args.draft, torch.bfloat16, "native", role="draft")
    if args.draft_vocab:
        draft.model.limit_vocabulary(args.draft_vocab)
    prompts = {p.id: p for p in load_prompts()}
    if args.prompt not in prompts:
        parser.error(f"unknown prompt id {args.prompt!r}")
    text = target.tokenizer.decode(text_token_ids(target.tokenizer, args.text, max_tokens=args.context))
    prompt = prompt_ids(target.tokenizer, prompts[args.prompt], text)

    phases: dict[str, list[float]] = {}  # phase -> seconds of each call
    timing = [False]  # only after the first round

    def timed(name, call):
        def wrapper(*a, **kw):
            if not timing[0]:
                return call(*a, **kw)
            started = time.perf_counter()
            result = call(*a, **kw)
            key = name(*a) if callable(name) else name
            phases.setdefault(key, []).append(time.perf_counter() - started)
            return result
        return wrapper

    for role, loaded in (("target", target), ("draft", draft)):
        loaded.model.forward = timed(lambda tokens, *_, role=role: f"{role} pass, {tokens.shape[0]} rows",
                                     loaded.model.forward)
    commit = KVArena.commit
    KVArena.commit = timed("commit", commit)
    try:
        stats = RunStats()
        tokens = run_generation(target, prompt, max_new_tokens=args.new_tokens, sampling=SamplingParams(),
                                cache=cache_options(args.cache),
                                draft=DraftOptions(draft, cache_options(args.draft_cache), parse_gamma(args.gamma)),
                                stats=stats)
        next(tokens)
        timing[0] = True
        started = time.perf_counter()
        rest = sum(1 for _ in tokens)
        decode_s = time.perf_counter() - started
    finally:
        KVArena.commit = commit
    facts = machine()
    common = {"bench": "round_phases", "model": args.model, "draft": args.draft, "context": args.context,
              "prompt": args.prompt, "gamma": args.gamma}
    for phase, seconds in sorted(phases.items()):
        emit({**common, "phase": phase, "calls": len(seconds), "ms_total": round(sum(seconds) * 1e3, 1),
              "ms_per_call": round(sum(seconds) / len(seconds) * 1e3, 3), **facts}, args.out)
    emit({**common, "phase": "decode", "tokens": rest, "tok_s": round(rest / decode_s, 2),
          "acceptance_rate": round(stats.speculative.acceptance_rate, 3),
          "accounted_s": round(sum(sum(s) for s in phases.values()), 3), "decode_s": round(decode_s, 3), **facts},
         args.out)


if __name__ == "__main__":
    main()
