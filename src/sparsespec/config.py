"""Model hyper-parameters with Hugging Face field names, built from ``config.json`` or GGUF metadata.

This module imports no torch, so the edge simulator can read model shapes without loading weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import UserError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

# Hugging Face ``model_type`` / ``architectures`` entries that map to our two decoder families.
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2"}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder.

    ``architecture`` is ``"llama"`` (Llama, SmolLM2: no q/k/v bias) or ``"qwen2"`` (q/k/v bias).
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

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings")
        for name in sizes:
            if getattr(self, name) < 1:
                raise UserError(f"The model config gives {name} = {getattr(self, name)}; it must be at least 1.")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UserError(
                f"Unsupported architecture {self.architecture!r}; sparsespec runs {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError("num_attention_heads must be a multiple of num_key_value_heads.")

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
        per_layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary."""
        model_type = str(cfg.get("model_type", ""))
        arch = _HF_MODEL_TYPES.get(model_type)
        if arch is None:
            raise UserError(f"Unsupported architecture {model_type or 'unknown'!r}; sparsespec runs llama and qwen2.")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        if heads < 1:
            raise UserError(f"The model config gives num_attention_heads = {heads}; it must be at least 1.")
        return cls(
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
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        )

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
    def from_gguf_metadata(cls, meta: Mapping[str, Any], tensor_names: set[str]) -> "ModelConfig":
        """Build from GGUF key/value metadata (``{arch}.block_count`` …) and the set of tensor names.

        ``tensor_names`` decides tied vs untied heads (``output.weight`` present or not) and q/k/v bias.
        """
        arch = str(meta.get("general.architecture", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(f"Unsupported architecture {arch or 'unknown'!r}; sparsespec runs llama and qwen2.")

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise UserError(f"The GGUF file lacks the metadata key {arch}.{key}.")
            return value

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        if heads < 1:
            raise UserError(f"The GGUF file gives {arch}.attention.head_count = {heads}; it must be at least 1.")
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens") or [])
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("rope.dimension_count", hidden // heads)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
        )
