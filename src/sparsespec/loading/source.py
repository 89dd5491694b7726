"""Turning what the user typed after ``--model`` into a model file or folder, and reading its config.

Torch-free: the edge simulator reads model shapes through here without loading any weights.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..config import GGUF_ROPE_FREQS, ModelConfig
from ..errors import UserError
from .fixtures import MODEL_FIXTURES


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: ``kind`` is ``"gguf"`` (a single file) or ``"hf"`` (a Hugging Face folder)."""

    kind: str
    path: Path
    name: str


def resolve_model(ref: str) -> ModelSource:
    """Resolve a fixture name, a ``.gguf`` path or a Hugging Face folder; raise :class:`UserError` if none fits."""
    if ref in MODEL_FIXTURES:
        fixture = MODEL_FIXTURES[ref]
        if not fixture.path.is_file():
            raise UserError(f"Model {ref!r} is not fetched yet; run `sparsespec fetch {ref}` first.")
        check_gguf_readable(fixture.path)
        return ModelSource("gguf", fixture.path, ref)
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} is a folder without config.json, so it is not a Hugging Face model folder.")
        if not any(path.glob("*.safetensors")):
            raise UserError(f"{path} holds no *.safetensors weights.")
        return ModelSource("hf", path, path.name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"GGUF file {path} does not exist.")
        check_gguf_readable(path)
        return ModelSource("gguf", path, path.stem)
    known = ", ".join(MODEL_FIXTURES)
    raise UserError(f"Unknown model {ref!r}: give one of {known}, a .gguf file or a Hugging Face model folder.")


def check_gguf_readable(path: Path) -> None:
    """Raise :class:`UserError` unless ``path`` can be opened and starts with GGUF's magic number: checked on every
    resolution, so a model whose prepared weights are stored still needs its file (no other read of it may come)."""
    try:
        with open(path, "rb") as file:
            magic = file.read(4)
    except OSError as exc:
        raise UserError(f"GGUF file {path} cannot be read ({exc.strerror or exc}).") from None
    if magic != b"GGUF":
        raise UserError(f"{path} is not a readable GGUF file (it does not start with GGUF's magic number).")


