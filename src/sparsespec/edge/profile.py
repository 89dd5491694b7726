"""Device profiles: the handful of hardware figures the edge simulator needs, stored as data.

Each profile is one JSON file under ``edge/devices/`` (or any path the user gives). Every figure in a profile names
its source in ``sources`` (keyed by field name, ``peak_flops.bf16`` / ``caches.gpu_l2`` for mapping entries), and a
figure that is an estimate says so and why. Units are SI: bytes, bytes per second, FLOP per second, seconds.

Profiles looked up by name come first from the user's folder ``$SPARSESPEC_HOME/devices/`` (default
``~/.cache/sparsespec/devices/``), then from the packaged ``edge/devices/``. ``sparsespec calibrate`` writes its
measurements of this machine to ``host.json`` in the user's folder, so ``load_profile("host")`` returns the
calibrated profile once there is one and the packaged placeholder before that.

Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from ..errors import UserError
from ..loading.fixtures import cache_dir

DEVICES_DIR = Path(__file__).with_name("devices")

# Paths of the engine's attention that a profile may give a measured FLOP rate for (see DeviceProfile), each also
# for quantized keys and values (``single:int8``).
ATTENTION_PATHS = ("single", "multi", "evicting")
ATTENTION_KV_DTYPES = ("int8", "int4")


def user_devices_dir() -> Path:
    """The user's profile folder, searched before the packaged one: ``$SPARSESPEC_HOME/devices``."""
    return cache_dir() / "devices"


