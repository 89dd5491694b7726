"""The device profile a calibration makes (:func:`build_profile`): the simulator's figures from a
:class:`~.measure.Calibration`, each with a source that says how it was measured; and where ``sparsespec calibrate``
writes it (:func:`default_output_path`)."""

from __future__ import annotations

from pathlib import Path

from ..profile import DeviceProfile, user_devices_dir
from .measure import Calibration
from .settings import ATTENTION_NARROW_SHAPE, ATTENTION_SHAPE, DEFAULT_L3, FULL, MIB, CalibrationSettings


def _sizes(sizes: list[int]) -> str:
    return ", ".join(f"{n / MIB:g} MiB" for n in sizes)


def build_profile(cal: Calibration, settings: CalibrationSettings = FULL, name: str = "host") -> DeviceProfile:
    """The device profile for the measurements in ``cal``; every figure's source says how it was obtained."""
    stamp = f"measured by sparsespec calibrate on {cal.date} ({cal.threads} threads, load average " \
            f"{cal.loadavg_before:.2f} before, {cal.loadavg_after:.2f} after)"
    read = f"read by sparsespec calibrate on {cal.date}"
    l3 = cal.caches.get("cpu_l3", DEFAULT_L3)
    # Decoding may stream faster than the sum reads (another moment on a shared machine, other kernels): the
    # DRAM figure is then raised to the streaming rate, so that bandwidth × efficiency is always what was measured.
    dram = max(cal.dram_bandwidth, cal.stream_bandwidth)
    efficiency = cal.stream_bandwidth / dram
    lo, hi = cal.raw["tiny_probe"]["layers"]
    h, i, heads, kv_heads, hd = cal.raw["tiny_probe"]["shape"]
    tiny = (f"a tiny random model with native Q8_0 weights (hidden {h}, MLP {i}, {heads} query / {kv_heads} KV heads "
            f"of {hd}) with {lo} and {hi} layers, its weights in the caches, run through the engine's decode loop "
            f"(median step of {settings.probe_steps}, median of {settings.probe_rounds} rounds)")
    probes = "; ".join(f"{p['layers']} layers of hidden {p['shape'][0]}, MLP {p['shape'][1]}, {p['shape'][2]} "
                       f"query / {p['shape'][3]} KV heads of {p['shape'][4]}" for p in cal.raw.get("probes", []))
    streaming = (f"two random models with native {settings.probe_type} weights streaming from memory ({probes}) run "
                 f"through the engine's decode loop and passes (median step of {settings.probe_steps}, median of "
                 f"{settings.probe_rounds} rounds), each beside a pass over its projections alone")
    isa = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "avx2", "fma", "asimd", "sve")
           if f in cal.flags]
    sources = {
        "memory_bytes": f"{read}: sysconf SC_PHYS_PAGES × SC_PAGE_SIZE.",
        "dram_bandwidth": f"{stamp}: fp32 sum over buffers of {_sizes(cal.dram_sizes)} (the largest sizes), "
                          "median of the best trial per size"
                          + (f" ({cal.dram_bandwidth / 1e9:.1f} GB/s), raised to the decode streaming rate, which "
                             "was higher" if dram > cal.dram_bandwidth else "") + ".",
        "dram_efficiency": f"{stamp}: one-row bf16 F.linear (torch, the dense weight format) over "
                           f"{cal.stream_bytes / MIB:.0f} MiB of layer-shaped weights streams "
                           f"{cal.stream_bandwidth / 1e9:.1f} GB/s; over the DRAM figure {dram / 1e9:.1f} GB/s that "
                           f"is {efficiency:.3f}. The native format streams at native_stream's rates instead.",
        "sram_bytes": f"{read} from {cal.cache_source}: the L3 (last-level cache)"
                      + ("" if "cpu_l3" in cal.caches else f"; not reported, {DEFAULT_L3 // MIB} MiB assumed") + ".",
        "sram_bandwidth": f"{stamp}: fp32 sum over buffers of {_sizes(cal.sram_sizes)} (fit the L3, not the L2s), "
                          "median of the best trial per size.",
        "sram_kv_fraction": f"{stamp}: share of a buffer still cached after 4x the L3 of other data was read "
                            f"(per fraction of the L3: {cal.residency}); the largest fraction at least half "
                            "resident" + ("" if any(v >= 0.5 for v in cal.residency.values())
                                          else "; none was, so half the smallest fraction tested") + ".",
        "peak_flops.bf16": f"{stamp}: {settings.gemm_n}x{settings.gemm_n} bf16 torch.mm, best trial.",
        "peak_flops.fp32": f"{stamp}: {settings.gemm_n}x{settings.gemm_n} fp32 torch.mm, best trial.",
        "overhead_s": f"{stamp}: intercept over layers of the decode-step time of {tiny}, less its head's "
                      "streaming and its sampling cost.",
        "per_layer_overhead_s": f"{stamp}: per layer, the decode step less its weights' streaming time at "
                                f"native_stream's rates, the pass's fixed cost and the attention op's time over its "
                                f"entries at attention_flops, for {streaming}: the part that does not grow with the "
                                "layer's streaming time (a line through the narrow and the wide model).",
        "stream_overhead_fraction": f"{stamp}: the same line's slope against the layer's streaming time.",
        "per_row_layer_overhead_s": f"{stamp}: ({settings.rows}-row pass − 1-row pass), less the same difference of "
                                    "the projections alone and of the attention op at attention_flops, per layer "
                                    f"and extra row, mean over {streaming}.",
        "evict_layer_overhead_s": f"{stamp}: (decode step over a full hybrid cache of {settings.probe_context} − "
                                  f"over the full cache of about as many entries) per layer, less the attention "
                                  f"op's difference at attention_flops, mean over {streaming}.",
        "evict_row_layer_overhead_s": f"{stamp}: ({settings.rows}-row pass over the full hybrid cache − over the "
                                      "full cache) per layer, less evict_layer_overhead_s, per extra row, for the same "
                                      "models.",
        "threads": f"{read}: the torch threads it measured with (--threads); the engine decodes with as many.",
        "per_vocab_overhead_s": f"{stamp}: greedy choice (argmax) over one row of logits, slope between vocabularies of "
                                f"{settings.vocab_sizes[0]} and {settings.vocab_sizes[1]} entries.",
    }
    if cal.extra_row_flops is not None:
        sources["extra_row_flops"] = (
            f"{stamp}: bf16 F.linear over the same weights with {settings.rows} rows vs 1 row: "
            f"({settings.rows}−1)·2·P FLOPs over the extra time."
        )
    heads, kv_heads, hd = ATTENTION_SHAPE
    paths = {"single": "1 row over the full cache", "multi": f"{settings.rows} rows over the full cache",
             "evicting": "1 row over a full hybrid cache"}
    for key in cal.attention_flops:
        path, _, kv_dtype = key.partition(":")
        timed = (f"{stamp}: one layer of KVArena.attend ({heads} and {ATTENTION_NARROW_SHAPE[0]} query heads, "
                 f"{kv_heads} KV heads of {hd}; {kv_dtype or 'bfloat16'} keys and values), {paths[path]}, at "
                 f"{settings.attention_entries[0]} and {settings.attention_entries[1]} entries, "
                 f"{settings.flush_bytes // MIB} MiB read before each call: per entry and row the extra time is "
                 "4·H·d / attention_flops + n_kv·d / attention_head_reads, solved from the two shapes")
        sources[f"attention_flops.{key}"] = timed + "."
        if key in cal.attention_head_reads:
            sources[f"attention_head_reads.{key}"] = timed + "."
        else:
            sources[f"attention_flops.{key}"] = timed + " (they did not separate: the first shape's 4·H·d alone)."
    for kind, curve in cal.native_stream.items():
        sources[f"native_stream.{kind}"] = (
            f"{stamp}: the native kernels' one-row matmul over random {kind} blocks of layers shaped "
            f"{list(settings.stream_shapes)} ([out, in]), {curve['working_set_bytes'] / MIB:.0f} MiB in all (median "
            f"trial; the file's bytes over the time); extra_row_bytes_per_s: the same bytes over the extra time per "
            f"extra row of {settings.rows}-row passes (median of one-row and {settings.rows}-row passes in turn)."
        )
    caches = {}
    for key, label in (("cpu_l1d_per_core", "L1d per core"), ("cpu_l2_per_core", "L2 per core"), ("cpu_l3", "L3")):
        if key in cal.caches:
            caches[key] = cal.caches[key]
            sources[f"caches.{key}"] = f"{read} from {cal.cache_source}: {label}."
    vm = " under a hypervisor" if cal.hypervisor else ""
    return DeviceProfile(
        name=name,
        description=f"This machine: {cal.cores} × {cal.cpu}{vm}, decoding with sparsespec's native kernels on the "
                    f"CPU at {cal.threads} threads",
        compute_unit=f"CPU: {cal.cores} cores" + (f" ({', '.join(isa)})" if isa else ""),
        memory_bytes=cal.memory_bytes,
        dram_bandwidth=dram,
        dram_efficiency=efficiency,
        sram_level="CPU last-level cache (L3)",
        sram_bytes=l3,
        sram_bandwidth=max(cal.sram_bandwidth, dram),
        sram_kv_fraction=cal.sram_kv_fraction,
        peak_flops=dict(cal.peak_flops),
        overhead_s=cal.overhead_s,
        per_layer_overhead_s=cal.per_layer_overhead_s,
        stream_overhead_fraction=cal.stream_overhead_fraction,
        threads=cal.threads,
        extra_row_flops=cal.extra_row_flops,
        per_row_layer_overhead_s=cal.per_row_layer_overhead_s,
        evict_layer_overhead_s=cal.evict_layer_overhead_s,
        evict_row_layer_overhead_s=cal.evict_row_layer_overhead_s,
        per_vocab_overhead_s=cal.per_vocab_overhead_s,
        attention_flops=dict(cal.attention_flops),
        attention_head_reads=dict(cal.attention_head_reads),
        native_stream={kind: {k: entry[k] for k in ("bytes_per_s", "extra_row_bytes_per_s")}
                       for kind, entry in cal.native_stream.items()},
        caches=caches,
        sources=sources,
        note=f"Measured by sparsespec calibrate on {cal.date} in {cal.seconds:.0f} s at {cal.threads} threads "
             f"(load average {cal.loadavg_before:.2f} before, {cal.loadavg_after:.2f} after). The overheads, "
             "native streaming, extra-row, sampling and attention figures describe sparsespec's own engine (native "
             "kernels, bfloat16 compute), not the chip alone. Read bandwidth by buffer size (bytes: GB/s): "
             + ", ".join(f"{int(p['bytes'])}: {p['bytes_per_s'] / 1e9:.1f}" for p in cal.bandwidth_curve) + ".",
    )


def default_output_path() -> Path:
    """Where ``sparsespec calibrate`` writes by default: ``$SPARSESPEC_HOME/devices/host.json``."""
    return user_devices_dir() / "host.json"
