"""Perplexity at equal KV bytes: which mix of precision and entries keeps quality best for a fixed cache size.

The reference size is the arena of a bf16 cache of ``--reference-budget`` entries read in ``--chunk``-token chunks
(budget + one chunk of staging slots, keys and values, all layers: the ``kv_cache_bytes`` the perplexity run
reports), times each of ``--fractions``. For every size, KV dtype and policy the sweep gives the budget whose arena
fits those bytes (bf16 1024 ≈ int8 1870 ≈ int4 2837 entries on qwen2.5-coder-1.5b with 64-token chunks) and
measures streaming perplexity with ``--positions`` (default in-cache, the budget study's best); the full cache is
measured at every KV dtype (quantization's cost alone). Results go to a resumable sweep file and the plots
``ppl_vs_kv_bytes.png`` (perplexity against KV MiB per dtype × policy, the full caches as dashed lines) and
``ppl_gap_vs_position.png``.

    python benchmarks/bench_kv_bytes.py                      # the study: qwen2.5-coder-1.5b, 16k tokens
    python benchmarks/bench_kv_bytes.py --policies hybrid,hybrid-age --fractions 1,0.5,0.25
    python benchmarks/bench_kv_bytes.py --model smollm2-135m --max-tokens 64 --reference-budget 16 --chunk 4 \
        --fractions 1 --out /tmp/kv_bytes_smoke.jsonl        # a smoke run

``--speed-context N`` adds decode speed after N tokens of context (per KV dtype, the first policy at the reference
budget and at the reference bytes); ``--accept-context N`` the draft's acceptance after N tokens (the full bf16
cache against each KV dtype at the reference bytes). Both go to ``<out>_speed.jsonl``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import results_dir

from sparsespec.cache.arena import KVArena
from sparsespec.cli import main as sparsespec_main
from sparsespec.eval.sweep import plot_sweep, read_records
from sparsespec.loading.source import read_config, resolve_model

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def reference_bytes(config, budget: int, staging: int, dtype: torch.dtype) -> int:
    """Bytes of a bf16 arena of ``budget`` entries plus ``staging`` slots (one perplexity chunk)."""
    per_slot = KVArena.bytes_per_slot(config, "bf16", dtype) * config.num_hidden_layers * config.num_key_value_heads
    return (budget + staging) * per_slot


def sweep_commands(args: argparse.Namespace) -> list[list[str]]:
    config = read_config(resolve_model(args.model))
    dtype = DTYPES[args.dtype]
    total = reference_bytes(config, args.reference_budget, args.chunk, dtype)
    sizes = ",".join(str(int(total * float(f))) for f in args.fractions.split(","))
    common = ["sweep", "--model", args.model, "--dtype", args.dtype, "--positions", args.positions,
              "--text", args.text]
    if args.threads:
        common += ["--threads", str(args.threads)]
    quality = common + ["--policies", "full," + args.policies, "--kv-dtypes", args.kv_dtypes, "--kv-bytes", sizes,
                        "--out", args.out, "--quality", "--max-tokens", str(args.max_tokens), "--chunk",
                        str(args.chunk)] + (["--plots", args.plots] if args.plots else [])
    commands = [] if args.no_quality else [quality]
    policy = args.policies.split(",")[0]
    kv_dtypes = args.kv_dtypes.split(",")

    def at_bytes(kv_dtype: str) -> int:  # the budget the quality points of kv_dtype have at the reference bytes
        return KVArena.budget_for_bytes(config, kv_dtype, dtype, total, args.chunk)

    speed_out = args.out.removesuffix(".jsonl") + "_speed.jsonl"
    speed = ["--speed", "--new-tokens", str(args.new_tokens), "--out", speed_out]
    if args.speed_context:  # decode after a long context: each dtype at the reference budget and at its bytes
        for kv_dtype in kv_dtypes:
            budgets = sorted({args.reference_budget, at_bytes(kv_dtype)})
            commands.append(common + speed + [
                "--policies", policy, "--kv-dtypes", kv_dtype, "--budgets", ",".join(map(str, budgets)),
                "--context-tokens", str(args.speed_context), "--prompts", "prose", "--max-prompts", "1"])
    if args.accept_context:  # acceptance of the full bf16 target and of each dtype at the reference bytes
        draft = ["--draft", args.draft, "--gammas", str(args.gamma), "--context-tokens", str(args.accept_context),
                 "--prompts", "code,prose", "--max-prompts", "1"]
        commands.append(common + speed + draft + ["--policies", "full", "--kv-dtypes", "bf16"])
        for kv_dtype in kv_dtypes:
            commands.append(common + speed + draft + ["--policies", policy, "--kv-dtypes", kv_dtype,
                                                      "--budgets", str(at_bytes(kv_dtype))])
    return commands


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--reference-budget", type=int, default=1024,
                        help="entries of the bf16 hybrid cache whose bytes are the reference (default: %(default)s)")
    parser.add_argument("--fractions", default="1,0.5",
                        help="sizes as fractions of the reference (default: %(default)s)")
    parser.add_argument("--kv-dtypes", default="bf16,int8,int4")
    parser.add_argument("--policies", default="hybrid", help="budgeted policies besides full (default: %(default)s)")
    parser.add_argument("--text", default="corpus:paradise_lost")
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=64,
                        help="perplexity chunk: 64 as the budget study in RESULTS.md; 1 is token by token, 40 times "
                             "slower (default: %(default)s)")
    parser.add_argument("--positions", default="in-cache",
                        help="position modes of the budgeted caches (default: %(default)s, the budget study's best)")
    parser.add_argument("--speed-context", type=int, default=0,
                        help="also measure decode after N tokens of context, per KV dtype at the reference budget "
                             "and at the reference bytes")
    parser.add_argument("--accept-context", type=int, default=0,
                        help="also measure the draft's acceptance after N tokens of context: the full bf16 cache "
                             "and each KV dtype at the reference bytes")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model for --accept-context")
    parser.add_argument("--gamma", type=int, default=4, help="γ for --accept-context (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-quality", action="store_true",
                        help="skip the perplexity sweep (only the --speed-context / --accept-context points)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(results_dir(__file__) / "kv_bytes.jsonl"))
    parser.add_argument("--plots", default=None, help="folder for the plots (default: next to --out)")
    parser.add_argument("--dry-run", action="store_true", help="print the sweep commands only")
    parser.add_argument("--replot", action="store_true",
                        help="only redraw the plots from the quality points already in --out")
    parser.add_argument("--plot-kv-dtypes", default=None,
                        help="comma-separated KV dtypes to plot (default: all; a failed dtype squashes the scale)")
    args = parser.parse_args()
    if args.plots is None:
        args.plots = args.out.removesuffix(".jsonl")
    if args.accept_context and not args.draft:
        parser.error("--accept-context needs a --draft")
    if args.replot:
        return replot(args)
    for command in sweep_commands(args):
        print("sparsespec " + " ".join(command), file=sys.stderr)
        if not args.dry_run:
            code = sparsespec_main(command)
            if code:
                return code
    if not args.dry_run and args.plots and not args.no_quality:
        return replot(args)
    return 0


def replot(args: argparse.Namespace) -> int:
    """The plots from every quality point in ``--out`` with the latest setup, so grids run one after another (say
    hybrid-age at bf16 only, then the other dtypes) share one figure."""
    records = [r for r in read_records(args.out) if r["quality"]]
    if not records:
        print(f"no quality points in {args.out}", file=sys.stderr)
        return 1
    wanted = set(args.plot_kv_dtypes.split(",")) if args.plot_kv_dtypes else None
    records = [r for r in records if r["setup"] == records[-1]["setup"]
               and (wanted is None or r["kv_dtype"] in wanted)]
    for path in plot_sweep(records, args.plots):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
