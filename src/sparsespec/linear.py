"""Weight formats for linear layers: every projection in the model is one of these callables.

A linear maps ``x: [..., in_features]`` to ``[..., out_features]`` in the dtype of ``x`` and reports the
bytes its weights occupy (``nbytes``). Given ``residual`` (``[..., out_features]``, the dtype of ``x``) it returns
``residual + linear(x)``, bit for bit that add: the decoder's skip connections (the native format adds them as it
writes its output, so a decode step has no pass of their own over the rows).

Formats (``make_linear(..., fmt=...)``):

* ``"dense"`` -- the unquantized weights in the compute dtype as rows of a native float type (a
  :class:`NativeLinear` of F32 or BF16 rows): the native kernels multiply them by the activations as they are.
* ``"int8"``  -- :class:`Int8Linear`, symmetric per-output-channel int8, ``torch.ops.aten._weight_int8pack_mm``.
* ``"int4"``  -- :class:`Int4Linear`, group-wise asymmetric int4, ``torch.ops.aten._weight_int4pack_mm_for_cpu``.
* ``"native"`` -- :class:`NativeLinear`, the GGUF file's own blocks (``loading/weights.py``) through the native
  kernels (``kernels/``), or float weights quantized to Q8_0 blocks.

``"bf16"`` is accepted as another name for ``"dense"`` (:func:`canonical_format`); ``"auto"`` picks a format per
model role (:func:`auto_format`).

Every linear can be taken apart into plain tensors plus JSON-ready facts (``to_tensors()`` / ``meta()``) and put
back together without redoing any work (:func:`linear_from_tensors`): the on-disk tensor cache of
``loading/weights.py`` stores quantized layers that way, so a cached start neither dequantizes nor quantizes.

Kernel facts for the torch CPU weight-only kernels (torch 2.13, x86 AVX-512 build):

* Both kernels take a 2-D, row-contiguous activation ``x2d [M, K]`` and require the scales (int8) or
  the scales-and-zeros table (int4) to have exactly the dtype of ``x2d``; the output has that dtype.
  float32, bfloat16 and float16 are accepted.
* Only the bfloat16 path is vectorised. With float32 activations both kernels fall back to scalar code, many
  times slower than with bfloat16 activations or a float32 ``F.linear``, and the cost grows linearly with the
  number of rows. ``kernel_dtype=torch.bfloat16`` lets a float32 model use the fast path (activations are rounded
  to bfloat16 for the matmul only). Measured:
  benchmarks/history/source-notes.md#linear-float32-activations
* Both kernels accumulate in float32 and round the result once to the output dtype.
* Both kernels work on blocks of 4 activation rows and dequantize the weights again for every block,
  so a multi-row call costs more than a 1-row call, and more again past each block of 4 rows (int4 more than int8),
  whereas a bfloat16 ``F.linear`` costs about what a 1-row call does up to 8 rows. Measured:
  benchmarks/history/source-notes.md#linear-multi-row-cost
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels

FORMATS = ("dense", "int8", "int4")

# The vectorised bfloat16 int8 kernel steps through K 16 (AVX-512) or 8 (AVX2) values at a time with
# aligned vector loads: K must be a multiple of 16 and the activation rows must be 32-byte aligned,
# otherwise it reads out of bounds or faults (torch 2.13). Weights are padded to this multiple of K
# and misaligned activations (e.g. a view at an odd offset) are copied (torch allocations are
# 64-byte aligned).
_INT8_K_MULTIPLE = 16
_INT8_X_ALIGNMENT = 32
# Alignment of the weight tensors handed to the kernels (what torch's CPU allocator guarantees).
_TENSOR_ALIGNMENT = 64

# Group sizes the int4 CPU kernel accepts.
INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_DEFAULT_GROUP_SIZE = 64
# The int4 packer requires the number of output channels to be a multiple of this.
_INT4_N_MULTIPLE = 16


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _to_dtype_rounding_up(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast positive float32 ``values`` to ``dtype`` so that every result is ``>=`` its input."""
    out = values.to(dtype)
    up = torch.nextafter(out, torch.full_like(out, float("inf")))
    return torch.where(out.float() < values, up, out)


