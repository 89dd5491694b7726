"""Command-line flags shared by several commands: model, weights, threads and KV cache options.

The command modules (``cli.py``, ``eval/commands.py``, ``edge/commands.py`` …) import these; this module imports
only the core, so commands depend on the core and never on each other.
"""

from __future__ import annotations

import argparse

from .activations import ACTIVATION_CHOICES, FLOAT_ACTIVATIONS_MAX_PARAMETERS
from .errors import UserError, reworded
from .speedup import DEFAULT_GAMMA

WEIGHT_CHOICES = ("auto", "native", "dense", "bf16", "int8", "int4")
KV_DTYPE_CHOICES = ("auto", "bf16", "int8", "int4")  # as cache/quant.py's KV_DTYPES (kept torch-free here)
RETENTION_CHOICES = ("auto", "query", "off")  # as cache/retention.py's RETENTION_MODES
SIZE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}
# The draft's hybrid cache when no --draft-policy / --draft-budget is given: the knee of the measured acceptance.
# Fewer entries lost acceptance on prose at short context; more gained nothing at the contexts measured and cost
# draft time:
# benchmarks/history/speculative.md#draft-budget-against-context-bench_draft_budgetpy
DEFAULT_DRAFT_BUDGET = 256
# Without --gamma, greedy decoding drafts only while that is measured faster than the target alone (DraftWhileFaster).
CACHE_SIZE_FLAGS = ("budget", "sinks", "heavy", "window")

# The library's parameters (errors.ConfigError) as the command line names them, for the sentence the user sees
# (errors.user_message): the flags defined below that set them. The draft's cache flags and the n-gram flags have
# tables of their own (DRAFT_CACHE_FLAGS, NGRAM_PARAMETER_FLAGS), used where those settings are read.
PARAMETER_FLAGS = {
    "activations": "--activations",
    "budget": "--budget",
    "force_context": "--force-context",
    "gamma": "--gamma",
    "heavy": "--heavy",
    "kv_bytes": "--kv-bytes",
    "kv_dtype": "--kv-dtype",
    "max_new_tokens": "--max-new-tokens",
    "policy": "--policy",
    "positions": "--positions",
    "prefill_chunk": "--prefill-chunk",
    "recall_pages": "--recall-pages",
    "recent_window": "--kv-recent",
    "retention": "--retention",
    "retention_tokens": "--retention-tokens",
    "sinks": "--sinks",
    "temperature": "--temperature",
    "threads": "--threads",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "weights": "--weights",
    "window": "--window",
}
# The draft's cache settings are the same parameters, set by the --draft- copies of the cache flags.
DRAFT_CACHE_FLAGS = {param: "--draft-" + PARAMETER_FLAGS[param][2:] for param in (
    "policy", "budget", "sinks", "heavy", "window", "kv_dtype", "recent_window", "retention", "retention_tokens",
    "recall_pages")}
# NgramOptions' parameters.
NGRAM_PARAMETER_FLAGS = {"min_n": "--ngram-min", "max_n": "--ngram-max", "max_tokens": "--ngram-tokens"}


def add_model_arguments(parser: argparse.ArgumentParser, default_model: str | None = "smollm2-135m") -> None:
    parser.add_argument("--model", "-m", default=default_model,
                        help="fixture name, .gguf file or Hugging Face folder (default: %(default)s)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype")
    parser.add_argument("--weights", choices=WEIGHT_CHOICES, default=None,
                        help="weight format of the projections: native (the GGUF file's own blocks, native kernels), "
                        "dense (= bf16: in --dtype), int8, int4, or auto (default: native for a GGUF file the "
                        "kernels read; else target int8 / draft int4 with bfloat16, dense with float32)")
    parser.add_argument("--activations", choices=ACTIVATION_CHOICES, default="auto",
                        help="what the model's native weights multiply: int8 (activations quantized per block: "
                        "fastest), float (as they are: a float model's arithmetic with the file's weights), or auto "
                        f"(default: float for models of at most {FLOAT_ACTIVATIONS_MAX_PARAMETERS // 10**6}M "
                        "parameters, else int8; a --draft model always takes auto)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")


