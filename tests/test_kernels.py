"""The native quantized matmul against float64 references built from ``gguf.quants.dequantize``.

Weights are random GGUF blocks of every supported type (random codes, random finite scales), so every bit of every
block layout is exercised; shapes are deliberately not multiples of the kernels' tiles (odd row counts, inputs that
end in a partial 256-chunk or a half 64-quarter).

The error bound. The kernel quantizes each activation row per block of inputs (32 for the 32-weight formats, 256
for the K-quants, as llama.cpp does) to ``q = round(x / dx)`` with ``dx = max|x| / 127``, so ``|x - dx q| <= dx / 2``
per input; the weight side is exact (the repacked blocks dequantize to exactly the file's values). Hence for
output ``n``::

    |y_kernel - y_ref| <= sum_i |w[n, i]| * dx(i) / 2  +  float32 rounding (1e-5 of sum_i |w[n, i] x_i|)

which the tests check output by output. A wrongly packed block breaks the bound by orders of magnitude (tested).

With float activations (``csrc/fmatmul.h``: row layouts) nothing is quantized: the kernel's product differs from
the float64 one by float32 rounding alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from sparsespec import kernels
from sparsespec.kernels.repack import BLOCK_TYPES, FLOAT_TYPES, TILED_TYPES, pack, repack, repack_tiles

# Skipped without the kernels, failed where they must build (conftest.py: native_kernels).
pytestmark = pytest.mark.usefixtures("native_kernels")

TYPES = sorted(BLOCK_TYPES)
# (GGML type, column tiles?): every block type in the row layout, and Q4_K / Q6_K / Q5_0 also in 16-column tiles.
LAYOUTS = [(t, False) for t in TYPES] + [(t, True) for t in sorted(TILED_TYPES)]


LAYOUT_IDS = [BLOCK_TYPES[t][0] + ("-tiles" if tiles else "") for t, tiles in LAYOUTS]

ROW_COUNTS = (1, 2, 3, 5, 8, 13, 16)
# fp16 fields of each block (byte offsets): scales that must be finite and modest.
_F16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_blocks(ggml_type: int, rows: int, k: int, seed: int) -> np.ndarray:
    """Random raw GGUF bytes ``[rows, row bytes]`` of a block type, with scales drawn in [-0.05, 0.05]."""
    _, size, block_bytes = BLOCK_TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, k // size, block_bytes), dtype=np.uint8)
    for at in _F16_FIELDS[ggml_type]:
        scales = rng.uniform(0.001, 0.05, size=(rows, k // size)).astype(np.float16)
        if ggml_type not in (3, 7, 12, 13) or at == 0:  # offsets (m, dmin) may be any sign; d may be too
            scales *= rng.choice([-1, 1], size=scales.shape).astype(np.float16)
        raw[..., at: at + 2] = scales.view(np.uint8).reshape(rows, k // size, 2)
    return raw.reshape(rows, -1)


def shapes_for(ggml_type: int) -> list[tuple[int, int]]:
    """(rows, k) pairs off the tiles: k ending in a partial chunk, and (32-weight blocks) in half a quarter."""
    if BLOCK_TYPES[ggml_type][1] == 256:
        return [(37, 768), (5, 256)]
    return [(37, 608), (3, 96), (17, 576)]


def reference(raw: np.ndarray, ggml_type: int, k: int) -> np.ndarray:
    return dequantize(raw, GGMLQuantizationType(ggml_type)).reshape(raw.shape[0], k).astype(np.float64)


def packed(raw: np.ndarray, ggml_type: int, k: int, tiles: bool = False) -> tuple[torch.Tensor, int, int]:
    """(repacked bytes, padded k, kernel type)."""
    kernel_type, blob, k_padded = pack(ggml_type, raw, k, tiles)
    return torch.from_numpy(blob.reshape(-1)), k_padded, kernel_type


def run(blob, kernel_type, rows, k, k_padded, x, isa=kernels.ISA_AUTO, bias=None, float_activations=False):
    if k_padded != k:
        x = torch.nn.functional.pad(x, (0, k_padded - k))
    return kernels.gguf_linear(x, [blob], [kernel_type], [rows], k_padded, bias, isa, float_activations)


def activation_bound(x: torch.Tensor, w: np.ndarray, ggml_type: int) -> np.ndarray:
    """``[m, n]``: the bound of the module docstring for each output."""
    m, k = x.shape
    xd = x.double().numpy()
    size = BLOCK_TYPES[ggml_type][1]  # activation block: 32, or 256 for the K-quants
    blocks = -(-k // size)
    padded = np.zeros((m, blocks * size))
    padded[:, :k] = np.abs(xd)
    dx = padded.reshape(m, blocks, size).max(axis=-1) / 127.0  # [m, blocks]
    dx_per_input = np.repeat(dx, size, axis=1)[:, :k]
    half_step = 0.5 * dx_per_input @ np.abs(w).T
    rounding = 1e-5 * (np.abs(xd) @ np.abs(w).T) + 1e-30
    return half_step + rounding


@pytest.mark.parametrize("ggml_type,tiles", LAYOUTS, ids=LAYOUT_IDS)
def test_repack_is_lossless(ggml_type, tiles):
    for rows, k in shapes_for(ggml_type):
        raw = random_blocks(ggml_type, rows, k, seed=rows)
        blob, k_padded, kind = packed(raw, ggml_type, k, tiles)
        ours = kernels.gguf_dequantize(blob, kind, k_padded, torch.arange(rows)).numpy()[:, :k]
        assert np.array_equal(ours, reference(raw, ggml_type, k).astype(np.float32))


@pytest.mark.parametrize("ggml_type,tiles", LAYOUTS, ids=LAYOUT_IDS)
def test_matmul_within_activation_rounding_bound(ggml_type, tiles):
    g = torch.Generator().manual_seed(ggml_type)
    for rows, k in shapes_for(ggml_type):
        raw = random_blocks(ggml_type, rows, k, seed=k)
        w = reference(raw, ggml_type, k)
        blob, k_padded, kind = packed(raw, ggml_type, k, tiles)
        bias = torch.randn(rows, generator=g)
        for m in ROW_COUNTS:
            x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
            x[:, :: max(1, k // 7)] *= 20  # outlier channels, as real activations have
            y = run(blob, kind, rows, k, k_padded, x, bias=bias).double().numpy()
            y_ref = x.double().numpy() @ w.T + bias.double().numpy()
            err = np.abs(y - y_ref)
            bound = activation_bound(x, w, ggml_type)
            assert (err <= bound).all(), f"M={m} rows={rows} k={k}: worst error / bound {(err / bound).max():.3g}"
            assert (err <= 0.6 * bound).mean() > 0.99  # rounding errors partly cancel: most outputs sit well inside


@pytest.mark.parametrize("ggml_type,tiles", LAYOUTS, ids=LAYOUT_IDS)
def test_every_instruction_set_equals_scalar_bit_for_bit(ggml_type, tiles):
    simd = (kernels.ISA_AVX2, kernels.ISA_AVX512, kernels.ISA_AMX, kernels.ISA_NEON)
    isas = [i for i in simd if kernels.isa_available(i)]
    if not isas:
        pytest.skip("no SIMD path runs on this CPU")
    g = torch.Generator().manual_seed(1)
    for rows, k in shapes_for(ggml_type):
        raw = random_blocks(ggml_type, rows, k, seed=3)
        blob, k_padded, kind = packed(raw, ggml_type, k, tiles)
        for m in ROW_COUNTS:
            x = torch.randn(m, k, generator=g)
            scalar = run(blob, kind, rows, k, k_padded, x, kernels.ISA_SCALAR)
            for isa in isas:
                assert torch.equal(run(blob, kind, rows, k, k_padded, x, isa), scalar), kernels.isa_name(isa)


@pytest.mark.skipif(not kernels.isa_available(kernels.ISA_AMX), reason="no AMX-INT8 here")
@pytest.mark.parametrize("ggml_type", [12, 14], ids=["Q4_K", "Q6_K"])
def test_amx_runs_the_tiles_of_passes_of_four_rows_or_more(ggml_type):
    """The AMX kernels multiply Q4_K / Q6_K tiles only in passes of 4+ rows (counted), and equal the scalar path."""
    rows, k = 37, 768
    blob, k_padded, kind = packed(random_blocks(ggml_type, rows, k, seed=8), ggml_type, k, tiles=True)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(6))
    for m, runs_amx in ((1, False), (3, False), (4, True), (16, True), (17, True)):
        before = kernels.amx_tile_passes()
        y = run(blob, kind, rows, k, k_padded, x[:m], kernels.ISA_AMX)
        assert (kernels.amx_tile_passes() > before) == runs_amx, m
        assert torch.equal(y, run(blob, kind, rows, k, k_padded, x[:m], kernels.ISA_SCALAR))


@pytest.mark.parametrize("ggml_type,tiles", LAYOUTS, ids=LAYOUT_IDS)
def test_a_row_does_not_depend_on_the_rows_beside_it(ggml_type, tiles):
    rows, k = shapes_for(ggml_type)[0]
    blob, k_padded, kind = packed(random_blocks(ggml_type, rows, k, seed=5), ggml_type, k, tiles)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(2))
    together = run(blob, kind, rows, k, k_padded, x)
    for m in ROW_COUNTS:
        assert torch.equal(run(blob, kind, rows, k, k_padded, x[:m]), together[:m])
    alone = torch.cat([run(blob, kind, rows, k, k_padded, x[i: i + 1]) for i in range(16)])
    assert torch.equal(alone, together)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: BLOCK_TYPES[t][0])
def test_float_activations_within_float32_rounding_of_the_float64_product(ggml_type):
    g = torch.Generator().manual_seed(ggml_type)
    for rows, k in shapes_for(ggml_type):
        raw = random_blocks(ggml_type, rows, k, seed=k)
        w = reference(raw, ggml_type, k)
        blob, k_padded, kind = packed(raw, ggml_type, k)
        bias = torch.randn(rows, generator=g)
        for m in ROW_COUNTS:
            x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
            x[:, :: max(1, k // 7)] *= 20  # outlier channels, which cost the 8-bit activations the most
            y = run(blob, kind, rows, k, k_padded, x, bias=bias, float_activations=True).double().numpy()
            y_ref = x.double().numpy() @ w.T + bias.double().numpy()
            scale = np.abs(x.double().numpy()) @ np.abs(w).T + np.abs(bias.double().numpy())
            err = np.abs(y - y_ref)
            # Each lane sums k / 16 products, then four additions and the bias: float32 rounding, with the
            # dequantized weight's own rounding, stays below (k / 16 + 8) units of 2^-23 of the sum of |terms|.
            bound = (k / 16 + 8) * 2.0**-23 * scale
            assert (err <= bound).all(), f"M={m} k={k}: worst error / bound {(err / bound).max():.3g}"
            quantized = run(blob, kind, rows, k, k_padded, x, bias=bias).double().numpy()
            assert err.mean() < np.abs(quantized - y_ref).mean() / 20  # far inside the 8-bit activations' error


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: BLOCK_TYPES[t][0])
def test_float_activations_every_instruction_set_equals_scalar_and_rows_are_independent(ggml_type):
    isas = [i for i in (kernels.ISA_AVX2, kernels.ISA_AVX512, kernels.ISA_AMX) if kernels.isa_available(i)]
    rows, k = shapes_for(ggml_type)[0]
    blob, k_padded, kind = packed(random_blocks(ggml_type, rows, k, seed=5), ggml_type, k)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(2))
    for isa in (kernels.ISA_AUTO, *isas):
        together = run(blob, kind, rows, k, k_padded, x, isa, float_activations=True)
        assert torch.equal(together, run(blob, kind, rows, k, k_padded, x, kernels.ISA_SCALAR, float_activations=True))
        for m in ROW_COUNTS:
            assert torch.equal(run(blob, kind, rows, k, k_padded, x[:m], isa, float_activations=True), together[:m])
        alone = torch.cat([run(blob, kind, rows, k, k_padded, x[i: i + 1], isa, float_activations=True)
                           for i in range(16)])
        assert torch.equal(alone, together)


@pytest.mark.parametrize("ggml_type", sorted(FLOAT_TYPES), ids=lambda t: FLOAT_TYPES[t][0])
def test_float_weights_within_float32_rounding_of_the_float64_product_on_every_instruction_set(ggml_type):
    """F32 / F16 / BF16 weights multiply the activations as they are, whatever the projection asks for; every
    instruction set gives the scalar path's bits; a row never depends on the rows beside it."""
    torch_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[FLOAT_TYPES[ggml_type][0]]
    isas = [i for i in (kernels.ISA_AVX2, kernels.ISA_AVX512, kernels.ISA_AMX) if kernels.isa_available(i)]
    g = torch.Generator().manual_seed(ggml_type)
    for rows, k in [(37, 608), (3, 88), (17, 32)]:
        weight = (torch.randn(rows, k, generator=g) * 0.05).to(torch_dtype)
        blob, k_padded, kind = packed(weight.view(torch.uint8).numpy(), ggml_type, k)
        assert kind == ggml_type and k_padded == -(-k // 16) * 16
        w = weight.double().numpy()
        bias = torch.randn(rows, generator=g)
        x = torch.randn(16, k, generator=g) * 4
        for float_activations in (False, True):
            together = run(blob, kind, rows, k, k_padded, x, bias=bias, float_activations=float_activations)
            y = together.double().numpy()
            y_ref = x.double().numpy() @ w.T + bias.double().numpy()
            scale = np.abs(x.double().numpy()) @ np.abs(w).T + np.abs(bias.double().numpy())
            bound = (k / 16 + 8) * 2.0**-23 * scale  # the module's float-activation bound; the weight is exact
            assert (np.abs(y - y_ref) <= bound).all()
            for isa in (kernels.ISA_SCALAR, *isas):
                assert torch.equal(run(blob, kind, rows, k, k_padded, x, isa, bias=bias), together)
            for m in (1, 3, 5):
                assert torch.equal(run(blob, kind, rows, k, k_padded, x[:m], bias=bias), together[:m])
        rows_wanted = torch.tensor([rows - 1, 0])
        assert torch.equal(kernels.gguf_dequantize(blob, kind, k_padded, rows_wanted)[:, :k],
                           weight[rows_wanted].float())


def test_float_activations_refuse_column_tiles():
    tiles, k, kind = packed(random_blocks(12, 16, 256, seed=0), 12, 256, tiles=True)
    with pytest.raises(RuntimeError, match="float activations read the row layout"):
        kernels.gguf_linear(torch.randn(1, 256), [tiles], [kind], [16], 256, None, kernels.ISA_AUTO, True)


@pytest.mark.parametrize("ggml_type", sorted(TILED_TYPES), ids=lambda t: BLOCK_TYPES[t][0])
def test_tiles_equal_the_row_layout_within_float_rounding_and_cut_like_it(ggml_type):
    """The two layouts hold the same weight: their products differ only in the float steps' order, and the first
    rows of a tiled weight (a cut inside a tile, as a draft's smaller vocabulary makes) are the first outputs."""
    from sparsespec.linear import NativeLinear

    rows, k = shapes_for(ggml_type)[0]
    raw = random_blocks(ggml_type, rows, k, seed=7)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    by_rows, by_tiles = (NativeLinear([(kind, blob, rows)], k, k_padded)
                         for blob, k_padded, kind in (packed(raw, ggml_type, k, tiles) for tiles in (False, True)))
    # The file's bytes per block (Q4_K: plus its 4 spread scale bytes, as in the row layout); the last tile is
    # padded to 16 columns.
    _, size, block_bytes = BLOCK_TYPES[ggml_type]
    assert by_tiles.types == [TILED_TYPES[ggml_type]]
    per_row = by_tiles.padded_in // size * (block_bytes + (4 if ggml_type == 12 else 0))
    assert by_tiles.nbytes == per_row * (-(-rows // 16) * 16)
    assert torch.allclose(by_tiles(x), by_rows(x), rtol=1e-5, atol=1e-5 * by_rows(x).abs().max().item())
    cut = by_tiles.first_rows(21)
    assert cut.out_features == 21 and torch.equal(cut(x), by_tiles(x)[:, :21])


def test_a_wrongly_packed_block_fails_the_bound():
    """Swapping the two nibble planes of one quarter (a plausible packing bug) is caught by the reference."""
    ggml_type, rows, k = 12, 8, 512  # Q4_K
    raw = random_blocks(ggml_type, rows, k, seed=9)
    blob, k_padded, _ = packed(raw, ggml_type, k)
    broken = blob.clone().view(rows, -1)
    quarter = broken[:, 20:52]  # the first quarter's nibbles, after the 20-byte scale section
    broken[:, 20:52] = (quarter >> 4) | ((quarter & 0x0F) << 4)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    w = reference(raw, ggml_type, k)
    err = np.abs(run(broken.reshape(-1), ggml_type, rows, k, k_padded, x).double().numpy() - x.double().numpy() @ w.T)
    assert (err > activation_bound(x, w, ggml_type)).any()


@pytest.mark.parametrize("ggml_type,scale_bytes", [(12, 320), (6, 32)], ids=["Q4_K", "Q5_0"])
def test_a_wrongly_packed_tile_fails_the_bound(ggml_type, scale_bytes):
    """Swapping the nibbles of one 64-byte pair of codes in a tile (inputs 0-3 with 4-7 of 16 columns) is caught."""
    rows, k = 16, 512
    raw = random_blocks(ggml_type, rows, k, seed=9)
    blob, k_padded, kind = packed(raw, ggml_type, k, tiles=True)
    broken = blob.clone()
    pair = broken[scale_bytes: scale_bytes + 64]  # the first pair of codes, after the first chunk's scales
    broken[scale_bytes: scale_bytes + 64] = (pair >> 4) | ((pair & 0x0F) << 4)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    w = reference(raw, ggml_type, k)
    err = np.abs(run(broken, kind, rows, k, k_padded, x).double().numpy() - x.double().numpy() @ w.T)
    assert (err > activation_bound(x, w, ggml_type)).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("ggml_type,tiles,float_activations", [(8, False, False), (8, False, True), (12, True, False)],
                         ids=["Q8_0", "Q8_0-float", "Q4_K-tiles"])  # float activations read the row layout only
def test_a_residual_is_added_bit_for_bit_as_a_separate_add(ggml_type, tiles, float_activations, dtype):
    """The fused skip connection equals ``residual + product`` exactly, for one row and for five, the threads
    splitting the columns; through a NativeLinear too; a residual of the wrong shape or dtype is refused."""
    rows, k = shapes_for(ggml_type)[0]
    blob, k_padded, kind = packed(random_blocks(ggml_type, rows, k, seed=9), ggml_type, k, tiles)
    gen = torch.Generator().manual_seed(4)
    for m in (1, 5):
        x = torch.nn.functional.pad(torch.randn(m, k, generator=gen), (0, k_padded - k)).to(dtype)
        residual = (10 * torch.randn(m, rows, generator=gen)).to(dtype)
        product = kernels.gguf_linear(x, [blob], [kind], [rows], k_padded, None, kernels.ISA_AUTO, float_activations)
        fused = kernels.gguf_linear(x, [blob], [kind], [rows], k_padded, None, kernels.ISA_AUTO, float_activations,
                                    residual)
        assert fused.dtype == dtype and torch.equal(fused, residual + product)
        assert not torch.equal(fused, product)
    from sparsespec.linear import NativeLinear

    linear = NativeLinear([(kind, blob, rows)], k, k_padded)
    linear.float_activations = float_activations
    batched_x, batched_residual = x[None, :, :k], residual[None]  # the [..., in] a linear takes
    assert torch.equal(linear(batched_x, residual=batched_residual), batched_residual + linear(batched_x))
    with pytest.raises(RuntimeError, match="residual must be"):
        kernels.gguf_linear(x, [blob], [kind], [rows], k_padded, residual=residual[:, :-1])
    with pytest.raises(RuntimeError, match="residual must be"):
        other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
        kernels.gguf_linear(x, [blob], [kind], [rows], k_padded, residual=residual.to(other))


def test_bad_inputs_raise():
    raw = random_blocks(2, 4, 64, seed=0)
    blob, k, _ = packed(raw, 2, 64)
    with pytest.raises(RuntimeError, match="bytes"):
        kernels.gguf_linear(torch.randn(1, 64), [blob[:-1]], [2], [4], 64)
    with pytest.raises(RuntimeError, match="unsupported block type"):
        kernels.gguf_linear(torch.randn(1, 64), [blob], [10], [4], 64)
    with pytest.raises(RuntimeError, match="x must be"):
        kernels.gguf_linear(torch.randn(1, 63), [blob], [2], [4], 64)
    with pytest.raises(ValueError, match="does not hold"):
        repack(2, raw[:, :-1], 64)
    with pytest.raises(ValueError, match="in tiles"):
        repack_tiles(2, raw, 64)  # only Q4_K, Q6_K and Q5_0 have a tile layout
    tiles, k, kind = packed(random_blocks(12, 20, 256, seed=0), 12, 256, tiles=True)
    with pytest.raises(RuntimeError, match="bytes"):  # 20 rows fill two tiles, not one
        kernels.gguf_linear(torch.randn(1, 256), [tiles[: tiles.numel() // 2]], [kind], [20], 256)
    meta = torch.empty(1, 64, device="meta")  # the ops read host memory and say so for any other device
    for call in (lambda: kernels.gguf_linear(meta, [blob], [2], [4], 64),
                 lambda: kernels.gguf_dequantize(blob.to("meta"), 2, 64, torch.arange(2)),
                 lambda: kernels.rms_norm(meta, torch.ones(64), 1e-6),
                 lambda: kernels.gated(meta)):
        with pytest.raises(RuntimeError, match="on the CPU"):
            call()


def test_a_k_that_splits_the_blocks_raises():
    """``k`` must cut whole rows: below a quarter (or a tile's span) a row would be 0 bytes and gguf_dequantize
    would divide by it (SIGFPE); a K-quant row layout of a partial 256-input chunk would be read past its end by
    the matmul, whose K-quant kernels take whole chunks (as every GGUF K-quant row is)."""
    blob, _, _ = packed(random_blocks(2, 4, 64, seed=0), 2, 64)  # Q4_0, 4 rows of 64
    with pytest.raises(RuntimeError, match="k must be a positive multiple of 64, not 32"):
        kernels.gguf_dequantize(blob, 2, 32, torch.arange(1))
    tiles, _, kind = packed(random_blocks(12, 16, 256, seed=0), 12, 256, tiles=True)
    with pytest.raises(RuntimeError, match="tiles' span, not 64"):
        kernels.gguf_dequantize(tiles, kind, 64, torch.arange(1))
    rows, k = 3, 320  # Q4_K rows of one chunk and a quarter, with the bytes the row layout gives them
    weight = torch.zeros(kernels.weight_bytes(12, k, rows), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="K-quant type 12 needs k a multiple of 256"):
        kernels.gguf_linear(torch.randn(1, k), [weight], [12], [rows], k)


def test_a_stale_build_lock_is_removed_and_a_fresh_one_waited_for(tmp_path, capsys):
    """A build killed outright leaves torch's lock file behind; a start does not wait on it forever."""
    import threading

    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (0, 0))  # decades old: a killed build's
    kernels.wait_for_other_build(tmp_path)
    assert not lock.exists() and "interrupted build" in capsys.readouterr().err
    lock.touch()  # a build in progress: waited for until its lock goes
    threading.Timer(1.5, lock.unlink).start()
    kernels.wait_for_other_build(tmp_path)
    assert not lock.exists() and capsys.readouterr().err == ""


def _without_a_compiler(tmp_path: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """``sparsespec argv`` on a machine whose C++ compiler fails, in a fresh kernel folder, with ``env`` set too."""
    env = dict(os.environ, SPARSESPEC_HOME=str(tmp_path), CXX="/bin/false", **env)
    env.pop("SPARSESPEC_KERNELS", None)
    return subprocess.run([sys.executable, "-m", "sparsespec.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=300)


def test_without_a_compiler_one_warning_and_info_runs(tmp_path):
    """A machine whose C++ compiler fails: the line saying the build starts, one warning line, ``info`` saying the
    kernels are unavailable and why, exit 0, no traceback."""
    out = _without_a_compiler(tmp_path, "info")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("sparsespec: building native kernels (once, about a minute) in ")
    assert lines[1].startswith("sparsespec: warning: native kernels unavailable")
    assert "kernels: unavailable (" in out.stdout


def test_without_a_compiler_generating_fails_in_one_sentence(tmp_path):
    """The KV cache attends through the native kernels alone: a command that decodes fails after the build's warning,
    before loading any model (its home here holds none), with one sentence saying so and why, exit non-zero, no
    traceback."""
    out = _without_a_compiler(tmp_path, "generate", "-m", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "2")
    assert out.returncode != 0 and out.stdout == ""
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-2].startswith("sparsespec: warning: native kernels unavailable"), lines
    assert lines[-1].startswith("sparsespec: error: The KV cache's attention runs in the native kernels, which are "
                                "not available here ("), lines
    assert lines[-1].endswith(").")


def test_a_build_says_so_and_a_built_library_loads_silently(tmp_path, monkeypatch, capsys):
    """The first load in a fresh kernel folder says it builds (and when it is done); a library that does not import
    is built again; a finished one is imported without the builder, silently. The compiler is a stand-in that
    leaves an empty library file behind."""
    from torch.utils import cpp_extension

    class Module:
        def set_isa(self, isa):
            return True

    builds = []

    def fake_build(name, sources, build_directory, **kwargs):
        builds.append(build_directory)
        (Path(build_directory) / kernels.LIBRARY).write_bytes(b"")
        return Module()

    monkeypatch.setenv("SPARSESPEC_HOME", str(tmp_path))
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    monkeypatch.setattr(cpp_extension, "load", fake_build)
    kernels._load.cache_clear()
    try:
        assert not kernels.built() and kernels.available() and kernels.built() and len(builds) == 1
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 2 and err[0].startswith("sparsespec: building native kernels (once, about a minute)")
        assert err[1].startswith("sparsespec: native kernels built in ")
        kernels._load.cache_clear()
        assert kernels.available() and len(builds) == 2  # the empty file does not import: built again
        assert capsys.readouterr().err.startswith("sparsespec: building native kernels")
        monkeypatch.setattr(kernels, "_import_finished_build", lambda folder: Module())
        kernels._load.cache_clear()
        assert kernels.available() and len(builds) == 2 and capsys.readouterr().err == ""
    finally:
        kernels._load.cache_clear()  # the real kernels again for the tests after this one


def test_kernels_named_by_instruction_set():
    """``SPARSESPEC_KERNELS=<instruction set>`` runs that path (``sparsespec info`` says so); a name that is no
    instruction set, or one this CPU lacks, is one error sentence, not a traceback."""
    def info(value: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sparsespec.cli", "info"], capture_output=True, text=True,
                              timeout=300, env=dict(os.environ, SPARSESPEC_KERNELS=value))

    out = info("scalar")
    assert out.returncode == 0 and "kernels: native (scalar)" in out.stdout, out.stderr
    missing = next(name for name, isa in kernels.ISA_NAMES.items() if not kernels.isa_available(isa))
    for value, says in (("avx9", "names no kernels"), (missing, "this CPU does not run that instruction set")):
        out = info(value)
        assert out.returncode != 0 and "Traceback" not in out.stderr
        assert out.stderr.strip().startswith("sparsespec: error:") and says in out.stderr, out.stderr
