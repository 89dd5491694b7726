"""The edge simulator's predictions for the fixture models on the packaged device profiles (Jetson, Raspberry Pi).

For each device and scenario, predicts decode tok/s of the four modes at several context lengths: ``full`` (the
whole KV cache), ``sparse`` (a hybrid cache of ``--budget`` entries, and of the largest budget that fits the
device's SRAM), ``speculative`` (draft model, full target cache) and ``combined`` (draft + sparse target), with
the acceptance measured on this machine (``--acceptance``, per-token α) and the best γ for that device.
Shapes come from the GGUF metadata (no weights are loaded). Prints a Markdown table and appends one JSON line per
row to ``--out`` (results/edge_predictions.jsonl).

    python benchmarks/edge_predictions.py                    # all packaged devices except host
    python benchmarks/edge_predictions.py --devices host     # this machine's calibrated profile
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from common import RESULTS_DIR, machine

from sparsespec.edge import load_profile
from sparsespec.edge.commands import SimulateOptions, simulate
from sparsespec.edge.profile import list_profiles
from sparsespec.loading.source import read_config, resolve_model

# (label, target, target weights, draft or None for self-speculation, draft weights)
SCENARIOS = (
    ("1.5B int4 + 0.5B int4 draft", "qwen2.5-coder-1.5b", "int4", "qwen2.5-coder-0.5b", "int4"),
    ("1.5B int8 + 0.5B int4 draft", "qwen2.5-coder-1.5b", "int8", "qwen2.5-coder-0.5b", "int4"),
    ("135M bf16, self-speculation", "smollm2-135m", "bf16", None, "bf16"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default=None, help="comma-separated profile names (default: all but host)")
    parser.add_argument("--contexts", default="2048,8192,32768")
    parser.add_argument("--budget", type=int, default=1024, help="the sparse target's budget")
    parser.add_argument("--acceptance", type=float, default=0.75,
                        help="per-token acceptance α (default: what the 0.5B draft reached on code and prose here)")
    parser.add_argument("--gamma", type=int, default=4,
                        help="γ of the speculative columns (default: 4, what RESULTS.md's table was computed with)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "edge_predictions.jsonl")
    args = parser.parse_args()
    devices = args.devices.split(",") if args.devices else [n for n in list_profiles() if n != "host"]
    configs = {}
    for _, target, _, draft, _ in SCENARIOS:
        for ref in filter(None, (target, draft)):
            if ref not in configs:
                configs[ref] = read_config(resolve_model(ref))

    header = ["device", "scenario", "context", "full", f"sparse {args.budget}", "sparse (SRAM-sized)",
              "speculative", f"combined {args.budget}", "best γ (combined)", "KV per token", f"KV at {args.budget}",
              "SRAM for KV"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in devices:
        device = load_profile(name)
        for label, target, weights, draft, draft_weights in SCENARIOS:
            for context in (int(c) for c in args.contexts.split(",")):
                options = SimulateOptions(weights=weights, draft_weights=draft_weights, acceptance=args.acceptance,
                                          context=context, gamma=args.gamma)
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


if __name__ == "__main__":
    main()
