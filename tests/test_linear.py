"""Weight formats: dense (native float rows), int8 (per-channel) and int4 (group-wise) linears."""

from __future__ import annotations

import pytest
import torch

from sparsespec.linear import (
    DENSE_TYPES,
    Int4Linear,
    Int8Linear,
    NativeLinear,
    make_linear,
)

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_matches_dequantized_reference(dtype, shape):
    w, b = _weights(*shape)
    lin = make_linear(w, b, dtype, "int8")
    assert isinstance(lin, Int8Linear)
    for lead in LEAD_SHAPES:
        x = torch.randn(*lead, shape[1]).to(dtype)
        _check_against_dequantized(lin, x, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_int4_matches_dequantized_reference(dtype, shape):
    w, b = _weights(*shape)
    lin = make_linear(w, b, dtype, "int4")
    assert isinstance(lin, Int4Linear)
    for lead in LEAD_SHAPES:
        x = torch.randn(*lead, shape[1]).to(dtype)
        _check_against_dequantized(lin, x, b)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_without_bias(fmt):
    w, _ = _weights(32, 128)
    lin = make_linear(w, None, torch.bfloat16, fmt)
    x = torch.randn(3, 128).to(torch.bfloat16)
    _check_against_dequantized(lin, x, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_quantization_error_bound(dtype, shape):
    w, b = _weights(*shape)
    lin = Int8Linear(w, b, dtype)
    w_hat = lin.dequantized_weight()
    assert w_hat.dtype == torch.float32 and w_hat.shape == w.shape
    assert lin.scales.dtype == dtype
    scale = lin.scales.float()[:, None]
    assert bool(((w - w_hat).abs() <= scale * (0.5 + 1e-5)).all())
    # the scale is not larger than needed (up to rounding to the scale dtype)
    rel = torch.finfo(dtype).eps
    assert bool((scale[:, 0] <= w.abs().amax(1) / 127 * (1 + 2 * rel) + 1e-30).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_int4_quantization_error_bound(dtype, shape):
    w, b = _weights(*shape)
    lin = Int4Linear(w, b, dtype)
    w_hat = lin.dequantized_weight()
    assert w_hat.dtype == torch.float32 and w_hat.shape == w.shape
    sz = lin.scales_and_zeros
    assert sz.dtype == dtype and sz.shape[1:] == (lin._n_padded, 2)
    g = lin.group_size
    # per-element scale and zero, [out, in]
    scale = sz[..., 0].float().T.repeat_interleave(g, dim=1)[: shape[0], : shape[1]]
    zero = sz[..., 1].float().T.repeat_interleave(g, dim=1)[: shape[0], : shape[1]]
    slack = torch.finfo(dtype).eps * zero.abs() + 1e-6 * scale
    assert bool(((w - w_hat).abs() <= scale / 2 + slack).all())
    # 4 bits: the error is far larger than int8's but bounded by the group range / 30
    assert (w - w_hat).abs().max().item() < 0.6 / 30 * 1.01 + 1e-3


@pytest.mark.parametrize(
    ("in_f", "requested", "expected"),
    [
        (1536, 128, 128), (576, 128, 64), (896, 128, 128), (4864, 256, 256), (896, 256, 128),
        (8960, 256, 256), (576, 64, 64), (96, 64, 32), (50, 64, 64), (50, 32, 32),
    ],
)
def test_int4_group_size_fallback(in_f, requested, expected):
    w, _ = _weights(16, in_f)
    lin = Int4Linear(w, None, torch.bfloat16, group_size=requested)
    assert lin.group_size == expected
    assert lin._k_padded % lin.group_size == 0 and lin._k_padded >= in_f


def test_int4_default_group_size_for_model_widths():
    for in_f in (576, 896, 1536, 4864, 8960):
        lin = Int4Linear(torch.randn(16, in_f), None, torch.bfloat16)
        assert lin.group_size == 64 and lin._k_padded == in_f


def test_nbytes():
    out_f, in_f = 48, 576
    w, b = _weights(out_f, in_f)
    dense = make_linear(w, b, torch.bfloat16)
    assert dense.nbytes == out_f * in_f * 2 + out_f * 4  # the native kernels add float32 biases
    i8 = make_linear(w, None, torch.bfloat16, "int8")
    assert i8.nbytes == out_f * in_f + out_f * 2
    i8b = make_linear(w, b, torch.float32, "int8")
    assert i8b.nbytes == out_f * in_f + out_f * 4 + out_f * 4
    i4 = make_linear(w, None, torch.bfloat16, "int4")  # group 64
    assert i4.nbytes == out_f * in_f // 2 + (in_f // 64) * out_f * 2 * 2
    i4b = make_linear(w, b, torch.bfloat16, "int4", group_size=32)
    assert i4b.nbytes == out_f * in_f // 2 + (in_f // 32) * out_f * 2 * 2 + out_f * 2
    # padded shapes count the padding actually stored
    i4p = make_linear(torch.randn(30, 50), None, torch.bfloat16, "int4")
    assert i4p.nbytes == 32 * 64 // 2 + 1 * 32 * 2 * 2
    i8p = make_linear(torch.randn(30, 50), None, torch.bfloat16, "int8")
    assert i8p.nbytes == 30 * 64 + 30 * 2
    assert i4.nbytes < i8.nbytes < dense.nbytes


def test_make_linear_formats():
    w, b = _weights(16, 32)
    assert isinstance(make_linear(w, b, torch.float32), NativeLinear)
    assert make_linear(w, b, torch.float32, fmt="dense").types == [DENSE_TYPES[torch.float32]]
    assert make_linear(w, b, torch.float32, fmt="native").types == [8]  # Q8_0
    assert isinstance(make_linear(w, b, torch.float32, "int8"), Int8Linear)
    assert isinstance(make_linear(w, b, torch.float32, "int4"), Int4Linear)
    with pytest.raises(ValueError):
        make_linear(w, b, torch.float32, "int2")
    with pytest.raises(ValueError):
        make_linear(w, b, torch.float32, "int4", group_size=48)
    with pytest.raises(TypeError):
        make_linear(w, b, torch.float32, "dense", group_size=32)
    with pytest.raises(ValueError, match="dense weights are float32 or bfloat16"):
        make_linear(w, b, torch.float16, "dense")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_bfloat16_kernel_for_float32_model(fmt):
    w, b = _weights(32, 128)
    lin = make_linear(w, b, torch.float32, fmt, kernel_dtype=torch.bfloat16)
    x = torch.randn(2, 128)
    y = lin(x)
    assert y.dtype == torch.float32
    # same as running the bfloat16 kernel on bfloat16-rounded activations, bias added in float32
    ref = make_linear(w, None, torch.bfloat16, fmt)(x.to(torch.bfloat16)).float() + b
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_misaligned_and_strided_inputs(fmt):
    w, b = _weights(32, 128)
    lin = make_linear(w, b, torch.bfloat16, fmt)
    buf = torch.randn(3 * 128 + 1).to(torch.bfloat16)
    x = buf[1:].view(3, 128)  # contiguous, but not 32-byte aligned
    assert x.data_ptr() % 32 != 0
    _check_against_dequantized(lin, x, b)
    xt = torch.randn(128, 3).to(torch.bfloat16).T  # non-contiguous
    _check_against_dequantized(lin, xt, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
def test_a_residual_is_the_add_after_the_linear(fmt, dtype):
    w, b = _weights(48, 576)
    lin = make_linear(w, b, dtype, fmt)
    for lead in LEAD_SHAPES:
        x = torch.randn(*lead, 576).to(dtype)
        residual = torch.randn(*lead, 48).to(dtype)
        assert torch.equal(lin(x, residual=residual), residual + lin(x))


@pytest.mark.parametrize("fmt", ["dense", "int8", "int4"])
def test_empty_batch(fmt):
    w, b = _weights(32, 128)
    lin = make_linear(w, b, torch.bfloat16, fmt)
    assert lin(torch.zeros(0, 128, dtype=torch.bfloat16)).shape == (0, 32)


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
