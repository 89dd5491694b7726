"""Markdown tables from the JSON lines in ``benchmarks/results/<script>/`` (pasted into RESULTS.md).

    python benchmarks/report.py engine|arena|speculative|simulator [--since "2026-11-30 07:20"]
    python benchmarks/report.py ppl --sweep sweep_ppl_qwen [--span 8192:16384]
    python benchmarks/report.py kv-bytes [--sweep kv_bytes] [--span 8192:16384]
    python benchmarks/report.py kv-speed [--sweep kv_bytes_speed]

``--since`` keeps only the records written at or after that UTC time (records carry ``date``), so a table shows
one run rather than every run appended to the file. ``--span`` gives the ppl table over a stretch of the text only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


SINCE = ""  # set from --since


def results_file(name: str) -> Path:
    """``results/<script>/<name>.jsonl``: each script writes into a folder of its own, and the names are unique across
    the folders, so a table names its file alone."""
    found = sorted(RESULTS.glob(f"*/{name}.jsonl"))
    if len(found) != 1:
        raise SystemExit(f"{name}.jsonl: {len(found)} files under {RESULTS} (expected one)")
    return found[0]


def rows(name: str) -> list[dict]:
    path = results_file(name)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if not SINCE or r.get("date", "") >= SINCE]


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
                     f"{r['prefill_seconds']:.1f}", f"{r['kv_cache_bytes'] / 2**20:.1f}", r.get("rss_mb_peak", "—"),
                     r.get("rss_mb_peak_growth", "—"), r["loadavg"]])
    return table(["model", "context", "cache", "positions", "decode tok/s", "prefill s", "KV MiB", "peak RSS MiB",
                  "peak RSS growth MiB", "load"], body)


def speculative() -> str:
    """Medians per (target, its cache, context, temperature, mode, prompt kind, weight formats)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows("speculative"):
        setting = (r.get("target", "qwen2.5-coder-1.5b"), r.get("target_cache", "full"), r.get("context", 0) // 1024,
                   r.get("temperature", 0.0))
        if r.get("mode") == "transformers":
            groups[(*setting, "transformers", r["kind"], "bf16", "bf16")].append(r)
        else:
            groups[(*setting, r["mode"], r["kind"], r.get("target_weights", "dense"),
                    r.get("draft_weights", "dense"))].append(r)
    body = []
    for (target, cache, kilo, temperature, mode, kind, tw, dw), rs in sorted(groups.items()):
        setting = [target, cache, f"{kilo}k" if kilo else "short", temperature]
        if mode == "transformers":
            body.append([*setting, mode, kind, tw, dw,
                         f"{statistics.median(r['transformers_tok_s'] for r in rs):.1f}",
                         f"assisted {statistics.median(r['transformers_assisted_tok_s'] for r in rs):.1f}",
                         "", "", "", len(rs)])
            continue
        med = lambda key: statistics.median(r.get(key, 0) or 0 for r in rs)  # noqa: E731
        spec = mode != "autoregressive"
        body.append([*setting, mode, kind, tw, dw, f"{med('tokens_per_s'):.1f}",
                     f"{med('speedup_vs_autoregressive'):.2f}×" if spec else "1.00×",
                     f"{med('acceptance_rate'):.2f}" if spec else "",
                     f"{med('tokens_per_target_pass'):.2f}" if spec else "",
                     f"{med('draft_target_cost_ratio'):.2f}" if spec else "", len(rs)])
    return table(["target", "target cache", "context", "temp", "mode", "prompts", "target weights", "draft weights",
                  "tok/s (median)", "vs AR (median of ratios)", "acceptance", "tokens / pass", "cost ratio", "n"],
                 body)


def simulator() -> str:
    """Predicted vs measured tok/s per configuration (``bench_simulator.py``)."""
    body = []
    for r in rows("simulator"):
        if r["bench"] != "simulator":
            continue
        body.append([r["config"], r["target"], r["draft"] or "—", r["budget"] or "full", r["prompt_tokens"],
                     f"{r['measured_tok_s']:.2f}", " / ".join(f"{x:.1f}" for x in r["runs"]),
                     f"{r['predicted_tok_s']:.2f}", f"{r['error_fraction'] * 100:+.0f}%", r["loadavg"]])
    return table(["config", "target", "draft", "target cache", "context", "measured tok/s (median)", "runs",
                  "predicted tok/s", "error", "load"], body)