class _QuantizedLinear:
    """Shared plumbing: flattening ``x``, dtype handling, bias, ``nbytes``."""

    in_features: int
    out_features: int
    dtype: torch.dtype
    kernel_dtype: torch.dtype
    bias: torch.Tensor | None

    def _init_common(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        kernel_dtype: torch.dtype | None,
    ) -> None:
        if weight.dim() != 2:
            raise ValueError(f"weight must be [out, in], got shape {tuple(weight.shape)}")
        if not weight.is_floating_point():
            raise TypeError(f"weight must be a float tensor, got {weight.dtype}")
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.dtype = dtype
        self.kernel_dtype = dtype if kernel_dtype is None else kernel_dtype
        if self.kernel_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported kernel dtype {self.kernel_dtype}")
        self.bias = None if bias is None else bias.to(dtype).contiguous()

    def _weight_tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    # Names of the tensors ``to_tensors`` returns (besides ``bias``) and of the scalar facts ``meta`` records.
    _TENSOR_NAMES: tuple[str, ...] = ()
    _META_FIELDS: tuple[str, ...] = ()

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that define this layer, as stored (see :func:`linear_from_tensors`)."""
        out = {name: getattr(self, name) for name in self._TENSOR_NAMES}
        return out | ({} if self.bias is None else {"bias": self.bias})

    def meta(self) -> dict:
        """JSON-ready facts that, with :meth:`to_tensors`, rebuild this layer exactly."""
        facts = {name: getattr(self, name) for name in self._META_FIELDS}
        return {"format": self.FORMAT, "kernel_dtype": str(self.kernel_dtype).removeprefix("torch."), **facts}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict, dtype: torch.dtype):
        """Rebuild a layer from :meth:`to_tensors` and :meth:`meta` without quantizing again."""
        self = cls.__new__(cls)
        self.dtype = dtype
        self.kernel_dtype = getattr(torch, meta["kernel_dtype"])
        for name in cls._META_FIELDS:
            setattr(self, name, meta[name])
        for name in cls._TENSOR_NAMES:
            t = tensors[name].contiguous()
            # The kernels use aligned vector loads; stored tensors (e.g. views into a memory-mapped file) may sit at
            # any offset, so those are copied into a fresh (64-byte aligned) allocation.
            setattr(self, name, t if t.data_ptr() % _TENSOR_ALIGNMENT == 0 else t.clone())
        bias = tensors.get("bias")
        self.bias = None if bias is None else bias.to(dtype).contiguous()
        return self

    @property
    def nbytes(self) -> int:
        """Bytes actually held: packed weights, scales (and zero points), bias."""
        tensors = self._weight_tensors() + ([] if self.bias is None else [self.bias])
        return sum(t.numel() * t.element_size() for t in tensors)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, *, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected last dim {self.in_features}, got {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features).to(self.kernel_dtype).contiguous()
        y = self._matmul(x2d)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        y = y.reshape(*lead, self.out_features)
        return y if residual is None else residual + y


class Int8Linear(_QuantizedLinear):
    """Symmetric per-output-channel int8 weights.

    ``w[o, i] ~= q[o, i] * scale[o]`` with ``q`` in ``[-127, 127]`` and ``scale[o] >= max_i |w[o, i]| / 127``
    (the float32 scale is rounded *up* to the kernel dtype, so no value is clipped and every weight is
    within ``scale[o] / 2`` of its dequantized value, up to float rounding).

    Stored: ``qweight [out, in] int8`` and ``scales [out]`` in the kernel dtype (the compute dtype by
    default). The matmul is ``torch.ops.aten._weight_int8pack_mm(x2d, qweight, scales)``.
    ``in_features`` that are not a multiple of 16 are zero-padded (weights once, activations per
    call), as the kernel requires.
    """

    FORMAT = "int8"
    _TENSOR_NAMES = ("qweight", "scales")
    _META_FIELDS = ("in_features", "out_features", "_k_padded")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        *,
        kernel_dtype: torch.dtype | None = None,
    ) -> None:
        self._init_common(weight, bias, dtype, kernel_dtype)
        w = weight.detach().float()
        amax = w.abs().amax(dim=1)
        tiny = torch.finfo(torch.float32).tiny
        scales = _to_dtype_rounding_up((amax / 127.0).clamp_min(tiny), self.kernel_dtype)
        q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127)
        self._k_padded = _round_up(self.in_features, _INT8_K_MULTIPLE)
        if self._k_padded != self.in_features:
            q = F.pad(q, (0, self._k_padded - self.in_features))
        self.qweight = q.to(torch.int8).contiguous()
        self.scales = scales.contiguous()

    def _weight_tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scales]

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the kernel multiplies by: ``q * scale`` as float32 ``[out, in]``."""
        q = self.qweight[:, : self.in_features].float()
        return q * self.scales.float()[:, None]

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if self._k_padded != self.in_features:
            x2d = F.pad(x2d, (0, self._k_padded - self.in_features))
        elif x2d.data_ptr() % _INT8_X_ALIGNMENT:
            x2d = x2d.clone()
        return torch.ops.aten._weight_int8pack_mm(x2d, self.qweight, self.scales)


