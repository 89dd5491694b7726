"""Turning what the user typed after ``--model`` into a model file or folder, and reading its config.

Torch-free: the edge simulator reads model shapes through here without loading any weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig
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
        return ModelSource("gguf", path, path.stem)
    known = ", ".join(MODEL_FIXTURES)
    raise UserError(f"Unknown model {ref!r}: give one of {known}, a .gguf file or a Hugging Face model folder.")


def open_gguf(path: Path):
    """Open a GGUF file with the ``gguf`` reader, turning any parse failure into a :class:`UserError`."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct errors, IndexError… on damaged files
        raise UserError(f"{path} is not a readable GGUF file (truncated or corrupt: {exc}).") from None


def gguf_metadata(reader) -> dict:
    """All scalar, string and array metadata of an open GGUF file as plain Python values."""
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:  # a field kind this gguf version cannot decode: not one we need
            continue
    return meta


def read_config(source: ModelSource) -> ModelConfig:
    """The model's :class:`ModelConfig`, read from metadata only (no weights are touched)."""
    if source.kind == "hf":
        return ModelConfig.from_hf_folder(source.path)
    reader = open_gguf(source.path)
    return ModelConfig.from_gguf_metadata(gguf_metadata(reader), {t.name for t in reader.tensors})
