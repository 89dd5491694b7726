"""``sparsespec ppl``, ``sparsespec sweep`` and ``sparsespec needle``: argument definitions and runners for the CLI.

``add_ppl_arguments`` / ``add_sweep_arguments`` / ``add_needle_arguments`` fill an ``argparse`` (sub)parser;
``run_ppl`` / ``run_sweep`` / ``run_needle`` run the command from the parsed arguments and return the exit status.
Mistakes in the arguments raise :class:`~sparsespec.errors.UserError`, worded in these commands' flags
(:data:`EVAL_PARAMETER_FLAGS`, :data:`SWEEP_PARAMETER_FLAGS`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..errors import UserError, reworded
from ..flags import (
    DEFAULT_GAMMA,
    KV_DTYPE_CHOICES,
    PARAMETER_FLAGS,
    WEIGHT_CHOICES,
    add_cache_arguments,
    add_draft_arguments,
    add_model_arguments,
    cache_options,
    check_draft_flags,
    draft_flags_given,
    draft_settings,
    load_draft,
    parse_size,
    reject_without,
    setup_torch,
)
from .sweep import split_list

DEFAULT_PPL_WINDOW = 256
DEFAULT_GAMMAS = str(DEFAULT_GAMMA)
DEFAULT_PROMPTS = "code,prose,chat"
DEFAULT_NEW_TOKENS = 64
DEFAULT_SWEEP_MAX_TOKENS = 1024
DEFAULT_RETENTIONS = "auto"
DEFAULT_RETRIEVAL_TASK = "passkey"
DEFAULT_RETRIEVAL_LENGTHS = "1024,2048"
DEFAULT_NEEDLE_TEXT = "corpus:paradise_lost"
DEFAULT_NEEDLE_LENGTHS = "1024,2048,4096"
DEFAULT_NEEDLE_DEPTHS = "0,25,50,75,100"
DEFAULT_NEEDLE_NEW_TOKENS = 16

# The eval library's parameters (errors.ConfigError) as these commands' flags name them, beside the shared ones.
EVAL_PARAMETER_FLAGS = {**PARAMETER_FLAGS, "text": "--text", "max_tokens": "--max-tokens", "task": "--task",
                        "lengths": "--lengths", "depths": "--depths", "trials": "--trials", "keys": "--keys",
                        "turns": "--turns", "chat": "--chat"}
# sweep's: the lists of its grid, its --new-tokens, and the needle settings of its --retrieval.
SWEEP_PARAMETER_FLAGS = {**EVAL_PARAMETER_FLAGS, "kinds": "--prompts", "policies": "--policies",
                         "budgets": "--budgets", "kv_dtypes": "--kv-dtypes", "retentions": "--retentions",
                         "max_new_tokens": "--new-tokens", "task": "--retrieval-task", "lengths": "--retrieval-lengths",
                         "depths": "--retrieval-depths", "turns": "--retrieval-turns"}


def _add_text_arguments(parser: argparse.ArgumentParser, required: bool, max_tokens_default: int | None) -> None:
    parser.add_argument("--text", required=required, default=None,
                        help="text file, or corpus:NAME for a text of the fetched corpus (e.g. corpus:hamlet)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens_default,
                        help="use only the first N tokens of the text" +
                             (" (default: all)" if max_tokens_default is None else " (default: %(default)s)"))
    parser.add_argument("--chunk", type=int, default=None,
                        help="tokens per forward pass while reading the text; 1 evicts after every token exactly as "
                             "decoding does, larger chunks evict once per chunk (faster, slightly more context) "
                             "(default: 1 for budgeted caches, --prefill-chunk for the full cache, whose results "
                             "do not depend on the chunk)")
    parser.add_argument("--ppl-window", type=int, default=DEFAULT_PPL_WINDOW,
                        help="tokens per window of the perplexity summary and of the plotted moving average "
                             "(default: %(default)s)")


def _chunk_for(args: argparse.Namespace, policy) -> int:
    chunk = args.chunk if args.chunk is not None else (args.prefill_chunk if policy.is_full else 1)
    if chunk < 1:
        raise UserError(f"--chunk must be at least 1 (got {chunk}).")
    return chunk


def _check_window(args: argparse.Namespace) -> None:
    if args.ppl_window < 1:
        raise UserError(f"--ppl-window must be at least 1 (got {args.ppl_window}).")


# ---------------------------------------------------------------------------------------------------- ppl
def add_ppl_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``sparsespec ppl``: model, cache, text and output flags."""
    add_model_arguments(parser)
    add_cache_arguments(parser)
    _add_text_arguments(parser, required=True, max_tokens_default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a text summary")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="write the moving-average NLL against token position to this PNG")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


@reworded(EVAL_PARAMETER_FLAGS)
def run_ppl(args: argparse.Namespace) -> int:
    """Streaming perplexity of a text through the chosen KV cache."""
    from ..engine import check_fits_context
    from ..cache.arena import require_kernels
    from ..loading.load import load_model
    from .perplexity import measure_perplexity, plot_nll
    from .texts import resolve_text, text_token_ids

    given = [flag for flag, value in (("--retention", args.retention), ("--retention-tokens", args.retention_tokens))
             if value is not None]
    if given:
        raise UserError(f"{', '.join(given)}: perplexity reads the text as one stream, with no prompt end at which "
                        "retention would choose; drop it (`sparsespec needle` measures retention).")
    if args.recall_pages is not None:
        raise UserError("--recall-pages: perplexity reads the text in prefill chunks, and only decode rows recall "
                        "from the cold tier; drop it (`sparsespec needle` measures recall).")
    cache = cache_options(args)
    chunk = _chunk_for(args, cache.policy)
    _check_window(args)
    if args.max_tokens is not None and args.max_tokens < 2:
        raise UserError(f"--max-tokens must be at least 2 (got {args.max_tokens}).")
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise UserError(f"--plot writes a PNG file; give a name ending in .png (got {args.plot}).")
    resolve_text(args.text)  # fail on a missing file before loading the model
    if args.max_tokens is not None:
        check_fits_context(_model_shapes(args.model), cache, args.max_tokens, "--max-tokens")
    dtype = setup_torch(args)

    started = time.perf_counter()
    require_kernels()  # before the minutes a load may take: nothing decodes without them
    loaded = load_model(args.model, dtype, args.weights, role="target", activations=args.activations)
    load_seconds = time.perf_counter() - started
    ids = text_token_ids(loaded.tokenizer, args.text, args.max_tokens)
    check_fits_context(loaded, cache, len(ids), "The text")
    nll, summary = measure_perplexity(loaded, cache, ids, chunk, args.ppl_window, progress=not args.quiet)

    result = {
        "model": loaded.name, "text": args.text, "policy": cache.policy.name,
        "positions": "original" if cache.policy.is_full else cache.positions,
        **summary,  # with cache (the description), budget and kv_dtype of the arena that ran
        "load_seconds": round(load_seconds, 3),
    }
    if args.plot:
        label = summary["cache"] + ("" if cache.policy.is_full else f", {cache.positions}, chunk {chunk}")
        label += "" if cache.kv_dtype == "auto" else f", KV {cache.kv_dtype}"
        result["plot"] = str(plot_nll({label: nll}, args.plot, args.ppl_window))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"model        {result['model']}")
    print(f"text         {args.text}: {summary['tokens']} tokens ({summary['predicted_tokens']} predicted)")
    print(f"cache        {result['cache']}, positions {result['positions']}, chunk {summary['chunk']}, "
          f"KV {summary['kv_dtype']}")
    print(f"perplexity   {summary['ppl']:.4f}  (mean NLL {summary['mean_nll']:.4f} nats)")
    windows = summary["window_ppl"]
    if windows:
        print(f"per {summary['window']} tokens  first {windows[0]:.3f}, last {windows[-1]:.3f}, "
              f"min {min(windows):.3f}, max {max(windows):.3f} ({len(windows)} windows)")
    print(f"KV cache     {summary['kv_cache_bytes']:,} bytes peak (fixed; +{summary['kv_metadata_bytes']:,} "
          "bytes of slot metadata)")
    print(f"time         {summary['seconds']:.2f} s ({summary['tokens_per_s']:.1f} tokens/s), "
          f"load {load_seconds:.2f} s")
    if args.plot:
        print(f"plot         {result['plot']}")
    return 0