def add_cache_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """Cache flags; ``prefix="draft-"`` gives the draft's copies (``--draft-policy`` …)."""
    p = f"--{prefix}"
    parser.add_argument(f"{p}policy", default=None,
                        help="full | window | streaming | h2o | hybrid | hybrid-age | hybrid-decay (default: "
                        + (f"hybrid, budget {DEFAULT_DRAFT_BUDGET})" if prefix else "full, or hybrid when a budget or size is given)"))
    parser.add_argument(f"{p}budget", type=int, default=None, help="KV entries kept per layer and head")
    parser.add_argument(f"{p}sinks", type=int, default=None, help="attention sinks (first tokens) kept")
    parser.add_argument(f"{p}heavy", type=int, default=None, help="heavy hitters kept")
    parser.add_argument(f"{p}window", type=int, default=None, help="most recent tokens kept")
    # The draft's default is None (meaning auto) so that a --draft-kv-dtype without a draft can be refused.
    parser.add_argument(f"{p}kv-dtype", choices=KV_DTYPE_CHOICES, default=None if prefix else "auto",
                        help="storage of the cached keys and values: auto (the compute dtype), bf16, or int8 / int4 "
                        "codes in groups of 32 / 16 channels with float16 scales (default: auto)")
    parser.add_argument(f"{p}kv-recent", type=int, default=None, metavar="N",
                        help="int8 / int4 entries: the N most recent positions are also kept, and read, in the "
                        "compute dtype (default: 32 for int4, 0 for int8)")
    parser.add_argument(f"{p}retention", choices=RETENTION_CHOICES, default=None,
                        help="query-aware retention: at the end of each prompt, a budgeted cache keeps what the "
                        "prompt's last 32 rows (the question) attend to, instead of evicting it while the prompt is "
                        "read: query, off, or auto (the default: query for h2o / hybrid policies, off for the others)")
    parser.add_argument(f"{p}retention-tokens", type=int, default=None, metavar="N",
                        help="with retention: the most prompt tokens held whole before the selection (the arena's "
                        "peak is budget + N entries; earlier tokens are evicted as the policy says) "
                        "(default: 16384, or the model's context minus the budget where less)")
    parser.add_argument(f"{p}recall-pages", type=int, default=None, metavar="N",
                        help="keep what a budgeted cache evicts in a cold tier (int4 pages of 16 entries in host "
                        "memory) and let each decode row also attend to the N pages its query points at "
                        "(default: no cold tier)")
    if not prefix:
        parser.add_argument("--kv-bytes", default=None, metavar="SIZE",
                            help="the cache's size in bytes (plain, or with a KiB / MiB / GiB suffix) instead of "
                            "--budget: the most entries whose arena — keys and values at --kv-dtype, all layers, "
                            "staging slots included, the kv_cache_bytes figure — fits")
        parser.add_argument("--positions", choices=("original", "in-cache"), default="original",
                            help="RoPE positions: true positions, or ranks inside a budgeted cache (StreamingLLM)")
        parser.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill pass")
        parser.add_argument("--force-context", action="store_true",
                            help="allow positions (true ones, or in-cache ranks) beyond the model's trained context")


def parse_size(text: str, flag: str = "--kv-bytes") -> int:
    """``"28MiB"`` → 29360128: a whole number of bytes, or a number with a KiB / MiB / GiB suffix."""
    import re

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match and SIZE_UNITS.get(match.group(2).lower())
    if not unit or (unit == 1 and "." in match.group(1)):
        raise UserError(f"{flag} takes a size in bytes, optionally with a KiB, MiB or GiB suffix (got {text!r}).")
    return int(float(match.group(1)) * unit)