def open_gguf(path: Path):
    """Open a GGUF file with the ``gguf`` reader, turning any parse failure into a :class:`UserError`."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct errors, IndexError… on damaged files
        raise UserError(f"{path} is not a readable GGUF file (truncated or corrupt: {exc}).") from None


@dataclass(frozen=True)
class SkippedArray:
    """A GGUF metadata array read for its length only (the vocabulary, the merges …)."""

    length: int

    def __len__(self) -> int:
        return self.length


# GGUF metadata value types: fixed-size scalars by struct format, then string and array.
_GGUF_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                        12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor of a GGUF file lies: GGUF dimension order (innermost first), GGML type id, byte offset of
    its data from the start of the file."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


def read_gguf_header(path: Path) -> tuple[dict, set[str]]:
    """Scalar and string metadata and the tensor names of a GGUF file (versions 2 and 3), from its header alone:
    every GGUF config (loading, ``simulate``, ``ppl``'s checks) is built from this.

    Arrays stand as :class:`SkippedArray` of their length: walking past a 150k-entry vocabulary takes a fraction of a
    second, where the ``gguf`` reader, which builds an object for every element, takes seconds.
    """
    metadata, tensors = read_gguf_tensor_table(path)
    return metadata, set(tensors)


def read_gguf_tensor_table(path: Path) -> tuple[dict, dict[str, GGUFTensorInfo]]:
    """Metadata (as :func:`read_gguf_header`) and every tensor's :class:`GGUFTensorInfo`, from the header alone."""
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _GGUFHeader(data).read()
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:  # an empty file fails mmap (ValueError)
        raise UserError(f"{path} is not a readable GGUF file (truncated or corrupt: {exc}).") from None


class _GGUFHeader:
    """A cursor over the bytes of a GGUF header; every read past the end raises ``struct.error``."""

    def __init__(self, data) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        if self.pos + length > len(self.data):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self.data[self.pos: self.pos + length]).decode("utf-8")
        self.pos += length
        return text

    def value(self, kind: int):
        if kind in _GGUF_SCALAR_FORMATS:
            return self.take(_GGUF_SCALAR_FORMATS[kind])
        if kind == _GGUF_STRING:
            return self.string()
        if kind != _GGUF_ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        element, count = self.take("<I"), self.take("<Q")
        # Each element takes at least this many bytes, so a count the rest of the file cannot hold is refused before
        # anything walks it (a string: its length field; an array: its type and count).
        least = struct.calcsize(_GGUF_SCALAR_FORMATS[element]) if element in _GGUF_SCALAR_FORMATS else 12
        if element not in _GGUF_SCALAR_FORMATS and element not in (_GGUF_STRING, _GGUF_ARRAY):
            raise ValueError(f"unknown metadata array type {element}")
        self.fits(count, 8 if element == _GGUF_STRING else least, "array elements")
        if element in _GGUF_SCALAR_FORMATS:
            self.pos += count * least
        else:  # strings or nested arrays: each element says its own length
            for _ in range(count):
                self.skip(element)
        return SkippedArray(count)

    def fits(self, count: int, least_bytes: int, what: str) -> None:
        """Raise ``ValueError`` when ``count`` items of at least ``least_bytes`` each cannot fit in the bytes left."""
        left = len(self.data) - self.pos
        if count * least_bytes > left:
            raise ValueError(f"it declares {count} {what}, more than its remaining {left} bytes can hold")

    def skip(self, kind: int) -> None:
        if kind == _GGUF_STRING:
            length = self.take("<Q")  # advances past the length field first
            self.pos += length
        else:
            self.value(kind)

    def read(self) -> tuple[dict, dict[str, GGUFTensorInfo]]:
        if bytes(self.data[:4]) != b"GGUF":
            raise ValueError("no GGUF magic number")
        self.pos = 4
        version = self.take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_metadata = self.take("<Q"), self.take("<Q")
        self.fits(n_tensors, 24, "tensors")  # name length, dimension count, type and offset
        self.fits(n_metadata, 13, "metadata entries")  # key length, value type, a one-byte value
        metadata = {}
        for _ in range(n_metadata):
            key = self.string()
            if key in metadata:
                raise ValueError(f"the metadata key {key} appears twice")
            metadata[key] = self.value(self.take("<I"))
        table = []
        names = set()
        for _ in range(n_tensors):
            name = self.string()
            if name in names:
                raise ValueError(f"the tensor name {name} appears twice")
            names.add(name)
            n_dims = self.take("<I")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise ValueError(f"tensor {name} has {n_dims} dimensions (GGUF allows 1 to {GGML_MAX_DIMS})")
            dims = tuple(self.take("<Q") for _ in range(n_dims))
            table.append((name, dims, self.take("<I"), self.take("<Q")))
        if self.pos > len(self.data):
            raise ValueError("the tensor table runs past the end of the file")
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 8 or alignment % 8:
            raise ValueError(f"general.alignment is {alignment!r}, not a positive multiple of 8")
        start = -(-self.pos // alignment) * alignment
        tensors = {name: GGUFTensorInfo(name, dims, kind, start + offset) for name, dims, kind, offset in table}
        _check_tensor_data(tensors, start, alignment, len(self.data))
        return metadata, tensors


# GGML's most dimensions a tensor may have.
GGML_MAX_DIMS = 4


def tensor_nbytes(info: GGUFTensorInfo) -> int | None:
    """Bytes of a tensor's data by its GGML type's block size and bytes (None for a type the ``gguf`` package does not
    know); raises ``ValueError`` when its rows are not whole blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    except (KeyError, ValueError):
        return None
    if info.dims[0] % block:
        raise ValueError(f"tensor {info.name}'s rows of {info.dims[0]} values are not whole blocks of {block}")
    elements = 1
    for d in info.dims:
        elements *= d
    return elements // block * block_bytes


def _check_tensor_data(tensors: dict[str, GGUFTensorInfo], start: int, alignment: int, file_size: int) -> None:
    """Raise ``ValueError`` unless every tensor's data starts aligned, lies inside the file and overlaps no other
    tensor's (by the sizes their types and shapes give). Tensors of a type the ``gguf`` package does not know are
    only checked for alignment: the loaders refuse them by name."""
    spans = []
    for info in tensors.values():
        if (info.offset - start) % alignment:
            raise ValueError(f"tensor {info.name}'s data is not aligned to {alignment} bytes")
        nbytes = tensor_nbytes(info)
        if nbytes is None:
            continue
        if info.offset + nbytes > file_size:
            raise ValueError(f"tensor {info.name}'s data runs past the end of the file")
        spans.append((info.offset, info.offset + nbytes, info.name))
    spans.sort()
    for (_, end, name), (begin, _, following) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"tensors {name} and {following} overlap")


def read_gguf_tensor_storage(path: Path) -> dict[str, tuple[str, int]]:
    """Each tensor of a GGUF file as stored: its GGML type's name (``Q4_K``) and its bytes (by the type's block size
    and bytes), from the header alone."""
    from gguf import GGMLQuantizationType

    _, tensors = read_gguf_tensor_table(path)
    sizes = {}
    for name, t in tensors.items():
        nbytes = tensor_nbytes(t)
        if nbytes is None:
            raise UserError(f"{path}: tensor {name} has an unknown type {t.ggml_type}.")
        sizes[name] = (GGMLQuantizationType(t.ggml_type).name, nbytes)
    return sizes


def read_gguf_config(path: Path, table: tuple[dict, dict[str, GGUFTensorInfo]] | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file: its header (``table``: :func:`read_gguf_tensor_table`'s, if read
    already) and the values of its ``rope_freqs.weight``, the one tensor that is part of the config."""
    metadata, tensors = table or read_gguf_tensor_table(path)
    _check_counts(path, metadata, tensors)
    info = tensors.get(GGUF_ROPE_FREQS)
    rope_freqs = _read_float_vector(path, info) if info else ()
    try:
        return ModelConfig.from_gguf_metadata(metadata, set(tensors), rope_freqs)
    except (TypeError, ValueError, OverflowError) as exc:  # a metadata value of the wrong type (a string for a count)
        raise UserError(f"{path} has a metadata value of the wrong type ({exc}).") from None


