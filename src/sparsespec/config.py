"""Model hyper-parameters with Hugging Face field names, built from ``config.json`` or GGUF metadata.

This module imports no torch, so the edge simulator can read model shapes without loading weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import UserError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")

# Hugging Face ``model_type`` entries that map to the decoder's families (Mistral's block is Llama's; its GGUF files
# say llama).
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                   "gemma3_text": "gemma3"}
# Architectures whose attention normalises each query and key head (RMSNorm over head_dim) before RoPE.
_QK_NORM_ARCHITECTURES = ("qwen3", "gemma3")
# Gemma 3 as llama.cpp reads its GGUF files, which do not store these: every sixth layer attends globally, the others
# over a sliding window with RoPE base 10,000.
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
SLIDING, GLOBAL = "sliding_attention", "full_attention"  # layer kinds, as Hugging Face's ``layer_types`` names them
# Architectures whose files store q/k/v as one projection and gate/up as one (Phi-3: ``qkv_proj``, ``gate_up_proj``).
_FUSED_ARCHITECTURES = ("phi3",)


def _unsupported(arch: str) -> UserError:
    return UserError(f"Unsupported architecture {arch or 'unknown'!r}; sparsespec runs "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}.")

ROPE_SCALING_KINDS = ("none", "linear", "llama3", "yarn")
# The GGUF tensor of per-frequency RoPE divisors (llama.cpp's ``LLM_TENSOR_ROPE_FREQS``).
GGUF_ROPE_FREQS = "rope_freqs.weight"
# GGUF YaRN keys whose meaning changed between llama.cpp versions: a file that sets one is refused, not guessed.
_GGUF_YARN_UNREAD = ("rope.scaling.attn_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor",
                     "rope.scaling.yarn_log_multiplier")


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's inverse frequencies are stretched past the pre-training context, as transformers'
    ``ROPE_INIT_FUNCTIONS`` define it (computed in :mod:`sparsespec.rope`).

    ``kind``:

    - ``none``: only ``freq_factors``;
    - ``linear``: every inverse frequency divided by ``factor``;
    - ``llama3`` (Llama 3.1): frequencies with wavelength above ``original_max_position_embeddings /
      low_freq_factor`` divided by ``factor``, those below ``original_max_position_embeddings / high_freq_factor``
      kept, a smooth blend between;
    - ``yarn``: frequency pairs below ``beta_fast``'s correction dimension (the fast ones) kept, those above
      ``beta_slow``'s divided by ``factor``, a linear ramp between (bounds rounded outwards when ``truncate``);
      cos and sin are multiplied by ``attention_factor``.

    ``freq_factors``: ``[head_dim / 2]`` divisors of the inverse frequencies applied before ``kind``'s rule, as
    llama.cpp does: a GGUF file's ``rope_freqs.weight``, which is how llama.cpp stores Llama 3.1's scaling.
    """

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "freq_factors", tuple(float(f) for f in self.freq_factors))  # JSON gives a list
        if self.kind not in ROPE_SCALING_KINDS:
            raise UserError(f"RoPE scaling {self.kind!r} is not supported; sparsespec reads linear, llama3 and yarn.")
        if not self.factor > 0 or not all(f > 0 for f in self.freq_factors):
            raise UserError(f"The {self.kind} RoPE scaling's factors must be positive.")
        if self.kind in ("llama3", "yarn") and self.original_max_position_embeddings < 1:
            raise UserError(f"The {self.kind} RoPE scaling needs original_max_position_embeddings of at least 1.")
        if self.kind == "llama3" and self.low_freq_factor == self.high_freq_factor:
            raise UserError("The llama3 RoPE scaling needs low_freq_factor and high_freq_factor to differ.")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder.

    ``architecture`` is ``"llama"`` (Llama, SmolLM2: no q/k/v bias), ``"qwen2"`` (q/k/v bias), ``"qwen3"`` (no
    bias; each query and key head RMS-normalised over ``head_dim`` before RoPE, :attr:`qk_norm`), ``"phi3"`` (a
    Llama block whose files fuse q/k/v and gate/up, :attr:`fused_projections`) or ``"gemma3"`` (q/k norms; embeddings
    scaled by √hidden; norms after attention and after the MLP too; GELU(tanh)-gated MLP; RMSNorm weights held as
    the GGUF files store them, ``1 + w`` of Hugging Face's ``w``).

    ``layer_types``: each layer's kind, :data:`SLIDING` or :data:`GLOBAL` (empty: every layer global). A sliding
    layer attends to the ``sliding_window`` most recent positions, itself included, with RoPE base
    ``local_rope_theta`` and no scaling; global layers use ``rope_theta`` and ``rope_scaling``.
    ``query_pre_attn_scalar``: queries are scaled by its inverse square root instead of ``head_dim``'s (0: head_dim).

    A model whose every layer is trained with sliding-window attention (Phi-3's ``sliding_window``) gets that window
    as its ``max_position_embeddings`` instead: up to the window, full attention is what it computes, and longer runs
    with true positions are refused rather than computed without the window.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: RopeScaling | None = None  # None: RoPE as trained
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    local_rope_theta: float = 0.0
    query_pre_attn_scalar: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # JSON gives a list
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings")
        for name in sizes:
            if getattr(self, name) < 1:
                raise UserError(f"The model config gives {name} = {getattr(self, name)}; it must be at least 1.")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise _unsupported(self.architecture)
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError("num_attention_heads must be a multiple of num_key_value_heads.")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {SLIDING, GLOBAL}:
                raise UserError(f"The model config's layer_types must name {SLIDING!r} or {GLOBAL!r} for each of its "
                                f"{self.num_hidden_layers} layers.")
            if SLIDING in self.layer_types and (self.sliding_window < 2 or self.local_rope_theta <= 0):
                raise UserError("A model with sliding-window layers needs a sliding_window of at least 2 and their "
                                "RoPE base.")
        factors = self.rope_scaling.freq_factors if self.rope_scaling else ()
        if factors and len(factors) != self.head_dim // 2:
            raise UserError(f"The model gives {len(factors)} RoPE frequency factors for head_dim {self.head_dim}; "
                            f"it needs {self.head_dim // 2}.")

    @property
    def qk_norm(self) -> bool:
        """Whether each query and key head is RMS-normalised (weights ``[head_dim]`` per layer) before RoPE."""
        return self.architecture in _QK_NORM_ARCHITECTURES

    @property
    def fused_projections(self) -> bool:
        """Whether the files store q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (Phi-3)."""
        return self.architecture in _FUSED_ARCHITECTURES

    @property
    def gemma(self) -> bool:
        """Gemma's block: embeddings scaled by √hidden, a norm after attention and after the MLP, GELU(tanh) gate."""
        return self.architecture == "gemma3"

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Indices of the layers that attend over a sliding window (empty: none)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == SLIDING)

    @property
    def queries_per_kv_head(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, bytes_per_element: float = 2) -> float:
        """Bytes of K and V per token over all layers, at ``bytes_per_element`` (2: bf16)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_element

    def num_parameters(self) -> int:
        """Parameter count implied by the shapes (embedding counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        norms = (4 if self.gemma else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = attn + 3 * h * i + norms
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any]) -> "ModelConfig":
        """The inverse of :meth:`to_dict` (also after a JSON round trip)."""
        fields = dict(fields)
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        return cls(**fields)

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary."""
        model_type = str(cfg.get("model_type", ""))
        arch = _HF_MODEL_TYPES.get(model_type)
        if arch is None:
            raise _unsupported(model_type)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        if heads < 1:
            raise UserError(f"The model config gives num_attention_heads = {heads}; it must be at least 1.")
        fields = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            # Qwen2 configs name a window they do not use (use_sliding_window false)
            max_position_embeddings=_within_window(int(cfg.get("max_position_embeddings", 2048)),
                                                   cfg.get("sliding_window") if cfg.get("use_sliding_window", True)
                                                   else None),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            rope_scaling=_hf_rope_scaling(cfg),
        )
        if arch == "gemma3":
            fields.update(_gemma3_hf_fields(cfg, fields["num_hidden_layers"]))
        return cls(**fields)

    @classmethod
    def from_hf_folder(cls, folder: Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("it is not a JSON object")
            return cls.from_hf_dict(data)
        except (OSError, ValueError, TypeError, KeyError) as exc:  # JSONDecodeError is a ValueError
            raise UserError(f"Cannot read a model config from {path}: {exc!s}.") from None

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], tensor_names: set[str],
                           rope_freqs: Sequence[float] = ()) -> "ModelConfig":
        """Build from GGUF key/value metadata (``{arch}.block_count`` …) and the set of tensor names.

        ``tensor_names`` decides tied vs untied heads (``output.weight`` present or not) and q/k/v bias;
        ``rope_freqs``: the values of the file's ``rope_freqs.weight`` tensor, which must be given when it has one.
        """
        arch = str(meta.get("general.architecture", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise _unsupported(arch)

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise UserError(f"The GGUF file lacks the metadata key {arch}.{key}.")
            return value

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        if heads < 1:
            raise UserError(f"The GGUF file gives {arch}.attention.head_count = {heads}; it must be at least 1.")
        if "rope_factors_long.weight" in tensor_names:
            raise UserError("The GGUF file carries LongRoPE factors (rope_factors_long.weight); sparsespec does not "
                            "implement LongRoPE scaling.")
        if GGUF_ROPE_FREQS in tensor_names and not rope_freqs:
            raise ValueError(f"the GGUF file has {GGUF_ROPE_FREQS}: pass its values as rope_freqs")
        head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // heads)))
        rotated = meta.get(f"{arch}.rope.dimension_count")
        if rotated is not None and int(rotated) != head_dim:
            raise UserError(f"The GGUF file rotates {rotated} of each head's {head_dim} dimensions; sparsespec rotates "
                            "whole heads only.")
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens") or [])
        window = meta.get(f"{arch}.attention.sliding_window")
        layers = int(get("block_count"))
        gemma = {}
        if arch == "gemma3":  # sliding layers as llama.cpp lays them out; the window is theirs, not the context's
            gemma = dict(layer_types=tuple(GLOBAL if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else SLIDING
                                           for i in range(layers)),
                         sliding_window=int(get("attention.sliding_window")),
                         local_rope_theta=GEMMA3_LOCAL_ROPE_THETA)
            window = None
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,  # Qwen3 files give it as attention.key_length (it is not hidden / heads there)
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=_within_window(int(get("context_length")), window),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            rope_scaling=_gguf_rope_scaling(arch, meta, tuple(rope_freqs)),
            **gemma,
        )


def _within_window(context: int, sliding_window: Any) -> int:
    """The context a run may use: the trained one, or a sliding-window model's window where that is shorter (every
    layer of such a model attends only that far back, which the decoder does not model)."""
    return min(context, int(sliding_window)) if sliding_window else context


def _gemma3_hf_fields(cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """The fields a Gemma 3 text config (``model_type`` ``gemma3_text``) sets otherwise than a Llama one: its layer
    kinds, and RoPE per layer kind in ``rope_parameters`` (transformers 5) or ``rope_theta`` /
    ``rope_local_base_freq`` / ``rope_scaling`` (transformers 4); its window is its sliding layers', not the run's."""
    kinds = cfg.get("layer_types")
    if not kinds:
        every = int(cfg.get("sliding_window_pattern") or GEMMA3_GLOBAL_EVERY)
        kinds = [GLOBAL if (i + 1) % every == 0 else SLIDING for i in range(layers)]
    params = cfg.get("rope_parameters") or {}
    if GLOBAL in params or SLIDING in params:
        global_rope, local_rope = dict(params.get(GLOBAL) or {}), dict(params.get(SLIDING) or {})
    else:
        global_rope = dict(cfg.get("rope_scaling") or {}, rope_theta=cfg.get("rope_theta", 1000000.0))
        local_rope = {"rope_theta": cfg.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA)}
    if str(local_rope.get("rope_type", "default")) != "default":
        raise UserError(f"The model config scales the sliding layers' RoPE ({local_rope['rope_type']}); sparsespec "
                        "reads scaling on global layers only.")
    activation = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise UserError(f"The model config's hidden_activation is {activation!r}; sparsespec's Gemma 3 runs "
                        "gelu_pytorch_tanh.")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key):
            raise UserError(f"The model config sets {key}, which sparsespec does not implement.")
    context = int(cfg.get("max_position_embeddings", 32768))
    return dict(
        rope_theta=float(global_rope.get("rope_theta", 1000000.0)),
        max_position_embeddings=context,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rope_scaling=_hf_rope_scaling({"rope_scaling": global_rope, "max_position_embeddings": context}),
        layer_types=tuple(kinds),
        sliding_window=int(cfg.get("sliding_window") or 4096),  # transformers' default
        local_rope_theta=float(local_rope.get("rope_theta", GEMMA3_LOCAL_ROPE_THETA)),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 0),
    )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for ``factor`` (Eq. 21 of the paper, as transformers' ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _hf_rope_scaling(cfg: Mapping[str, Any]) -> RopeScaling | None:
    """The RoPE scaling of a Hugging Face config: ``rope_scaling`` (transformers 4) or ``rope_parameters``
    (transformers 5), its kind in ``rope_type`` or ``type``, defaults as transformers fills them in."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = str(params.get("rope_type", params.get("type", "default")))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise UserError(f"The model config's partial_rotary_factor is {partial}; sparsespec rotates whole heads only.")
    if kind == "default":
        return None
    if kind not in ROPE_SCALING_KINDS[1:]:
        raise UserError(f"RoPE scaling {kind!r} is not supported; sparsespec reads linear, llama3 and yarn.")

    def need(key: str) -> float:
        if params.get(key) is None:
            raise UserError(f"The model config's {kind} RoPE scaling lacks {key}.")
        return float(params[key])

    original = int(params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 2048))
    if kind == "linear":
        return RopeScaling("linear", factor=need("factor"))
    if kind == "llama3":
        return RopeScaling("llama3", factor=need("factor"), low_freq_factor=need("low_freq_factor"),
                           high_freq_factor=need("high_freq_factor"), original_max_position_embeddings=original)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(cfg.get("max_position_embeddings", 2048)) / original
    attention, mscale, mscale_all_dim = (params.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim"))
    if attention is None:
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else _yarn_mscale(factor))
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original,
                       beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                       attention_factor=float(attention), truncate=bool(params.get("truncate", True)))


