"""Reading weights: GGUF files (dequantized) and safetensors folders into a Hugging Face-named state dict; and
the weight store of built models, whose files this module names, writes and rebuilds models from
(``weight_store.py`` describes the store, keys its folders and reads its files).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import ConfigError, UserError
from ..linear import NativeEmbedding, linear_from_tensors, native_layout_tag
from ..model import layer_norms
from .source import GGUFTensorInfo, ModelSource, open_gguf, read_gguf_config, read_gguf_tensor_table
from .weight_store import TENSOR_ALIGNMENT, source_store_key, take_tensor_file

# GGUF tensor names -> Hugging Face names ("{i}" is the layer index); the layers' norms come from layer_norms.
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
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
# Files with fused projections (ModelConfig.fused_projections, Phi-3): q/k/v in attn_qkv, gate and up in ffn_up.
_GGUF_FUSED = {
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",
}


def gguf_to_hf(config: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name for ``config``'s files (``{i}``: the layer index)."""
    table = _GGUF_TO_HF | (_GGUF_FUSED if config.fused_projections else {})
    return table | {f"blk.{{i}}.{gguf}.weight": f"model.layers.{{i}}.{hf}.weight"
                    for _, hf, gguf in layer_norms(config)}


def _hf_name(gguf_name: str, table: Mapping[str, str]) -> str | None:
    """The Hugging Face name of a GGUF tensor in ``table`` (:func:`gguf_to_hf`), None for tensors the decoder does
    not read."""
    if gguf_name.startswith("blk."):
        _, index, rest = gguf_name.split(".", 2)
        template = table.get(f"blk.{{i}}.{rest}")
        return template.format(i=index) if template else None
    return table.get(gguf_name)


def gguf_weight_table(path: Path) -> tuple[dict, dict[str, GGUFTensorInfo]]:
    """:func:`read_gguf_tensor_table` for the loaders, which read every tensor's GGML type and take the model's
    tensors as vectors or matrices: a type the ``gguf`` package does not know, or a layer or model tensor of other
    than one or two dimensions (e.g. a mixture of experts' 3-D tensors), is a :class:`UserError` naming it (not a
    ValueError deep inside the loading)."""
    from gguf import GGMLQuantizationType

    metadata, tensors = read_gguf_tensor_table(path)
    known = {t.value for t in GGMLQuantizationType}
    for t in tensors.values():
        if t.ggml_type not in known:
            raise UserError(f"{path}: tensor {t.name} has GGML type {t.ggml_type}, which the installed gguf "
                            "package does not know.")
        if (t.name.startswith("blk.") or t.name in _GGUF_TO_HF) and len(t.dims) not in (1, 2):
            raise UserError(f"{path}: tensor {t.name} has {len(t.dims)} dimensions, but a Llama or Qwen2 model's "
                            "weights have one or two.")
    return metadata, tensors


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

    config = read_gguf_config(path, gguf_weight_table(path))
    names = gguf_to_hf(config)
    reader = open_gguf(path)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, names)
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


def gguf_native_types(path: Path) -> set[str]:
    """Block types of a GGUF file's 2-D weights that the native kernels cannot read (empty: all readable)."""
    from ..kernels.repack import supported

    from gguf import GGMLQuantizationType

    _, tensors = gguf_weight_table(path)
    return {GGMLQuantizationType(t.ggml_type).name for t in tensors.values()
            if len(t.dims) == 2 and not supported(t.ggml_type)}


