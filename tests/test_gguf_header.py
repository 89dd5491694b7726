"""The GGUF header reader on malformed files: counts checked against the file's size before anything is allocated,
tensor data aligned, inside the file and never overlapping, names unique; each refusal one sentence.

The files are written byte by byte here (not with the ``gguf`` package, which would refuse to write most of them).
"""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest

from sparsespec.errors import UserError
from sparsespec.loading.source import read_gguf_config, read_gguf_tensor_table

F32 = 0  # GGML type ids
Q8_0 = 8
UINT32, STRING, ARRAY, UINT8 = 4, 8, 9, 0  # metadata value types


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: int, value) -> bytes:
    if kind == UINT32:
        return struct.pack("<I", value)
    if kind == STRING:
        return _string(value)
    raise AssertionError(kind)


def gguf_bytes(metadata: list[tuple[str, int, object]] = (), tensors: list[tuple[str, tuple[int, ...], int, int]] = (),
               data: bytes = b"", *, n_tensors: int | None = None, n_metadata: int | None = None,
               alignment: int = 32, raw_metadata: bytes = b"") -> bytes:
    """A GGUF version 3 file: ``metadata`` as (key, value type, value), then ``raw_metadata`` bytes as written,
    ``tensors`` as (name, dims innermost first, GGML type, offset from the data section), then ``data``. The counts
    written are the lists' lengths unless ``n_tensors`` / ``n_metadata`` say otherwise."""
    out = b"GGUF" + struct.pack("<I", 3)
    out += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors,
                       len(metadata) + bool(raw_metadata) if n_metadata is None else n_metadata)
    for key, kind, value in metadata:
        out += _string(key) + struct.pack("<I", kind) + _value(kind, value)
    out += raw_metadata
    for name, dims, kind, offset in tensors:
        out += _string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", kind, offset)
    out += b"\0" * (-len(out) % alignment)
    return out + data


def write(tmp_path, content: bytes):
    path = tmp_path / "probe.gguf"
    path.write_bytes(content)
    return path


def refused(path, *phrases: str) -> str:
    """The one-sentence refusal of ``path``'s header, checked to name each phrase."""
    with pytest.raises(UserError) as caught:
        read_gguf_config(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    for phrase in phrases:
        assert phrase in message, message
    return message


def two_f32_tensors(second_offset: int = 64, second_type: int = F32, second_name: str = "blk.0.attn_norm.weight"):
    """Two 16-value tensors, the first at offset 0 (64 bytes of float32)."""
    return [("token_embd.weight", (16,), F32, 0), (second_name, (16,), second_type, second_offset)]


def test_a_well_formed_file_reads(tmp_path):
    path = write(tmp_path, gguf_bytes([("general.architecture", STRING, "llama")], two_f32_tensors(), b"\0" * 128))
    metadata, tensors = read_gguf_tensor_table(path)
    assert metadata["general.architecture"] == "llama"
    assert [t.offset % 32 for t in tensors.values()] == [0, 0]


def test_a_layer_count_of_two_to_the_31_is_refused_with_bounded_memory(tmp_path):
    """A block_count that no tensor backs is refused from the header before anything is sized by it."""
    metadata = [("general.architecture", STRING, "llama"), ("llama.block_count", UINT32, 2**31 - 1)]
    path = write(tmp_path, gguf_bytes(metadata, two_f32_tensors(), b"\0" * 128))
    tracemalloc.start()
    try:
        refused(path, "declares 2147483647 layers", "holds the tensors of 1")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000


@pytest.mark.parametrize(("layout", "phrase"), [
    (dict(n_tensors=2**40), "declares 1099511627776 tensors"),
    (dict(n_metadata=2**50), "metadata entries"),
    (dict(raw_metadata=_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, UINT8, 2**60)),
     "array elements"),
    (dict(raw_metadata=_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 2**40)),
     "array elements"),
])
def test_counts_the_file_cannot_hold_are_refused(tmp_path, layout, phrase):
    path = write(tmp_path, gguf_bytes([("general.architecture", STRING, "llama")], two_f32_tensors(), b"\0" * 128,
                                      **layout))
    tracemalloc.start()
    try:
        refused(path, "not a readable GGUF file", phrase)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000


