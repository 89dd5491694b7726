"""The edge commands: ``sparsespec simulate`` and ``sparsespec calibrate``.

``simulate`` predicts the decode speed of a model on a device, from shapes and a device profile only.
``add_simulate_arguments`` fills an ``argparse`` (sub)parser; ``run_simulate`` runs the command from the parsed
arguments and returns the exit status. :func:`simulate` is the same computation on a :class:`ModelConfig` and a
:class:`DeviceProfile`, returning the report as a plain dictionary (what ``--json`` prints). Torch-free; matplotlib is
imported only when ``--plot`` asks for a figure.

``calibrate`` measures this machine (:mod:`sparsespec.edge.calibration`) and writes the ``host`` profile to
``$SPARSESPEC_HOME/devices/host.json``, or where ``--out`` says. A progress bar and one line per measurement go to
stderr; ``--json`` prints a JSON summary (profile, curve, raw timings) to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..config import ModelConfig
from ..errors import UserError
from ..flags import DEFAULT_DRAFT_BUDGET, DEFAULT_GAMMA, parse_size
from .calibration.host_profile import build_profile, default_output_path
from .calibration.measure import Calibration, calibrate
from .calibration.settings import FULL, MIB, QUICK
from .profile import DeviceProfile, list_profiles, load_profile, save_profile
from .roofline import (
    KV_BYTES_PER_ELEMENT,
    QUANTIZED_BLOCKS,
    Weights,
    best_budget,
    bytes_by_type,
    best_gamma_on_device,
    kv_bytes_per_token,
    predict_autoregressive,
    predict_speculative,
    resident_weight_bytes,
    streamed_parameters,
    weight_bytes,
)

DEFAULT_CONTEXT = 2048
DEFAULT_ACCEPTANCE = 0.8
# Budget used when none is given and not even 16 entries fit the device's SRAM budget.
FALLBACK_BUDGET = 256
WEIGHT_FORMATS = ("bf16", "int8", "int4", "native")


def add_simulate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``simulate`` options to ``parser`` and return it."""
    parser.add_argument(
        "--device",
        default="host",
        help=f"device profile name ({', '.join(list_profiles())}), a profile .json path, or 'all' (default: host: "
        "this machine as `sparsespec calibrate` measured it, else placeholder figures)",
    )
    parser.add_argument("--model", required=True, help="target model: fixture name, .gguf file or Hugging Face folder")
    parser.add_argument(
        "--draft", default=None, help="draft model (same vocabulary); without it, speculation is self-speculation"
    )
    parser.add_argument(
        "--policy",
        default=None,
        help="cache policy label; 'full' keeps every token (no sparse modes), any other name uses --budget",
    )
    parser.add_argument(
        "--budget", type=int, default=None, help="KV budget in tokens (default: the largest that fits SRAM)"
    )
    parser.add_argument(
        "--draft-budget",
        type=int,
        default=None,
        help=f"draft KV budget (default: the target's cache size for a draft model, "
        f"{DEFAULT_DRAFT_BUDGET} for self-speculation)",
    )
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16",
                        help="target weight format, by the engine's real bytes (int8: Q8_0 blocks, 1.0625 bytes a "
                        "weight; int4: Q4_1 blocks, 0.625), or native: the GGUF file's own tensor types (default: "
                        "%(default)s)")
    parser.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default=None,
                        help="draft weight format (needs --draft; default: as --weights)")
    parser.add_argument(
        "--kv-dtype", choices=tuple(KV_BYTES_PER_ELEMENT), default="bf16",
        help="KV cache element type (int8 / int4: the arena's codes with their float16 scales)"
    )
    parser.add_argument(
        "--kv-bytes", default=None, metavar="SIZE",
        help="KV budget as the cache's bytes (KiB / MiB / GiB suffixes allowed) instead of --budget: the most "
        "entries whose cache, staging slots included, fits at --kv-dtype",
    )
    parser.add_argument("--gamma", type=int, default=DEFAULT_GAMMA, help="draft tokens per round γ")
    parser.add_argument(
        "--acceptance", type=float, default=DEFAULT_ACCEPTANCE, help="per-token acceptance rate α in [0, 1]"
    )
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens of context already cached")
    parser.add_argument("--max-gamma", type=int, default=16, help="largest γ searched for the best γ")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="plot tok/s against context length")
    return parser


