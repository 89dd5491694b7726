"""Weight formats: dense (native float rows), int8 (Q8_0 blocks) and int4 (Q4_1 blocks) linears."""

from __future__ import annotations

import pytest
import torch

from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from sparsespec import kernels
from sparsespec.linear import DENSE_TYPES, QUANTIZED_TYPES, NativeLinear, make_linear

DTYPES = [torch.float32, torch.bfloat16]
LEAD_SHAPES = [(1,), (5,), (2, 3)]
# (out_features, in_features): multiples of the group size, real-model widths (576 is not a
# multiple of 128), and shapes needing padding (K not a multiple of 16/32, N not a multiple of 16).
SHAPES = [(64, 256), (48, 576), (40, 96), (30, 50), (16, 8)]


def _weights(out_f: int, in_f: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[0, 0] = 0.3  # an outlier
    b = torch.randn(out_f, generator=g) * 0.1
    return w, b


def _check_against_dequantized(lin, x: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The kernel output equals ``x @ W_hat.T + b`` up to float32 accumulation and output rounding."""
    w_hat = lin.dequantized_weight()
    xf = x.float()
    mm = xf @ w_hat.T
    ref = mm if bias is None else mm + bias.to(x.dtype).float()
    y = lin(x)
    assert y.dtype == x.dtype
    assert y.shape == (*x.shape[:-1], w_hat.shape[0])
    magnitude = xf.abs() @ w_hat.abs().T  # scale of the float32 accumulation error
    if x.dtype == torch.float32:
        tol = 1e-5 * magnitude + 1e-6
    else:
        # one rounding of the matmul to bfloat16, one of the bias addition
        eps = 2.0**-8
        tol = eps * (mm.abs() + ref.abs()) + 1e-5 * magnitude + 1e-6
    err = (y.float() - ref).abs()
    assert bool((err <= tol).all()), f"max err {err.max().item():.3g}, max excess {(err - tol).max().item():.3g}"


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dense_keeps_the_weights_in_the_compute_dtype_and_matches_the_reference(dtype, shape):
    w, b = _weights(*shape)
    lin = make_linear(w, b, dtype)
    assert lin.types == [DENSE_TYPES[dtype]]
    assert torch.equal(lin.dequantized_weight(), w.to(dtype).float())  # nothing rounded but to the dtype
    assert torch.equal(lin.bias, b.to(dtype).float())
    for lead in LEAD_SHAPES:
        x = torch.randn(*lead, shape[1]).to(dtype)
        _check_against_dequantized(lin, x, b)


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_formats_are_gguf_blocks_and_match_the_reference(fmt, shape, dtype):
    """int8 / int4 hold the blocks GGUF's own quantizer makes (Q8_0 / Q4_1); with float activations the product is
    the dequantized weight's, and with 8-bit activations (the default) within their rounding of it."""
    w, b = _weights(*shape)
    lin = make_linear(w, b, dtype, fmt)
    kind = GGMLQuantizationType(QUANTIZED_TYPES[fmt])
    assert lin.types == [kind.value] and not lin.float_activations
    padded = torch.nn.functional.pad(w, (0, -shape[1] % 32)).numpy()
    expected = dequantize(quantize(padded, kind), kind)[:, : shape[1]]
    assert torch.equal(lin.dequantized_weight(), torch.from_numpy(expected))
    for lead in LEAD_SHAPES:
        x = torch.randn(*lead, shape[1]).to(dtype)
        lin.float_activations = True
        _check_against_dequantized(lin, x, b)
        exact = lin(x).float()
        lin.float_activations = False
        quantized = lin(x).float()
        assert (quantized - exact).norm() <= 0.02 * exact.norm() + 1e-3


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("shape", SHAPES)
def test_quantization_error_is_within_half_a_step_of_each_block(shape):
    """Q8_0: |w - ŵ| <= d / 2 with d = max |w| / 127 of each block of 32; Q4_1: d = (max - min) / 15 (each up to the
    float16 rounding of the block's scale and minimum)."""
    w, _ = _weights(*shape)
    blocks = torch.nn.functional.pad(w, (0, -shape[1] % 32)).unflatten(1, (-1, 32))
    for fmt, step in (("int8", blocks.abs().amax(-1) / 127),
                      ("int4", (blocks.amax(-1) - blocks.amin(-1)) / 15)):
        w_hat = make_linear(w, None, torch.float32, fmt).dequantized_weight()
        error = torch.nn.functional.pad((w - w_hat).abs(), (0, -shape[1] % 32)).unflatten(1, (-1, 32))
        slack = 2.0**-9 * blocks.abs().amax(-1, keepdim=True)  # the fp16 scale and minimum, rounded
        assert bool((error <= step[..., None] / 2 + slack).all()), fmt


@pytest.mark.usefixtures("native_kernels")
def test_nbytes():
    out_f, in_f = 48, 576
    w, b = _weights(out_f, in_f)
    dense = make_linear(w, b, torch.bfloat16)
    assert dense.nbytes == out_f * in_f * 2 + out_f * 4  # the native kernels add float32 biases
    for fmt, kind in QUANTIZED_TYPES.items():
        lin = make_linear(w, b, torch.bfloat16, fmt)
        assert lin.nbytes == kernels.weight_bytes(kind, lin.padded_in, out_f) + out_f * 4
    i8, i4 = (make_linear(w, None, torch.bfloat16, fmt) for fmt in ("int8", "int4"))
    assert i4.nbytes < i8.nbytes < dense.nbytes


def test_make_linear_formats():
    w, b = _weights(16, 32)
    assert isinstance(make_linear(w, b, torch.float32), NativeLinear)
    assert make_linear(w, b, torch.float32, fmt="dense").types == [DENSE_TYPES[torch.float32]]
    assert make_linear(w, b, torch.float32, fmt="native").types == [8]  # Q8_0
    assert make_linear(w, b, torch.float32, "int8").types == [8]  # Q8_0
    assert make_linear(w, b, torch.float32, "int4").types == [3]  # Q4_1
    assert make_linear(w, b, torch.float32, "native", ggml_type=2).types == [2]  # Q4_0
    with pytest.raises(ValueError):
        make_linear(w, b, torch.float32, "int2")
    with pytest.raises(TypeError):
        make_linear(w, b, torch.float32, "dense", group_size=32)
    with pytest.raises(ValueError, match="dense weights are float32 or bfloat16"):
        make_linear(w, b, torch.float16, "dense")


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
def test_misaligned_and_strided_inputs(fmt):
    w, b = _weights(32, 128)
    lin = make_linear(w, b, torch.bfloat16, fmt)
    lin.float_activations = True
    buf = torch.randn(3 * 128 + 1).to(torch.bfloat16)
    x = buf[1:].view(3, 128)  # contiguous, but not 32-byte aligned
    assert x.data_ptr() % 32 != 0
    _check_against_dequantized(lin, x, b)
    xt = torch.randn(128, 3).to(torch.bfloat16).T  # non-contiguous
    _check_against_dequantized(lin, xt, b)


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
def test_a_residual_is_the_add_after_the_linear(fmt, dtype):
    w, b = _weights(48, 576)
    lin = make_linear(w, b, dtype, fmt)
    for lead in LEAD_SHAPES:
        x = torch.randn(*lead, 576).to(dtype)
        residual = torch.randn(*lead, 48).to(dtype)
        assert torch.equal(lin(x, residual=residual), residual + lin(x))


@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
def test_empty_batch(fmt):
    w, b = _weights(32, 128)
    lin = make_linear(w, b, torch.bfloat16, fmt)
    assert lin(torch.zeros(0, 128, dtype=torch.bfloat16)).shape == (0, 32)


@pytest.mark.usefixtures("native_kernels")
def test_quantized_close_to_dense():
    w, b = _weights(64, 512)
    x = torch.randn(4, 512)
    ref = make_linear(w, b, torch.float32)(x)
    rel = {}
    for fmt in ("int8", "int4"):
        y = make_linear(w, b, torch.float32, fmt)(x)
        rel[fmt] = ((y - ref).norm() / ref.norm()).item()
    assert rel["int8"] < 0.01
    assert rel["int4"] < 0.15
    assert rel["int8"] < rel["int4"]