def span_ppl(quality: dict, span: tuple[int, int] | None) -> float:
    """Perplexity over token positions ``[start, end)`` (multiples of the record's window): the geometric mean of
    its window perplexities (the text's first window predicts one token fewer); the whole text's without a span."""
    if span is None:
        return quality["ppl"]
    window = quality["window"]
    curve = quality["window_ppl"][span[0] // window: span[1] // window]
    return math.exp(sum(math.log(v) for v in curve) / len(curve))


def ppl(sweep: str, span: tuple[int, int] | None = None) -> str:
    """Perplexity per policy, position mode and budget from a ``sparsespec sweep --quality`` file, each with its
    change against the full cache's perplexity; over the tokens of ``span`` only if given."""
    records = [r for r in rows(sweep) if r.get("quality")]
    full = next(span_ppl(r["quality"], span) for r in records if r["policy"] == "full")
    budgets = sorted({r["budget"] for r in records if r["budget"]})
    cells = {(r["policy"], r["positions"], r["budget"]): span_ppl(r["quality"], span) for r in records}
    body = []
    for policy in ("window", "streaming", "h2o", "hybrid"):
        for mode in ("original", "in-cache"):
            values = [cells.get((policy, mode, budget)) for budget in budgets]
            if any(values):
                cells_text = (f"{v:.1f} ({(v / full - 1) * 100:+.1f}%)" if v else "—" for v in values)
                body.append([policy, mode, *cells_text])
    body.append(["full", "—", f"{full:.2f}", *([""] * (len(budgets) - 1))])
    return table(["policy", "positions", *map(str, budgets)], body)


def kv_bytes(sweep: str, span: tuple[int, int] | None = None) -> str:
    """Perplexity per KV dtype and policy at each cache size of a ``bench_kv_bytes.py`` sweep, each with its budget
    and its change against the bf16 full cache; the full cache per KV dtype last."""
    records = [r for r in rows(sweep) if r.get("quality")]
    full = {r["kv_dtype"]: span_ppl(r["quality"], span) for r in records if r["policy"] == "full"}
    reference = full["bf16"]
    sizes = sorted({r["kv_bytes"] for r in records if r["kv_bytes"]}, reverse=True)
    cells = {(r["kv_dtype"], r["policy"], r["kv_bytes"]): r for r in records}
    body = []
    for kv_dtype in ("bf16", "int8", "int4"):
        for policy in dict.fromkeys(r["policy"] for r in records if r["policy"] != "full"):
            found = [cells.get((kv_dtype, policy, size)) for size in sizes]
            if any(found):
                body.append([kv_dtype, policy, *(
                    "—" if r is None else
                    f"{span_ppl(r['quality'], span):.2f} ({(span_ppl(r['quality'], span) / reference - 1) * 100:+.1f}%)"
                    f", {r['budget']} entries" for r in found)])
    for kv_dtype, value in full.items():
        change = f"{value:.2f} ({(value / reference - 1) * 100:+.1f}%)"
        body.append([kv_dtype, "full", change, *([""] * (len(sizes) - 1))])
    return table(["KV dtype", "policy", *(f"{size / 2**20:.2f} MiB" for size in sizes)], body)


def kv_speed(sweep: str) -> str:
    """Decode speed (and, with a draft, acceptance) per point of ``bench_kv_bytes.py --speed-context /
    --accept-context``, in file order."""
    body = []
    for r in rows(sweep):
        speed = r.get("speed")
        if not speed:
            continue
        kinds = ", ".join(f"{kind} {v['tokens_per_s']:.1f}" for kind, v in speed["by_kind"].items())
        acceptance = speed.get("acceptance_rate")
        body.append([r["setup"]["context_tokens"], r["policy"], r["kv_dtype"], r["budget"] or "—",
                     f"{speed['kv_cache_bytes'] / 2**20:.1f}", r["draft"] or "—", kinds,
                     "—" if acceptance is None else f"{acceptance:.3f}", r["finished_at"][11:16]])
    return table(["context", "policy", "KV dtype", "budget", "KV MiB", "draft", "tok/s", "acceptance", "UTC"], body)


def main() -> None:
    global SINCE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", choices=["engine", "arena", "speculative", "simulator", "ppl", "kv-bytes", "kv-speed"])
    parser.add_argument("--sweep", default=None,
                        help="for ppl / kv-bytes / kv-speed: the sweep file's name under results/ (default: "
                             "sweep_ppl_smollm2 / kv_bytes / kv_bytes_speed)")
    parser.add_argument("--span", default=None, metavar="START:END",
                        help="for ppl: only token positions START..END-1 (multiples of the sweep's --ppl-window)")
    parser.add_argument("--since", default="", help='UTC time "YYYY-MM-DD HH:MM": only records from then on')
    args = parser.parse_args()
    SINCE = args.since
    span = tuple(map(int, args.span.split(":"))) if args.span else None
    tables = {"engine": engine, "arena": arena, "speculative": speculative, "simulator": simulator,
              "ppl": lambda: ppl(args.sweep or "sweep_ppl_smollm2", span),
              "kv-bytes": lambda: kv_bytes(args.sweep or "kv_bytes", span),
              "kv-speed": lambda: kv_speed(args.sweep or "kv_bytes_speed")}
    print(tables[args.table]())


if __name__ == "__main__":
    main()
