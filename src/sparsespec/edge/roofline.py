"""The analytical decode-speed model: a roofline per forward pass plus SRAM residency of the KV cache.

One forward pass of ``T`` new tokens over a KV cache of ``N`` entries moves, per memory level:

- DRAM: the streamed weights once (:func:`weight_bytes`, each matrix at its format's real bytes), plus the KV cache when it does not fit
  the device's SRAM budget;
- SRAM: the KV cache when its ``(N + T)`` slots fit ``sram_bytes × sram_kv_fraction``, plus the activations.

KV traffic is ``N`` entries read and ``T`` entries written, at ``kv_bytes_per_token`` for the cache dtype (``N`` is
what the arena keeps visible: the whole context for the full cache, the budget for a budgeted one, averaged over
the layers where sliding-window layers read at most their window, :func:`layer_mean_entries`). The streamed
weights are every projection and the output head (a tied head streams the embedding table), which is what
``Transformer.bytes_read_per_token`` reports plus the norm vectors. The pass does ``2·P·T`` FLOPs in the matrix
products plus ``4·L·H·d·N·T`` in attention (QKᵀ and PV), and takes

    time = max(memory + extra_rows + attention, FLOPs / peak) + overhead
    memory     = weights + Σ_level (other bytes)_level / bandwidth_level
    weights    = weight bytes / effective DRAM bandwidth, or for the native format Σ_type bytes_type / rate_type
    extra_rows = (T − 1) · 2·P / extra_row_flops, or for the native format (T − 1) · Σ_type bytes_type / extra_type
    attention  = (4·L·H·d·N·T / attention_flops[path] + L·n_kv·d·N·T / attention_head_reads[path]) · balance
                 (path: single, multi or evicting; per KV dtype)
    balance    = ⌈KV heads / threads⌉ · threads / KV heads where the op gives threads whole heads (else 1)
    overhead   = overhead_s + L · per_layer_overhead_s + V · per_vocab_overhead_s + weights · stream_overhead_fraction
                 + (T − 1) · L · per_row_layer_overhead_s
                 + [cache full and evicting] · L · (evict_layer_overhead_s + (T − 1) · evict_row_layer_overhead_s)

so a verification pass of γ+1 rows costs one pass of weight traffic plus a per-extra-row cost. The native format
(the GGUF file's own blocks, the engine's default) is given as the file's streamed bytes by block type; a profile
with ``native_stream`` rates (``sparsespec calibrate`` measures them) streams each type at its own rate, and where
the attention path has a measured rate, the op's time stands for its reads of the cache too (the KV bytes are
still reported as traffic). ``extra_row_flops``,
``attention_flops`` and the per-row overheads describe the decoding engine more than the chip: ``sparsespec
calibrate`` measures them for sparsespec's own engine on this machine; profiles without them count them as zero
(attention then costs its KV bytes, and its FLOPs at peak).

Decoding modes build on that pass:

- ``full``: one 1-token target pass per token over the whole context (``N = context``);
- ``sparse``: the same with a budgeted cache (``N = budget``: sinks + heavy hitters + window);
- ``speculative``: per round, γ 1-token draft passes and one (γ+1)-token target verification; a round yields
  ``E = (1 − α^(γ+1)) / (1 − α)`` tokens for per-token acceptance α (``γ+1`` when α = 1);
- ``combined``: speculative with a budgeted target cache (and a budgeted draft cache).

Without a separate draft model, speculation is self-speculation: the target's own weights with a small sparse cache
drafts for the target, so every draft step streams the full weights. Target and draft KV caches compete for the
same SRAM budget (see :func:`place_kv`).

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any, Mapping, Sequence

from ..config import ModelConfig
from ..errors import UserError
from ..speedup import check_alpha_gamma, expected_tokens_per_pass  # the decoding core's formulas
from .profile import DeviceProfile

# Weight formats the engine runs (``linear.py``), by their real bytes, scales included:
# - ``bf16`` / ``fp16`` / ``fp32``: dense, 2 / 2 / 4 bytes per weight;
# - ``int8`` / ``int4``: the weights quantized to GGML's Q8_0 / Q4_1 blocks of 32 weights along in_features (34 / 20
#   bytes a block, scales included; in_features padded to 32), priced as the native format's blocks of those types
#   (:func:`bytes_by_type`);
# - ``native``: the GGUF file's own tensors, given as their streamed bytes by block type (``{"Q4_K": bytes, …}``,
#   from the file header: ``edge.commands.native_streamed_bytes``).
# Norm vectors stay in the compute dtype (bf16); biases are float32 (4 bytes), as the native kernels add them.
# The nominal bytes per weight, for labels and rough totals:
BYTES_PER_WEIGHT: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 34 / 32, "int4": 20 / 32}
WEIGHT_FORMATS = (*BYTES_PER_WEIGHT, "native")
# The GGML block type of each quantized format (linear.QUANTIZED_TYPES) and its bytes per block of QUANTIZED_BLOCK
# weights (tests/test_edge.py checks both against the engine and GGUF).
QUANTIZED_BLOCKS: dict[str, tuple[str, int]] = {"int8": ("Q8_0", 34), "int4": ("Q4_1", 20)}
QUANTIZED_BLOCK = 32
_DENSE_VECTOR_BYTES = 2.0
_BIAS_BYTES = 4.0

# Bytes per stored K or V element of the cache, as the KV arena stores them (cache/quant.py): int8 codes with a
# float16 scale and zero per 32 channels (36 bytes / 32 elements), int4 codes with the same per 16 (12 / 16).
KV_BYTES_PER_ELEMENT: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 36 / 32, "int4": 12 / 16}

# Activations are counted as bf16 elements: per layer and token about 4 reads/writes of the hidden state
# and 3 of the MLP's intermediate width (gate, up, their product). Small next to the weights; kept for honesty.
ACTIVATION_BYTES = 2.0

MODES = ("full", "sparse", "speculative", "combined")


def _check_choice(value: str, table: dict[str, float], what: str) -> float:
    if value not in table:
        raise UserError(f"Unknown {what} {value!r}; choose one of {', '.join(table)}.")
    return table[value]


def streamed_parameters(model: ModelConfig) -> int:
    """Parameters read in full on every forward.

    Everything but an untied token-embedding table, of which a forward only gathers its ``T`` rows; a tied table is
    also the output head and is read whole.
    """
    embedding = model.vocab_size * model.hidden_size
    return model.num_parameters() - (0 if model.tie_word_embeddings else embedding)


def matrices(model: ModelConfig) -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of every streamed matrix: per layer the fused q/k/v, o, fused gate/up and down
    projections, then the output head."""
    h, i = model.hidden_size, model.intermediate_size
    q, kv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    layer = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    return layer * model.num_hidden_layers + [(model.vocab_size, h)]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def matrix_bytes(out_features: int, in_features: int, weights: str) -> float:
    """Bytes of one ``[out, in]`` matrix in the engine's format ``weights`` (see :data:`BYTES_PER_WEIGHT`)."""
    if weights in QUANTIZED_BLOCKS:
        return out_features * _round_up(in_features, QUANTIZED_BLOCK) // QUANTIZED_BLOCK * QUANTIZED_BLOCKS[weights][1]
    return out_features * in_features * _check_choice(weights, BYTES_PER_WEIGHT, "weight format")