class Int4Linear(_QuantizedLinear):
    """Group-wise asymmetric int4 weights (the torchao / gpt-fast "tinygemm" convention).

    Each run of ``group_size`` consecutive input features of one output channel shares a scale and a
    zero point: ``w ~= (q - 8) * scale + zero`` with ``q`` in ``[0, 15]``, from min/max quantization
    (``scale = (max - min) / 15`` rounded up to the kernel dtype, ``zero ~= min + 8 * scale``). Every
    weight is within ``scale / 2`` of its dequantized value, up to the rounding of ``zero`` to the
    kernel dtype.

    Stored: the CPU-packed codes ``[out, in / 2] uint8`` from
    ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` (two codes per byte, in a layout that
    depends on the CPU's vector width) and ``scales_and_zeros [in / group_size, out, 2]`` in the kernel
    dtype. The matmul is ``torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, packed, group_size,
    scales_and_zeros)``.

    Group size: default 64. The call time hardly depends on the group size, so the choice is error against
    memory: each halving of the group cuts the error on heavy-tailed weights (closer to real LLM weights than
    Gaussian ones) by about a fifth, and 64 takes most of that gain over 128 for few more bytes, where 32's
    scale/zero table adds a quarter to the code bytes. ``group_size=32`` remains available where accuracy matters
    more than memory. Measured (``benchmarks/bench_linear.py``):
    benchmarks/history/source-notes.md#linear-int4-group-size

    ``in_features`` that are not a multiple of the group size use the largest accepted group size
    (32, 64, 128, 256) not above the requested one that divides it (e.g. 576 with 128 -> 64); if even 32
    does not divide it, the input dimension is zero-padded to a multiple of 32 (the activations are
    padded per call). ``out_features`` is zero-padded to a multiple of 16, as the packer requires;
    the extra outputs are dropped.

    The packed layout depends on the CPU's vector width (see :func:`int4_layout_tag`), so stored packed
    codes are only valid on machines with the same tag.
    """

    FORMAT = "int4"
    _TENSOR_NAMES = ("packed", "scales_and_zeros")
    _META_FIELDS = ("in_features", "out_features", "requested_group_size", "group_size", "_k_padded", "_n_padded")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        *,
        group_size: int = INT4_DEFAULT_GROUP_SIZE,
        kernel_dtype: torch.dtype | None = None,
    ) -> None:
        self._init_common(weight, bias, dtype, kernel_dtype)
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        self.requested_group_size = group_size
        n, k = self.out_features, self.in_features
        k_pad = _round_up(k, INT4_GROUP_SIZES[0])
        self.group_size = max(g for g in INT4_GROUP_SIZES if g <= group_size and k_pad % g == 0)
        n_pad = _round_up(n, _INT4_N_MULTIPLE)
        self._k_padded, self._n_padded = k_pad, n_pad

        w = weight.detach().float()
        if (n_pad, k_pad) != (n, k):
            w = F.pad(w, (0, k_pad - k, 0, n_pad - n))
        g = self.group_size
        wg = w.reshape(n_pad, k_pad // g, g)
        wmin = wg.amin(dim=-1)
        wmax = wg.amax(dim=-1)
        tiny = torch.finfo(torch.float32).tiny
        scales = _to_dtype_rounding_up(((wmax - wmin) / 15.0).clamp_min(tiny), self.kernel_dtype)
        zeros = (wmin + 8.0 * scales.float()).to(self.kernel_dtype)
        s32, z32 = scales.float()[..., None], zeros.float()[..., None]
        q = torch.round((wg - z32) / s32 + 8.0).clamp_(0, 15).to(torch.int32).reshape(n_pad, k_pad)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        # [n, k/g, 2] -> [k/g, n, 2]
        self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()

    def _weight_tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_and_zeros]

    def _codes(self) -> torch.Tensor:
        """Recover the ``[n_pad, k_pad]`` int4 codes from the packed tensor.

        The packed layout is a fixed permutation of code positions that depends only on the shape (and
        the CPU's vector width). It is found by packing the base-16 digits of each position's index,
        so this does not depend on knowing the layout.
        """
        n, k = self._n_padded, self._k_padded

        def nibbles(packed: torch.Tensor) -> torch.Tensor:
            p = packed.reshape(-1).to(torch.int64)
            return torch.stack([p & 15, p >> 4], dim=-1).reshape(-1)

        index = torch.arange(n * k, dtype=torch.int64)
        source = torch.zeros(n * k, dtype=torch.int64)
        shift = 0
        while (n * k - 1) >> shift:
            digits = ((index >> shift) & 15).to(torch.int32).reshape(n, k)
            packed_digits = torch.ops.aten._convert_weight_to_int4pack_for_cpu(digits, 1)
            source |= nibbles(packed_digits) << shift
            shift += 4
        codes = torch.empty(n * k, dtype=torch.int64)
        codes[source] = nibbles(self.packed)
        return codes.reshape(n, k)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the kernel multiplies by: ``(q - 8) * scale + zero`` as float32 ``[out, in]``."""
        n, k, g = self._n_padded, self._k_padded, self.group_size
        q = self._codes().float().reshape(n, k // g, g)
        sz = self.scales_and_zeros.float().transpose(0, 1)  # [n, k/g, 2]
        w = (q - 8.0) * sz[..., 0:1] + sz[..., 1:2]
        return w.reshape(n, k)[: self.out_features, : self.in_features].contiguous()

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if self._k_padded != self.in_features:
            x2d = F.pad(x2d, (0, self._k_padded - self.in_features))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, self.group_size, self.scales_and_zeros)
        if self._n_padded != self.out_features:
            y = y[:, : self.out_features]
        return y


# The block type float weights are quantized to for the native format (GGML's Q8_0: 8-bit codes, one fp16 scale
# per 32 weights; the most accurate type the kernels read).
NATIVE_FLOAT_TYPE = 8

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
        self.float_activations = False

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

        from .kernels.repack import FLOAT_TYPES, repack

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


Linear = Int8Linear | Int4Linear | NativeLinear


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    fmt: str = "dense",
    **options,
) -> Linear:
    """Build the linear for ``weight [out, in]`` (float, any dtype) in the compute ``dtype``.

    ``fmt`` is ``"dense"``, ``"int8"``, ``"int4"`` or ``"native"`` (quantized to GGUF blocks, Q8_0 unless the
    ``ggml_type`` option says otherwise). ``options`` go to the quantized formats: ``kernel_dtype`` (int8, int4),
    ``group_size`` (int4), ``ggml_type`` (native).
    """
    if fmt == "dense":
        if options:
            raise TypeError(f"dense linear takes no options, got {sorted(options)}")
        if dtype not in DENSE_TYPES:
            raise ValueError(f"dense weights are float32 or bfloat16, not {dtype}")
        return NativeLinear.from_float(weight.to(dtype), None if bias is None else bias.to(dtype), DENSE_TYPES[dtype])
    if fmt == "int8":
        return Int8Linear(weight, bias, dtype, **options)
    if fmt == "int4":
        return Int4Linear(weight, bias, dtype, **options)
    if fmt == NATIVE:
        return NativeLinear.from_float(weight, bias, **options)
    raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS + (NATIVE,)}")


NATIVE = "native"


def canonical_format(fmt: str) -> str:
    """``"bf16"`` -> ``"dense"`` (dense weights in the compute dtype); other names are returned as they are."""
    return "dense" if fmt == "bf16" else fmt


ROLES = ("target", "draft")

# What ``"auto"`` picks per model role (see :func:`auto_format` for the measurements behind it).
AUTO_FORMATS = {"target": "int8", "draft": "int4"}


def auto_format(role: str) -> str:
    """The weight format ``"auto"`` stands for, by model role: the fastest format within a quality bound.

    Rule: a draft takes the fastest format, since its quality only moves the acceptance rate and never the
    output; a target takes the fastest format whose logits stay within a KL divergence of 0.01 nats/token of
    the float32 model on real text (its output *is* the text).

    Hence draft: int4 (the fastest rounds, for a small loss of acceptance) and target: int8 (int4's logits miss the
    bound several times over; int8 is the fastest format within it and halves the target's weight memory). Measured:
    benchmarks/history/source-notes.md#linear-auto-format

    Use ``dense`` (``bf16``) for a target whose output must be the unquantized model's.
    """
    if role not in AUTO_FORMATS:
        raise ValueError(f"unknown model role {role!r}; expected one of {ROLES}")
    return AUTO_FORMATS[role]


def resolve_format(fmt: str, role: str = "target") -> str:
    """The concrete format (``dense``, ``int8``, ``int4``, ``native``) for a requested one (also ``bf16``, ``auto``).

    ``auto`` here is the torch format for ``role``; whether a GGUF model takes ``native`` instead is decided where
    the source is known (``loading/load.py``).
    """
    fmt = auto_format(role) if fmt == "auto" else canonical_format(fmt)
    if fmt not in FORMATS + (NATIVE,):
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS + (NATIVE, 'bf16', 'auto')}")
    return fmt


# int4 group size models use (``Int4Linear``'s own default stays 64). GGUF files store their weights in blocks
# of 32 (Q4_0 / Q4_1 / Q5_x / Q8_0 blocks, the 32-weight sub-blocks of Q4_K / Q5_K), each an affine grid of its
# own; a group of 32 lines up with those blocks, so re-quantizing a Q4_1 block with its own min and max
# reproduces its grid up to the bfloat16 rounding of scale and zero. It also keeps the logits several times closer
# to the float32 model's than groups of 64 or 128 do, for a few percent more int4 bytes and no measurable change in
# kernel time:
# benchmarks/history/source-notes.md#linear-model-int4-group
MODEL_INT4_GROUP_SIZE = 32


def default_linear_options(fmt: str, dtype: torch.dtype) -> dict:
    """Options a model passes to :func:`make_linear` unless told otherwise.

    Quantized formats run their kernel in bfloat16 whatever the compute dtype: it is the only vectorised
    path (float32 activations are many times slower, see the module notes), and rounding activations to
    bfloat16 (relative error 2^-9) is small next to the weight quantization error. int4 uses groups of
    :data:`MODEL_INT4_GROUP_SIZE`.
    """
    if fmt in ("dense", NATIVE):
        return {}
    options = {"kernel_dtype": torch.bfloat16}
    if fmt == "int4":
        options["group_size"] = MODEL_INT4_GROUP_SIZE
    return options


def int4_layout_tag() -> str:
    """A short tag that changes whenever the CPU-packed int4 layout might: torch version and CPU capability."""
    capability = torch.backends.cpu.get_cpu_capability()
    return f"torch{torch.__version__.split('+')[0]}-{capability}".lower()


def native_layout_tag(tiles: bool) -> str:
    """A short tag that changes whenever the repacked native layout might: the repacking's version and whether
    Q4_K / Q6_K / Q5_0 weights load as column tiles (an x86 vector path) or rows (``kernels/repack.py``)."""
    from .kernels.repack import LAYOUT_VERSION

    return f"layout{LAYOUT_VERSION}-{'tiles' if tiles else 'rows'}"


def linear_from_tensors(tensors: dict[str, torch.Tensor], meta: dict, dtype: torch.dtype) -> Linear:
    """Rebuild a linear from its ``to_tensors()`` and ``meta()`` (the stored tensors are used as they are)."""
    classes = {"int8": Int8Linear, "int4": Int4Linear, NATIVE: NativeLinear}
    fmt = meta.get("format")
    if fmt not in classes:
        raise ValueError(f"unknown stored weight format {fmt!r}")
    return classes[fmt].from_tensors(tensors, meta, dtype)
