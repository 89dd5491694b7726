"""The edge simulator against real runs on this machine: measured decode tok/s vs the `host` profile's prediction.

Runs real configurations of the engine (`run_generation`, the native GGUF weights by default, bfloat16, greedy,
8-bit activations: the kernels `calibrate` measures; float activations, SmolLM2's default, are not modelled),
takes the median tok/s of `--runs` runs and the measured acceptance, and predicts each configuration with the edge
simulator from the model shapes, the GGUF file's bytes by block type and the device profile (`--device`, default
`host`: the profile written by `sparsespec calibrate` when there is one). The default configurations are the nine of
the simulator's goal: each fixture model autoregressive at 512 tokens, speculating at 512 tokens (the 1.5B with the
0.5B as its draft, the smaller two drafting for themselves with a 64-entry hybrid cache) and decoding over a
1,024-entry hybrid cache after an 8,000-token prompt (retention off: it changes which entries the budget keeps, not
what a decode step costs, and it triples the prefill).

Speculative predictions take the measured acceptance: `predicted_tok_s` replays the measured rounds (their γ and
accepted tokens) through the simulator's pass costs; `predicted_tok_s_simulator` is `predict_speculative` with the
measured tokens per target pass, `predicted_tok_s_iid` the same through the i.i.d. formula on the measured per-token
acceptance. Measured tok/s counts the tokens after the first forward pass (or speculative round) over the time after
it; `engine_tok_s` is `RunStats.tokens_per_s` for comparison. Prints one JSON line per configuration:
{config, measured_tok_s, predicted_tok_s, error_fraction, ...}, then a summary line, and plots predicted against
measured (`--plot`).

The context of a prediction is the mean number of cached tokens over the timed steps (prompt + new_tokens / 2) for
a full cache, the budget for a budgeted one. Calibrate first, at the same thread count, on an idle machine:

    sparsespec calibrate --threads 2
    python benchmarks/bench_simulator.py                # the nine configurations; about ten minutes
    python benchmarks/bench_simulator.py --quick        # SmolLM2 only, few tokens, short contexts; under a minute
    python benchmarks/bench_simulator.py --weights int8 --draft-weights int4   # torch's formats, by their bytes

The summary line reports the mean absolute and the mean signed error ((predicted − measured) / measured): a signed
mean far from zero is a bias of the model, not noise.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common import PROSE_PROMPT, emit, load_settled, loadavg, machine, median, results_dir

from sparsespec.cache.policy import make_policy
from sparsespec.edge import load_profile, predict_autoregressive, predict_speculative
from sparsespec.edge.commands import native_streamed_bytes
from sparsespec.flags import DEFAULT_GAMMA
from sparsespec.engine import CacheOptions, DraftOptions, RunStats, run_generation
from sparsespec.errors import UserError
from sparsespec.eval.prompts import load_prompts
from sparsespec.sampling import SamplingParams

TARGET = "qwen2.5-coder-1.5b"
DRAFT = "qwen2.5-coder-0.5b"
SMALL = "smollm2-135m"


@dataclass(frozen=True)
class Config:
    """One real run: ``draft`` is None (autoregressive), ``"self"`` or a model name; budgets None mean full caches."""

    name: str
    target: str
    context: int
    budget: int | None = None
    draft: str | None = None
    draft_budget: int | None = None
    gamma: int = DEFAULT_GAMMA


def full_configs(target: str, draft: str, small: str) -> list[Config]:
    """Each model autoregressive, speculating, and over a 1,024-entry budget at 8k."""
    configs = []
    for model, label, spec_draft, spec_budget in ((target, "1.5b", draft, None), (draft, "0.5b", "self", 64),
                                                  (small, "135m", "self", 64)):
        configs += [
            Config(f"{label}-ar-512", model, 512),
            Config(f"{label}-spec-512", model, 512, draft=spec_draft, draft_budget=spec_budget),
            Config(f"{label}-hybrid1024-8k", model, 8000, budget=1024),
        ]
    return configs


def quick_configs(small: str) -> list[Config]:
    return [
        Config("ar-full-128", small, 128),
        Config("ar-full-1k", small, 1024),
        Config("ar-hybrid128-1k", small, 1024, budget=128),
        Config("self-spec-128", small, 128, draft="self", draft_budget=64),
        Config("self-spec-gamma2-128", small, 128, draft="self", draft_budget=64, gamma=2),
        Config("self-spec-hybrid128-1k", small, 1024, budget=128, draft="self", draft_budget=64),
    ]


def filler_ids(tokenizer, count: int) -> list[int]:
    """``count`` token ids of long public-domain text (the corpus if fetched, else the benchmark prose repeated)."""
    if count <= 0:
        return []
    try:
        from sparsespec.loading.fetch import corpus_text_path

        text = corpus_text_path("paradise_lost").read_text(encoding="utf-8", errors="replace")
    except (UserError, OSError):
        text = (PROSE_PROMPT + "\n\n") * (count // 100 + 1)
    ids = tokenizer.encode(text[: count * 8])
    while len(ids) < count:
        ids = ids + ids
    return ids[:count]


def prompt_for(loaded, context: int) -> list[int]:
    """A code prompt (the first of the prompt set), preceded by filler text up to ``context`` tokens in all."""
    code = load_prompts(["code"])[0]
    ids = loaded.tokenizer.encode(code.text)
    return filler_ids(loaded.tokenizer, context - len(ids)) + ids


def cache_for(budget: int | None) -> CacheOptions:
    policy = make_policy("full") if budget is None else make_policy("hybrid", budget)
    return CacheOptions(policy, "original", 512, force_context=True, retention="off" if budget else "auto")


# Tokens that arrive less than this long after the previous one were produced by the same forward pass (a
# speculative round yields its accepted tokens back to back).
SAME_PASS_S = 1e-3


def steady_window(stamps: list[float]) -> tuple[float, int]:
    """(tok/s after the first pass, tokens of the first pass): tokens after the first burst over the time they took.

    ``RunStats.tokens_per_s`` counts every token over the time after prefill, the first pass or round included; this
    window leaves that first one out, as the simulator predicts the steady state.
    """
    first = 1
    while first < len(stamps) and stamps[first] - stamps[first - 1] < SAME_PASS_S:
        first += 1
    if first >= len(stamps):
        return 0.0, first
    return (len(stamps) - first) / (stamps[-1] - stamps[first - 1]), first


@dataclass
class Run:
    tok_s: float  # steady tok/s (after the first pass or round)
    first_burst: int  # tokens of the first pass or round
    window_s: float  # wall time of the steady window
    stats: RunStats


def _untimed_per_round(run: Run) -> float:
    """Seconds per round of the window outside the draft and target passes the engine times (commits, loop)."""
    spec = run.stats.speculative
    rounds = spec.gammas[1:]
    if not rounds:
        return 0.0
    draft_s = spec.draft_seconds / max(spec.draft_passes, 1)
    target_s = spec.target_seconds / max(spec.target_passes, 1)
    return (run.window_s - sum(rounds) * draft_s - len(rounds) * target_s) / len(rounds)


def run_once(target, ids: list[int], new_tokens: int, config: Config, draft_model) -> Run:
    draft = None
    if config.draft is not None:
        draft_cache = cache_for(config.draft_budget)
        draft = DraftOptions(draft_model, draft_cache, config.gamma, is_self=config.draft == "self")
    stats = RunStats()
    stamps = []
    for _ in run_generation(target, ids, max_new_tokens=new_tokens, sampling=SamplingParams(),
                            cache=cache_for(config.budget), seed=0, draft=draft, stats=stats):
        stamps.append(time.perf_counter())
    tok_s, first = steady_window(stamps)
    return Run(tok_s, first, stamps[-1] - stamps[first - 1], stats)


# The simulator's name of each engine weight format (its bytes: see edge/roofline.py).
SIMULATOR_FORMAT = {"dense": "bf16", "int8": "int8", "int4": "int4"}
WEIGHT_CHOICES = (*SIMULATOR_FORMAT, "native")


def simulator_format(weights: str, model: str):
    """The simulator's weight format for the engine's ``weights`` on ``model``: a format name, or for ``native``
    the GGUF file's streamed bytes by block type."""
    return native_streamed_bytes(model) if weights == "native" else SIMULATOR_FORMAT[weights]