def _resolve(ref: Any, default_name: str) -> tuple[ModelConfig, str]:
    """A ModelConfig (taken as is, named ``default_name``) or a model reference (read as metadata only)."""
    if isinstance(ref, ModelConfig):
        return ref, default_name
    from ..loading.source import read_config, resolve_model

    source = resolve_model(str(ref))
    return read_config(source), source.name


def _devices(name: str) -> list[DeviceProfile]:
    if name == "all":
        return [load_profile(n) for n in list_profiles()]
    return [load_profile(name)]


@dataclass(frozen=True)
class SimulateOptions:
    """The settings of one :func:`simulate` report (the ``simulate`` flags, less model and device).

    ``policy``: a cache policy label (``"full"`` drops the sparse modes); ``budget`` / ``draft_budget``: KV budgets
    (None: sized to the SRAM, see :func:`simulate`); ``weights`` / ``draft_weights``: weight formats
    (:data:`~sparsespec.edge.roofline.BYTES_PER_WEIGHT`, or ``native``: the GGUF file's own tensors, whose streamed
    bytes by block type ``native_bytes`` / ``draft_native_bytes`` give, see :func:`native_streamed_bytes`);
    ``kv_dtype``; ``kv_bytes``: the budgets as the cache's bytes instead (see :func:`simulate`); ``gamma`` and
    ``acceptance`` α of the speculative modes; ``context``: tokens already cached;
    ``max_gamma``: the largest γ searched for the best γ.
    """

    policy: str | None = None
    budget: int | None = None
    draft_budget: int | None = None
    weights: str = "bf16"
    draft_weights: str | None = None
    kv_dtype: str = "bf16"
    kv_bytes: int | None = None
    gamma: int = DEFAULT_GAMMA
    acceptance: float = DEFAULT_ACCEPTANCE
    context: int = DEFAULT_CONTEXT
    max_gamma: int = 16
    native_bytes: Mapping[str, float] | None = None
    draft_native_bytes: Mapping[str, float] | None = None


def native_streamed_bytes(ref: Any) -> dict[str, float]:
    """Bytes a forward streams of a GGUF model's tensors as its file stores them, by block type (``{"Q4_K": …}``):
    every tensor but an untied token-embedding table, of which a forward reads only its rows (from the header)."""
    from ..loading.source import read_config, read_gguf_tensor_storage, resolve_model

    source = None if isinstance(ref, ModelConfig) else resolve_model(str(ref))
    if source is None or source.kind != "gguf":
        raise UserError("--weights native / --draft-weights native read the model's GGUF file; give a .gguf model.")
    config = read_config(source)
    by_type: dict[str, float] = {}
    for name, (kind, nbytes) in read_gguf_tensor_storage(source.path).items():
        if name == "token_embd.weight" and not config.tie_word_embeddings:
            continue
        by_type[kind] = by_type.get(kind, 0.0) + nbytes
    return by_type


def _format(name: str, model: ModelConfig, native: Mapping[str, float] | None) -> Weights:
    """A weight format for the roofline: the streamed bytes by block type for ``native`` (the file's) and the
    quantized formats (their blocks'), else the name."""
    if name in QUANTIZED_BLOCKS:
        return bytes_by_type(model, name)
    if name != "native":
        return name
    if native is None:
        raise UserError("The native weight format needs the model's GGUF file to count its bytes.")
    return native