# -------------------------------------------------------------------------------------------------- sweep
def add_sweep_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``sparsespec sweep``: the grid axes, what to measure, where to write."""
    add_model_arguments(parser)
    parser.add_argument("--draft", default="none",
                        help="comma-separated drafts: none, self, a model; NAME:BUDGET sets that draft's cache "
                             "budget (e.g. none,self:64,self:128) (default: none)")
    parser.add_argument("--draft-weights", choices=WEIGHT_CHOICES, default=None,
                        help="the drafts' weight format (default: as --weights)")
    add_cache_arguments(parser, prefix="draft-")
    parser.add_argument("--policies", default="full,hybrid",
                        help="comma-separated cache policies (default: %(default)s)")
    parser.add_argument("--budgets", default=None, help="comma-separated budgets (default: 256 without --kv-bytes)")
    parser.add_argument("--kv-bytes", default=None, metavar="SIZES",
                        help="comma-separated cache sizes in bytes (KiB / MiB / GiB suffixes allowed) instead of "
                             "--budgets: per policy and KV dtype, the budget whose quality arena (keys and values, "
                             "all layers, one --chunk of staging) fits")
    parser.add_argument("--kv-dtypes", default="auto",
                        help="comma-separated KV storage: auto (the compute dtype), bf16, int8, int4 "
                             "(default: %(default)s)")
    parser.add_argument("--positions", default="original",
                        help="comma-separated position modes: original, in-cache (default: %(default)s)")
    parser.add_argument("--retentions", default=DEFAULT_RETENTIONS,
                        help="comma-separated query-aware retention modes: auto (a heavy-hitter cache keeps what "
                             "each prompt's end attends to; query is the same) and/or off; policies without heavy "
                             "hitters have one value (default: %(default)s)")
    parser.add_argument("--gammas", default=None,
                        help=f"comma-separated γ values or auto (default: {DEFAULT_GAMMAS}; needs a draft)")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill pass")
    parser.add_argument("--force-context", action="store_true",
                        help="allow true positions beyond the model's trained context")
    _add_text_arguments(parser, required=False, max_tokens_default=DEFAULT_SWEEP_MAX_TOKENS)
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS,
                        help="prompt kinds for the speed runs: code, prose, chat or all (default: %(default)s)")
    parser.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts of each kind")
    parser.add_argument("--context-tokens", type=int, default=0,
                        help="tokens of --text read before every prompt (a long context) (default: 0)")
    parser.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS,
                        help="new tokens per prompt (default: %(default)s)")
    measure = parser.add_argument_group("what to measure", "the measurements named are the ones made (default: "
                                        "--quality and --speed)")
    measure.add_argument("--quality", action="store_true", help="perplexity of --text")
    measure.add_argument("--speed", action="store_true", help="speed / acceptance over the prompt set")
    measure.add_argument("--retrieval", action="store_true",
                         help="the needle check of `sparsespec needle`: a fact planted once in --text, asked for "
                              "greedily (chat template when the model has one) at each length and depth")
    measure.add_argument("--retrieval-task", default=DEFAULT_RETRIEVAL_TASK, metavar="{passkey,multikey,fact}",
                         help="what --retrieval plants and asks for, as needle's --task (default: %(default)s)")
    measure.add_argument("--retrieval-lengths", default=DEFAULT_RETRIEVAL_LENGTHS, metavar="N,N,...",
                         help="comma-separated --retrieval prompt lengths in the model's tokens, chat template "
                              "included (default: %(default)s)")
    measure.add_argument("--retrieval-depths", default=DEFAULT_NEEDLE_DEPTHS, metavar="PCT,PCT,...",
                         help="comma-separated --retrieval needle depths, percent of the haystack: 0 at its start, "
                              "100 just before the question (default: %(default)s)")
    measure.add_argument("--retrieval-turns", action="store_true",
                         help="--retrieval-task multikey: ask every passkey, one per turn of one conversation, as "
                              "needle's --turns")
    parser.add_argument("--out", required=True, metavar="FILE.jsonl",
                        help="results, one JSON line per point; points already in it are skipped")
    parser.add_argument("--plots", default=None, metavar="DIR", help="draw the trade-off plots into this folder")
    parser.add_argument("--plot-only", action="store_true", help="only draw --plots from the records in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _sweep_grid(args: argparse.Namespace):
    from ..engine import parse_gamma
    from .sweep import build_grid, parse_draft

    drafts: list[str | None] = []
    for entry in split_list(args.draft) or ["none"]:
        if entry == "none":
            drafts.append(None)
        else:
            ref, _ = parse_draft(entry)
            if not ref:
                raise UserError(f"Empty draft model in --draft entry {entry!r}.")
            drafts.append(entry)
    gammas = [parse_gamma(g) for g in split_list(args.gammas or DEFAULT_GAMMAS)]
    if not gammas:
        raise UserError("--gammas is empty; give at least one γ (a positive integer or auto).")
    kv_dtypes = split_list(args.kv_dtypes)
    for kv in kv_dtypes:
        if kv not in KV_DTYPE_CHOICES:
            raise UserError(f"Unknown KV dtype {kv!r} in --kv-dtypes; choose from {', '.join(KV_DTYPE_CHOICES)}.")
    kv_bytes = [parse_size(size) for size in split_list(args.kv_bytes)]
    if kv_bytes and args.budgets is not None:
        raise UserError("Give the budgets either as --budgets or as --kv-bytes, not both.")
    budgets = _parse_budgets(args.budgets if args.budgets is not None or kv_bytes else "256")
    budget_for_bytes = _budget_for_bytes(args) if kv_bytes else None
    return build_grid(split_list(args.policies), budgets, split_list(args.positions), gammas, drafts, kv_dtypes,
                      kv_bytes, budget_for_bytes, split_list(args.retentions))


def _budget_for_bytes(args: argparse.Namespace):
    """``(policy, kv_dtype, nbytes) -> budget`` for the sweep's target: its quality arena (budget + one chunk of
    staging, 1 for budgeted caches unless --chunk) fits the bytes."""
    from ..engine import sized_policy
    from ..loading.load import DTYPES
    from ..loading.source import read_config, resolve_model

    config = read_config(resolve_model(args.model))
    staging = args.chunk or 1

    def budget_for_bytes(policy: str, kv_dtype: str, nbytes: int) -> int:
        return sized_policy(policy, None, config, DTYPES[args.dtype], kv_dtype, nbytes, staging).budget

    return budget_for_bytes


def _check_sweep_args(args: argparse.Namespace):
    """What to measure: ``(quality, speed, retrieval)``, the last a ``NeedleSetup`` (its ``chat`` still to be
    decided by the model) or None. Raises :class:`UserError` for bad values and for flags that would do nothing
    (flags of a measurement not made; draft flags without a draft)."""
    named = {"perplexity": args.quality, "speed": args.speed, "retrieval": args.retrieval}
    if not any(named.values()):
        named.update(perplexity=True, speed=True)
    measure_quality, measure_speed, measure_retrieval = named.values()
    only = f" (the sweep measures only {' and '.join(name for name, on in named.items() if on)})"
    if not measure_speed:
        reject_without([flag for flag, on in (
            ("--prompts", args.prompts != DEFAULT_PROMPTS), ("--max-prompts", args.max_prompts is not None),
            ("--new-tokens", args.new_tokens != DEFAULT_NEW_TOKENS), ("--context-tokens", args.context_tokens != 0),
        ) if on], "the speed runs", only)
    if not measure_quality:
        reject_without([flag for flag, on in (
            ("--max-tokens", args.max_tokens != DEFAULT_SWEEP_MAX_TOKENS), ("--chunk", args.chunk is not None),
            ("--ppl-window", args.ppl_window != DEFAULT_PPL_WINDOW),
        ) if on], "perplexity", only)
    if not measure_retrieval:
        reject_without([flag for flag, on in (
            ("--retrieval-task", args.retrieval_task != DEFAULT_RETRIEVAL_TASK),
            ("--retrieval-lengths", args.retrieval_lengths != DEFAULT_RETRIEVAL_LENGTHS),
            ("--retrieval-depths", args.retrieval_depths != DEFAULT_NEEDLE_DEPTHS),
        ) if on], "--retrieval")
    if not (measure_speed or measure_retrieval):
        reject_without(["--retentions"] * (args.retentions != DEFAULT_RETENTIONS), "the speed runs or --retrieval",
                       " (perplexity reads the text as one stream, with no prompt end at which retention would "
                       "choose)")
    if all(entry == "none" for entry in split_list(args.draft)):
        reject_without(["--gammas"] * (args.gammas is not None) + draft_flags_given(args), "a draft in --draft")
    if measure_quality and args.text is None:
        raise UserError("Perplexity needs --text FILE or --text corpus:NAME (or measure only --speed).")
    if measure_retrieval and args.text is None:
        raise UserError("--retrieval plants its needles in --text; give --text FILE or --text corpus:NAME.")
    if args.context_tokens < 0:
        raise UserError(f"--context-tokens must not be negative (got {args.context_tokens}).")
    if args.context_tokens and args.text is None:
        raise UserError("--context-tokens takes its context from --text; give --text too.")
    if args.new_tokens < 1:
        raise UserError(f"--new-tokens must be at least 1 (got {args.new_tokens}).")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise UserError(f"--max-tokens must be at least 2 (got {args.max_tokens}).")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise UserError(f"--max-prompts must be at least 1 (got {args.max_prompts}).")
    if args.prefill_chunk < 1:
        raise UserError(f"--prefill-chunk must be at least 1 (got {args.prefill_chunk}).")
    if args.chunk is not None and args.chunk < 1:
        raise UserError(f"--chunk must be at least 1 (got {args.chunk}).")
    if not args.out.endswith(".jsonl"):
        raise UserError(f"--out names a JSON-lines file; give a name ending in .jsonl (got {args.out}).")
    _check_window(args)
    retrieval = None
    if measure_retrieval:
        from .needle import NeedleSetup

        retrieval = NeedleSetup(
            task=args.retrieval_task, lengths=_parse_numbers(args.retrieval_lengths, "--retrieval-lengths", int),
            depths=_parse_numbers(args.retrieval_depths, "--retrieval-depths", float), turns=args.retrieval_turns)
    return measure_quality, measure_speed, retrieval


@reworded(SWEEP_PARAMETER_FLAGS)
def run_sweep(args: argparse.Namespace) -> int:
    """Measure every point of the grid not yet in ``--out``, then draw ``--plots``."""
    from .sweep import plot_sweep, read_records

    if args.plot_only:
        if not args.plots:
            raise UserError("--plot-only needs --plots DIR.")
        records = read_records(args.out)
        if not records:
            raise UserError(f"{args.out} holds no sweep records to plot.")
        for path in plot_sweep(records, args.plots):
            print(path)
        return 0

    measure_quality, measure_speed, retrieval = _check_sweep_args(args)
    points = _sweep_grid(args)
    from .prompts import load_prompts, parse_kinds
    from .texts import read_text, resolve_text

    prompts = load_prompts(parse_kinds(args.prompts), per_kind=args.max_prompts) if measure_speed else []
    if measure_speed and not prompts:
        raise UserError("No prompts selected; check --prompts.")
    if args.text is not None:
        resolve_text(args.text)

    from ..cache.arena import require_kernels
    from ..loading.load import load_model
    from .sweep import SweepEvaluator, SweepOptions, log_record, run_grid, setup_id
    from .texts import text_token_ids

    # The draft's cache flags are checked now, not when the first speculative point starts.
    if any(p.draft for p in points):
        _draft_cache(args, "original", None)
    dtype = setup_torch(args)
    require_kernels()  # before the minutes a load may take: nothing decodes without them
    target = load_model(args.model, dtype, args.weights, role="target", activations=args.activations)

    text_ids = None
    context = ""
    if measure_quality:
        wanted = None if args.max_tokens is None else max(args.max_tokens, args.context_tokens)
    else:
        wanted = args.context_tokens
    if args.text is not None and (wanted is None or wanted > 0):
        text_ids = text_token_ids(target.tokenizer, args.text, wanted)
        if args.context_tokens:
            if len(text_ids) < args.context_tokens:
                raise UserError(f"--context-tokens {args.context_tokens} exceeds the text's {len(text_ids)} tokens.")
            context = target.tokenizer.decode(text_ids[: args.context_tokens], skip_special_tokens=True)
        if args.max_tokens is not None:
            text_ids = text_ids[: args.max_tokens]
    needle_prompts = []
    if retrieval is not None:
        from dataclasses import replace

        from .needle import Haystack, build_prompts

        has_template = bool(getattr(target.tokenizer, "chat_template", None))
        if retrieval.turns and not has_template:
            raise UserError(f"--retrieval-turns holds a conversation, and {target.name} has no chat template.")
        retrieval = replace(retrieval, chat=has_template)
        haystack = Haystack(read_text(args.text), target.tokenizer, args.text)
        needle_prompts = build_prompts(target.tokenizer, haystack, retrieval)

    setup = {
        "model": target.name, "dtype": args.dtype, "weights": args.weights,
        "text": args.text, "max_tokens": len(text_ids) if measure_quality else None,
        "chunk": args.chunk if measure_quality else None, "ppl_window": args.ppl_window if measure_quality else None,
        "measure": [m for m, on in (("quality", measure_quality), ("speed", measure_speed),
                                    ("retrieval", retrieval is not None)) if on],
        "prompts": [p.id for p in prompts], "context_tokens": args.context_tokens if measure_speed else 0,
        "new_tokens": args.new_tokens if measure_speed else None, "prefill_chunk": args.prefill_chunk,
        "force_context": args.force_context, "seed": 0,  # speed runs are greedy; the field keeps setup ids as before
        "draft_weights": args.draft_weights if any(p.draft for p in points) else None,
        "draft_cache": _draft_cache_flags(args) if any(p.draft for p in points) else None,
        "threads": args.threads,
    }
    if retrieval is not None:  # absent otherwise, so setups without retrieval keep their ids
        setup["retrieval"] = {"task": retrieval.task, "lengths": sorted(set(retrieval.lengths)),
                              "depths": sorted(set(retrieval.depths)), "keys": retrieval.key_count,
                              "seed": retrieval.seed, "chat": retrieval.chat,
                              "answer_tokens": DEFAULT_NEEDLE_NEW_TOKENS}
    loaded_drafts: dict[str, object] = {}

    def load_draft(ref: str):
        if ref not in loaded_drafts:
            loaded_drafts[ref] = load_model(ref, dtype, args.draft_weights, role="draft",
                                            share_tokenizer=target.tokenizer)
        return loaded_drafts[ref]

    options = SweepOptions(
        quality=measure_quality, speed=measure_speed, retrieval=retrieval, context=context,
        new_tokens=args.new_tokens, answer_tokens=DEFAULT_NEEDLE_NEW_TOKENS, chunk=args.chunk,
        window=args.ppl_window, prefill_chunk=args.prefill_chunk, force_context=args.force_context,
        progress=not args.quiet,
    )
    evaluator = SweepEvaluator(
        target, options, text_ids=text_ids if measure_quality else None, prompts=prompts,
        needle_prompts=needle_prompts,
        draft_cache=lambda positions, budget: _draft_cache(args, positions, budget), load_draft=load_draft,
    )
    for point in points:
        evaluator.check(point)
    evaluator.remember(r for r in read_records(args.out) if r.get("setup_id") == setup_id(setup))
    print(f"sweep: {len(points)} points -> {args.out}", file=sys.stderr)
    records = run_grid(points, args.out, evaluator, setup, on_record=log_record)
    if args.plots:
        for path in plot_sweep(records, args.plots):
            print(path)
    return 0


def _draft_cache_flags(args: argparse.Namespace) -> dict:
    flags = {k: getattr(args, f"draft_{k}") for k in ("policy", "budget", "sinks", "heavy", "window")}
    if args.draft_kv_dtype not in (None, "auto"):  # absent from setups written before KV dtypes existed
        flags["kv_dtype"] = args.draft_kv_dtype
    if args.draft_kv_recent is not None:  # the same, before the full-precision window
        flags["kv_recent"] = args.draft_kv_recent
    if args.draft_retention not in (None, "auto"):  # the same, before retention
        flags["retention"] = args.draft_retention
    if args.draft_retention_tokens is not None:
        flags["retention_tokens"] = args.draft_retention_tokens
    if args.draft_recall_pages is not None:
        flags["recall_pages"] = args.draft_recall_pages
    return flags


def _draft_cache(args: argparse.Namespace, positions: str, budget: int | None):
    """The draft's CacheOptions for one point: the ``--draft-*`` flags, the point's positions, a budget override."""
    ns = argparse.Namespace(**vars(args))
    ns.positions = positions
    if budget is not None:
        ns.draft_budget = budget
    return cache_options(ns, "draft_")


# ------------------------------------------------------------------------------------------------- needle
def add_needle_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of ``sparsespec needle``: model, cache and draft flags as ``generate`` has them, the test, output."""
    add_model_arguments(parser)
    add_cache_arguments(parser)
    add_draft_arguments(parser)
    test = parser.add_argument_group("the test")
    test.add_argument("--task", default="passkey", metavar="{passkey,multikey,fact}",
                      help="passkey: one five-digit number; multikey: --keys numbers, each for a named lock, one "
                           "asked for; fact: a made-up name stated once (default: %(default)s)")
    test.add_argument("--keys", type=int, default=None, metavar="N",
                      help="passkeys planted by --task multikey: the one asked about at the depth, the others at "
                           "seed-chosen depths (default: 4)")
    test.add_argument("--turns", action="store_true",
                      help="--task multikey: ask every passkey, one per turn of one conversation (the prompt's key "
                           "first, each later one as a new message), through one session as chat and serve hold it")
    test.add_argument("--text", default=DEFAULT_NEEDLE_TEXT, metavar="FILE|corpus:NAME",
                      help="the haystack: a text file, or corpus:NAME for a text of the fetched corpus "
                           "(default: %(default)s)")
    test.add_argument("--lengths", default=DEFAULT_NEEDLE_LENGTHS, metavar="N,N,...",
                      help="comma-separated prompt lengths in the model's tokens, chat template included "
                           "(default: %(default)s)")
    test.add_argument("--depths", default=DEFAULT_NEEDLE_DEPTHS, metavar="PCT,PCT,...",
                      help="comma-separated needle depths, percent of the haystack: 0 at its start, 100 just before "
                           "the question (default: %(default)s)")
    test.add_argument("--trials", type=int, default=1, metavar="N",
                      help="prompts per length and depth, each with its own needle and haystack (default: "
                           "%(default)s)")
    test.add_argument("--seed", type=int, default=0, metavar="N",
                      help="seed of the needles, haystack offsets and other depths; the same seed builds the same "
                           "prompts (default: %(default)s)")
    test.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                      help="wrap each prompt in the tokenizer's chat template as one user message; --no-chat sends "
                           "plain text ending in 'Answer:' (default: chat when the model has a template)")
    test.add_argument("--max-new-tokens", "-n", type=int, default=DEFAULT_NEEDLE_NEW_TOKENS, metavar="N",
                      help="most tokens of each greedy answer, which also stops at end-of-sequence (default: "
                           "%(default)s)")
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true",
                        help="print one JSON record per length, depth and trial instead of the summary table")
    output.add_argument("--out", default=None, metavar="FILE.jsonl", help="also append the records to this file")
    output.add_argument("--plot", default=None, metavar="FILE.png",
                        help="write a heatmap of the fraction correct by depth and length to this PNG")
    output.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _parse_budgets(text: str) -> list[int]:
    """``--budgets``: ``"64, 256"`` → ``[64, 256]``; :class:`UserError` for anything but positive integers."""
    values = []
    for item in split_list(text):
        try:
            value = int(item)
        except ValueError:
            raise UserError(f"--budgets takes comma-separated integers (got {item!r}).") from None
        if value < 1:
            raise UserError(f"Every budget must be at least 1 (got {value}).")
        values.append(value)
    return values