# A weight format for the functions below: a name of BYTES_PER_WEIGHT, the bytes per streamed parameter of a
# format known only by its total, or the native format's streamed bytes by GGUF block type.
Weights = str | float | Mapping[str, float]


def weight_bytes(model: ModelConfig, weights: Weights = "bf16") -> float:
    """Bytes of weights streamed from DRAM per forward.

    ``weights`` is a format of :data:`BYTES_PER_WEIGHT` (each matrix by its real bytes, norms and biases dense), a
    number of bytes per streamed parameter, or the native format's streamed bytes by block type (their sum).
    """
    if isinstance(weights, Mapping):
        return float(sum(weights.values()))
    if not isinstance(weights, str):
        return streamed_parameters(model) * float(weights)
    shapes = matrices(model)
    vectors = streamed_parameters(model) - sum(o * i for o, i in shapes)
    total = sum(matrix_bytes(o, i, weights) for o, i in shapes) + vectors * _DENSE_VECTOR_BYTES
    if model.attention_bias:
        q, kv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
        total += model.num_hidden_layers * (q + 2 * kv) * (_BIAS_BYTES - _DENSE_VECTOR_BYTES)
    return total


def bytes_by_type(model: ModelConfig, weights: str) -> dict[str, float]:
    """A quantized format's streamed bytes as the native format gives them, by GGML type: its matrices' blocks
    (``Q8_0`` / ``Q4_1``) and the rest (norms, biases) as ``BF16``, so that a profile's per-type rates price them."""
    kind = QUANTIZED_BLOCKS[weights][0]
    blocks = float(sum(matrix_bytes(o, i, weights) for o, i in matrices(model)))
    return {kind: blocks, "BF16": weight_bytes(model, weights) - blocks}


