"""The decoder's element-wise native ops (``kernels.rms_norm``, ``kernels.gated``) against the torch operations
they replace in ``model.py``: the same values in bfloat16 (both compute in float32 and round once per step), and
float32 within a few units in the last place (the sums, the exponential and tanh are evaluated in another order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparsespec import kernels

# Skipped without the kernels, failed where they must build (conftest.py: native_kernels).
pytestmark = pytest.mark.usefixtures("native_kernels")


def _inputs(rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(rows, width, generator=gen)).to(dtype)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_equals_torch(rows):
    width = 576
    weight = (2 * torch.rand(width, generator=torch.Generator().manual_seed(1))).bfloat16()
    x = _inputs(rows, width, torch.bfloat16)
    ours, ref = kernels.rms_norm(x, weight, 1e-5), F.rms_norm(x, (width,), weight, 1e-5)
    assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
    # The mean of squares is summed in another order: a rare last-bit difference in bfloat16, never more.
    assert (ours != ref).float().mean() < 0.01
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-7, atol=0)
    x32, w32 = x.float(), weight.float()
    torch.testing.assert_close(kernels.rms_norm(x32, w32, 1e-5), F.rms_norm(x32, (width,), w32, 1e-5), rtol=1e-6,
                               atol=1e-6)


def test_rms_norm_rows_are_independent():
    x = _inputs(9, 320, torch.bfloat16)
    weight = torch.ones(320, dtype=torch.bfloat16)
    whole = kernels.rms_norm(x, weight, 1e-6)
    for i in range(9):
        assert torch.equal(kernels.rms_norm(x[i : i + 1], weight, 1e-6)[0], whole[i])


@pytest.mark.parametrize("rows", [1, 3])
def test_silu_mul_equals_torch(rows):
    gate_up = _inputs(rows, 2 * 4864, torch.float32)
    gate_up[0, :6] = torch.tensor([-200.0, -88.0, -30.0, 0.0, 30.0, 200.0])  # the exponential's clamps
    for dtype, rtol in ((torch.bfloat16, 0.0), (torch.float32, 3e-7)):
        x = gate_up.to(dtype)
        gate, up = x.chunk(2, dim=-1)
        ref = F.silu(gate) * up
        ours = kernels.gated(x)
        assert ours.dtype == dtype and ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, rtol=rtol, atol=1e-30 if rtol else 0.0)


@pytest.mark.parametrize("rows", [1, 3])
def test_gelu_mul_agrees_with_torch(rows):
    """Gemma's GELU (tanh approximation) times up: torch evaluates tanh in its own vector code, so bfloat16 results
    differ from torch's in at most a rare last bit, float32 ones by a few units in the last place; where 1 + tanh
    cancels (large negative gates), by less than 1e-5 in all."""
    gate_up = _inputs(rows, 2 * 2048, torch.float32)
    gate_up[0, :6] = torch.tensor([-200.0, -10.0, -1e-3, 0.0, 10.0, 200.0])
    for dtype in (torch.bfloat16, torch.float32):
        x = gate_up.to(dtype)
        gate, up = x.chunk(2, dim=-1)
        ref = F.gelu(gate, approximate="tanh") * up
        ours = kernels.gated(x, gelu=True)
        assert ours.dtype == dtype and ours.shape == ref.shape
        if dtype == torch.bfloat16:
            assert (ours != ref).float().mean() < 0.01
            torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-7, atol=1e-5)
        else:
            torch.testing.assert_close(ours, ref, rtol=2e-6, atol=1e-5)
    x = gate_up.to(torch.bfloat16)
    assert torch.equal(kernels.gated(x[1:2], gelu=True)[0], kernels.gated(x, gelu=True)[1]) if rows > 1 else True


def test_bad_shapes_raise():
    with pytest.raises(RuntimeError, match="gated"):
        kernels.gated(torch.zeros(2, 5))
    with pytest.raises(RuntimeError, match="rms_norm"):
        kernels.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)
