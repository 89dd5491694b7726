"""Weight formats for linear layers: every projection in the model is a :class:`NativeLinear`.

A linear maps ``x: [..., in_features]`` to ``[..., out_features]`` in the dtype of ``x`` and reports the
bytes its weights occupy (``nbytes``). Given ``residual`` (``[..., out_features]``, the dtype of ``x``) it returns
``residual + linear(x)``, bit for bit that add: the decoder's skip connections (the kernels add them as they write
their output, so a decode step has no pass of its own over the rows).

Formats (``make_linear(..., fmt=...)``), all multiplied by the native kernels (``kernels/``):

* ``"dense"`` -- the unquantized weights in the compute dtype, as rows of a native float type (F32 or BF16): the
  kernels multiply them by the activations as they are.
* ``"int8"`` -- the weights quantized to GGML's Q8_0 blocks (8-bit codes, one fp16 scale per 32 weights).
* ``"int4"`` -- the weights quantized to GGML's Q4_1 blocks (4-bit codes, an fp16 scale and minimum per 32
  weights: an affine grid per group of 32, as Q4_1 files and GGUF's 32-weight blocks have).
* ``"native"`` -- the GGUF file's own blocks (``loading/weights.py``), or for float weights Q8_0 blocks.

``"bf16"`` is accepted as another name for ``"dense"`` (:func:`canonical_format`); ``"auto"`` picks a format per
model role (:func:`auto_format`).

Every linear can be taken apart into plain tensors plus JSON-ready facts (``to_tensors()`` / ``meta()``) and put
back together without redoing any work (:func:`linear_from_tensors`): the on-disk weight store of
``loading/weights.py`` stores layers that way, so a later start neither dequantizes nor quantizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels
from .kernels.repack import FLOAT_TYPES

FORMATS = ("dense", "int8", "int4")

# Alignment of the weight tensors handed to the kernels (what torch's CPU allocator guarantees): a stored segment
# that a memory-mapped file places elsewhere is copied.
_TENSOR_ALIGNMENT = 64

# The block type float weights are quantized to for the native format (GGML's Q8_0: 8-bit codes, one fp16 scale
# per 32 weights; the most accurate type the kernels read).
NATIVE_FLOAT_TYPE = 8

# The GGML block type of each quantized format (Q8_0, Q4_1), which ``make_linear`` quantizes float weights to.
QUANTIZED_TYPES = {"int8": 8, "int4": 3}

# The float type of the native kernels that holds ``dense`` weights, by compute dtype (GGML's F32 and BF16).
DENSE_TYPES = {torch.float32: 0, torch.bfloat16: 30}


class NativeLinear:
    """Weights kept in a GGUF file's own formats, multiplied by the native kernels (``kernels/``).

    A linear may stack several GGUF tensors of different types along the output dimension (q, k and v of one
    layer): ``segments`` lists them as ``(kernel type, repacked bytes, rows)`` (the kernel type is the GGML type,
    or its column-tile layout: ``kernels/repack.py``). Activations are quantized to 8 bits per block inside the
    kernel (``kernels/csrc/qmatmul.h``), or, with ``float_activations`` set (row layouts only), multiply the
    dequantized blocks as they are (``kernels/csrc/fmatmul.h``); float weights (F32, F16, BF16) always multiply the
    activations as they are. The result is computed in float32 and returned in the dtype of ``x`` (float32 or
    bfloat16). Each row's result is independent of how many rows share the call.
    """

    FORMAT = "native"

    def __init__(self, segments: list[tuple[int, torch.Tensor, int]], in_features: int, padded_in: int,
                 bias: torch.Tensor | None = None) -> None:
        self.types = [int(t) for t, _, _ in segments]
        self.blobs = [b for _, b, _ in segments]
        self.rows = [int(r) for _, _, r in segments]
        self.in_features = in_features
        self.padded_in = padded_in
        self.out_features = sum(self.rows)
        self.bias = None if bias is None else bias.float().contiguous()
        # float weights always multiply the activations as they are: the flag says so for them
        self.float_activations = all(t in FLOAT_TYPES for t in self.types)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blobs) + (0 if self.bias is None else self.bias.nbytes)

    def __call__(self, x: torch.Tensor, isa: int = -1, *, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in]`` (float32 or bfloat16) -> ``[..., out]`` in the dtype of ``x`` (plus ``residual [..., out]``,
        added by the kernel)."""
        x2d = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # the model's [T, in]: no reshape op
        if self.padded_in != self.in_features:
            x2d = F.pad(x2d, (0, self.padded_in - self.in_features))
        residual2d = residual if residual is None or residual.dim() == 2 else residual.reshape(-1, self.out_features)
        y = kernels.gguf_linear(x2d, self.blobs, self.types, self.rows, self.padded_in, self.bias, isa,
                                self.float_activations, residual2d)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def first_rows(self, n: int) -> "NativeLinear":
        """The same weight cut to its first ``n`` outputs (views of the blocks, no copy)."""
        if n > self.out_features:
            raise ValueError(f"cannot keep {n} of {self.out_features} outputs")
        segments, left = [], n
        for kind, blob, rows in zip(self.types, self.blobs, self.rows):
            keep = min(rows, left)
            if keep:
                segments.append((kind, blob[: kernels.weight_bytes(kind, self.padded_in, keep)], keep))
            left -= keep
        bias = None if self.bias is None else self.bias[:n]
        cut = NativeLinear(segments, self.in_features, self.padded_in, bias)
        cut.float_activations = self.float_activations
        return cut

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, ggml_type: int = NATIVE_FLOAT_TYPE):
        """A float ``weight [out, in]`` as one GGUF type (default Q8_0): a block type quantized with ``gguf``'s
        quantizer, or a float type (F32, F16, BF16) rounded to nearest even: how Hugging Face folders and
        in-process models get native weights."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        from .kernels.repack import repack

        out_features, in_features = weight.shape
        if ggml_type in FLOAT_TYPES:
            dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[FLOAT_TYPES[ggml_type][0]]
            raw = weight.detach().to(dtype).contiguous().view(torch.uint8).numpy()
            packed, padded_in = repack(ggml_type, raw, in_features)
            return cls([(ggml_type, torch.from_numpy(packed.reshape(-1)), out_features)], in_features, padded_in, bias)
        w = weight.detach().float()
        block = 256 if ggml_type >= 10 else 32
        if in_features % block:
            w = F.pad(w, (0, block - in_features % block))
        raw = quantize(w.numpy(), GGMLQuantizationType(ggml_type))
        packed, padded_in = repack(ggml_type, raw, w.shape[1])
        return cls([(ggml_type, torch.from_numpy(packed.reshape(-1)), out_features)], in_features, padded_in, bias)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Each segment's repacked blocks (``blocks0``, ``blocks1``, …) and the bias, as stored (see
        :func:`linear_from_tensors`)."""
        out = {f"blocks{i}": blob for i, blob in enumerate(self.blobs)}
        return out | ({} if self.bias is None else {"bias": self.bias})

    def meta(self) -> dict:
        """JSON-ready facts that, with :meth:`to_tensors`, rebuild this layer exactly."""
        return {"format": self.FORMAT, "types": self.types, "rows": self.rows, "in_features": self.in_features,
                "padded_in": self.padded_in}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict, dtype: torch.dtype) -> "NativeLinear":
        """Rebuild from :meth:`to_tensors` and :meth:`meta` without repacking; a segment whose byte count is not the
        layout's for its rows is a ValueError (a damaged or foreign store)."""
        segments = []
        for i, (kind, rows) in enumerate(zip(meta["types"], meta["rows"])):
            blob = tensors[f"blocks{i}"].contiguous()
            if blob.dtype != torch.uint8 or blob.numel() != kernels.weight_bytes(kind, meta["padded_in"], rows):
                raise ValueError(f"segment {i}: {blob.numel()} bytes for {rows} rows of type {kind}")
            segments.append((kind, blob if blob.data_ptr() % _TENSOR_ALIGNMENT == 0 else blob.clone(), rows))
        return cls(segments, meta["in_features"], meta["padded_in"], tensors.get("bias"))

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the kernel multiplies by, as float32 ``[out, in]``."""
        parts = [kernels.gguf_dequantize(b, t, self.padded_in, torch.arange(r))
                 for t, b, r in zip(self.types, self.blobs, self.rows)]
        return torch.cat(parts)[:, : self.in_features]


class NativeEmbedding:
    """An embedding table kept in GGUF blocks (one segment of a :class:`NativeLinear`): ``table[ids]`` dequantizes
    only the rows asked for, ``[T] -> [T, hidden]`` in ``dtype``."""

    def __init__(self, table: NativeLinear, dtype: torch.dtype) -> None:
        if len(table.blobs) != 1:
            raise ValueError("an embedding is a single GGUF tensor")
        self.table = table
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        rows = kernels.gguf_dequantize(t.blobs[0], t.types[0], t.padded_in, ids.reshape(-1))
        # contiguous: rows padded past in_features leave a strided slice, which .to() keeps when the dtype matches
        return rows[:, : t.in_features].to(self.dtype).contiguous().reshape(*ids.shape, t.in_features)


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    fmt: str = "dense",
    *,
    ggml_type: int = NATIVE_FLOAT_TYPE,
) -> NativeLinear:
    """Build the linear for ``weight [out, in]`` (float, any dtype) in the compute ``dtype``.

    ``fmt`` is ``"dense"`` (the weights in ``dtype``: F32 or BF16 rows), ``"int8"`` (Q8_0 blocks), ``"int4"`` (Q4_1
    blocks) or ``"native"`` (blocks of ``ggml_type``, Q8_0 unless said otherwise).
    """
    bias = None if bias is None else bias.to(dtype)  # rounded as the model's other vectors (added in float32)
    if fmt == "dense":
        if dtype not in DENSE_TYPES:
            raise ValueError(f"dense weights are float32 or bfloat16, not {dtype}")
        return NativeLinear.from_float(weight.to(dtype), bias, DENSE_TYPES[dtype])
    if fmt in QUANTIZED_TYPES:
        return NativeLinear.from_float(weight, bias, QUANTIZED_TYPES[fmt])
    if fmt == NATIVE:
        return NativeLinear.from_float(weight, bias, ggml_type)
    raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS + (NATIVE,)}")


NATIVE = "native"


def canonical_format(fmt: str) -> str:
    """``"bf16"`` -> ``"dense"`` (dense weights in the compute dtype); other names are returned as they are."""
    return "dense" if fmt == "bf16" else fmt


ROLES = ("target", "draft")

# What ``"auto"`` picks per model role (see :func:`auto_format` for the measurements behind it).
AUTO_FORMATS = {"target": "int8", "draft": "int4"}


def auto_format(role: str) -> str:
    """The weight format ``"auto"`` stands for, by model role, where the model's file has no blocks the kernels
    read (a Hugging Face folder in bfloat16): the fastest format within a quality bound.

    Rule: a draft takes the fastest format, since its quality only moves the acceptance rate and never the
    output; a target takes the fastest format whose logits stay within a KL divergence of 0.01 nats/token of
    the float32 model on real text (its output *is* the text).

    Hence draft: int4 and target: int8 (int4's logits miss the bound several times over; int8 is within it at half
    the bytes of bfloat16). Measured: benchmarks/RESULTS.md#weight-formats

    Use ``dense`` (``bf16``) for a target whose output must be the unquantized model's.
    """
    if role not in AUTO_FORMATS:
        raise ValueError(f"unknown model role {role!r}; expected one of {ROLES}")
    return AUTO_FORMATS[role]


def resolve_format(fmt: str, role: str = "target") -> str:
    """The concrete format (``dense``, ``int8``, ``int4``, ``native``) for a requested one (also ``bf16``, ``auto``).

    ``auto`` here is the quantized format for ``role``; whether a GGUF model takes ``native`` instead is decided
    where the source is known (``loading/load.py``).
    """
    fmt = auto_format(role) if fmt == "auto" else canonical_format(fmt)
    if fmt not in FORMATS + (NATIVE,):
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS + (NATIVE, 'bf16', 'auto')}")
    return fmt


def native_layout_tag(tiles: bool) -> str:
    """A short tag that changes whenever the repacked native layout might: the repacking's version and whether
    Q4_K / Q6_K / Q5_0 weights load as column tiles (an x86 vector path) or rows (``kernels/repack.py``)."""
    from .kernels.repack import LAYOUT_VERSION

    return f"layout{LAYOUT_VERSION}-{'tiles' if tiles else 'rows'}"


def linear_from_tensors(tensors: dict[str, torch.Tensor], meta: dict, dtype: torch.dtype) -> NativeLinear:
    """Rebuild a linear from its ``to_tensors()`` and ``meta()`` (the stored tensors are used as they are)."""
    if meta.get("format") != NativeLinear.FORMAT:
        raise ValueError(f"unknown stored weight format {meta.get('format')!r}")
    return NativeLinear.from_tensors(tensors, meta, dtype)
