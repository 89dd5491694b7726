"""GGUF blocks -> the kernels' chunk layout, losslessly (the layout is described in ``csrc/qmatmul.h``).

A GGUF tensor ``[n, k]`` of a block type stores each row as blocks (32 weights for Q4_0 / Q4_1 / Q5_0 / Q5_1 /
Q8_0, 256 for the K-quants). The kernels read each row as chunks of 256 weights: the chunk's scales first, in a
form the vector units load at once (the K-quants' packed 6-bit scales spread to bytes; the per-block fp16 scales of
the 32-weight formats side by side), then 64-code quarters with the codes' low nibbles together and their high bits
as bit planes. Every code and scale keeps its value: dequantizing the repacked weight gives exactly the GGUF's own
dequantized weight. Bytes per weight equal the file's, but for two small additions of a few percent: the
K-quants' spread scales (4 bytes per 256 weights) and a full-size scale section in a row's last, partial chunk
(in rows whose width is not a multiple of 256). Figures: benchmarks/history/source-notes.md#repack-overhead

Float tensors (F32, F16, BF16) keep each row as it is, zero padded to a multiple of 16 weights.
"""

from __future__ import annotations

import numpy as np

# GGML type id -> (name, weights per block, bytes per block).
BLOCK_TYPES = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
# GGML type id -> (name, bytes per weight) of the float types: rows kept as they are, zero padded to whole 16s.
FLOAT_GROUP = 16
FLOAT_TYPES = {0: ("F32", 4), 1: ("F16", 2), 30: ("BF16", 2)}
CHUNK, QUARTER = 256, 64
# Bumped whenever the bytes this module writes change, so that stored repacked weights (the weight store) are rebuilt.
LAYOUT_VERSION = 1


def supported(ggml_type: int) -> bool:
    return int(ggml_type) in BLOCK_TYPES or int(ggml_type) in FLOAT_TYPES