def cache_options(args: argparse.Namespace, prefix: str = ""):
    """CacheOptions from parsed flags (``prefix="draft_"`` for the draft, which shares positions and chunk).

    ``--positions in-cache`` with the target's full cache is an error: with nothing evicted, ranks inside the cache
    are the true positions, so the flag would do nothing.

    With ``--kv-bytes`` the policy gets the budget of a one-slot staging (the model's shapes are read from its
    header); the arena built for the run sizes it exactly (see :func:`~sparsespec.engine.sized_policy`).
    """
    from .cache.policy import make_policy
    from .engine import CacheOptions

    name = getattr(args, f"{prefix}policy")
    budget = getattr(args, f"{prefix}budget")
    sizes = {part: getattr(args, f"{prefix}{part}") for part in ("sinks", "heavy", "window")}
    kv_dtype = getattr(args, f"{prefix}kv_dtype", None) or "auto"
    recent_window = getattr(args, f"{prefix}kv_recent", None)
    kv_bytes = None if prefix or getattr(args, "kv_bytes", None) is None else parse_size(args.kv_bytes)
    sized = budget is not None or any(v is not None for v in sizes.values())
    if kv_bytes is not None:
        if budget is not None or sizes["heavy"] is not None or sizes["window"] is not None:
            raise UserError("--kv-bytes sets the budget; drop --budget, --heavy and --window (--sinks may stay).")
        from .engine import sized_policy
        from .loading.load import DTYPES
        from .loading.source import read_config, resolve_model

        config = read_config(resolve_model(args.model))
        policy = sized_policy(name or "hybrid", sizes["sinks"], config, DTYPES[args.dtype], kv_dtype, kv_bytes, 1,
                              recent_window=recent_window)
    else:
        if name is None:
            name = "hybrid" if prefix or sized else "full"
            if prefix and not sized:
                budget = DEFAULT_DRAFT_BUDGET
        policy = make_policy(name, budget, **sizes)
    if not prefix and policy.is_full and args.positions == "in-cache":
        raise UserError("--positions in-cache ranks tokens inside a budgeted cache; the full cache evicts nothing, "
                        "so give --policy/--budget or drop --positions.")
    retention = getattr(args, f"{prefix}retention", None) or "auto"
    retention_tokens = getattr(args, f"{prefix}retention_tokens", None)
    return CacheOptions(policy, args.positions, args.prefill_chunk, args.force_context, kv_dtype, kv_bytes,
                        recent_window, retention, retention_tokens, getattr(args, f"{prefix}recall_pages", None))


# --draft's value that drafts from n-gram matches in the text alone (no draft model).
NGRAM_DRAFT = "ngram"


def add_draft_arguments(parser: argparse.ArgumentParser) -> None:
    """``sparsespec generate``'s draft flags: ``--draft``, ``--draft-weights``, ``--draft-vocab``, ``--gamma``, the
    draft's cache flags (``--draft-policy`` …) and n-gram drafting's (``--draft-ngram``, ``--ngram-*``)."""
    from .ngram import DEFAULT_MAX_N, DEFAULT_MAX_TOKENS, DEFAULT_MIN_N

    parser.add_argument("--draft", default=None,
                        help=f"speculative decoding: a draft model, 'self' (the target's own weights with a small "
                        f"cache), or '{NGRAM_DRAFT}' (proposals from n-gram matches in the text so far, no draft "
                        "model)")
    parser.add_argument("--draft-ngram", choices=("on", "off"), default=None,
                        help="with a draft model: also propose from n-gram matches in the text so far, taking them "
                        "in the rounds where they are expected to pay more (default: on)")
    parser.add_argument("--ngram-min", type=int, default=None, metavar="N",
                        help=f"n-gram drafting: the shortest suffix matched (default: {DEFAULT_MIN_N})")
    parser.add_argument("--ngram-max", type=int, default=None, metavar="N",
                        help=f"n-gram drafting: the longest suffix matched (default: {DEFAULT_MAX_N})")
    parser.add_argument("--ngram-tokens", type=int, default=None, metavar="N",
                        help=f"n-gram drafting: the most tokens one round proposes (default: {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--draft-weights", choices=WEIGHT_CHOICES, default=None,
                        help="the draft's weight format (default: as --weights)")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="the draft scores only the first N token ids (a smaller head to read; output unchanged)")
    parser.add_argument("--draft-sibling", action="store_const", const=True, default=None,
                        help="a draft model's rounds also verify its runner-up for the first token beside the chain (a "
                        "tree of one more row): a token more where the target rejects the first proposal for the "
                        "runner-up; pays where verification rows are cheap")
    parser.add_argument("--gamma", default=None,
                        help=f"draft tokens per round, or 'auto' (default: {DEFAULT_GAMMA}, greedy decoding drafting "
                        "only while measured faster than the target alone; needs --draft)")
    add_cache_arguments(parser, prefix="draft-")