def resident_weight_bytes(model: ModelConfig, weights: Weights = "bf16") -> float:
    """Bytes of all weights held in memory: the streamed ones plus an untied embedding table (kept dense)."""
    untied = 0 if model.tie_word_embeddings else model.vocab_size * model.hidden_size * _DENSE_VECTOR_BYTES
    return weight_bytes(model, weights) + untied


def kv_bytes_per_token(model: ModelConfig, kv_dtype: str = "bf16") -> float:
    """Bytes of K and V per cached token over all layers at the cache dtype."""
    return model.kv_bytes_per_token(_check_choice(kv_dtype, KV_BYTES_PER_ELEMENT, "KV cache dtype"))


def layer_mean_entries(model: ModelConfig, entries: float) -> float:
    """Cache entries a row reads, averaged over the layers, where the global layers read ``entries``: a
    sliding-window layer (Gemma 3) holds and reads at most its window."""
    sliding = len(model.sliding_layers)
    if not sliding:
        return entries
    return ((model.num_hidden_layers - sliding) * entries + sliding * min(entries, model.sliding_window)) / \
        model.num_hidden_layers


def activation_bytes(model: ModelConfig, tokens: int) -> float:
    """Rough activation traffic of a ``tokens``-token forward (bf16), kept on chip."""
    per_layer = 4 * model.hidden_size + 3 * model.intermediate_size
    return ACTIVATION_BYTES * tokens * model.num_hidden_layers * per_layer


def attention_flops(model: ModelConfig, tokens: int, kv_entries: float) -> float:
    """``4·L·H·d·N·T``: QKᵀ and PV of ``tokens`` rows over ``kv_entries`` cached entries (a layer's mean), all
    layers."""
    return 4.0 * model.num_hidden_layers * model.num_attention_heads * model.head_dim * kv_entries * tokens


def attention_head_reads(model: ModelConfig, tokens: int, kv_entries: float) -> float:
    """``L·n_kv·d·N·T``: the KV-head channels the attention op goes through for ``tokens`` rows over ``kv_entries``
    cached entries (a layer's mean), all layers (each KV head's keys and values, scores and evictions)."""
    return 1.0 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * kv_entries * tokens


def forward_flops(model: ModelConfig, tokens: int, kv_entries: float) -> float:
    """``2·P·T`` matrix-product FLOPs plus ``4·L·H·d·N·T`` attention FLOPs."""
    return 2.0 * streamed_parameters(model) * tokens + attention_flops(model, tokens, kv_entries)


def kv_fits_sram(model: ModelConfig, device: DeviceProfile, slots: float, kv_dtype: str = "bf16") -> bool:
    """Whether ``slots`` cached tokens (all layers) fit the device's SRAM budget for the KV cache."""
    return slots * kv_bytes_per_token(model, kv_dtype) <= device.sram_kv_budget