def _parse_numbers(text: str, flag: str, kind):
    """``"0, 25,50"`` → ``(0, 25, 50)`` as ``kind`` (int or float); :class:`UserError` for anything else."""
    values = []
    for item in split_list(text):
        try:
            values.append(kind(item))
        except ValueError:
            noun = "whole numbers" if kind is int else "numbers"
            raise UserError(f"{flag} takes comma-separated {noun} (got {item!r}).") from None
    return tuple(values)


def _model_shapes(ref: str):
    """A ``LoadedModel`` holding only the name, source and config of ``ref`` (read from its header, no weights):
    enough for the engine's context checks before anything is loaded."""
    from ..loading.load import LoadedModel
    from ..loading.source import read_config, resolve_model

    source = resolve_model(ref)
    return LoadedModel(source.name, source, read_config(source), None, None)


def _check_needle_args(args: argparse.Namespace):
    """``(setup, cache, draft settings, haystack text)`` from the flags, every mistake found before a model loads
    (the prompts' own limits, which need the tokenizer, come later); ``setup.chat`` is still to be decided."""
    from ..engine import check_fits_context
    from .needle import NeedleSetup
    from .texts import read_text

    setup = NeedleSetup(task=args.task, lengths=_parse_numbers(args.lengths, "--lengths", int),
                        depths=_parse_numbers(args.depths, "--depths", float), trials=args.trials, keys=args.keys,
                        seed=args.seed, turns=args.turns)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens}).")
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise UserError(f"--plot writes a PNG file; give a name ending in .png (got {args.plot}).")
    if args.out is not None and not args.out.endswith(".jsonl"):
        raise UserError(f"--out names a JSON-lines file; give a name ending in .jsonl (got {args.out}).")
    cache = cache_options(args)
    check_draft_flags(args)
    draft = draft_settings(args)
    text = read_text(args.text)
    # The longest prompt must fit the target (and the draft) now, not after the shorter ones have run.
    longest = max(setup.lengths) + args.max_new_tokens
    target = _model_shapes(args.model)
    check_fits_context(target, cache, longest, "The longest prompt (--lengths) plus --max-new-tokens")
    if draft is not None and draft[0] is not None:  # a draft model (not n-gram drafting alone)
        draft_model = target if args.draft == "self" else _model_shapes(args.draft)
        check_fits_context(draft_model, draft[0], longest,
                           "The longest prompt (--lengths) plus --max-new-tokens (for the draft)")
    return setup, cache, draft, text