def simulate(
    target: ModelConfig,
    device: DeviceProfile,
    options: SimulateOptions = SimulateOptions(),
    *,
    draft: ModelConfig | None = None,
    model_name: str = "model",
    draft_name: str | None = None,
) -> dict[str, Any]:
    """Predict every mode for ``target`` on ``device`` and return the report (JSON-ready dictionary).

    Modes: ``full`` and ``speculative`` always; ``sparse`` and ``combined`` unless ``policy == "full"``. With no
    ``budget``, ``sparse`` uses the largest budget that keeps the target's cache in SRAM and ``combined`` the
    largest that keeps it there beside the draft's cache (falling back to the former when none does).
    ``kv_bytes`` gives the budgets as the cache's bytes instead: ``sparse`` the most entries whose cache of
    budget + 1 slots fits, ``combined`` of budget + γ + 1 slots.
    """
    o = options
    policy, budget, draft_budget = o.policy, o.budget, o.draft_budget
    weights = _format(o.weights, target, o.native_bytes)
    kv_dtype, kv_bytes, gamma, acceptance, context = o.kv_dtype, o.kv_bytes, o.gamma, o.acceptance, o.context
    if draft is not None and draft.vocab_size != target.vocab_size:
        raise UserError(
            f"The draft's vocabulary ({draft.vocab_size} tokens) differs from the target's ({target.vocab_size}); "
            "a draft must share the target's tokenizer."
        )
    if policy == "full" and (budget is not None or kv_bytes is not None):
        raise UserError("Policy 'full' keeps every token; drop --budget / --kv-bytes or choose a budgeted policy.")
    if kv_bytes is not None:
        if budget is not None:
            raise UserError("--kv-bytes sets the budget; drop --budget.")
        slots = int(kv_bytes // kv_bytes_per_token(target, kv_dtype))
        if slots - (gamma + 1) < 1:
            raise UserError(f"--kv-bytes {kv_bytes} holds {slots} cache slots at {kv_dtype}; that leaves no budget "
                            f"beside the {gamma + 1} slots in flight.")
    self_draft = draft is None
    draft_format = o.draft_weights or o.weights
    draft_weights = _format(draft_format, target if self_draft else draft,
                            o.native_bytes if self_draft else o.draft_native_bytes)
    if self_draft and draft_budget is None:
        draft_budget = DEFAULT_DRAFT_BUDGET
    sparse_modes = policy != "full"

    # Largest SRAM-resident budgets: decoding alone (1 staged slot), and speculating (γ+1 staged slots) beside the
    # draft's cache, which is either of fixed size (self-speculation, or a given draft budget) or follows the
    # target's budget (a draft model without its own budget).
    draft_model = target if self_draft else draft
    draft_kvb = kv_bytes_per_token(draft_model, kv_dtype)
    fixed = draft_budget is not None
    fit_budget = best_budget(target, device, kv_dtype=kv_dtype, context=context)
    combined_fit = best_budget(
        target,
        device,
        kv_dtype=kv_dtype,
        staging=gamma + 1,
        reserve_bytes=(min(draft_budget, context) + 1) * draft_kvb if fixed else 0.0,
        tracking_kv_bytes_per_token=0.0 if fixed else draft_kvb,
        context=context,
    )
    if kv_bytes is not None:
        budget, combined_budget, budget_source = slots - 1, slots - (gamma + 1), "from --kv-bytes"
    elif budget is not None:
        combined_budget, budget_source = budget, "given"
    elif fit_budget is not None:
        budget, budget_source = fit_budget, "largest that fits SRAM"
        combined_budget = combined_fit or fit_budget
    else:
        budget, budget_source = min(FALLBACK_BUDGET, context), "fallback (no budget fits SRAM)"
        combined_budget = budget

    ar = dict(weights=weights, kv_dtype=kv_dtype)
    spec = dict(draft=draft, draft_budget=draft_budget, weights=weights, draft_weights=draft_weights, kv_dtype=kv_dtype)
    modes = {"full": predict_autoregressive(target, device, context=context, **ar)}
    if sparse_modes:
        modes["sparse"] = predict_autoregressive(target, device, context=context, budget=budget, **ar)
    modes["speculative"] = predict_speculative(
        target, device, context=context, gamma=gamma, acceptance=acceptance, **spec
    )
    if sparse_modes:
        modes["combined"] = predict_speculative(
            target, device, context=context, gamma=gamma, acceptance=acceptance, budget=combined_budget, **spec
        )

    best_gammas = {}
    for mode, mode_budget in (("speculative", None), ("combined", combined_budget)):
        if mode not in modes:
            continue
        g, pred = best_gamma_on_device(
            target, device, context=context, acceptance=acceptance, max_gamma=o.max_gamma, budget=mode_budget, **spec
        )
        best_gammas[mode] = {"gamma": g, "tokens_per_second": pred.tokens_per_second}

    total_weights = resident_weight_bytes(target, weights)
    if not self_draft:
        total_weights += resident_weight_bytes(draft, draft_weights)
    resident = total_weights + (context + gamma + 1) * kv_bytes_per_token(target, kv_dtype)
    return {
        "device": device.name,
        "device_description": device.description,
        "model": model_name,
        "draft": "self" if self_draft else (draft_name or "draft"),
        "settings": {
            "context": context,
            "policy": policy,
            "budget": budget if sparse_modes else None,
            "combined_budget": combined_budget if sparse_modes else None,
            "budget_source": budget_source if sparse_modes else None,
            "draft_budget": draft_budget,
            "weights": o.weights,
            "draft_weights": draft_format,
            "kv_dtype": kv_dtype,
            "kv_bytes": kv_bytes,
            "gamma": gamma,
            "acceptance": acceptance,
        },
        "model_info": {
            "parameters": target.num_parameters(),
            "streamed_parameters": streamed_parameters(target),
            "weight_bytes_per_forward": weight_bytes(target, weights),
            "kv_bytes_per_token": kv_bytes_per_token(target, kv_dtype),
            "resident_bytes": resident,
            "fits_memory": resident <= device.memory_bytes,
        },
        "sram": {
            "level": device.sram_level,
            "bytes": device.sram_bytes,
            "kv_budget_bytes": device.sram_kv_budget,
        },
        "modes": {name: pred.to_dict() for name, pred in modes.items()},
        "best_gamma": best_gammas,
        "best_budget": {"autoregressive": fit_budget, "combined": combined_fit},
    }


def _mb(value: float) -> str:
    return f"{value / 1e6:.3f}"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable form of one :func:`simulate` report."""
    s, info, sram = report["settings"], report["model_info"], report["sram"]
    lines = [
        f"Device: {report['device']} — {report['device_description']}",
        f"Model: {report['model']} ({info['parameters'] / 1e6:.1f} M parameters, {s['weights']} weights: "
        f"{_mb(info['weight_bytes_per_forward'])} MB per forward; KV {info['kv_bytes_per_token'] / 1024:.1f} KiB "
        f"per token at {s['kv_dtype']})",
        f"Draft: {report['draft']}"
        + (f" (cache {s['draft_budget']} tokens)" if s["draft_budget"] is not None else ""),
        f"Context {s['context']}, γ={s['gamma']}, α={s['acceptance']:.2f}"
        + (
            f", budget {s['budget']} ({s['budget_source']}; {s['combined_budget']} when combined)"
            if s["budget"] is not None
            else ", policy full"
        ),
        f"SRAM: {sram['level']}, {sram['bytes'] / 2**20:.2f} MiB ({sram['kv_budget_bytes'] / 2**20:.2f} MiB for KV)",
    ]
    if not info["fits_memory"]:
        lines.append(f"Warning: weights + KV ({info['resident_bytes'] / 1e9:.2f} GB) exceed the device memory.")
    lines.append("")
    header = f"{'mode':<12} {'tok/s':>9} {'tok/pass':>9} {'DRAM MB/tok':>12} {'(weights':>9} {'KV)':>8}"
    header += f" {'SRAM MB/tok':>12}  KV in SRAM"
    lines.append(header)
    for name, m in report["modes"].items():
        dram, on_chip = m["bytes_per_token"]["dram"], m["bytes_per_token"]["sram"]
        where = "yes" if m["kv_in_sram"] else "no"
        if m.get("draft_kv_in_sram") is not None:
            where += f" (draft {'yes' if m['draft_kv_in_sram'] else 'no'})"
        lines.append(
            f"{name:<12} {m['tokens_per_second']:>9.2f} {m['tokens_per_pass']:>9.2f} "
            f"{_mb(sum(dram.values())):>12} {_mb(dram['weights']):>9} {_mb(dram['kv']):>8} "
            f"{_mb(sum(on_chip.values())):>12}  {where}"
        )
    lines.append("")
    for mode, best in report["best_gamma"].items():
        g = best["gamma"]
        verdict = "speculation does not pay" if g == 0 else f"γ={g}"
        lines.append(f"Best γ ({mode}): {verdict}, {best['tokens_per_second']:.2f} tok/s")
    bb = report["best_budget"]
    fits = lambda n: f"{n} tokens" if n else "none fits"  # noqa: E731
    lines.append(
        f"Best budget (largest SRAM-resident cache): {fits(bb['autoregressive'])} decoding alone; "
        f"{fits(bb['combined'])} with γ={s['gamma']} beside the draft's cache"
    )
    return "\n".join(lines)


def _sweep_contexts(model: ModelConfig, context: int) -> list[int]:
    top = max(context, min(model.max_position_embeddings, 32768), 256)
    points, c = [], 64
    while c < top:
        points.append(int(c))
        c *= 2**0.5
    points.append(top)
    return sorted(set(points))


def plot_context_sweep(
    target: ModelConfig,
    devices: Sequence[DeviceProfile],
    path: str | Path,
    *,
    options: SimulateOptions,
    draft: ModelConfig | None = None,
    title: str = "",
) -> Path:
    """Plot predicted tok/s against context length for each mode, one panel per device; write a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = _sweep_contexts(target, options.context)
    cols = min(3, len(devices))
    rows = -(-len(devices) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, device in zip(axes.flat, devices):
        curves: dict[str, list[float]] = {}
        for ctx in contexts:
            report = simulate(target, device, replace(options, context=ctx), draft=draft)
            for mode, m in report["modes"].items():
                curves.setdefault(mode, []).append(m["tokens_per_second"])
        for mode, values in curves.items():
            ax.plot(contexts, values, marker=".", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_title(device.name, fontsize=10)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("predicted tok/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(devices) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``sparsespec simulate`` from parsed arguments; ``args.model`` / ``args.draft`` may be ModelConfigs."""
    target, model_name = _resolve(args.model, "model")
    draft, draft_name = _resolve(args.draft, "draft") if getattr(args, "draft", None) is not None else (None, None)
    devices = _devices(args.device)
    if draft is None and args.draft_weights is not None:
        raise UserError("--draft-weights needs --draft; self-speculation drafts with the target's --weights.")
    native = args.weights == "native"
    draft_native = args.draft_weights == "native" or (native and args.draft_weights is None)
    options = SimulateOptions(
        policy=args.policy, budget=args.budget, draft_budget=args.draft_budget, weights=args.weights,
        draft_weights=args.draft_weights, kv_dtype=args.kv_dtype,
        kv_bytes=None if args.kv_bytes is None else parse_size(args.kv_bytes), gamma=args.gamma,
        acceptance=args.acceptance, context=args.context, max_gamma=args.max_gamma,
        native_bytes=native_streamed_bytes(args.model) if native else None,
        draft_native_bytes=native_streamed_bytes(args.draft) if draft_native and draft is not None else None,
    )
    reports = [
        simulate(target, device, options, draft=draft, model_name=model_name, draft_name=draft_name)
        for device in devices
    ]
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else {"devices": reports}, indent=2))
    else:
        print("\n\n".join(format_report(r) for r in reports))
    if args.plot:
        title = f"{model_name}, " + (f"draft: {draft_name}" if draft is not None else "self-speculation")
        path = plot_context_sweep(target, devices, args.plot, options=options, draft=draft, title=title)
        print(f"Wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


# ------------------------------------------------------------------------------------------------- calibrate
def add_calibrate_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``calibrate`` options to ``parser`` and return it."""
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads to measure with (default: torch's choice, as `generate` uses)")
    parser.add_argument("--out", default=None, metavar="PATH",
                        help=f"where to write the profile (default: {default_output_path()}, which "
                             "`simulate --device host` then uses)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes, block types and trials (about a minute; noisier)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary to stdout")
    return parser


def summary(cal: Calibration, profile: DeviceProfile, path: Path) -> dict[str, Any]:
    """The ``--json`` output: where the profile went, the profile, and every raw measurement."""
    data = cal.to_dict()
    data.pop("flags")
    return {"profile_path": str(path), "profile": profile.to_dict(), "measurements": data}


def format_summary(cal: Calibration, profile: DeviceProfile, path: Path) -> str:
    lines = [
        f"Wrote {path}",
        f"  {cal.cpu}, {cal.threads} threads, load average {cal.loadavg_before:.2f} → {cal.loadavg_after:.2f}, "
        f"{cal.seconds:.1f} s",
        f"  DRAM read {cal.dram_bandwidth / 1e9:.1f} GB/s; decode streaming {cal.stream_bandwidth / 1e9:.1f} GB/s "
        f"(efficiency {profile.dram_efficiency:.2f}); L3 {cal.sram_bandwidth / 1e9:.1f} GB/s "
        f"({profile.sram_bytes / MIB:.0f} MiB, KV fraction {profile.sram_kv_fraction:.3g})",
        f"  GEMM bf16 {cal.peak_flops['bf16'] / 1e9:.0f} GFLOP/s, fp32 {cal.peak_flops['fp32'] / 1e9:.0f} GFLOP/s; "
        "torch extra rows "
        + (f"{cal.extra_row_flops / 1e9:.0f} GFLOP/s" if cal.extra_row_flops else "free"),
        "  native streaming (GB/s; each extra row): " + ", ".join(
            f"{kind} {curve['bytes_per_s'] / 1e9:.1f}"
            + (f" ({curve['extra_row_bytes_per_s'] / 1e9:.0f})" if curve["extra_row_bytes_per_s"] else "")
            for kind, curve in cal.native_stream.items()),
        f"  overheads: {cal.overhead_s * 1e3:.3f} ms per pass, {cal.per_layer_overhead_s * 1e6:.1f} µs per layer "
        f"+ {cal.stream_overhead_fraction:.3f} of the weights' streaming time, "
        f"{cal.per_row_layer_overhead_s * 1e6:.1f} µs per layer and extra row, "
        f"{cal.evict_layer_overhead_s * 1e6:.1f} + {cal.evict_row_layer_overhead_s * 1e6:.1f} µs per layer and "
        "evicting pass + extra row, "
        f"{cal.per_vocab_overhead_s * 1e9:.2f} ns per vocabulary entry",
        "  attention: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in cal.attention_flops.items()),
        "  attention per KV head: " + ", ".join(f"{k} {v / 1e9:.2f} G channels/s"
                                                 for k, v in cal.attention_head_reads.items()),
        "  read bandwidth curve: " + ", ".join(
            f"{p['bytes'] / MIB:g} MiB {p['bytes_per_s'] / 1e9:.0f}" for p in cal.bandwidth_curve) + " (GB/s)",
    ]
    return "\n".join(lines)


def run_calibrate(args: argparse.Namespace) -> int:
    """Run ``sparsespec calibrate`` from parsed arguments; returns the exit status."""
    settings = QUICK if getattr(args, "quick", False) else FULL
    settings = getattr(args, "settings", None) or settings  # a CalibrationSettings (tests pass tiny ones)
    path = Path(args.out).expanduser() if getattr(args, "out", None) else default_output_path()
    cal = calibrate(settings, threads=getattr(args, "threads", None), quiet=getattr(args, "quiet", False))
    profile = build_profile(cal, settings)
    try:
        save_profile(profile, path)
    except OSError as exc:
        raise UserError(f"Cannot write the device profile to {path}: {exc.strerror or exc}.") from None
    if getattr(args, "json", False):
        print(json.dumps(summary(cal, profile, path), indent=2))
    else:
        print(format_summary(cal, profile, path))
    return 0