@dataclass(frozen=True)
class PassCost:
    """Cost of one forward pass of ``tokens`` new tokens over ``kv_entries`` cached ones.

    ``dram_bytes`` / ``sram_bytes`` split the traffic by kind (``weights``, ``kv``, ``activations``).
    """

    tokens: int
    kv_entries: int
    kv_in_sram: bool
    dram_bytes: dict[str, float]
    sram_bytes: dict[str, float]
    flops: float
    memory_s: float
    compute_s: float
    overhead_s: float
    extra_rows_s: float = 0.0
    attention_s: float = 0.0
    evicting: bool = False

    @property
    def streaming_s(self) -> float:
        """The memory side of the roofline: bytes moved, plus the extra rows' and attention kernels' own time."""
        return self.memory_s + self.extra_rows_s + self.attention_s

    @property
    def time_s(self) -> float:
        return max(self.streaming_s, self.compute_s) + self.overhead_s

    @property
    def bound(self) -> str:
        """``"memory"`` or ``"compute"``: which side of the roofline sets the pass time."""
        return "memory" if self.streaming_s >= self.compute_s else "compute"

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "kv_entries": self.kv_entries,
            "kv_in_sram": self.kv_in_sram,
            "dram_bytes": dict(self.dram_bytes),
            "sram_bytes": dict(self.sram_bytes),
            "flops": self.flops,
            "memory_s": self.memory_s,
            "compute_s": self.compute_s,
            "extra_rows_s": self.extra_rows_s,
            "attention_s": self.attention_s,
            "overhead_s": self.overhead_s,
            "evicting": self.evicting,
            "time_s": self.time_s,
            "bound": self.bound,
        }


def forward_pass(
    model: ModelConfig,
    device: DeviceProfile,
    *,
    tokens: int,
    kv_entries: int,
    weights: Weights = "bf16",
    kv_dtype: str = "bf16",
    compute_dtype: str = "bf16",
    kv_in_sram: bool | None = None,
    evicting: bool = False,
) -> PassCost:
    """Roofline cost of one forward of ``tokens`` new tokens over ``kv_entries`` cached ones.

    ``kv_in_sram=None`` decides residency from the cache's ``kv_entries + tokens`` slots and the SRAM budget; pass
    True/False to force it (used when several caches share the budget). Weight-only quantized formats compute at
    ``compute_dtype`` (the weights are widened before the products). ``evicting``: the cache is a full budgeted
    one, so every row evicts (adds ``evict_layer_overhead_s`` per layer, and ``evict_row_layer_overhead_s`` per
    layer for each row after the first).
    """
    if tokens < 1 or kv_entries < 0:
        raise UserError("A forward pass needs at least one token and a non-negative cache size.")
    kvb = kv_bytes_per_token(model, kv_dtype)
    read = layer_mean_entries(model, kv_entries)  # sliding-window layers read their window
    if kv_in_sram is None:
        kv_in_sram = kv_fits_sram(model, device, read + tokens, kv_dtype)
    kv_traffic = (read + tokens) * kvb  # N entries read, T entries written
    dram = {"weights": weight_bytes(model, weights), "kv": 0.0 if kv_in_sram else kv_traffic}
    sram = {"kv": kv_traffic if kv_in_sram else 0.0, "activations": activation_bytes(model, tokens)}
    path = "evicting" if evicting else ("multi" if tokens > 1 else "single")
    op_s = device.attention_seconds(path, kv_dtype, attention_flops(model, tokens, read),
                                    attention_head_reads(model, tokens, read))
    if op_s is not None:  # the op's measured time holds its reads of the cache
        attention_s = op_s * head_balance(model, device, kv_entries + tokens)
        kv_s = 0.0
    else:
        attention_s = 0.0
        kv_s = kv_traffic / (device.sram_bandwidth if kv_in_sram else device.effective_dram_bandwidth)
    streaming_weights_s = weights_seconds(device, weights, dram["weights"])
    memory_s = streaming_weights_s + kv_s + sram["activations"] / device.sram_bandwidth
    flops = forward_flops(model, tokens, read)
    # Native weights: the profile's per-type rates, for the first row and for each extra one, are the kernels' own
    # roofline, their arithmetic included; the GEMM peak is torch's, which the native kernels never run (on a host
    # without a bf16 GEMM it is 1 GFLOP/s, two orders below them): dense weights are still priced by it.
    compute_s = 0.0 if isinstance(weights, Mapping) else flops / device.peak(compute_dtype)
    layers = model.num_hidden_layers
    extra = tokens - 1
    extra_rows_s = extra * extra_row_seconds(model, device, weights) if extra else 0.0
    overhead_s = device.overhead_s + layers * device.per_layer_overhead_s
    overhead_s += model.vocab_size * (device.per_vocab_overhead_s or 0.0)
    overhead_s += streaming_weights_s * (device.stream_overhead_fraction or 0.0)
    overhead_s += extra * layers * (device.per_row_layer_overhead_s or 0.0)
    if evicting:
        overhead_s += layers * (device.evict_layer_overhead_s or 0.0)
        overhead_s += extra * layers * (device.evict_row_layer_overhead_s or 0.0)
    return PassCost(
        tokens, kv_entries, kv_in_sram, dram, sram, flops, memory_s, compute_s, overhead_s, extra_rows_s, attention_s,
        evicting,
    )