def _gguf_rope_scaling(arch: str, meta: Mapping[str, Any], freq_factors: tuple[float, ...]) -> RopeScaling | None:
    """The RoPE scaling of a GGUF file as llama.cpp reads it: ``{arch}.rope.scaling.type`` (default linear) with
    ``.factor`` (absent or 1: none) and ``.original_context_length``, and the ``rope_freqs.weight`` divisors."""
    kind = str(meta.get(f"{arch}.rope.scaling.type", "linear"))
    factor = float(meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear") or 1.0)
    if kind == "linear" and factor == 1.0:
        kind = "none"
    if kind not in ("none", "linear", "yarn"):
        raise UserError(f"GGUF RoPE scaling {kind!r} is not supported; sparsespec reads none, linear and yarn.")
    if kind == "none":
        return RopeScaling("none", freq_factors=freq_factors) if freq_factors else None
    if kind == "linear":
        return RopeScaling("linear", factor=factor, freq_factors=freq_factors)
    for key in _GGUF_YARN_UNREAD:
        if f"{arch}.{key}" in meta:
            raise UserError(f"The GGUF file sets {arch}.{key}, which sparsespec's YaRN does not read.")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise UserError(f"The GGUF file's yarn RoPE scaling lacks {arch}.rope.scaling.original_context_length.")
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=int(original),
                       beta_fast=float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                       beta_slow=float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                       attention_factor=_yarn_mscale(factor), freq_factors=freq_factors)
