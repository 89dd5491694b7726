"""One call from a ``--model`` argument to a ready model and tokenizer."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..activations import check_activations, float_activations_chosen
from ..config import ModelConfig
from ..errors import ConfigError
from ..kernels.repack import TILED_TYPES
from ..linear import NATIVE, resolve_format
from ..model import Transformer
from .source import ModelSource, resolve_model
from .tokenizer import Tokenizer, load_tokenizer, stored_tokenizer_digest
from .weights import (
    gguf_native_types,
    load_gguf_native,
    load_model_tensors,
    load_state,
    save_model_tensors,
    weight_store_file,
)
from .weight_store import drop_prefetches, weight_store_root

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# Values accepted for ``weights`` (``bf16`` = ``dense``; ``auto`` = ``native`` for a GGUF file the native kernels
# read, else by role, see ``linear.auto_format``).
WEIGHT_CHOICES = ("auto", "native", "dense", "bf16", "int8", "int4")


@dataclass
class LoadedModel:
    """A model with its tokenizer and where it came from.

    ``weights`` is the concrete weight format (``native``, ``dense``, ``int8`` or ``int4``, after resolving ``auto``);
    ``from_cache`` tells whether the tensors came from the on-disk weight store.
    """

    name: str
    source: ModelSource
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer | None
    weights: str = "dense"
    from_cache: bool = False

    @property
    def activations(self) -> str:
        """What the weights multiply, ``float`` or ``int8`` (``--activations``; ``dense`` weights always ``float``)."""
        return "float" if self.model.lm_head.float_activations else "int8"


def load_model(
    ref: str,
    dtype: torch.dtype = torch.bfloat16,
    weights: str = "dense",
    tokenizer: bool = True,
    *,
    role: str = "target",
    weight_store: bool | str | Path = True,
    share_tokenizer: Tokenizer | None = None,
    activations: str = "auto",
) -> LoadedModel:
    """Resolve ``ref`` (fixture name, ``.gguf`` path or Hugging Face folder) and load weights and tokenizer.

    Args:
        ref: the model.
        dtype: compute dtype (``torch.bfloat16`` or ``torch.float32``).
        weights: ``native`` (a GGUF file's own blocks), ``dense`` (alias ``bf16``: weights in ``dtype``), ``int8``
            (Q8_0 blocks), ``int4`` (Q4_1 blocks) or ``auto`` (:func:`choose_format`).
        tokenizer: also load the tokenizer.
        role: ``"target"`` or ``"draft"``, for ``weights="auto"``.
        weight_store: the on-disk store of prepared models (``loading/weight_store.py``): ``True`` = default
            folder, ``False`` = off, or a folder. A hit skips reading the source's weights and building the model
            (for native weights: repacking the GGUF's blocks); a miss builds the model and stores it. The tokenizer
            is stored too (next to the tensors).
        share_tokenizer: another model's tokenizer, taken as this model's when their stored backends are the
            same (a draft's, whose chat template and special tokens are never used).
        activations: what quantized weights multiply: ``int8`` (activations quantized per block, the kernels'
            fastest path), ``float`` (as they are: the arithmetic of a float model with the file's weights), or
            ``auto`` (float for models of at most
            :data:`~sparsespec.activations.FLOAT_ACTIVATIONS_MAX_PARAMETERS` parameters). ``dense`` weights always
            multiply float activations.
    """
    from .. import kernels

    check_activations(activations)
    source = resolve_model(ref)
    root = weight_store_root(weight_store)
    # Float activations read the row layout; the automatic choice learns the model's size once it is loaded.
    tiles = kernels.tiles_preferred() and activations != "float"

    def stored(fmt: str):
        options = {"tiles": tiles} if fmt == NATIVE else {}
        file = None if root is None else weight_store_file(root, source, dtype, fmt, options)
        return file, (None if file is None else load_model_tensors(file, dtype, fmt))

    fmt, note, file, hit = NATIVE, None, None, None
    tried_native = weights in ("auto", NATIVE) and source.kind == "gguf"
    if tried_native:
        # A stored native build of this file means the kernels read all its weights: that is what choose_format
        # would find by reading the file's header (a third of a second for a 150k-token vocabulary).
        file, hit = stored(NATIVE)
    if hit is None:
        fmt, note = choose_format(source, weights, role, dtype)
        if not (tried_native and fmt == NATIVE):  # a native store found unusable above is not read again
            file, hit = stored(fmt)
    if hit is not None:
        config, model = hit
    else:
        if fmt == NATIVE and source.kind == "gguf":  # the file's own blocks, repacked
            config, state, linears = load_gguf_native(source.path, dtype, tiles)
            model = Transformer(config, state, dtype, fmt, linears=linears)
            del linears
        else:
            config, state = load_state(source)
            model = Transformer(config, state, dtype, fmt)
        del state
        release_freed_memory()
        if file is not None and not save_model_tensors(model, file, source):
            print(f"sparsespec: warning: could not store the built weights in {file.parent} (disk full or not "
                  "writable?); the next start builds them again.", file=sys.stderr)
        elif file is not None:
            # Run on the stored copy, as every later start does: its weights move into huge pages (huge_pages.py),
            # which decode faster than the built tensors' memory:
            # benchmarks/history/decode.md#weights-in-huge-pages-native-decoding-10-20-faster-2026-12-05-evening
            stored = load_model_tensors(file, dtype, fmt)
            if stored is not None:
                config, model = stored
                release_freed_memory()
    if file is not None:
        drop_prefetches(file.parent)  # a background mapping of this model the load did not take
    if float_activations_chosen(activations, model.projection_parameters()):
        if any(kind in TILED_TYPES.values() for _, linear in model.linear_items() for kind in linear.types):
            # the same file in the row layout, which float activations read
            return load_model(ref, dtype, weights, tokenizer, role=role, weight_store=weight_store,
                              share_tokenizer=share_tokenizer, activations="float")
        for _, linear in model.linear_items():
            linear.float_activations = True
    tok = None
    if tokenizer:
        tok = _stored_tokenizer(source, None if file is None else file.parent / "tokenizer", share_tokenizer)
    if note:  # said once the model loaded, so that a file that fails to load gets its one error line only
        print(f"sparsespec: note: {note}", file=sys.stderr)
    return LoadedModel(source.name, source, config, model, tok, fmt, hit is not None)


def prepare_model(ref: str) -> bool:
    """Build and store what ``generate``'s defaults load for ``ref`` (bfloat16, ``--weights auto``: for a GGUF file
    the native kernels read, its blocks repacked for this CPU; and its tokenizer), unless they are stored already.
    True when they were built now."""
    return not load_model(ref, torch.bfloat16, "auto").from_cache


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; a no-op elsewhere).

    Repacking a GGUF file's blocks frees tens of MB of numpy temporaries in pieces that glibc keeps in its heap,
    so the process's resident memory would stay that much above what the model holds.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def choose_format(source: ModelSource, weights: str, role: str,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[str, str | None]:
    """The concrete weight format for a requested one, and a note for the user when ``auto`` re-quantizes a GGUF file
    whose block types the native kernels do not read (else None).

    ``auto`` picks ``native`` for a GGUF file whose every weight the kernels read; for a Hugging Face folder, or a
    file of other block types, ``dense`` in float32 (which is for exactness) and in bfloat16 the quantized format
    of ``role`` (:func:`~sparsespec.linear.auto_format`). An explicit ``native`` quantizes a Hugging Face folder to
    Q8_0 blocks and is a :class:`UserError` for a GGUF file of block types the kernels do not read.
    """
    if weights not in ("auto", NATIVE):
        return resolve_format(weights, role), None
    quantized = "dense" if dtype == torch.float32 else resolve_format("auto", role)
    if source.kind != "gguf":  # a Hugging Face folder: native only when asked (its weights quantized to Q8_0)
        return (NATIVE if weights == NATIVE else quantized), None
    unreadable = ", ".join(sorted(gguf_native_types(source.path)))
    if unreadable:
        if weights == NATIVE:
            raise ConfigError("{path} has weights in {unreadable}, which the native kernels do not read; use "
                              "{weights} int8, int4 or dense.", path=source.path, unreadable=unreadable)
        return quantized, (f"{Path(source.path).name} has weights in {unreadable}, which the native kernels do not "
                           f"read; running them re-quantized as {quantized}.")
    return NATIVE, None


def _stored_tokenizer(source: ModelSource, folder: Path | None, share: Tokenizer | None = None) -> Tokenizer:
    """The tokenizer, read from ``folder`` when stored there, else built with ``transformers`` and stored; or
    ``share`` itself when the stored backend is the same (the same ids for the same text; for a draft, which
    reads ids only, so that the pair holds one tokenizer, ~90 MB for 150k tokens, not two).

    Building one imports ``transformers`` and, for a GGUF file, parses the whole file (seconds for a 150k-token
    vocabulary); the stored copy loads in a third of a second without ``transformers`` (150k tokens; ~90 MB).
    """
    if folder is None:
        return load_tokenizer(source)
    if share is not None and share.digest is not None and stored_tokenizer_digest(folder) == share.digest:
        return share
    if (folder / "tokenizer.json").is_file():
        try:
            return Tokenizer.from_folder(folder)
        except Exception:  # unreadable or from an older version: rebuild it below
            pass
    tok = load_tokenizer(source)
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except Exception:  # storing is best effort (e.g. a full disk)
        shutil.rmtree(tmp, ignore_errors=True)
    return tok