# The attention op gives each thread whole KV heads while a head holds fewer slots than this (attention.cpp).
HEADS_SCHEDULE_SLOTS = 4096


def head_balance(model: ModelConfig, device: DeviceProfile, slots: int) -> float:
    """The attention op's time against an even share of its work: with ``device.threads`` threads taking whole KV
    heads (at most as many threads as heads, fewer than :data:`HEADS_SCHEDULE_SLOTS` slots a head), the busiest
    thread's ``⌈H / threads⌉`` heads against ``H / threads``; 1 where the heads divide evenly, where the op spreads
    the work in chunks instead, or where the profile names no threads."""
    heads, threads = model.num_key_value_heads, device.threads
    if not threads or heads % threads == 0 or threads > heads or slots >= HEADS_SCHEDULE_SLOTS:
        return 1.0
    return -(-heads // threads) * threads / heads


def weights_seconds(device: DeviceProfile, weights: Weights, total_bytes: float) -> float:
    """Seconds to stream one pass's ``total_bytes`` of weights: at the effective DRAM bandwidth, or for the native
    format each block type at the profile's rate (types without one at the DRAM rate)."""
    if not isinstance(weights, Mapping):
        return total_bytes / device.effective_dram_bandwidth
    return sum(nbytes / (device.weight_stream_rate(kind) or device.effective_dram_bandwidth)
               for kind, nbytes in weights.items())


def extra_row_seconds(model: ModelConfig, device: DeviceProfile, weights: Weights) -> float:
    """Seconds each row after the first adds to a pass's matrix products: ``2·P / extra_row_flops``, or for the
    native format each block type's bytes at the profile's extra-row rate (types without one by the FLOP rule on
    their share of the bytes). Zero when the profile has neither."""
    flop_rule = 2.0 * streamed_parameters(model) / device.extra_row_flops if device.extra_row_flops else 0.0
    if not isinstance(weights, Mapping):
        return flop_rule
    total = sum(weights.values()) or 1.0
    seconds = 0.0
    for kind, nbytes in weights.items():
        rate = device.extra_row_stream_rate(kind)
        seconds += nbytes / rate if rate else flop_rule * nbytes / total
    return seconds


# --- SRAM placement ----------------------------------------------------------------------------------------------


def place_kv(sizes: Sequence[float], reads: Sequence[float], budget: float) -> list[bool]:
    """Choose which KV caches live in SRAM when several share one budget.

    ``sizes[i]`` are resident bytes, ``reads[i]`` how many times cache i is streamed per round. Returns, per cache,
    whether it is placed in SRAM: the subset that fits ``budget`` and saves the most DRAM traffic (ties: more caches).
    """
    best: tuple[float, int] = (-1.0, -1)
    choice: tuple[bool, ...] = tuple(False for _ in sizes)
    for subset in product((False, True), repeat=len(sizes)):
        used = sum(s for s, keep in zip(sizes, subset) if keep)
        if used > budget:
            continue
        saved = sum(s * r for s, r, keep in zip(sizes, reads, subset) if keep)
        key = (saved, sum(subset))
        if key > best:
            best, choice = key, subset
    return list(choice)


# --- per-token predictions ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """Predicted decode speed of one mode on one device.

    ``bytes_per_token`` is traffic per generated token by level and kind
    (``{"dram": {"weights", "kv"}, "sram": {"kv", "activations"}}``). ``passes`` holds the per-pass costs
    (``"target"``, and ``"draft"`` for the speculative modes). ``cost_ratio`` is c: one draft pass over one 1-token
    target pass on the same cache.
    """

    mode: str
    device: str
    tokens_per_second: float
    seconds_per_token: float
    tokens_per_pass: float
    kv_entries: int
    kv_bytes: float
    kv_in_sram: bool
    bytes_per_token: dict[str, dict[str, float]]
    passes: dict[str, PassCost]
    gamma: int = 0
    acceptance: float | None = None
    draft: str | None = None
    draft_kv_entries: int | None = None
    draft_kv_bytes: float | None = None
    draft_kv_in_sram: bool | None = None
    cost_ratio: float | None = None

    def to_dict(self) -> dict[str, Any]:
        data = {
            "mode": self.mode,
            "device": self.device,
            "tokens_per_second": self.tokens_per_second,
            "seconds_per_token": self.seconds_per_token,
            "tokens_per_pass": self.tokens_per_pass,
            "kv_entries": self.kv_entries,
            "kv_bytes": self.kv_bytes,
            "kv_in_sram": self.kv_in_sram,
            "bytes_per_token": {level: dict(kinds) for level, kinds in self.bytes_per_token.items()},
            "passes": {name: cost.to_dict() for name, cost in self.passes.items()},
        }
        if self.mode in ("speculative", "combined"):
            data.update(
                gamma=self.gamma,
                acceptance=self.acceptance,
                draft=self.draft,
                draft_kv_entries=self.draft_kv_entries,
                draft_kv_bytes=self.draft_kv_bytes,
                draft_kv_in_sram=self.draft_kv_in_sram,
                cost_ratio=self.cost_ratio,
            )
        return data


def _bytes_per_token(weighted: Sequence[tuple[float, PassCost]], tokens: float) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {"dram": {"weights": 0.0, "kv": 0.0}, "sram": {"kv": 0.0, "activations": 0.0}}
    for count, cost in weighted:
        for level, kinds in (("dram", cost.dram_bytes), ("sram", cost.sram_bytes)):
            for kind, value in kinds.items():
                out[level][kind] += count * value / tokens
    return out


def _check_context(context: int, budget: int | None = None) -> None:
    if context < 1:
        raise UserError(f"Context length must be >= 1, got {context}.")
    if budget is not None and budget < 1:
        raise UserError(f"KV budget must be >= 1, got {budget}.")


def predict_autoregressive(
    model: ModelConfig,
    device: DeviceProfile,
    *,
    context: int,
    budget: int | None = None,
    weights: Weights = "bf16",
    kv_dtype: str = "bf16",
    compute_dtype: str = "bf16",
) -> Prediction:
    """One token per 1-token pass: mode ``full`` (``budget=None``, ``N = context``) or ``sparse`` (``N = budget``).

    A budgeted cache that the context fills (``context >= budget``) evicts on every step.
    """
    _check_context(context, budget)
    entries = context if budget is None else min(budget, context)
    cost = forward_pass(
        model, device, tokens=1, kv_entries=entries, weights=weights, kv_dtype=kv_dtype, compute_dtype=compute_dtype,
        evicting=_evicts(budget, context),
    )
    return Prediction(
        mode="full" if budget is None else "sparse",
        device=device.name,
        tokens_per_second=1.0 / cost.time_s,
        seconds_per_token=cost.time_s,
        tokens_per_pass=1.0,
        kv_entries=entries,
        kv_bytes=(layer_mean_entries(model, entries) + 1) * kv_bytes_per_token(model, kv_dtype),
        kv_in_sram=cost.kv_in_sram,
        bytes_per_token=_bytes_per_token([(1.0, cost)], 1.0),
        passes={"target": cost},
    )


def _evicts(budget: int | None, context: int) -> bool:
    """Whether a cache of ``budget`` entries (None: full) is full at ``context`` tokens, so each new row evicts."""
    return budget is not None and context >= budget


def predict_sparse(model: ModelConfig, device: DeviceProfile, *, context: int, budget: int, **kw: Any) -> Prediction:
    """Autoregressive decoding over a budgeted cache of ``min(budget, context)`` entries."""
    return predict_autoregressive(model, device, context=context, budget=budget, **kw)


def predict_speculative(
    target: ModelConfig,
    device: DeviceProfile,
    *,
    context: int,
    gamma: int,
    acceptance: float,
    draft: ModelConfig | None = None,
    budget: int | None = None,
    draft_budget: int | None = None,
    weights: Weights = "bf16",
    draft_weights: Weights | None = None,
    kv_dtype: str = "bf16",
    compute_dtype: str = "bf16",
    tokens_per_pass: float | None = None,
) -> Prediction:
    """Draft-then-verify: per round, γ 1-token draft passes and one (γ+1)-token target pass.

    ``budget=None`` keeps the target's full cache (mode ``speculative``); a budget makes it ``combined``.
    ``draft=None`` is self-speculation (the target's weights with a ``draft_budget``-entry cache; required then):
    each draft step streams the target's full weights. A separate draft keeps ``draft_budget`` entries if given,
    else the same cache size as the target. ``tokens_per_pass`` replaces the i.i.d. formula
    :func:`expected_tokens_per_pass` with a measured mean (tokens per target pass, in ``[1, γ+1]``).
    """
    _check_context(context, budget)
    check_alpha_gamma(acceptance, gamma)
    if gamma < 1:
        raise UserError("Speculative decoding needs γ >= 1 drafted tokens per round.")
    if tokens_per_pass is not None and not 1.0 <= tokens_per_pass <= gamma + 1:
        raise UserError(f"Tokens per target pass must lie in [1, γ+1] = [1, {gamma + 1}], got {tokens_per_pass}.")
    if draft is None and draft_budget is None:
        raise UserError("Self-speculation (no draft model) needs a draft cache budget.")
    if draft_budget is not None and draft_budget < 1:
        raise UserError(f"Draft KV budget must be >= 1, got {draft_budget}.")
    draft_model = target if draft is None else draft
    draft_weights = draft_weights or weights
    entries = context if budget is None else min(budget, context)
    draft_entries = min(draft_budget, context) if draft_budget is not None else entries
    draft_evicts = _evicts(draft_budget if draft_budget is not None else budget, context)

    # Target and draft caches share the SRAM budget: the target (γ+1 staged slots) is read once per round,
    # the draft (1 staged slot) γ times.
    sizes = [
        (layer_mean_entries(target, entries) + gamma + 1) * kv_bytes_per_token(target, kv_dtype),
        (layer_mean_entries(draft_model, draft_entries) + 1) * kv_bytes_per_token(draft_model, kv_dtype),
    ]
    target_in_sram, draft_in_sram = place_kv(sizes, [1.0, float(gamma)], device.sram_kv_budget)

    common = dict(kv_dtype=kv_dtype, compute_dtype=compute_dtype)
    target_evicts = _evicts(budget, context)
    verify = forward_pass(
        target, device, tokens=gamma + 1, kv_entries=entries, weights=weights, kv_in_sram=target_in_sram,
        evicting=target_evicts, **common,
    )
    draft_cost = forward_pass(
        draft_model,
        device,
        tokens=1,
        kv_entries=draft_entries,
        weights=draft_weights,
        kv_in_sram=draft_in_sram,
        evicting=draft_evicts,
        **common,
    )
    single = forward_pass(
        target, device, tokens=1, kv_entries=entries, weights=weights, kv_in_sram=target_in_sram,
        evicting=target_evicts, **common,
    )
    tokens = expected_tokens_per_pass(acceptance, gamma) if tokens_per_pass is None else float(tokens_per_pass)
    round_s = gamma * draft_cost.time_s + verify.time_s
    return Prediction(
        mode="speculative" if budget is None else "combined",
        device=device.name,
        tokens_per_second=tokens / round_s,
        seconds_per_token=round_s / tokens,
        tokens_per_pass=tokens,
        kv_entries=entries,
        kv_bytes=sizes[0],
        kv_in_sram=target_in_sram,
        bytes_per_token=_bytes_per_token([(float(gamma), draft_cost), (1.0, verify)], tokens),
        passes={"target": verify, "draft": draft_cost},
        gamma=gamma,
        acceptance=acceptance,
        draft="self" if draft is None else "model",
        draft_kv_entries=draft_entries,
        draft_kv_bytes=sizes[1],
        draft_kv_in_sram=draft_in_sram,
        cost_ratio=draft_cost.time_s / single.time_s,
    )


def predict_combined(
    target: ModelConfig, device: DeviceProfile, *, context: int, budget: int, **kw: Any
) -> Prediction:
    """Speculative decoding with a budgeted (sparse) target cache; see :func:`predict_speculative`."""
    return predict_speculative(target, device, context=context, budget=budget, **kw)


def predict(mode: str, target: ModelConfig, device: DeviceProfile, **kw: Any) -> Prediction:
    """Dispatch on ``mode`` (one of :data:`MODES`) to the matching ``predict_*`` function."""
    if mode == "full":
        kw.pop("budget", None)
        return predict_autoregressive(target, device, **_only(kw, _AR_KEYS))
    if mode == "sparse":
        return predict_sparse(target, device, **_only(kw, _AR_KEYS))
    if mode == "speculative":
        kw.pop("budget", None)
        return predict_speculative(target, device, **kw)
    if mode == "combined":
        return predict_combined(target, device, **kw)
    raise UserError(f"Unknown simulation mode {mode!r}; choose one of {', '.join(MODES)}.")


_AR_KEYS = ("context", "budget", "weights", "kv_dtype", "compute_dtype")


def _only(kw: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if k in keys}


# --- choosing γ and the budget on a device -----------------------------------------------------------------------


def best_gamma_on_device(
    target: ModelConfig,
    device: DeviceProfile,
    *,
    context: int,
    acceptance: float,
    max_gamma: int = 16,
    budget: int | None = None,
    **kw: Any,
) -> tuple[int, Prediction]:
    """The γ in ``0..max_gamma`` that maximises predicted tok/s on ``device``, with its prediction.

    γ = 0 is plain autoregressive decoding (over the same target cache); it wins when speculation does not pay.
    ``kw`` goes to :func:`predict_speculative` (``draft``, ``draft_budget``, ``weights``, …).
    """
    base = predict_autoregressive(
        target, device, context=context, budget=budget, **_only(kw, ("weights", "kv_dtype", "compute_dtype"))
    )
    best_g, best = 0, base
    for g in range(1, max_gamma + 1):
        pred = predict_speculative(target, device, context=context, gamma=g, acceptance=acceptance, budget=budget, **kw)
        if pred.tokens_per_second > best.tokens_per_second * (1 + 1e-12):
            best_g, best = g, pred
    return best_g, best


def best_budget(
    model: ModelConfig,
    device: DeviceProfile,
    *,
    kv_dtype: str = "bf16",
    staging: int = 1,
    reserve_bytes: float = 0.0,
    tracking_kv_bytes_per_token: float = 0.0,
    multiple: int = 16,
    context: int | None = None,
) -> int | None:
    """The largest KV budget (a multiple of ``multiple``) whose cache stays resident in SRAM.

    The cache holds ``budget + staging`` slots (``staging`` = γ+1 under speculation). ``reserve_bytes`` of the SRAM
    budget are kept for something of fixed size (a draft cache with its own budget);
    ``tracking_kv_bytes_per_token`` is the per-token size of a second cache that holds ``budget + 1`` slots too (a
    draft model's cache that follows the target's budget). Past this budget every token streams the KV cache from
    DRAM; below it the speed barely changes while quality falls, so it is the budget to pick for speed. Capped at
    ``context`` when given. None when not even ``multiple`` entries fit.
    """
    if multiple < 1 or staging < 0:
        raise UserError("best_budget needs multiple >= 1 and staging >= 0.")
    kvb = kv_bytes_per_token(model, kv_dtype)
    room = device.sram_kv_budget - reserve_bytes - staging * kvb - tracking_kv_bytes_per_token
    slots = int(room // (kvb + tracking_kv_bytes_per_token)) if room > 0 else 0
    budget = (slots // multiple) * multiple
    if budget < multiple:
        return None
    return budget if context is None else min(budget, context)