@pytest.mark.parametrize(("tensors", "phrase"), [
    (two_f32_tensors(second_offset=48), "not aligned to 32 bytes"),
    (two_f32_tensors(second_offset=32), "overlap"),
    (two_f32_tensors(second_offset=96), "runs past the end of the file"),
    # A type whose blocks take more bytes than the next tensor leaves: 64 values of Q8_0 are 68 bytes.
    ([("token_embd.weight", (64,), Q8_0, 0), ("blk.0.attn_norm.weight", (16,), F32, 64)], "overlap"),
    ([("token_embd.weight", (10,), Q8_0, 0)], "not whole blocks of 32"),
    (two_f32_tensors(second_name="token_embd.weight"), "appears twice"),
    ([("token_embd.weight", (1, 1, 1, 1, 16), F32, 0)], "has 5 dimensions"),
])
def test_tensor_data_must_be_aligned_inside_and_apart(tmp_path, tensors, phrase):
    path = write(tmp_path, gguf_bytes([("general.architecture", STRING, "llama")], tensors, b"\0" * 128))
    refused(path, "not a readable GGUF file", phrase)


def test_alignment_must_be_a_multiple_of_8(tmp_path):
    metadata = [("general.architecture", STRING, "llama"), ("general.alignment", UINT32, 12)]
    path = write(tmp_path, gguf_bytes(metadata, two_f32_tensors(), b"\0" * 128))
    refused(path, "general.alignment is 12")


def test_duplicate_metadata_keys_are_refused(tmp_path):
    metadata = [("general.architecture", STRING, "llama"), ("general.architecture", STRING, "qwen2")]
    refused(write(tmp_path, gguf_bytes(metadata, two_f32_tensors(), b"\0" * 128)), "appears twice")


def test_a_vocabulary_the_embedding_does_not_have_is_refused(tmp_path):
    metadata = [("general.architecture", STRING, "llama"), ("llama.block_count", UINT32, 1),
                ("llama.vocab_size", UINT32, 1000)]
    tensors = [("token_embd.weight", (8, 2), F32, 0), ("blk.0.attn_norm.weight", (8,), F32, 64)]
    refused(write(tmp_path, gguf_bytes(metadata, tensors, b"\0" * 128)), "vocabulary of 1000 tokens",
            "embedding has 2 rows")


def test_the_real_fixture_reads_and_its_damaged_copies_fail_in_one_line(tmp_path, smollm2_path):
    """The fixture's header passes every check; shifting one tensor's offset by 4 bytes, or doubling its type's
    width, is caught."""
    content = bytearray(smollm2_path.read_bytes()[:2_000_000])
    metadata, tensors = read_gguf_tensor_table(smollm2_path)
    assert len(tensors) == 272 and metadata["llama.block_count"] == 30
    name = b"blk.3.ffn_down.weight"
    at = content.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", content, at)[0]
    type_at = at + 4 + 8 * n_dims
    for field, value, phrase in ((type_at + 4, struct.unpack_from("<Q", content, type_at + 4)[0] + 4, "not aligned"),
                                 (type_at, F32, "overlap")):
        damaged = bytearray(content)
        struct.pack_into("<Q" if field != type_at else "<I", damaged, field, value)
        path = tmp_path / "damaged.gguf"
        path.write_bytes(bytes(damaged) + b"\0" * (smollm2_path.stat().st_size - len(damaged)))
        refused(path, phrase)


def test_random_headers_fail_in_one_line(tmp_path):
    """Random counts and bytes after the magic number and version: every outcome is a UserError."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        counts = struct.pack("<QQ", *(int(c) for c in rng.integers(0, [8, 8])))
        body = bytes(rng.integers(0, 256, int(rng.integers(0, 400)), np.uint8))
        path = write(tmp_path, b"GGUF" + struct.pack("<I", 3) + counts + body)
        with pytest.raises(UserError):
            read_gguf_config(path)