@reworded(EVAL_PARAMETER_FLAGS)
def run_needle(args: argparse.Namespace) -> int:
    """Plant a needle at each depth of prompts of each length, ask for it greedily, score the answers."""
    from dataclasses import replace

    from ..cache.arena import require_kernels
    from ..loading.load import load_model
    from .needle import Haystack, build_prompts, cache_fields, cache_label, engine_answerer, plot_heatmap
    from .needle import run_needle_grid, summary_table, turns_answerer

    setup, cache, draft_setup, text = _check_needle_args(args)
    dtype = setup_torch(args)
    require_kernels()  # before the minutes a load may take: nothing decodes without them
    target = load_model(args.model, dtype, args.weights, role="target", activations=args.activations)
    has_template = bool(getattr(target.tokenizer, "chat_template", None))
    if args.chat and not has_template:
        raise UserError(f"{target.name} has no chat template; drop --chat.")
    setup = replace(setup, chat=has_template if args.chat is None else args.chat)
    draft = load_draft(args, target, dtype, draft_setup)
    prompts = build_prompts(target.tokenizer, Haystack(text, target.tokenizer, args.text), setup)

    context = {"model": target.name, **cache_fields(cache), "draft": None}
    model = target.name
    if draft is not None and draft.model is not None:
        context.update(draft="self" if draft.is_self else draft.model.name, gamma_setting=draft.gamma,
                       draft_cache=cache_fields(draft.cache)["cache"])
        model += f" with draft {context['draft']}"
    elif draft is not None:
        context.update(draft="ngram")
        model += " with n-gram drafts"
    if draft is not None:
        context.update(draft_ngram=draft.ngram is not None)
    try:
        out = open(args.out, "a", encoding="utf-8") if args.out else None
    except OSError as exc:
        raise UserError(f"Cannot open --out {args.out}: {exc.strerror}.") from None

    def on_record(record: dict) -> None:
        line = json.dumps(record)
        if args.json:
            print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
            out.flush()  # an interrupted run keeps the cells it finished

    try:
        answerer = turns_answerer if setup.turns else engine_answerer
        records = run_needle_grid(prompts, answerer(target, cache, draft, args.max_new_tokens), setup,
                                  context, on_record=on_record, progress=not args.quiet)
    finally:
        if out is not None:
            out.close()
    if args.plot:
        plot_heatmap(records, args.plot, f"{model}, {cache_label(cache)}")
    if not args.json:
        keys = f" ({setup.key_count} keys{', one per turn' if setup.turns else ''})" if setup.task == "multikey" else ""
        print(f"model   {model}")
        print(f"cache   {cache_label(cache)}")
        print(f"task    {setup.task}{keys}, {setup.trials} trial(s) per cell, seed {setup.seed}, "
              f"{'chat' if setup.chat else 'plain'} prompts, haystack {args.text}")
        print(summary_table(records))
        if args.plot:
            print(f"plot    {args.plot}")
    return 0
