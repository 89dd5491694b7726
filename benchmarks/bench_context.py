"""Decode speed at long context: llama.cpp's full cache against sparsespec's full and budgeted caches, in one run.

Decode speed at long context, in the same run: llama.cpp's full cache against sparsespec's full cache and
budgeted caches, on the same GGUF file, the same prompt ids (the first N tokens of a corpus text) and threads.

For each context length: the prompt is read (prefill, timed), then ``--new-tokens`` tokens are decoded greedily
(EOS ignored); decode tok/s counts the tokens after the first over the time after the first. sparsespec runs with
native weights; each ``--caches`` entry is ``full`` or ``POLICY:BUDGET``, and each budgeted one runs in the
``--positions`` mode (in-cache by default) once per ``--retentions`` value and ``--recall-pages`` value.
Optionally with a draft (``--draft``, its cache ``--draft-cache``, its head cut to ``--draft-vocab`` ids), once per
``--gamma`` value (a comma-separated list runs each γ after the same llama.cpp run). With
``--prompts``, each prompt of the prompt set is read after the N tokens of text (the text, a blank line, the
prompt: ``eval.prompts.prompt_ids``), so an instruction about a long document is what gets decoded; without it the
prompt is the text alone and decoding continues it. One JSON line per (engine, cache, context, prompt), stdout and
``--out``.

    python benchmarks/bench_context.py --model smollm2-135m --contexts 1024,8192 --caches full,hybrid:1024
    python benchmarks/bench_context.py --model qwen2.5-coder-1.5b --contexts 8192 --caches hybrid:1024 \
        --prompts py-lru-class,prose-lighthouse --draft qwen2.5-coder-0.5b --draft-cache hybrid:256 --gamma 4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench_llamacpp import common_prefix, llama_greedy, open_llama
from common import emit, fixture_path, load_settled, machine, results_dir

from sparsespec.cache.policy import make_policy
from sparsespec.engine import CacheOptions, DraftOptions, RunStats, parse_gamma, run_generation
from sparsespec.eval.prompts import load_prompts, prompt_ids
from sparsespec.eval.texts import text_token_ids
from sparsespec.sampling import SamplingParams


def cache_options(spec: str, positions: str = "in-cache", retention: str = "auto",
                  recall_pages: int | None = None) -> CacheOptions:
    """``full`` or ``POLICY:BUDGET``; a budgeted cache takes the position mode, retention and recall given."""
    if spec == "full":
        return CacheOptions()
    name, budget = spec.split(":")
    return CacheOptions(make_policy(name, int(budget)), positions=positions, retention=retention,
                        recall_pages=recall_pages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--caches", default="full,hybrid:1024",
                        help="comma-separated caches: full or POLICY:BUDGET; '' runs llama.cpp alone, so that "
                             "rounds can alternate the engines by invocation")
    parser.add_argument("--text", default="corpus:paradise_lost")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default=None,
                        help="prompt ids of the prompt set, each read after the context text (default: none)")
    parser.add_argument("--draft", default=None, help="a draft model (native weights)")
    parser.add_argument("--draft-cache", default="hybrid:1024", help="the draft's cache, POLICY:BUDGET (in-cache)")
    parser.add_argument("--draft-vocab", type=int, default=0,
                        help="the draft's head over the first N token ids (0: its whole vocabulary)")
    parser.add_argument("--gamma", default="auto", help="γ, or comma-separated γ values each run with the draft")
    parser.add_argument("--positions", default="in-cache", choices=("original", "in-cache"),
                        help="position mode of the budgeted caches (default: in-cache)")
    parser.add_argument("--retentions", default="auto",
                        help="comma-separated --retention values, each run for every budgeted cache (default: auto)")
    parser.add_argument("--recall-pages", default="0",
                        help="comma-separated --recall-pages values, 0 for no cold tier, each run for every "
                             "budgeted cache (default: 0)")
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "context.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_settled(args.model, torch.bfloat16, "native")
    contexts = [int(c) for c in args.contexts.split(",")]
    ids = text_token_ids(loaded.tokenizer, args.text, max_tokens=max(contexts))
    wanted = args.prompts.split(",") if args.prompts else []
    prompts = {p.id: p for p in load_prompts()}
    missing = [name for name in wanted if name not in prompts]
    if missing:
        parser.error(f"unknown prompt id {missing[0]!r}")
    drafts = []  # one DraftOptions per --gamma value
    if args.draft:
        draft_model = load_settled(args.draft, torch.bfloat16, "native", role="draft")
        if args.draft_vocab:
            draft_model.model.limit_vocabulary(args.draft_vocab)
        drafts = [DraftOptions(draft_model, cache_options(args.draft_cache), parse_gamma(g))
                  for g in args.gamma.split(",")]
    runs = [(context, name) for context in contexts for name in (wanted or [None])]
    for context, name in runs:
        if name is None:
            prompt = ids[:context]
        else:
            prompt = prompt_ids(loaded.tokenizer, prompts[name], loaded.tokenizer.decode(ids[:context]))
        if not args.skip_llamacpp:
            llm = open_llama(fixture_path(args.model), args.threads, n_ctx=len(prompt) + args.new_tokens + 16)
            prefill_s, decode_s, _ = llama_greedy(llm, prompt, args.new_tokens)
            emit({"bench": "context", "engine": "llama.cpp", "model": args.model, "cache": "full",
                  "context": context, "prompt": name, "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
                  "prefill_s": round(prefill_s, 2), "decode_tok_s": round((args.new_tokens - 1) / decode_s, 3),
                  **machine()}, args.out)
            llm.close()
            del llm
        variants = [(spec, "auto", 0) if spec == "full" else (spec, retention, int(pages))
                    for spec in (args.caches.split(",") if args.caches else [])
                    for retention in (["auto"] if spec == "full" else args.retentions.split(","))
                    for pages in (["0"] if spec == "full" else args.recall_pages.split(","))]
        for spec, retention, pages in variants:
            options = cache_options(spec, args.positions, retention, pages or None)
            alone = None  # each cache runs alone first, then with the draft at each γ
            for draft in [None, *drafts]:
                with_draft = draft is not None
                stats = RunStats()
                started = time.perf_counter()
                tokens = list(run_generation(
                    loaded, prompt, max_new_tokens=args.new_tokens, sampling=SamplingParams(),
                    cache=options, draft=draft, stats=stats))
                record = {"bench": "context", "engine": "sparsespec", "model": args.model, "cache": spec,
                          "positions": None if spec == "full" else args.positions,
                          "retention": retention, "recall_pages": pages, "evicted_tokens": stats.evicted_tokens,
                          "kv_peak_bytes": stats.kv_peak_bytes,
                          "draft": args.draft if with_draft else None, "context": context, "prompt": name,
                          "prompt_tokens": len(prompt), "new_tokens": stats.new_tokens,
                          "prefill_s": round(stats.prefill_seconds, 2), "decode_tok_s": round(stats.tokens_per_s, 3),
                          "kv_cache_bytes": stats.kv_cache_bytes, "wall_s": round(time.perf_counter() - started, 2)}
                if with_draft:
                    record.update(gamma=draft.gamma, acceptance_rate=round(stats.speculative.acceptance_rate, 3),
                                  final_gamma=stats.final_gamma, draft_cache=args.draft_cache,
                                  draft_vocab=args.draft_vocab, tokens_equal_to_alone=common_prefix(tokens, alone))
                if draft is None:
                    alone = tokens
                emit({**record, **machine()}, args.out)


if __name__ == "__main__":
    main()