def check_draft_flags(args: argparse.Namespace) -> None:
    """Raise :class:`UserError` for draft flags that would do nothing: any of them without ``--draft``,
    ``--draft-weights`` / ``--draft-vocab`` with ``--draft self`` (which drafts with the target's own weights), the
    draft model's flags with ``--draft ngram`` (which has no draft model), and the n-gram flags with
    ``--draft-ngram off``."""
    if not args.draft:
        reject_without(draft_flags_given(args), "--draft")
    elif args.draft == "self" and (args.draft_weights is not None or args.draft_vocab is not None):
        raise UserError("--draft self drafts with the target's own weights and head; drop --draft-weights and "
                        "--draft-vocab.")
    elif args.draft == NGRAM_DRAFT:
        model_flags = [flag for flag in draft_flags_given(args) if flag not in NGRAM_FLAGS]
        reject_without(model_flags, "a draft model", f" (--draft {NGRAM_DRAFT} drafts from the text alone)")
        if args.draft_ngram == "off":
            raise UserError(f"--draft {NGRAM_DRAFT} drafts from n-gram matches alone; drop --draft-ngram off.")
    if args.draft_ngram == "off":
        reject_without([flag for flag in draft_flags_given(args) if flag in NGRAM_FLAGS[1:]], "n-gram drafting",
                       " (--draft-ngram off)")


# The n-gram drafting flags (draft_flags_given names them so).
NGRAM_FLAGS = ("--draft-ngram", "--ngram-min", "--ngram-max", "--ngram-tokens")


def draft_settings(args: argparse.Namespace):
    """``(draft CacheOptions or None, γ or None, only while faster, NgramOptions or None, sibling)`` from the flags, or None
    without ``--draft``: checked before anything loads. Without ``--gamma``: γ = :data:`DEFAULT_GAMMA` while
    drafting pays (``DraftOptions.only_while_faster``). n-gram proposals are on unless ``--draft-ngram off``."""
    from .engine import parse_gamma
    from .ngram import NgramOptions

    if not args.draft:
        return None
    sizes = {name: value for name, value in (("min_n", args.ngram_min), ("max_n", args.ngram_max),
                                             ("max_tokens", args.ngram_tokens)) if value is not None}
    with reworded(NGRAM_PARAMETER_FLAGS):
        ngram = NgramOptions(**sizes) if args.draft_ngram != "off" else None
    if args.draft == NGRAM_DRAFT:
        return None, None, False, ngram, False
    with reworded({**PARAMETER_FLAGS, **DRAFT_CACHE_FLAGS}):
        cache = cache_options(args, "draft_")
    return cache, parse_gamma(args.gamma or str(DEFAULT_GAMMA)), args.gamma is None, ngram, bool(args.draft_sibling)


