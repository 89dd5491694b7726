"""Weight formats for linear layers: every projection in the model is one of these callables.

A linear maps ``x: [..., in_features]`` to ``[..., out_features]`` in the dtype of ``x`` and reports the
bytes its weights occupy (``nbytes``).

Formats (``make_linear(..., fmt=...)``):

* ``"dense"`` -- :class:`DenseLinear`, float weights in the compute dtype (``F.linear``).
* ``"int8"``  -- :class:`Int8Linear`, symmetric per-output-channel int8, ``torch.ops.aten._weight_int8pack_mm``.
* ``"int4"``  -- :class:`Int4Linear`, group-wise asymmetric int4, ``torch.ops.aten._weight_int4pack_mm_for_cpu``.

Kernel facts for the torch CPU weight-only kernels (torch 2.13, x86 AVX-512 build):

* Both kernels take a 2-D, row-contiguous activation ``x2d [M, K]`` and require the scales (int8) or
  the scales-and-zeros table (int4) to have exactly the dtype of ``x2d``; the output has that dtype.
  float32, bfloat16 and float16 are accepted.
* Only the bfloat16 path is vectorised. With float32 activations both kernels fall back to scalar code:
  for an 8960x1536 weight (2 threads) a 1-row call takes about 4.5 ms (int8) and 10 ms (int4), versus
  0.45 ms and 0.21 ms with bfloat16 activations and 2.8 ms for a float32 ``F.linear``; the cost grows
  linearly with the number of rows. ``kernel_dtype=torch.bfloat16`` lets a float32 model use the fast
  path (activations are rounded to bfloat16 for the matmul only).
* Both kernels accumulate in float32 and round the result once to the output dtype.
* Both kernels work on blocks of 4 activation rows and dequantize the weights again for every block,
  so a multi-row call costs more than a 1-row call (2 threads, bfloat16, 8960x1536 and 1536x8960:
  int8 stays within 1.15x up to 4 rows, then 1.6-1.7x at 5 and 1.8-2.1x at 8; int4 is 1.2x / 1.45x /
  1.65x at 2 / 3 / 4 rows and 3.0-3.3x at 5 to 8), whereas a bfloat16 ``F.linear`` costs within 1.15x
  of a 1-row call up to 8 rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FORMATS = ("dense", "int8", "int4")

# The vectorised bfloat16 int8 kernel steps through K 16 (AVX-512) or 8 (AVX2) values at a time with
# aligned vector loads: K must be a multiple of 16 and the activation rows must be 32-byte aligned,
# otherwise it reads out of bounds or faults (torch 2.13). Weights are padded to this multiple of K
# and misaligned activations (e.g. a view at an odd offset) are copied (torch allocations are
# 64-byte aligned).
_INT8_K_MULTIPLE = 16
_INT8_X_ALIGNMENT = 32

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


class DenseLinear:
    """Plain float weights (float32 or bfloat16): ``weight [out, in]``, optional ``bias [out]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.weight = weight.to(dtype).contiguous()
        self.bias = None if bias is None else bias.to(dtype).contiguous()

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        size = self.weight.numel() * self.weight.element_size()
        return size + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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

    @property
    def nbytes(self) -> int:
        """Bytes actually held: packed weights, scales (and zero points), bias."""
        tensors = self._weight_tensors() + ([] if self.bias is None else [self.bias])
        return sum(t.numel() * t.element_size() for t in tensors)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected last dim {self.in_features}, got {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features).to(self.kernel_dtype).contiguous()
        y = self._matmul(x2d)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)


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

    Group size: default 64, chosen from measurements on 8960x1536 and 1536x8960 weights (bfloat16
    activations, 2 threads, weights streamed from memory; ``benchmarks/bench_linear.py``):

    ==========  =====================  =====================  ===========  ==============
    group size  rel. RMS error, Gauss  rel. RMS error, t(4)   bytes vs 64  1-row call, ms
    ==========  =====================  =====================  ===========  ==============
    32          0.079                  0.094                  1.11         0.20-0.21
    64          0.090                  0.118                  1.00         0.19-0.22
    128         0.100                  0.145                  0.94         0.19-0.21
    256         0.109                  0.176                  0.92         0.18-0.22
    ==========  =====================  =====================  ===========  ==============

    The call time hardly depends on the group size (differences are within run-to-run noise, about
    5%), so the choice is error against memory. Each halving of the group cuts the error on
    heavier-tailed weights (closer to real LLM weights than Gaussian ones) by about a fifth. 64 takes
    most of that gain over 128 (19% less error for 6% more bytes); 32 gains another 20% but its
    scale/zero table adds a quarter to the code bytes (11% more than 64). ``group_size=32`` remains
    available where accuracy matters more than memory.

    ``in_features`` that are not a multiple of the group size use the largest accepted group size
    (32, 64, 128, 256) not above the requested one that divides it (e.g. 576 with 128 -> 64); if even 32
    does not divide it, the input dimension is zero-padded to a multiple of 32 (the activations are
    padded per call). ``out_features`` is zero-padded to a multiple of 16, as the packer requires;
    the extra outputs are dropped.
    """

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


Linear = DenseLinear | Int8Linear | Int4Linear


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    fmt: str = "dense",
    **options,
) -> Linear:
    """Build the linear for ``weight [out, in]`` (float, any dtype) in the compute ``dtype``.

    ``fmt`` is ``"dense"``, ``"int8"`` or ``"int4"``. ``options`` go to the quantized formats:
    ``kernel_dtype`` (both) and ``group_size`` (int4).
    """
    if fmt == "dense":
        if options:
            raise TypeError(f"dense linear takes no options, got {sorted(options)}")
        return DenseLinear(weight, bias, dtype)
    if fmt == "int8":
        return Int8Linear(weight, bias, dtype, **options)
    if fmt == "int4":
        return Int4Linear(weight, bias, dtype, **options)
    raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")