def predict(config: Config, target, draft_model, device, prompt_tokens: int, new_tokens: int, run: Run,
            formats: dict[str, str]) -> dict:
    """The simulator's tok/s for ``config`` (and the pieces it came from).

    Speculative runs are predicted three ways: ``predicted_tok_s`` replays the rounds of the measured window (their
    γ and accepted tokens) through the simulator's pass costs, so that only the time model is under test;
    ``predicted_tok_s_simulator`` is ``predict_speculative`` with the run's measured tokens per target pass (what
    ``sparsespec simulate`` gives for that acceptance); ``predicted_tok_s_iid`` feeds it the measured per-token
    acceptance through the i.i.d. formula instead. ``formats``: the simulator's ``weights`` and ``draft_weights``.
    """
    context = prompt_tokens + new_tokens // 2
    if config.draft is None:
        pred = predict_autoregressive(target.config, device, context=context, budget=config.budget,
                                      weights=formats["weights"])
        return {"predicted_tok_s": pred.tokens_per_second, "prediction": _brief(pred)}
    spec = run.stats.speculative
    gamma = config.gamma
    draft_cfg = None if config.draft == "self" else draft_model.config
    kw = dict(context=context, acceptance=min(max(spec.acceptance_rate, 0.0), 1.0), draft=draft_cfg,
              budget=config.budget, draft_budget=config.draft_budget, **formats)
    tokens_per_pass = min(max(spec.tokens_per_target_pass, 1.0), gamma + 1.0)
    pred = predict_speculative(target.config, device, gamma=gamma, tokens_per_pass=tokens_per_pass, **kw)
    iid = predict_speculative(target.config, device, gamma=gamma, **kw)

    # Replay: every round of the window costs g draft passes and one (g+1)-row verification.
    round_s: dict[int, float] = {}
    for g in set(spec.gammas[1:]):
        if g == 0:
            single = predict_autoregressive(target.config, device, context=context, budget=config.budget,
                                            weights=formats["weights"])
            round_s[g] = single.seconds_per_token
        else:
            cost = predict_speculative(target.config, device, gamma=g, **kw).passes
            round_s[g] = g * cost["draft"].time_s + cost["target"].time_s
    window_s = sum(round_s[g] for g in spec.gammas[1:])
    window_tokens = spec.new_tokens - run.first_burst
    replay = window_tokens / window_s if window_s > 0 else 0.0
    return {"predicted_tok_s": replay, "predicted_tok_s_simulator": pred.tokens_per_second,
            "predicted_tok_s_iid": iid.tokens_per_second, "window_rounds": len(spec.gammas) - 1,
            "window_tokens": window_tokens, "prediction": _brief(pred)}