def load_draft(args: argparse.Namespace, target, dtype, settings):
    """The ``DraftOptions`` of ``--draft`` (None without one): n-gram proposals alone for ``ngram``, ``target``
    itself for ``self``, else the draft model loaded in ``--draft-weights``, its head cut to ``--draft-vocab`` ids;
    ``settings`` from :func:`draft_settings`."""
    from .engine import DraftOptions
    from .loading.load import load_model

    if settings is None:
        return None
    cache, gamma, only_while_faster, ngram, sibling = settings
    if args.draft == NGRAM_DRAFT:
        return DraftOptions(None, None, None, ngram=ngram)
    if args.draft == "self":
        return DraftOptions(target, cache, gamma, is_self=True, only_while_faster=only_while_faster, ngram=ngram,
                            sibling=sibling)
    model = load_model(args.draft, dtype, args.draft_weights, role="draft", share_tokenizer=target.tokenizer)
    if args.draft_vocab is not None:
        model.model.limit_vocabulary(args.draft_vocab)
    return DraftOptions(model, cache, gamma, only_while_faster=only_while_faster, ngram=ngram, sibling=sibling)


def draft_flags_given(args: argparse.Namespace) -> list[str]:
    """The ``--draft-*`` flags (and ``--gamma``) set on the command line, by their option names.

    Their defaults are all None, so "set" means "not None".
    """
    names = ["weights", "policy", "vocab", *CACHE_SIZE_FLAGS, "kv_dtype", "kv_recent", "retention",
             "retention_tokens", "recall_pages", "ngram", "sibling"]
    given = [f"--draft-{n.replace('_', '-')}" for n in names if getattr(args, f"draft_{n}", None) is not None]
    given += [f"--ngram-{n}" for n in ("min", "max", "tokens") if getattr(args, f"ngram_{n}", None) is not None]
    if getattr(args, "gamma", None) is not None:
        given.insert(0, "--gamma")
    return given


def reject_without(given: list[str], needed: str, reason: str = "") -> None:
    """Raise :class:`UserError` naming ``given`` flags that do nothing without ``needed``."""
    if given:
        verb = "does" if len(given) == 1 else "do"
        raise UserError(f"{', '.join(given)} {verb} nothing without {needed}{reason}; drop "
                        + ("it." if len(given) == 1 else "them."))


def prefetch_models(args: argparse.Namespace) -> None:
    """Start mapping the stored builds of ``--model`` and ``--draft`` in the background, before the command imports
    torch (``loading/weight_store.py``); the loads take them."""
    from .loading.weight_store import prefetch_stored_models

    draft_weights = getattr(args, "draft_weights", None) or args.weights
    draft = getattr(args, "draft", None)
    prefetch_stored_models([args.model, None if draft == NGRAM_DRAFT else draft], args.dtype,
                           [args.weights, draft_weights])


# More threads than this many per core only queue for the cores (each pass's barriers then wait on the slowest).
MAX_THREADS_PER_CORE = 4


def check_threads(threads: int) -> int:
    """``threads`` if the engine can use it: refused below 1 or above :data:`MAX_THREADS_PER_CORE` per core this
    process may run on, with a warning above one per core."""
    import os
    import sys

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not 1 <= threads <= MAX_THREADS_PER_CORE * cores:
        raise UserError(f"--threads must be from 1 to {MAX_THREADS_PER_CORE * cores} ({MAX_THREADS_PER_CORE} per "
                        f"core of the {cores} this process may use; got {threads}).")
    if threads > cores:
        print(f"sparsespec: warning: --threads {threads} is more than the {cores} cores this process may use; the "
              "threads will take turns on them, which is slower than one per core.", file=sys.stderr)
    return threads


def setup_torch(args: argparse.Namespace):
    import torch

    if args.threads is not None:
        torch.set_num_threads(check_threads(args.threads))
    from .loading.load import DTYPES

    if args.weights is None:
        args.weights = "auto"
    if getattr(args, "draft_weights", "") is None:
        args.draft_weights = args.weights
    return DTYPES[args.dtype]
