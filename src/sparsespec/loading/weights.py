"""Reading weights into a Hugging Face-named state dict: GGUF files (dequantized) and safetensors folders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import UserError
from .source import ModelSource, gguf_metadata, open_gguf

# GGUF tensor names -> Hugging Face names ("{i}" is the layer index).
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name.startswith("blk."):
        _, index, rest = gguf_name.split(".", 2)
        template = _GGUF_TO_HF.get(f"blk.{{i}}.{rest}")
        return template.format(i=index) if template else None
    return _GGUF_TO_HF.get(gguf_name)


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (llama-arch GGUF files) to get the Hugging Face layout.

    llama.cpp stores each head's rows as (head_dim/2, 2) interleaved pairs; Hugging Face keeps the two halves
    apart. ``weight``: ``[n_heads * head_dim, ...]``.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def load_gguf_state(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and float32 state dict of a GGUF file (every tensor dequantized)."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    config = ModelConfig.from_gguf_metadata(gguf_metadata(reader), {t.name for t in reader.tensors})
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:  # truncated data or an unknown quantization type
            raise UserError(f"{path} has an unreadable tensor {tensor.name} ({exc}).") from None
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = np.asarray(array, dtype=np.float32).reshape(shape)
        if config.architecture == "llama" and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in tensor.name else config.num_key_value_heads
            array = unpermute_rotary_rows(array, heads)
        state[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))
    _check_complete(config, state, str(path))
    return config, state


def load_hf_state(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and state dict of a Hugging Face folder (``config.json`` + ``*.safetensors``)."""
    from safetensors.torch import load_file

    config = ModelConfig.from_hf_folder(folder)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            state.update(load_file(str(file)))
        except Exception as exc:
            raise UserError(f"{file} is not a readable safetensors file ({exc}).") from None
    _check_complete(config, state, str(folder))
    return config, state


def load_state(source: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and state dict for a resolved model source."""
    return load_gguf_state(source.path) if source.kind == "gguf" else load_hf_state(source.path)


def _check_complete(config: ModelConfig, state: dict[str, torch.Tensor], where: str) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_hidden_layers):
        needed += [
            f"model.layers.{i}.{part}.weight"
            for part in (
                "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
            )
        ]
    missing = [n for n in needed if n not in state]
    if missing:
        raise UserError(f"{where} lacks {len(missing)} weight tensors (first: {missing[0]}); the model is incomplete.")