@dataclass(frozen=True)
class DeviceProfile:
    """Memory hierarchy and compute peaks of one device, as seen by a decoder running on ``compute_unit``.

    ``sram_*`` describe the on-chip level the KV cache can live in (GPU L2 on a Jetson, the CPU's last-level cache on
    a CPU device). ``sram_kv_fraction`` is the share of it the KV cache may occupy while weights stream through the
    same cache. ``dram_efficiency`` is the fraction of ``dram_bandwidth`` the decode kernels achieve (1.0 when only
    the vendor's peak is known: predictions are then upper bounds). ``caches`` holds other cache sizes for reference;
    the model does not use them.

    Costs of the decoding engine beyond the roofline (seconds unless noted): ``overhead_s`` per forward pass (the
    step's fixed work: launching the pass, sampling, committing), ``per_layer_overhead_s`` per layer and pass.
    Optional figures (``None`` = not known, counted as zero; see :func:`..roofline.forward_pass`):

    - ``extra_row_flops``: FLOP/s at which a pass processes the matrix products of its rows after the first, on top
      of streaming the weights once (a verification pass of γ+1 rows; small-M matrix products run far below peak);
    - ``per_row_layer_overhead_s``: per layer, each row after the first (masks and bookkeeping of multi-row
      attention);
    - ``evict_layer_overhead_s``: per layer, once per pass, while a budgeted cache is full and evicts (attention
      row by row and the eviction choice), and ``evict_row_layer_overhead_s`` per layer for each further row of such
      a pass;
    - ``threads``: threads the engine decodes with; the attention op gives each thread whole KV heads while a
      head holds fewer than 4,096 slots (``kernels/csrc/attention.cpp``), so heads that do not divide among the
      threads leave the op as slow as its busiest thread (None: not a CPU engine, no such imbalance);
    - ``stream_overhead_fraction``: the share of a pass's weight-streaming time that its other work takes on top
      (each layer's norms, attention and glue run in caches the layer's weights just went through; measured as a
      part of the per-layer cost in proportion to the layer's streaming time);
    - ``per_vocab_overhead_s``: per vocabulary entry and forward pass (choosing the token from the logits; measured
      greedy, an argmax);
    - ``attention_flops``: FLOP/s that the engine's attention kernels reach per cached entry, by path: ``single``
      (one row over the full cache), ``multi`` (several rows over the full cache, masked), ``evicting`` (rows of a
      full budgeted cache, one after another), each also for int8 / int4 keys and values (``single:int8``; a path
      without its KV dtype's rate uses the bfloat16 one). Empty: attention costs only its bytes and its FLOPs at
      peak. A path with a rate is timed by it (and ``attention_head_reads``) alone: the rates were measured on the
      op, its reads of the cache included.
    - ``attention_head_reads``: the attention op's work per KV head, besides its FLOPs, by the same paths: KV-head
      channels per second (``n_kv · d`` per cached entry and row: the keys and values a KV head reads, its scores
      and evictions, whatever its number of query heads). A KV head with few query heads costs more per FLOP
      (SmolLM2's 3 query heads per KV head against Qwen's 6–7); a path without a figure prices FLOPs alone.
    - ``native_stream``: how fast the native kernels stream weights kept in each GGUF block type from DRAM, by
      type name (``Q4_K``): ``bytes_per_s`` in the file's bytes, and ``extra_row_bytes_per_s`` the rate at which
      each further row of a multi-row pass goes through them. Types not listed, and profiles without it, stream at
      ``effective_dram_bandwidth``.
    """

    name: str
    description: str
    compute_unit: str
    memory_bytes: int
    dram_bandwidth: float
    sram_level: str
    sram_bytes: int
    sram_bandwidth: float
    peak_flops: Mapping[str, float]
    overhead_s: float
    per_layer_overhead_s: float = 0.0
    dram_efficiency: float = 1.0
    sram_kv_fraction: float = 1.0
    extra_row_flops: float | None = None
    per_row_layer_overhead_s: float | None = None
    evict_layer_overhead_s: float | None = None
    evict_row_layer_overhead_s: float | None = None
    per_vocab_overhead_s: float | None = None
    stream_overhead_fraction: float | None = None
    threads: int | None = None
    attention_flops: Mapping[str, float] = field(default_factory=dict)
    attention_head_reads: Mapping[str, float] = field(default_factory=dict)
    native_stream: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    caches: Mapping[str, int] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    note: str = ""

    def __post_init__(self) -> None:
        positive = ("memory_bytes", "dram_bandwidth", "sram_bandwidth")
        for key in positive:
            if not _is_number(getattr(self, key)) or getattr(self, key) <= 0:
                raise UserError(f"Device profile {self.name!r}: {key} must be a positive number.")
        for key in ("sram_bytes", "overhead_s", "per_layer_overhead_s"):
            if not _is_number(getattr(self, key)) or getattr(self, key) < 0:
                raise UserError(f"Device profile {self.name!r}: {key} must be a number >= 0.")
        optional = ("per_row_layer_overhead_s", "evict_layer_overhead_s", "evict_row_layer_overhead_s",
                    "per_vocab_overhead_s", "stream_overhead_fraction")
        for key in optional:
            value = getattr(self, key)
            if value is not None and (not _is_number(value) or value < 0):
                raise UserError(f"Device profile {self.name!r}: {key} must be a number >= 0 (or null).")
        if self.threads is not None and (not isinstance(self.threads, int) or isinstance(self.threads, bool)
                                         or self.threads < 1):
            raise UserError(f"Device profile {self.name!r}: threads must be a whole number >= 1 (or null).")
        if self.extra_row_flops is not None and (not _is_number(self.extra_row_flops) or self.extra_row_flops <= 0):
            raise UserError(f"Device profile {self.name!r}: extra_row_flops must be a positive number (or null).")
        for key in ("dram_efficiency", "sram_kv_fraction"):
            value = getattr(self, key)
            if not _is_number(value) or not 0 < value <= 1:
                raise UserError(f"Device profile {self.name!r}: {key} must lie in (0, 1].")
        if not self.peak_flops:
            raise UserError(f"Device profile {self.name!r}: peak_flops needs at least one dtype (e.g. fp32).")
        for dtype, value in self.peak_flops.items():
            if not _is_number(value) or value <= 0:
                raise UserError(f"Device profile {self.name!r}: peak_flops.{dtype} must be a positive number.")
        for figure in ("attention_flops", "attention_head_reads"):
            for path, value in getattr(self, figure).items():
                base, colon, kv_dtype = path.partition(":")
                if base not in ATTENTION_PATHS or (colon and kv_dtype not in ATTENTION_KV_DTYPES):
                    raise UserError(
                        f"Device profile {self.name!r}: {figure}.{path} is not one of {', '.join(ATTENTION_PATHS)}"
                        f", alone or with :{' / :'.join(ATTENTION_KV_DTYPES)}."
                    )
                if not _is_number(value) or value <= 0:
                    raise UserError(f"Device profile {self.name!r}: {figure}.{path} must be a positive number.")
        for kind, entry in self.native_stream.items():
            _check_native_stream(self.name, kind, entry)

    @property
    def effective_dram_bandwidth(self) -> float:
        """Bytes per second the decode kernels stream from DRAM: ``dram_bandwidth × dram_efficiency``."""
        return self.dram_bandwidth * self.dram_efficiency

    @property
    def sram_kv_budget(self) -> float:
        """Bytes of KV cache that stay resident in SRAM: ``sram_bytes × sram_kv_fraction``."""
        return self.sram_bytes * self.sram_kv_fraction

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; a dtype the profile does not list runs at the fp32 rate (or the lowest listed)."""
        if dtype in self.peak_flops:
            return float(self.peak_flops[dtype])
        if "fp32" in self.peak_flops:
            return float(self.peak_flops["fp32"])
        return float(min(self.peak_flops.values()))

    def weight_stream_rate(self, kind: str) -> float | None:
        """Bytes/s at which the native kernels stream weights of GGUF type ``kind`` (see ``native_stream``); None
        when the profile has no rate for the type."""
        return self._native_figure(kind, "bytes_per_s")

    def extra_row_stream_rate(self, kind: str) -> float | None:
        """Bytes/s at which each row after the first of a multi-row pass goes through weights of type ``kind``;
        None when the profile has no figure for the type."""
        return self._native_figure(kind, "extra_row_bytes_per_s")

    def _native_figure(self, kind: str, key: str) -> float | None:
        value = self.native_stream.get(kind, {}).get(key)
        return None if value is None else float(value)

    def attention_seconds(self, path: str, kv_dtype: str, flops: float, head_reads: float) -> float | None:
        """Seconds of the attention op on ``path`` for ``kv_dtype`` keys and values: ``flops`` at ``attention_flops``
        plus ``head_reads`` (KV-head channels, ``n_kv · d`` per entry and row) at ``attention_head_reads`` (each the
        path's own figure where the dtype has none; no head figure: FLOPs alone); None without a FLOP rate."""
        rate = self.attention_flops.get(f"{path}:{kv_dtype}") or self.attention_flops.get(path)
        if rate is None:
            return None
        reads = self.attention_head_reads.get(f"{path}:{kv_dtype}") or self.attention_head_reads.get(path)
        return flops / float(rate) + (head_reads / float(reads) if reads else 0.0)

    def figures(self) -> list[str]:
        """Names of every numeric figure in the profile (``peak_flops.bf16`` style for mapping entries)."""
        names = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Mapping) and f.name != "sources":
                names.extend(f"{f.name}.{key}" for key in value)
            elif _is_number(value):
                names.append(f.name)
        return names

    def missing_sources(self) -> list[str]:
        """Figures without an entry in ``sources`` (an empty list means every figure is cited)."""
        return [name for name in self.figures() if not str(self.sources.get(name, "")).strip()]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["peak_flops"] = dict(self.peak_flops)
        data["attention_flops"] = dict(self.attention_flops)
        data["attention_head_reads"] = dict(self.attention_head_reads)
        data["native_stream"] = {kind: dict(entry) for kind, entry in self.native_stream.items()}
        data["caches"] = dict(self.caches)
        data["sources"] = dict(self.sources)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "profile") -> "DeviceProfile":
        """Build from a JSON mapping; unknown or missing keys raise :class:`UserError` naming ``origin``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"Device profile {origin} has unknown keys: {', '.join(unknown)}.")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise UserError(f"Device profile {origin} lacks the keys: {', '.join(missing)}.")
        try:
            return cls(**data)
        except TypeError as exc:
            raise UserError(f"Device profile {origin} is malformed: {exc}.") from None


def _check_native_stream(name: str, kind: str, entry: Any) -> None:
    """A ``native_stream`` entry: a positive ``bytes_per_s`` and an optional positive ``extra_row_bytes_per_s``."""
    where = f"Device profile {name!r}: native_stream.{kind}"
    if not isinstance(entry, Mapping):
        raise UserError(f"{where} must be an object with bytes_per_s (and extra_row_bytes_per_s).")
    unknown = sorted(set(entry) - {"bytes_per_s", "extra_row_bytes_per_s"})
    if unknown:
        raise UserError(f"{where} has unknown keys: {', '.join(unknown)}.")
    rate = entry.get("bytes_per_s")
    if not _is_number(rate) or rate <= 0:
        raise UserError(f"{where}: bytes_per_s must be a positive number.")
    extra = entry.get("extra_row_bytes_per_s")
    if extra is not None and (not _is_number(extra) or extra <= 0):
        raise UserError(f"{where}: extra_row_bytes_per_s must be a positive number (or null).")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def list_profiles() -> list[str]:
    """Names of the device profiles shipped with sparsespec, sorted (a user profile may override any of them)."""
    return sorted(path.stem for path in DEVICES_DIR.glob("*.json"))


def profile_path(name: str) -> Path | None:
    """Where the profile called ``name`` lives: the user's folder first, then the packaged one; None if neither."""
    if not name or "/" in name or "\\" in name or name.endswith(".json"):
        return None
    for folder in (user_devices_dir(), DEVICES_DIR):
        path = folder / f"{name}.json"
        if path.is_file():
            return path
    return None


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """Load a profile by name (``jetson-orin-nano-8gb``, ``host``) or any profile JSON file by path.

    A name is looked up in :func:`user_devices_dir` first (where ``sparsespec calibrate`` writes ``host.json``),
    then among the packaged profiles. Raises :class:`UserError` for an unknown name, listing the known ones.
    """
    text = str(name_or_path)
    path = profile_path(text)
    if path is None:
        candidate = Path(text).expanduser()
        if candidate.is_file():
            path = candidate
        else:
            known = ", ".join(list_profiles())
            raise UserError(f"Unknown device {text!r}: give one of {known}, or the path of a device profile .json.")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"Cannot read the device profile {path}: {exc}.") from None
    if not isinstance(data, dict):
        raise UserError(f"Device profile {path} must hold one JSON object.")
    return DeviceProfile.from_dict(data, origin=str(path))


def save_profile(profile: DeviceProfile, path: str | Path) -> Path:
    """Write ``profile`` as indented JSON to ``path`` (parent folders are created) and return the path."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    return path