def _f16_bytes(raw: np.ndarray) -> np.ndarray:
    """``[..., 2]`` uint8 -> the same bytes (fp16 values are kept bit for bit)."""
    return np.ascontiguousarray(raw)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF 32-weight nibble blocks ``[..., 16]`` -> codes ``[..., 32]`` (low nibbles first, then high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bit field bytes ``[..., count / 8]`` -> ``[..., count]`` of 0 / 1."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K packed 6-bit scales ``[..., 12]`` -> (sc ``[..., 8]``, min ``[..., 8]``) as uint8."""
    q = scales.astype(np.uint8)
    sc = np.empty(q.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = q[..., 0:4] & 63
    mn[..., :4] = q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return sc, mn


def _decode(ggml_type: int, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks ``[n, nb, bytes]`` -> (codes ``[n, nb * block]`` uint8, scale sections ``[n, chunks, bytes]``)."""
    name, size, _ = BLOCK_TYPES[ggml_type]
    n, nb, _ = blocks.shape
    if size == 32:
        per_chunk = CHUNK // 32
        chunks = -(-nb // per_chunk)
        pad = chunks * per_chunk - nb

        def per_block_f16(raw):  # [n, nb, 2] -> [n, chunks, 16], zero scales for missing blocks
            raw = np.pad(raw, ((0, 0), (0, pad), (0, 0)))
            return raw.reshape(n, chunks, per_chunk * 2)

        d = blocks[..., 0:2]
        if name == "Q4_0":
            codes = _nibbles(blocks[..., 2:18])
            scales = per_block_f16(d)
        elif name == "Q4_1":
            codes = _nibbles(blocks[..., 4:20])
            scales = np.concatenate([per_block_f16(d), per_block_f16(blocks[..., 2:4])], axis=-1)
        elif name in ("Q5_0", "Q5_1"):
            at = 2 if name == "Q5_0" else 4
            high = _bits(blocks[..., at : at + 4], 32)
            codes = _nibbles(blocks[..., at + 4 : at + 20]) | (high << 4)
            scales = per_block_f16(d)
            if name == "Q5_1":
                scales = np.concatenate([scales, per_block_f16(blocks[..., 2:4])], axis=-1)
        else:  # Q8_0: signed bytes
            codes = blocks[..., 2:34].copy()
            scales = per_block_f16(d)
        return codes.reshape(n, nb * 32), np.ascontiguousarray(scales)

    if name == "Q4_K" or name == "Q5_K":
        d, dmin, packed = blocks[..., 0:2], blocks[..., 2:4], blocks[..., 4:16]
        sc, mn = _k_scales(packed)
        qs = blocks[..., 16:144] if name == "Q4_K" else blocks[..., 48:176]
        qs = qs.reshape(n, nb, 4, 32)
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [n, nb, 4, 64]: a 64-run per group of 32 bytes
        if name == "Q5_K":
            qh = blocks[..., 16:48]  # bit 2j of qh[l]: code l of group j; bit 2j + 1: code 32 + l
            bits = np.unpackbits(qh[..., None], axis=-1, bitorder="little")  # [n, nb, 32, 8]
            high = np.concatenate([bits[..., 0::2].transpose(0, 1, 3, 2), bits[..., 1::2].transpose(0, 1, 3, 2)],
                                  axis=-1)  # [n, nb, 4, 64]
            codes = codes | (high << 4)
        scales = np.concatenate([d, dmin, sc, mn], axis=-1)
        return codes.reshape(n, nb * 256), np.ascontiguousarray(scales)

    # Q6_K: ql[128], qh[64], scales[16] (int8), d
    ql = blocks[..., 0:128].reshape(n, nb, 2, 64)
    qh = blocks[..., 128:192].reshape(n, nb, 2, 32)
    low = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    codes = (low | (high << 4)).reshape(n, nb * 256)
    scales = np.concatenate([blocks[..., 208:210], blocks[..., 192:208]], axis=-1)
    return codes, np.ascontiguousarray(scales)


def _quarters(ggml_type: int, codes: np.ndarray) -> np.ndarray:
    """Codes ``[n, k]`` (k a multiple of 64) -> quarter bytes ``[n, k / 64, quarter_bytes]``."""
    n, k = codes.shape
    q = codes.reshape(n, k // QUARTER, QUARTER)
    if BLOCK_TYPES[ggml_type][0] == "Q8_0":
        return q
    parts = [(q[..., :32] & 0x0F) | ((q[..., 32:] & 0x0F) << 4)]
    bits = {"Q5_0": 1, "Q5_1": 1, "Q5_K": 1, "Q6_K": 2}.get(BLOCK_TYPES[ggml_type][0], 0)
    for plane in range(bits):
        parts.append(np.packbits((q >> (4 + plane)) & 1, axis=-1, bitorder="little"))
    return np.concatenate(parts, axis=-1)


def repack(ggml_type: int, raw: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """A GGUF tensor's raw bytes ``[n, row bytes]`` -> (repacked bytes ``[n, repacked row bytes]``, padded k).

    ``k`` is the number of weights per row; rows of the 32-weight formats with ``k`` not a multiple of 64 get one
    zero block (zero scale), which the padded activations meet with zeros.
    """
    ggml_type = int(ggml_type)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    if ggml_type in FLOAT_TYPES:
        name, width = FLOAT_TYPES[ggml_type]
        if raw.size != n * k * width:
            raise ValueError(f"{name} tensor of {raw.size} bytes does not hold {n} rows of {k} weights")
        k_padded = -(-k // FLOAT_GROUP) * FLOAT_GROUP
        rows = np.zeros((n, k_padded * width), np.uint8)
        rows[:, : k * width] = raw.reshape(n, -1)
        return rows, k_padded
    name, size, block_bytes = BLOCK_TYPES[ggml_type]
    nb = k // size
    if k % size or raw.size != n * nb * block_bytes:
        raise ValueError(f"{name} tensor of {raw.size} bytes does not hold {n} rows of {k} weights")
    blocks = raw.reshape(n, nb, block_bytes)
    if size == 32 and nb % 2:
        blocks = np.concatenate([blocks, np.zeros((n, 1, block_bytes), np.uint8)], axis=1)
        nb += 1
    k_padded = nb * size
    codes, scales = _decode(ggml_type, blocks)
    quarters = _quarters(ggml_type, codes)  # [n, k / 64, qb]
    full, rest = divmod(k_padded // QUARTER, 4)
    parts = []
    if full:
        body = quarters[:, : 4 * full].reshape(n, full, -1)
        parts.append(np.concatenate([scales[:, :full], body], axis=-1).reshape(n, -1))
    if rest:
        parts.append(scales[:, full])
        parts.append(quarters[:, 4 * full :].reshape(n, -1))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1)), k_padded


# GGML type -> the kernel type of its column-tile layout (``csrc/qmatmul.h``): 16 output rows side by side per
# chunk of inputs (256 for the K-quants, one block of 32 for Q5_0), so a pass of several activation rows multiplies
# each unpacked vector of codes for 16 columns.
TILED_TYPES = {12: 112, 14: 114, 6: 106}  # Q4_K, Q6_K, Q5_0
TILE = 16


def _pairs(low: np.ndarray) -> np.ndarray:
    """Codes ``[t, chunks, 16, span]`` below 16 -> ``[t, chunks, span * 8]``: pair j of 64 bytes holds inputs
    8j + b (low nibble) and 8j + 4 + b (high nibble) of column c at byte 4c + b."""
    t, chunks, _, span = low.shape
    q = low.reshape(t, chunks, TILE, span // 8, 2, 4)  # [.., column, pair j, half, b]: input 8j + 4 half + b
    packed = q[..., 0, :] | (q[..., 1, :] << 4)  # [.., column, j, b]
    return packed.transpose(0, 1, 3, 2, 4).reshape(t, chunks, -1)  # pair j, byte 4c + b


def repack_tiles(ggml_type: int, raw: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """A Q4_K, Q6_K or Q5_0 tensor's raw bytes ``[n, row bytes]`` -> (its column tiles ``[ceil(n / 16), tile
    bytes]``, padded k), losslessly: each code and scale keeps its value. The last tile is zero padded; Q5_0 rows of
    an odd number of blocks get one zero block, as in the row layout (the kernels take k in whole 64s)."""
    ggml_type = int(ggml_type)
    name, size, block_bytes = BLOCK_TYPES[ggml_type]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.shape[0]
    nb = k // size
    if ggml_type not in TILED_TYPES or k % size or raw.size != n * nb * block_bytes:
        raise ValueError(f"{name} tensor of {raw.size} bytes does not hold {n} rows of {k} weights in tiles")
    tiles = -(-n // TILE)
    padded_nb = nb + (nb % 2 if size == 32 else 0)
    blocks = np.zeros((tiles * TILE, padded_nb, block_bytes), np.uint8)
    blocks[:n, :nb] = raw.reshape(n, nb, block_bytes)
    nb = padded_nb

    def by_tile(field: np.ndarray) -> np.ndarray:  # [n', nb, ...] -> [t, nb, 16, ...]
        return field.reshape(tiles, TILE, nb, *field.shape[2:]).swapaxes(1, 2)

    def by_column(field: np.ndarray) -> np.ndarray:  # [t, nb, 16, f] -> [t, nb, f * 16]: field row j, column c
        return field.transpose(0, 1, 3, 2).reshape(tiles, nb, -1)

    if name == "Q5_0":
        codes = by_tile(_nibbles(blocks[..., 6:22]) | (_bits(blocks[..., 2:6], 32) << 4))  # [t, nb, 16, 32]
        high = (codes >> 4).reshape(tiles, nb, TILE, 8, 4).swapaxes(-1, -2)  # [.., column, b, v]: input 4v + b
        bits = np.packbits(high, axis=-1, bitorder="little").reshape(tiles, nb, -1)  # byte 4c + b, bit v
        parts = [by_tile(blocks[..., 0:2]).reshape(tiles, nb, -1), _pairs(codes & 0x0F), bits]
        return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(tiles, -1)), nb * size

    codes, scales = _decode(ggml_type, blocks)  # [n', k], [n', nb, scale bytes]
    codes = by_tile(codes.reshape(-1, nb, CHUNK))  # [tile, chunk, column, 256]
    scales = by_tile(scales)
    if name == "Q4_K":
        parts = [scales[..., 0:2].reshape(tiles, nb, -1), scales[..., 2:4].reshape(tiles, nb, -1),
                 by_column(scales[..., 4:12]), by_column(scales[..., 12:20]), _pairs(codes)]
    else:  # Q6_K
        high = (codes >> 4).reshape(tiles, nb, TILE, 16, 4, 4)  # [.., column, group g, i, b]: input 16g + 4i + b
        bits = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
        bits = bits.transpose(0, 1, 3, 2, 4).reshape(tiles, nb, 16, 64)  # [.., g, 4c + b]
        low = _pairs(codes & 0x0F).reshape(tiles, nb, 16, 128)  # [.., g, pairs 2g and 2g + 1]
        groups = np.concatenate([low, bits], axis=-1).reshape(tiles, nb, -1)  # per group: 128 + 64 bytes
        parts = [scales[..., 0:2].reshape(tiles, nb, -1), by_column(scales[..., 2:18]), groups]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(tiles, -1)), k


def pack(ggml_type: int, raw: np.ndarray, k: int, tiles: bool) -> tuple[int, np.ndarray, int]:
    """(kernel type, repacked bytes, padded k) of a GGUF tensor: column tiles where ``tiles`` and the type has
    them (Q4_K, Q6_K, Q5_0), else the row layout of :func:`repack`."""
    if tiles and int(ggml_type) in TILED_TYPES:
        packed, padded_k = repack_tiles(ggml_type, raw, k)
        return TILED_TYPES[int(ggml_type)], packed, padded_k
    packed, padded_k = repack(ggml_type, raw, k)
    return int(ggml_type), packed, padded_k