def _brief(pred) -> dict:
    out = {"seconds_per_token": pred.seconds_per_token, "tokens_per_pass": pred.tokens_per_pass}
    for name, cost in pred.passes.items():
        out[name] = {k: round(v, 6) if isinstance(v, float) else v for k, v in cost.to_dict().items()
                     if k in ("tokens", "kv_entries", "memory_s", "extra_rows_s", "attention_s", "compute_s",
                              "overhead_s", "time_s", "evicting", "kv_in_sram")}
    return out


def plot_predictions(records: list[dict], path: Path, title: str) -> None:
    """Predicted against measured tok/s, one labelled point per configuration, the ±15% band around equality."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    measured = [r["measured_tok_s"] for r in records]
    predicted = [r["predicted_tok_s"] for r in records]
    top = max(measured + predicted) * 1.3
    low = min(measured + predicted) / 1.3
    line = [low, top]
    ax.plot(line, line, color="black", lw=1, label="predicted = measured")
    ax.fill_between(line, [v * 0.85 for v in line], [v * 1.15 for v in line], color="grey", alpha=0.2, label="±15%")
    ax.scatter(measured, predicted, zorder=3)
    for r in records:
        ax.annotate(f"{r['config']} ({r['error_fraction']:+.0%})", (r["measured_tok_s"], r["predicted_tok_s"]),
                    fontsize=7, xytext=(4, -10), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, top)
    ax.set_ylim(low, top)
    ax.set_xlabel("measured tok/s")
    ax.set_ylabel("predicted tok/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{SMALL} only, few tokens, contexts up to 1k")
    parser.add_argument("--device", default="host", help="device profile name or .json path (default: host)")
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--draft", default=DRAFT)
    parser.add_argument("--small", default=SMALL, help="the cheap model (autoregressive and self-speculation)")
    parser.add_argument("--configs", default=None, help="comma-separated configuration names to run (default: all)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 64 (16 with --quick)")
    parser.add_argument("--weights", choices=WEIGHT_CHOICES, default="native",
                        help="the target's weight format, run by the engine and modelled by its bytes (default: "
                             "native, the engine's own)")
    parser.add_argument("--draft-weights", choices=WEIGHT_CHOICES, default=None,
                        help="a draft model's weight format (default: as --weights)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None,
                        help="also append the JSON lines here (default: results/bench_simulator/simulator.jsonl; "
                             "none with --quick)")
    parser.add_argument("--plot", type=Path, default=None,
                        help="predicted against measured tok/s as a PNG (default: "
                             "results/bench_simulator/simulator.png; none with --quick)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    new_tokens = args.new_tokens or (16 if args.quick else 64)
    out = args.out if args.out is not None else (None if args.quick else results_dir(__file__) / "simulator.jsonl")
    configs = quick_configs(args.small) if args.quick else full_configs(args.target, args.draft, args.small)
    if args.configs:
        wanted = set(args.configs.split(","))
        configs = [c for c in configs if c.name in wanted]
    device = load_profile(args.device)
    print(f"device profile {device.name}: {device.note[:160]}", file=sys.stderr)

    models: dict[str, object] = {}

    def get(name: str, weights: str):
        if (name, weights) not in models:
            print(f"loading {name} ({weights})", file=sys.stderr)
            models[name, weights] = load_settled(name, torch.bfloat16, weights, activations="int8")
            warm = models[name, weights]
            list(run_generation(warm, warm.tokenizer.encode(PROSE_PROMPT)[:32], max_new_tokens=4,
                                sampling=SamplingParams(), cache=cache_for(None)))
        return models[name, weights]

    errors, records = [], []
    for config in configs:
        target = get(config.target, args.weights)
        draft_weights = args.draft_weights or args.weights
        draft_model = target if config.draft == "self" else (get(config.draft, draft_weights) if config.draft else None)
        ids = prompt_for(target, config.context)
        runs = [run_once(target, ids, new_tokens, config, draft_model) for _ in range(args.runs)]
        speeds = [r.tok_s for r in runs]
        measured = median(speeds)
        run = runs[speeds.index(measured)] if measured in speeds else runs[0]
        stats = run.stats
        record = {"bench": "simulator", "config": config.name, "target": config.target, "draft": config.draft,
                  "budget": config.budget, "draft_budget": config.draft_budget, "weights": args.weights,
                  "draft_weights": (args.draft_weights or args.weights) if config.draft else None,
                  "gamma": config.gamma if config.draft else None, "prompt_tokens": len(ids),
                  "new_tokens": new_tokens, "measured_tok_s": measured, "runs": [round(s, 3) for s in speeds],
                  "engine_tok_s": median([r.stats.tokens_per_s for r in runs])}
        formats = {"weights": simulator_format(args.weights, config.target),
                   "draft_weights": (simulator_format(args.weights, config.target) if config.draft in (None, "self")
                                     else simulator_format(draft_weights, config.draft))}
        prediction = predict(config, target, draft_model, device, len(ids), new_tokens, run, formats)
        record["predicted_tok_s"] = prediction.pop("predicted_tok_s")
        record["error_fraction"] = (record["predicted_tok_s"] - measured) / measured
        if "predicted_tok_s_simulator" in prediction:
            record["error_fraction_simulator"] = (prediction["predicted_tok_s_simulator"] - measured) / measured
        if stats.speculative is not None:
            spec = stats.speculative
            record.update(acceptance=round(spec.acceptance_rate, 4),
                          tokens_per_target_pass=round(spec.tokens_per_target_pass, 4),
                          measured_cost_ratio=round(spec.draft_target_cost_ratio, 4),
                          gammas=spec.gammas,
                          measured_draft_pass_s=spec.draft_seconds / max(spec.draft_passes, 1),
                          measured_target_pass_s=spec.target_seconds / max(spec.target_passes, 1),
                          measured_other_s_per_round=_untimed_per_round(run))
        record.update(prediction, device=device.name, loadavg=loadavg(), date=machine()["date"])
        errors.append(record["error_fraction"])
        records.append(record)
        emit(record, out)
        gc.collect()
    plot = args.plot if args.plot is not None else (None if args.quick else results_dir(__file__) / "simulator.png")
    if plot and records:
        plot_predictions(records, plot, f"{device.name} profile, {args.weights} weights, {machine()['date']}")
        print(f"wrote {plot}", file=sys.stderr)
    if errors:  # signed: (predicted − measured) / measured; a mean signed error far from 0 is a systematic bias
        emit({"bench": "simulator_summary", "configs": len(errors),
              "mean_abs_error": sum(abs(e) for e in errors) / len(errors),
              "mean_signed_error": sum(errors) / len(errors), "max_abs_error": max(abs(e) for e in errors),
              "weights": args.weights, "draft_weights": args.draft_weights or args.weights, "device": device.name,
              **machine()}, out)


if __name__ == "__main__":
    main()
