"""One speculative run over an evicting cache, as one JSON line: the unit of an A/B between two checkouts.

Run it alternately from two source trees (each with its own ``src`` on ``PYTHONPATH``), so that the two codes
take turns on the same host, e.g. three rounds of the change against the commit before it::

    git worktree add /tmp/before <commit>
    for case in smollm2 pair; do for round in 1 2 3; do for src in src /tmp/before/src; do
        PYTHONPATH=$src python benchmarks/bench_speculative_ab.py $case; done; done; done

Cases (native weights, bfloat16, greedy, 2 threads): ``smollm2``: SmolLM2-135M with ``hybrid`` 64, drafting for
itself with ``streaming`` 32, γ = 4, 256 new tokens, the first prose prompt; ``pair``: Qwen2.5-Coder-1.5B with
``hybrid`` 128 and the 0.5B draft (full cache), γ = 3, 160 new tokens, the first code prompt.
"""

from __future__ import annotations

import json
import sys

import torch

from common import load_settled
from sparsespec.cache.policy import make_policy
from sparsespec.engine import CacheOptions, DraftOptions, RunStats, run_generation
from sparsespec.eval.prompts import load_prompts, prompt_ids
from sparsespec.sampling import SamplingParams


def main() -> None:
    case = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    if case not in ("smollm2", "pair"):
        sys.exit(f"unknown case {case!r}: smollm2 or pair")
    torch.set_num_threads(2)
    if case == "smollm2":
        target = draft_model = load_settled("smollm2-135m", torch.bfloat16, "auto", role="target")
        cache = CacheOptions(make_policy("hybrid", 64), "original")
        draft = DraftOptions(draft_model, CacheOptions(make_policy("streaming", 32, sinks=2)), 4, is_self=True)
        prompt, new_tokens = load_prompts(["prose"])[0], 256
    else:
        target = load_settled("qwen2.5-coder-1.5b", torch.bfloat16, "auto", role="target")
        draft_model = load_settled("qwen2.5-coder-0.5b", torch.bfloat16, "auto", role="draft")
        cache = CacheOptions(make_policy("hybrid", 128), "original")
        draft = DraftOptions(draft_model, CacheOptions(make_policy("full")), 3)
        prompt, new_tokens = load_prompts(["code"])[0], 160
    stats = RunStats()
    tokens = list(run_generation(target, prompt_ids(target.tokenizer, prompt), max_new_tokens=new_tokens,
                                 sampling=SamplingParams(), cache=cache, seed=0, draft=draft, stats=stats))
    print(json.dumps({"case": case, "tok_s": stats.tokens_per_s, "evicted": stats.evicted_tokens,
                      "new": len(tokens), "acceptance": stats.speculative.acceptance_rate, "tokens": tokens[:8]}))


if __name__ == "__main__":
    main()