def load_gguf_native(path: Path, dtype: torch.dtype,
                     tiles: bool) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, object]]:
    """Config, the float tensors (norms, biases) and the projections of a GGUF file in its own block formats.

    Every projection, the output head and the embedding stay in the file's blocks, repacked for the native kernels
    (``kernels/repack.py``: lossless, the file's bytes per weight); nothing is dequantized. Returns the ``state`` and
    ``linears`` arguments of :class:`~sparsespec.model.Transformer` for the ``native`` format. ``tiles``: Q4_K /
    Q6_K / Q5_0 weights as 16-column tiles (where :func:`~sparsespec.kernels.tiles_preferred`, unless float
    activations will read them) or rows.
    """
    from ..kernels.repack import pack, supported
    from ..linear import NativeEmbedding, NativeLinear

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    metadata, tensors = gguf_weight_table(path)
    config = read_gguf_config(path, (metadata, tensors))
    shapes = expected_shapes(config)
    names = gguf_to_hf(config)
    file = np.memmap(path, dtype=np.uint8, mode="r")

    def data(t) -> np.ndarray:
        """The raw bytes of ``t``: ``[rows, row bytes]`` for a block type."""
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        rows = int(np.prod(t.dims[1:], dtype=np.int64))
        nbytes = rows * t.dims[0] // block * size
        if t.offset + nbytes > file.size:
            raise UserError(f"{path} is truncated: tensor {t.name} runs past the end of the file.")
        return file[t.offset: t.offset + nbytes].reshape(rows, -1)

    def segment(gguf_name: str) -> tuple[int, torch.Tensor, int, int]:
        hf = _hf_name(gguf_name, names)
        t = tensors.get(gguf_name)
        if t is None:
            raise UserError(f"{path} lacks the tensor {gguf_name}; the model is incomplete.")
        rows, k = (int(d) for d in reversed(t.dims))
        want = shapes.get(hf, (config.vocab_size, config.hidden_size))
        if (rows, k) != tuple(want):
            raise UserError(f"{path}: {hf} has shape {[rows, k]} but the model's configuration implies {list(want)}; "
                            "the weights do not match the config.")
        kind = t.ggml_type
        if not supported(kind):
            raise ConfigError("{path}: {tensor} is stored as {kind}, which the native kernels do not read; use "
                              "{weights} int8, int4 or dense.", path=path, tensor=gguf_name,
                              kind=GGMLQuantizationType(kind).name)
        raw = data(t)
        if config.architecture == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
            raw = unpermute_rotary_rows(raw, heads)
        try:
            kernel_type, packed, padded_k = pack(kind, raw, k, tiles)
        except ValueError as exc:
            raise UserError(f"{path}: {gguf_name} is damaged ({exc}).") from None
        return kernel_type, torch.from_numpy(packed.reshape(-1)), rows, padded_k

    def linear(names: list[str], bias_names: list[str] = ()) -> NativeLinear:
        parts = [segment(n) for n in names]
        bias = None
        if bias_names:
            bias = torch.cat([vector(b, torch.float32) for b in bias_names])
        k = int(tensors[names[0]].dims[0])
        return NativeLinear([(kind, blob, rows) for kind, blob, rows, _ in parts], k, parts[0][3], bias)

    def vector(gguf_name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        t = tensors.get(gguf_name)
        if t is None:
            raise UserError(f"{path} lacks the tensor {gguf_name}; the model is incomplete.")
        if t.ggml_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            raise UserError(f"{path}: {gguf_name} is not a float vector.")
        values = data(t).view(np.float32 if t.ggml_type == GGMLQuantizationType.F32 else np.float16)
        return torch.from_numpy(values.astype(np.float32).reshape(-1)).to(as_dtype)

    state = {"model.norm.weight": vector("output_norm.weight")}
    linears: dict[str, object] = {}
    for i in range(config.num_hidden_layers):
        blk = f"blk.{i}."
        for _, hf, gguf in layer_norms(config):
            state[f"model.layers.{i}.{hf}.weight"] = vector(f"{blk}{gguf}.weight")
        fused = config.fused_projections
        qkv = [blk + "attn_qkv.weight"] if fused else [blk + f"attn_{p}.weight" for p in "qkv"]
        biases = [blk + f"attn_{p}.bias" for p in "qkv"] if config.attention_bias else []
        linears[f"layers.{i}.qkv"] = linear(qkv, biases)
        linears[f"layers.{i}.o_proj"] = linear([blk + "attn_output.weight"])
        gate_up = [blk + "ffn_up.weight"] if fused else [blk + "ffn_gate.weight", blk + "ffn_up.weight"]
        linears[f"layers.{i}.gate_up"] = linear(gate_up)
        linears[f"layers.{i}.down"] = linear([blk + "ffn_down.weight"])
    table = linear(["token_embd.weight"])
    linears["embed"] = NativeEmbedding(table, dtype)
    tied = config.tie_word_embeddings or "output.weight" not in tensors
    linears["lm_head"] = table if tied else linear(["output.weight"])
    return config, state, linears


def load_hf_state(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and state dict of a Hugging Face folder (``config.json`` + ``*.safetensors``).

    Gemma's RMSNorm weights ``w`` become ``1 + w``, the factor its norms multiply by, as its GGUF files store them."""
    from safetensors.torch import load_file

    config = ModelConfig.from_hf_folder(folder)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            state.update(load_file(str(file)))
        except Exception as exc:
            raise UserError(f"{file} is not a readable safetensors file ({exc}).") from None
    if config.gemma:
        # Gemma 3 checkpoints saved from the multimodal class name their text weights model.language_model.*
        state = {name.replace("model.language_model.", "model.", 1): t for name, t in state.items()}
        state = {name: t.float() + 1 if name.endswith("norm.weight") else t for name, t in state.items()}
    _check_complete(config, state, str(folder))
    return config, state


def load_state(source: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and state dict for a resolved model source."""
    return load_gguf_state(source.path) if source.kind == "gguf" else load_hf_state(source.path)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor the decoder needs, in Hugging Face's naming and ``[out, in]`` layout.

    The output head (``lm_head.weight``) is optional (tied embeddings) and not listed; its shape is checked when
    present.
    """
    c = config
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    for i in range(c.num_hidden_layers):
        layer = f"model.layers.{i}."
        shapes.update({f"{layer}{hf}.weight": (c.head_dim if field in ("q_norm", "k_norm") else c.hidden_size,)
                       for field, hf, _ in layer_norms(c)})
        shapes.update({
            layer + "self_attn.o_proj.weight": (c.hidden_size, q_out),
            layer + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        })
        if c.fused_projections:
            shapes.update({layer + "self_attn.qkv_proj.weight": (q_out + 2 * kv_out, c.hidden_size),
                           layer + "mlp.gate_up_proj.weight": (2 * c.intermediate_size, c.hidden_size)})
        else:
            shapes.update({
                layer + "self_attn.q_proj.weight": (q_out, c.hidden_size),
                layer + "self_attn.k_proj.weight": (kv_out, c.hidden_size),
                layer + "self_attn.v_proj.weight": (kv_out, c.hidden_size),
                layer + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                layer + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            })
        if c.attention_bias:
            shapes.update({layer + "self_attn.q_proj.bias": (q_out,), layer + "self_attn.k_proj.bias": (kv_out,),
                           layer + "self_attn.v_proj.bias": (kv_out,)})
    return shapes


def _check_complete(config: ModelConfig, state: dict[str, torch.Tensor], where: str) -> None:
    """Raise :class:`UserError` when a needed tensor is missing or its shape contradicts the config."""
    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in state]
    if missing:
        raise UserError(f"{where} lacks {len(missing)} weight tensors (first: {missing[0]}); the model is incomplete.")
    if "lm_head.weight" in state:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise UserError(f"{where}: {name} has shape {list(state[name].shape)} but the model's configuration "
                            f"implies {list(shape)}; the weights do not match the config.")


# ------------------------------------------------------------------------------------------------ weight store

# 2: the config carries RoPE scaling (entries without it may be wrong, so rebuild); 3: the data section starts
# 64-byte aligned, so that the file is mapped rather than copied
WEIGHT_STORE_VERSION = 3
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def weight_store_file(
    root: Path, source: ModelSource, dtype: torch.dtype, fmt: str, options: Mapping
) -> Path | None:
    """The store's file for one (source, dtype, format, options), or None when these options cannot be stored.
    Native weights take the option ``tiles`` (their layout, :func:`load_gguf_native`)."""
    if dtype not in _DTYPE_NAMES:
        return None
    options = dict(options)
    name = f"{_DTYPE_NAMES[dtype]}-{fmt}-{native_layout_tag(bool(options.pop('tiles', False)))}"
    if options:  # an option the store does not know how to name
        return None
    return root / source_store_key(source) / f"{name}.safetensors"


def save_model_tensors(model, file: Path, source: ModelSource) -> bool:
    """Store a built :class:`~sparsespec.model.Transformer` in ``file``; False (and no file) when writing fails.

    Native weights are stored repacked, the embedding table as the linear ``embed``, so that a later start reads
    the blocks back instead of repacking the GGUF file."""
    native_embedding = isinstance(model.embed, NativeEmbedding)
    tensors: dict[str, torch.Tensor] = {"norm": model.norm} | ({} if native_embedding else {"embed": model.embed})
    for i, layer in enumerate(model.layers):
        for field, _, _ in layer_norms(model.config):
            tensors[f"layers.{i}.{field}"] = getattr(layer, field)
    linears = {}
    items = model.linear_items() + ([("embed", model.embed.table)] if native_embedding else [])
    for key, lin in items:
        if key == "lm_head" and model.head_shares_embedding:
            continue  # rebuilt from the embedding, as a build from the source does
        linears[key] = lin.meta()
        for name, t in lin.to_tensors().items():
            tensors[f"{key}.{name}"] = t
    metadata = {
        "sparsespec_tensor_cache": str(WEIGHT_STORE_VERSION),
        "config": json.dumps(model.config.to_dict()),
        "dtype": _DTYPE_NAMES[model.dtype],
        "weights": model.weights_format,
        "linears": json.dumps(linears),
        "head_shares_embedding": json.dumps(model.head_shares_embedding),
    }
    folder = file.parent
    tmp = folder / f".{file.name}.tmp{os.getpid()}"
    try:
        _claim_key_folder(folder, source)
        write_safetensors(tmp, tensors, metadata)
        os.replace(tmp, file)
        return True
    except (OSError, RuntimeError, ValueError):
        tmp.unlink(missing_ok=True)
        return False


def _claim_key_folder(folder: Path, source: ModelSource) -> None:
    """Create the key folder with its ``source.json``; delete stale key folders.

    Stale: recorded for the same path under another key (the file changed), or for a path that no longer exists
    (e.g. a deleted temporary model folder).
    """
    path = str(Path(source.path).resolve())
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / "source.json"
    if not record.is_file():
        record.write_text(json.dumps({"path": path, "kind": source.kind, "key": folder.name}) + "\n")
    for other in folder.parent.iterdir():
        if other == folder or not other.is_dir() or other.name.startswith("."):
            continue
        try:
            recorded = json.loads((other / "source.json").read_text()).get("path")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(recorded, str) and (recorded == path or not Path(recorded).exists()):
            shutil.rmtree(other, ignore_errors=True)


_SAFETENSORS_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I8": torch.int8, "U8": torch.uint8,
    "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}


def write_safetensors(file: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` and string ``metadata`` as a safetensors file, each tensor's bytes straight from its memory
    (no serialized copy of the whole model, so storing a model does not double the process's memory)."""
    names = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % TENSOR_ALIGNMENT)  # the format pads the header (to 8 bytes at least)
    with open(file, "wb") as f:
        f.write(np.uint64(len(raw)).tobytes() + raw)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))


def read_safetensors(file: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Metadata and tensors of a safetensors file written by :func:`write_safetensors`: views of its mapping (see
    :func:`weight_store.read_tensor_file`; taken from its background mapping when the command started one), which
    a background thread moves into anonymous huge pages (``huge_pages.py``). A tensor whose offset would leave it
    less than 64-byte aligned for the kernels is a copy instead.
    """
    stored = take_tensor_file(file)
    tensors = {}
    for name, info in stored.entries.items():
        begin, end = (int(x) for x in info["data_offsets"])
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        shape = [int(d) for d in info["shape"]]
        count = math.prod(shape)
        if count * dtype.itemsize != end - begin:
            raise ValueError(f"tensor {name}: {end - begin} bytes for shape {shape} {info['dtype']}")
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        t = torch.frombuffer(stored.data, dtype=dtype, count=count, offset=stored.data_offset + begin).view(shape)
        tensors[name] = t if begin % TENSOR_ALIGNMENT == 0 else t.clone()
    return stored.metadata, tensors


def load_model_tensors(file: Path, dtype: torch.dtype, fmt: str):
    """The model stored in ``file`` as ``(config, Transformer)``, or None when it is absent or unusable."""
    from ..model import Transformer

    if not file.is_file():
        return None
    try:
        metadata, tensors = read_safetensors(file)
        if (
            metadata.get("sparsespec_tensor_cache") != str(WEIGHT_STORE_VERSION)
            or metadata.get("dtype") != _DTYPE_NAMES[dtype]
            or metadata.get("weights") != fmt
        ):
            return None
        config = ModelConfig.from_dict(json.loads(metadata["config"]))
        linear_meta = json.loads(metadata["linears"])
        state = {"model.norm.weight": tensors.pop("norm")}
        if "embed" in tensors:
            state["model.embed_tokens.weight"] = tensors.pop("embed")
        for i in range(config.num_hidden_layers):
            for field, name, _ in layer_norms(config):
                state[f"model.layers.{i}.{name}.weight"] = tensors.pop(f"layers.{i}.{field}")
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            key, part = name.rsplit(".", 1)
            grouped.setdefault(key, {})[part] = t
        linears = {key: linear_from_tensors(grouped.pop(key), meta, dtype) for key, meta in linear_meta.items()}
        if grouped:
            return None
        expected = set(_linear_keys(config)) | ({"embed"} if "model.embed_tokens.weight" not in state else set())
        head_shares_embedding = json.loads(metadata["head_shares_embedding"])
        if head_shares_embedding:
            expected.discard("lm_head")
        if set(linears) != expected:
            return None
        if "embed" in linears:  # native weights: the table in blocks, and the head that reads it when tied
            table = linears["embed"]
            linears["embed"] = NativeEmbedding(table, dtype)
            if head_shares_embedding:
                linears["lm_head"] = table
        model = Transformer(config, state, dtype, fmt, linears=linears)
    except Exception:  # a damaged or foreign file: rebuild from the source
        return None
    return config, model


def _linear_keys(config: ModelConfig) -> list[str]:
    """The keys of :meth:`Transformer.linear_items` for ``config``."""
    parts = ("qkv", "o_proj", "gate_up", "down")
    keys = [f"layers.{i}.{part}" for i in range(config.num_hidden_layers) for part in parts]
    return keys + ["lm_head"]
