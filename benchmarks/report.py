"""Markdown tables from the JSON lines in ``benchmarks/results/`` (pasted into RESULTS.md).

    python benchmarks/report.py engine|arena|speculative
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def rows(name: str) -> list[dict]:
    path = RESULTS / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(header: list[str], body: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def engine() -> str:
    records = rows("engine")
    bandwidths = [r["bytes_per_s"] / 1e9 for r in records if r["bench"] == "dram_read"]
    body = []
    for r in records:
        if r["bench"] != "engine":
            continue
        hf = r.get("transformers_tok_s")
        body.append([r["model"], r["weights"], f"{r['ours_tok_s']:.1f}", f"{hf:.1f}" if hf else "—",
                     f"{r['speedup_vs_transformers']:.2f}×" if hf else "—", f"{r['weight_bytes_per_token'] / 1e9:.2f}",
                     f"{r['effective_gb_s']:.1f}", r["loadavg"]])
    out = table(["model", "weights", "ours tok/s", "transformers tok/s", "ratio", "GB read / token",
                 "effective GB/s", "load"], body)
    return out + f"\n\nDRAM read bandwidth measured in the same runs (GB/s): {', '.join(f'{b:.0f}' for b in bandwidths)}"


def arena() -> str:
    body = []
    for r in rows("arena"):
        if r["bench"] != "arena_context":
            continue
        label = r["policy"] + (f" {r['budget']}" if r["budget"] else "")
        body.append([r["model"], r["context"], label, r["positions"], f"{r['tokens_per_s']:.1f}",
                     f"{r['prefill_seconds']:.1f}", f"{r['kv_cache_bytes'] / 2**20:.1f}", r["rss_mb_after"]])
    return table(["model", "context", "cache", "positions", "decode tok/s", "prefill s", "KV MiB", "RSS MiB"], body)


def speculative() -> str:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows("speculative"):
        if r.get("mode") == "transformers":
            groups[("transformers", r["kind"], "", "")].append(r)
        else:
            groups[(r["mode"], r["kind"], r.get("target_weights", "dense"), r.get("draft_weights", "dense"))].append(r)
    body = []
    for (mode, kind, tw, dw), rs in sorted(groups.items()):
        if mode == "transformers":
            body.append([mode, kind, "bf16", "bf16", f"{statistics.median(r['transformers_tok_s'] for r in rs):.1f}",
                         f"assisted {statistics.median(r['transformers_assisted_tok_s'] for r in rs):.1f}", "", "", len(rs)])
            continue
        med = lambda key: statistics.median(r.get(key, 0) or 0 for r in rs)  # noqa: E731
        body.append([mode, kind, tw, dw, f"{med('tokens_per_s'):.1f}",
                     f"{med('speedup_vs_autoregressive'):.2f}×" if mode != "autoregressive" else "1.00×",
                     f"{med('acceptance_rate'):.2f}" if mode != "autoregressive" else "",
                     f"{med('tokens_per_target_pass'):.2f}" if mode != "autoregressive" else "", len(rs)])
    return table(["mode", "prompts", "target weights", "draft weights", "tok/s (median)", "vs AR", "acceptance",
                  "tokens / pass", "n"], body)


if __name__ == "__main__":
    print({"engine": engine, "arena": arena, "speculative": speculative}[sys.argv[1]]())
