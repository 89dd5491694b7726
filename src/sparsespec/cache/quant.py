"""Storage formats of the KV arena's keys and values: the compute dtype, bfloat16, or int8 / int4 codes.

A stored key (or value) is one head vector ``[head_dim]``. The integer formats split it into groups of
:func:`group_size` consecutive channels (int8: 32, int4: 16; the whole vector when ``head_dim`` is smaller) and
store, per group, an asymmetric min-max code: ``x ≈ code · scale + zero`` with ``code`` in ``[0, 2^bits - 1]`` and
``scale`` and ``zero`` (the group's minimum) in float16. In float32: ``scale = float16(max((max - min) / (2^bits -
1), MIN_SCALE))``, ``zero = float16(min)``, ``code = clamp(round_half_even((x - zero) / scale), 0, 2^bits - 1)``; read
back as ``fma(code, scale, zero)``. The native code writes and reads them (``kernels/csrc/attention.h``:
``quantize_row``, ``dequantize_row_scalar``; the arena's entries and the cold tier's pages alike), and
``tests/test_kv_quant.py`` holds a reference of the definition that it is checked against bit for bit::

    codes    [..., head_dim]          uint8   int8: one code per byte
             [..., head_dim // 2]     uint8   int4: channel c in the low nibble of byte c, channel c + head_dim/2
                                              in the high nibble
    params   [..., head_dim // group, 2]  float16   (scale, zero) per group

Why per-token groups for keys as well as values (KIVI quantizes keys per channel, across tokens): every slot is then
self-contained — a key's codes depend on that key alone — so the arena's eviction, compaction, commit and rollback
remain moves of single slots, and a token's stored key is the same whether it was written in a prefill chunk, a
decode step or a verification block (which speculative decoding's exactness needs). Per-channel scales would be
shared by a group of tokens that eviction breaks up. The price of per-token keys is the outlier channels of keys,
which widen a group's range; groups of 32 channels keep int8's error small, and int4 needs groups of 16. Hence
int8 groups of 32 and int4 groups of 16. Measured:
benchmarks/history/source-notes.md#quant-group-sizes

Keys can be stored minus a fixed offset per layer, head and channel (the native arena's ``key_offset``, the model's
key bias): ``x - offset`` is quantized and the offset added back when the entry is read. Qwen2's key
bias reaches ±354 in a few channels of layer 0 (±111 in layer 1, at most ±13 in layers 2, 10 and 27), and every key
carries it, so a group holding one such channel has a step of ``r / 255`` ≈ 2.8 for all its channels; without the
bias the keys' ranges are those of the tokens themselves: taking it out makes int8 keys as good as bfloat16 ones,
and int4 keys usable at all. Measured:
benchmarks/history/source-notes.md#quant-key-bias
and benchmarks/history/kv-cache.md#quantized-keys-stored-without-the-key-bias-2026-12-01

int4 arenas keep their 32 most recent positions in full precision as well (``RECENT_WINDOW``; the arena's ring,
``arena.py``): the most recent entries are the ones attention weighs most, and 4 bits cost there; at equal bytes,
the ring's included, the window lowers int4's perplexity. int8 entries cost nothing against bfloat16 at equal
entries, so they have none by default. Measured:
benchmarks/history/kv-cache.md#the-full-precision-window-built-int4s-newest-positions-in-the-arena-and-the-native-op-2026-12-03

Round-trip bound (tested): for a group with minimum ``m`` and range ``r``, an entry read back differs from ``x`` by
at most ``s/2 + 2^-11·(r + |m|)`` where ``s = max(r / (2^bits - 1), 2^-14)`` is the float16 scale: half a step, plus
the rounding of scale and zero to float16 (the floor ``2^-14``, float16's smallest normal number, keeps constant
groups well defined).
"""

from __future__ import annotations

import torch

from ..errors import UserError

KV_DTYPES = ("auto", "bf16", "int8", "int4")  # auto: the model's compute dtype
BITS = {"int8": 8, "int4": 4}
GROUP = {8: 32, 4: 16}  # channels per quantization group, by bits
PARAM_BYTES = 4  # float16 scale + float16 zero per group
MIN_SCALE = 2.0**-14
RECENT_WINDOW = {"int4": 32}  # positions also kept in the compute dtype, by kv_dtype (others: none)


def recent_window_for(kv_dtype: str, asked: int | None = None) -> int:
    """Positions of ``kv_dtype`` entries also kept in full precision: ``asked``, or the dtype's default."""
    return RECENT_WINDOW.get(kv_dtype, 0) if asked is None else asked


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise UserError(f"Unknown KV cache dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}.")
    return kv_dtype


def group_size(head_dim: int, bits: int) -> int:
    """Channels per quantization group of ``bits``-bit codes for vectors of ``head_dim`` channels."""
    group = min(GROUP[bits], head_dim)
    if head_dim % group or (head_dim % 2):
        raise UserError(f"KV quantization needs an even head_dim divisible by {group} (got {head_dim}).")
    return group


def storage_dtype(kv_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the stored tensor: the compute dtype, bfloat16, or uint8 codes."""
    check_kv_dtype(kv_dtype)
    return {"auto": compute_dtype, "bf16": torch.bfloat16}.get(kv_dtype, torch.uint8)


def bytes_per_vector(kv_dtype: str, head_dim: int, compute_dtype: torch.dtype) -> int:
    """Stored bytes of one key (or one value) head vector, codes plus scales and zeros."""
    if kv_dtype not in BITS:
        return head_dim * torch.tensor([], dtype=storage_dtype(kv_dtype, compute_dtype)).element_size()
    bits = BITS[kv_dtype]
    return head_dim * bits // 8 + head_dim // group_size(head_dim, bits) * PARAM_BYTES
