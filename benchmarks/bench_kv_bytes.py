"""Perplexity at equal KV bytes: which mix of precision and entries keeps quality best for a fixed cache size.

The reference size is the arena of a bf16 hybrid cache of ``--reference-budget`` entries read token by token
(budget + one staging slot, keys and values, all layers: the ``kv_cache_bytes`` the perplexity run reports), times
each of ``--fractions``. For every size, KV dtype and policy the sweep gives the budget whose arena fits those bytes
(bf16 1024 ≈ int8 1821 ≈ int4 2732 entries on qwen2.5-coder-1.5b) and measures streaming perplexity; the full cache
is measured at every KV dtype (quantization's cost alone). Results go to a resumable sweep file and the plots
``ppl_vs_kv_bytes.png`` (perplexity against KV MiB per dtype × policy, the full caches as dashed lines) and
``ppl_gap_vs_position.png``.

    python benchmarks/bench_kv_bytes.py                      # the study: qwen2.5-coder-1.5b, 16k tokens
    python benchmarks/bench_kv_bytes.py --policies hybrid,hybrid-age --fractions 1,0.5,0.25
    python benchmarks/bench_kv_bytes.py --model smollm2-135m --max-tokens 64 --reference-budget 16 \
        --fractions 1 --out /tmp/kv_bytes_smoke.jsonl        # a smoke run

``--speed-context N`` adds decode speed and, with ``--draft``, acceptance after N tokens of context at the same
points (a second sweep over the same grid, speed only).
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import RESULTS_DIR

from sparsespec.cache.arena import KVArena
from sparsespec.cli import main as sparsespec_main
from sparsespec.loading.source import read_config, resolve_model

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def reference_bytes(model: str, budget: int, dtype: torch.dtype) -> int:
    """Bytes of a bf16 arena of ``budget`` entries plus one staging slot for ``model`` (chunk-1 perplexity)."""
    config = read_config(resolve_model(model))
    per_slot = KVArena.bytes_per_slot(config, "bf16", dtype) * config.num_hidden_layers * config.num_key_value_heads
    return (budget + 1) * per_slot


def sweep_commands(args: argparse.Namespace) -> list[list[str]]:
    total = reference_bytes(args.model, args.reference_budget, DTYPES[args.dtype])
    sizes = ",".join(str(int(total * float(f))) for f in args.fractions.split(","))
    common = ["sweep", "--model", args.model, "--dtype", args.dtype, "--policies", "full," + args.policies,
              "--kv-dtypes", args.kv_dtypes, "--kv-bytes", sizes, "--text", args.text, "--out", args.out]
    if args.threads:
        common += ["--threads", str(args.threads)]
    commands = [common + ["--quality", "--max-tokens", str(args.max_tokens)]
                + (["--plots", args.plots] if args.plots else [])]
    if args.speed_context:
        speed = common + ["--speed", "--context-tokens", str(args.speed_context), "--new-tokens",
                          str(args.new_tokens), "--prompts", "prose", "--max-prompts", "1"]
        if args.draft:
            speed += ["--draft", args.draft]
        commands.append(speed)
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
    parser.add_argument("--speed-context", type=int, default=0, help="also measure decode after N context tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft", default=None, help="draft model for acceptance in the speed runs")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS_DIR / "kv_bytes.jsonl"))
    parser.add_argument("--plots", default=None, help="folder for the plots (default: next to --out)")
    parser.add_argument("--dry-run", action="store_true", help="print the sweep commands only")
    args = parser.parse_args()
    if args.plots is None:
        args.plots = args.out.removesuffix(".jsonl")
    for command in sweep_commands(args):
        print("sparsespec " + " ".join(command), file=sys.stderr)
        if not args.dry_run:
            code = sparsespec_main(command)
            if code:
                return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
