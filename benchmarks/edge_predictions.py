"""The edge simulator's predictions for the fixture models on the packaged device profiles (Jetson, Raspberry Pi).

For each device and scenario, predicts decode tok/s of the four modes at several context lengths: ``full`` (the
whole KV cache), ``sparse`` (a hybrid cache of ``--budget`` entries, and of the largest budget that fits the
device's SRAM), ``speculative`` (draft model, full target cache) and ``combined`` (draft + sparse target), with
the acceptance measured on this machine (``--acceptance``, per-token α) and the best γ for that device. The
weights are the GGUF files' own blocks (the engine's native format: their bytes by block type from the headers;
no weights are loaded). Prints a Markdown table and appends one JSON line per row to ``--out``
(results/edge_predictions/edge_predictions.jsonl); ``--readme`` prints only the guide's edge table (the 1.5B with the
0.5B draft at 8k tokens) and writes nothing.

    python benchmarks/edge_predictions.py                    # all packaged devices except host
    python benchmarks/edge_predictions.py --devices host     # this machine's calibrated profile
    python benchmarks/edge_predictions.py --readme           # the guide's edge table (docs/guide.md)
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from common import machine, results_dir

from sparsespec.edge import load_profile
from sparsespec.edge.commands import SimulateOptions, native_streamed_bytes, simulate
from sparsespec.flags import DEFAULT_GAMMA
from sparsespec.edge.profile import list_profiles
from sparsespec.loading.source import read_config, resolve_model

# (label, target, draft or None for self-speculation), all in their GGUF files' own blocks
SCENARIOS = (
    ("1.5B Q4_K_M + 0.5B Q4_K_M draft", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
    ("135M Q4_1, self-speculation", "smollm2-135m", None),
)
README_CONTEXT = 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default=None, help="comma-separated profile names (default: all but host)")
    parser.add_argument("--contexts", default="2048,8192,32768")
    parser.add_argument("--budget", type=int, default=1024, help="the sparse target's budget")
    parser.add_argument("--acceptance", type=float, default=0.75,
                        help="per-token acceptance α (default: what the 0.5B draft reached on code and prose here)")
    parser.add_argument("--gamma", type=int, default=DEFAULT_GAMMA,
                        help="γ of the speculative columns (default: %(default)s, the engine's)")
    parser.add_argument("--out", type=Path, default=results_dir(__file__) / "edge_predictions.jsonl")
    parser.add_argument("--readme", action="store_true",
                        help="print only the guide's edge table (docs/guide.md), write nothing")
    args = parser.parse_args()
    devices = args.devices.split(",") if args.devices else [n for n in list_profiles() if n != "host"]
    configs, native = {}, {}
    for _, target, draft in SCENARIOS:
        for ref in filter(None, (target, draft)):
            if ref not in configs:
                configs[ref] = read_config(resolve_model(ref))
                native[ref] = native_streamed_bytes(ref)
    if args.readme:
        print_readme_table(devices, configs, native, args)
        return

    header = ["device", "scenario", "context", "full", f"sparse {args.budget}", "sparse (SRAM-sized)",
              "speculative", f"combined {args.budget}", "best γ (combined)", "KV per token", f"KV at {args.budget}",
              "SRAM for KV"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in devices:
        device = load_profile(name)
        for label, target, draft in SCENARIOS:
            for context in (int(c) for c in args.contexts.split(",")):
                options = native_options(target, draft, native, args, context)
                names = dict(draft=configs[draft] if draft else None, model_name=target, draft_name=draft)
                sized = simulate(configs[target], device, options, **names)
                fixed = simulate(configs[target], device, replace(options, budget=args.budget), **names)
                modes, info = fixed["modes"], fixed["model_info"]
                row = {
                    "device": name, "scenario": label, "context": context, "acceptance": args.acceptance,
                    "full": modes["full"]["tokens_per_second"],
                    "sparse": modes["sparse"]["tokens_per_second"],
                    "sparse_sram_sized": sized["modes"]["sparse"]["tokens_per_second"],
                    "sram_sized_budget": sized["settings"]["budget"],
                    "speculative": modes["speculative"]["tokens_per_second"],
                    "combined": modes["combined"]["tokens_per_second"],
                    "best_gamma_combined": fixed["best_gamma"]["combined"],
                    "kv_bytes_per_token": info["kv_bytes_per_token"],
                    "kv_bytes_at_budget": modes["sparse"]["kv_bytes"],
                    "kv_at_budget_in_sram": modes["sparse"]["kv_in_sram"],
                    "sram_kv_budget_bytes": fixed["sram"]["kv_budget_bytes"],
                    "fits_memory": info["fits_memory"],
                }
                with args.out.open("a") as f:
                    f.write(json.dumps({"bench": "edge_prediction", **row, "date": machine()["date"]}) + "\n")
                best = row["best_gamma_combined"]
                print("| " + " | ".join(str(c) for c in [
                    name, label, context, f"{row['full']:.1f}", f"{row['sparse']:.1f}",
                    f"{row['sparse_sram_sized']:.1f} (budget {row['sram_sized_budget']})", f"{row['speculative']:.1f}",
                    f"{row['combined']:.1f}", f"γ={best['gamma']}: {best['tokens_per_second']:.1f}",
                    f"{row['kv_bytes_per_token'] / 1024:.0f} KiB", f"{row['kv_bytes_at_budget'] / 2**20:.1f} MiB"
                    + (" (in SRAM)" if row["kv_at_budget_in_sram"] else ""),
                    f"{row['sram_kv_budget_bytes'] / 2**20:.2f} MiB"]) + " |", flush=True)


def native_options(target: str, draft: str | None, native: dict, args, context: int) -> SimulateOptions:
    """The simulator's settings for a scenario in the GGUF files' own blocks."""
    return SimulateOptions(weights="native", native_bytes=native[target],
                           draft_native_bytes=native[draft] if draft else None, acceptance=args.acceptance,
                           context=context, gamma=args.gamma)


def print_readme_table(devices: list[str], configs: dict, native: dict, args) -> None:
    """The guide's edge table (docs/guide.md, "The edge simulator"): the first scenario at README_CONTEXT tokens, tok/s of each mode per device."""
    label, target, draft = SCENARIOS[0]
    print(f"| device ({label}, {README_CONTEXT:,} tokens, α = {args.acceptance}, γ = {args.gamma}) | full cache | "
          f"hybrid {args.budget} | draft, full cache | draft + hybrid {args.budget} |")
    print("|---|---|---|---|---|")
    for name in devices:
        options = replace(native_options(target, draft, native, args, README_CONTEXT), budget=args.budget)
        modes = simulate(configs[target], load_profile(name), options, draft=configs[draft])["modes"]
        print(f"| {name} | " + " | ".join(f"{modes[m]['tokens_per_second']:.1f}" for m in
                                         ("full", "sparse", "speculative", "combined")) + " |")


if __name__ == "__main__":
    main()