def _check_counts(path: Path, metadata: dict, tensors: dict[str, GGUFTensorInfo]) -> None:
    """Raise :class:`UserError` when the header's layer count or vocabulary size disagrees with the tensors the file
    holds, before anything is sized by them (a layer count of 2³¹ would otherwise be allocated for)."""
    arch = metadata.get("general.architecture")
    layers = metadata.get(f"{arch}.block_count")
    if isinstance(layers, int):
        held = {name.split(".", 2)[1] for name in tensors if name.startswith("blk.") and name.count(".") >= 2}
        if layers != len(held) or held != {str(i) for i in range(layers)}:
            raise UserError(f"{path} declares {layers} layers ({arch}.block_count) but holds the tensors of "
                            f"{len(held)}; the file is damaged.")
    vocab = metadata.get(f"{arch}.vocab_size", metadata.get("tokenizer.ggml.tokens"))
    vocab = len(vocab) if isinstance(vocab, SkippedArray) else vocab
    embedding = tensors.get("token_embd.weight")
    if isinstance(vocab, int) and embedding is not None and len(embedding.dims) == 2 and embedding.dims[1] != vocab:
        raise UserError(f"{path} declares a vocabulary of {vocab} tokens but its embedding has {embedding.dims[1]} "
                        "rows; the file is damaged.")


def _read_float_vector(path: Path, info: GGUFTensorInfo) -> tuple[float, ...]:
    """The values of a 1-D float32 or float16 tensor of a GGUF file."""
    formats = {0: "f", 1: "e"}  # GGML types F32, F16
    if info.ggml_type not in formats or len(info.dims) != 1:
        raise UserError(f"{path}: {info.name} is not a float vector.")
    fmt = f"<{info.dims[0]}{formats[info.ggml_type]}"
    try:
        with open(path, "rb") as file:
            file.seek(info.offset)
            return struct.unpack(fmt, file.read(struct.calcsize(fmt)))
    except (OSError, struct.error):
        raise UserError(f"{path} is truncated: tensor {info.name} runs past the end of the file.") from None


def read_config(source: ModelSource) -> ModelConfig:
    """The model's :class:`ModelConfig`, read from metadata only (no weights are touched)."""
    if source.kind == "hf":
        return ModelConfig.from_hf_folder(source.path)
    return read_gguf_config(source.path)
