"""The weight store: built models kept on disk, where their files live, and reading one, in the background if asked.

Opening a GGUF file is slow in pure Python (parsing the metadata of the 1.5B Qwen2.5 file alone takes a third of a
second), repacking its blocks for the native kernels takes seconds, and quantizing to int8 / int4 more. So after
a model is built its tensors are stored, exactly as the model holds them (repacked GGUF blocks, quantized or
float rows), in one safetensors file, its tokenizer beside it::

    <store root>/<source key>/<dtype>-<format>-<layout>.safetensors
    <store root>/<source key>/tokenizer/

with the model config and each layer's facts in the file's metadata. A later load of the same source, dtype and
format reads that file and builds nothing, so it holds exactly the same values as a build from the source
(``weights.py`` names the files, stores and rebuilds models; ``load.py`` reads the tokenizer).

* Root: ``cache_dir()/tensors`` (``$SPARSESPEC_HOME/tensors``); ``$SPARSESPEC_WEIGHT_STORE`` set to ``0`` /
  ``off`` / ``false`` turns the store off, set to a folder it moves it there.
* Source key (what invalidates a stored build): for a GGUF file with a fetch stamp (``<file>.sha256.json``, written by
  ``sparsespec fetch``) whose recorded size and mtime still match, its sha256: ``sha256-<hex>``. Any other GGUF
  file, and a Hugging Face folder (``config.json``, every ``*.safetensors`` and its tokenizer files), is keyed by a
  hash of resolved path, size and mtime (``stat-<hex>``), so replacing or touching the file makes a new key
  without hashing gigabytes on every start. Each key folder records its source in ``source.json``; whenever an
  entry is written, the folders of the same path's old keys and of paths that no longer exist are deleted.
* The layout in the file name, :func:`~sparsespec.linear.native_layout_tag` (the repacking's version, and whether
  blocks load as column tiles, which depends on the CPU), so a store moved to another machine is rebuilt rather
  than misread.
* Files are written to a temporary name and renamed into place, so a reader never sees a partial file; a file
  that cannot be read (truncated, or written by another store version) is ignored and rebuilt. Failing to write
  (e.g. a full disk) only skips storing.

A stored file is memory-mapped, not read: the model runs on the page cache's pages from the start, and a background
thread moves them into anonymous huge pages at the same addresses when the command lets it (``huge_pages.py``, which
says why, what each costs and who holds the move). :func:`prefetch_stored_models` maps the files on that thread
before the command imports torch. This module does not import torch for that reason.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from .fetch import stamped_sha256
from .fixtures import cache_dir
from .huge_pages import move_into_huge_pages, populate
from .source import ModelSource, resolve_model

WEIGHT_STORE_ENV = "SPARSESPEC_WEIGHT_STORE"
OLD_WEIGHT_STORE_ENV = "SPARSESPEC_TENSOR_CACHE"  # its name before, still read so that a setting keeps its effect


def weight_store_root(store: bool | str | Path = True) -> Path | None:
    """Where stored models live, or None when the store is off.

    ``store``: ``True`` (the default root, or ``$SPARSESPEC_WEIGHT_STORE`` when it names a folder), ``False``
    (off), or a folder.
    """
    if store is False or store is None:
        return None
    if store is not True:
        return Path(store)
    env = os.environ.get(WEIGHT_STORE_ENV, os.environ.get(OLD_WEIGHT_STORE_ENV, "")).strip()
    if env.lower() in ("0", "off", "false", "no"):
        return None
    return Path(env).expanduser() if env and env.lower() not in ("1", "on", "true", "yes") else cache_dir() / "tensors"


def source_store_key(source: ModelSource) -> str:
    """The store's key of a model source: ``sha256-<hex>`` from a matching fetch stamp, else ``stat-<hex>`` (of the
    file, or of a folder's config, weights and tokenizer files: the store holds its tokenizer too)."""
    path = Path(source.path)
    if source.kind == "gguf":
        sha = stamped_sha256(path)
        if sha is not None:
            return f"sha256-{sha}"
        files = [path]
    else:
        tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
        files = [path / "config.json", *sorted(path.glob("*.safetensors")),
                 *(path / name for name in tokenizer_files if (path / name).is_file())]
    digest = hashlib.sha256()
    for file in files:
        st = file.stat()
        digest.update(f"{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"stat-{digest.hexdigest()[:32]}"


def describe_weight_store() -> list[str]:
    """Lines for ``sparsespec info``: the store's folder and size, then each model's stored builds and tokenizer."""
    root = weight_store_root(True)
    if root is None:
        return [f"weight store: off (${WEIGHT_STORE_ENV})"]
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []
    lines, total = [], 0
    for folder in folders:
        try:
            source = str(json.loads((folder / "source.json").read_text())["path"])
        except (OSError, ValueError, KeyError, TypeError):
            source = folder.name
        builds = []
        for file in sorted(folder.glob("*.safetensors")):
            size = file.stat().st_size
            total += size
            builds.append(f"{file.stem} ({size / 1e9:.2f} GB)" if size >= 1e8 else f"{file.stem} ({size / 1e6:.1f} MB)")
        if (folder / "tokenizer").is_dir():
            builds.append("tokenizer")
        lines.append(f"  {source}: {', '.join(builds) or 'nothing stored'}")
    models = f"{len(folders)} model{'' if len(folders) == 1 else 's'}"
    return [f"weight store: {root}, {models}, {total / 1e9:.2f} GB"] + lines


# ----------------------------------------------------------------------------------------------- reading a file
# Where a stored file's data section and each tensor in it start: 64-byte aligned in memory, as the kernels read.
TENSOR_ALIGNMENT = 64


@dataclass
class StoredTensors:
    """A safetensors file mapped into memory: its metadata, its header's entries (name → ``{"dtype", "shape",
    "data_offsets"}``, offsets into the data section) and the mapping of the whole file, whose data section starts
    at ``data_offset`` (a multiple of :data:`TENSOR_ALIGNMENT`; the mapping itself is page-aligned); ``fd`` reads
    the same file (the same inode, whatever is renamed over its path) for :func:`_move_then_close`."""

    metadata: dict[str, str]
    entries: dict[str, dict]
    data: mmap.mmap
    data_offset: int
    fd: int  # the mapped file, open for its move into huge pages (which closes it)


def read_tensor_file(file: Path) -> StoredTensors:
    """Map ``file`` (private: the process never writes it) and fault its pages in; ``ValueError`` when its header
    is malformed, its data section unaligned (a file from an older store version) or its data truncated,
    ``OSError`` when it cannot be read. :func:`~sparsespec.loading.huge_pages.move_into_huge_pages` may then move
    the mapping into anonymous huge pages."""
    with open(file, "rb", buffering=0) as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise ValueError(f"{file}: the header is not a table")
        metadata = header.pop("__metadata__", None) or {}
        data_offset = 8 + header_len
        if data_offset % TENSOR_ALIGNMENT:
            raise ValueError(f"{file}: its data section does not start {TENSOR_ALIGNMENT}-byte aligned")
        size = os.fstat(f.fileno()).st_size
        if size - data_offset < max((int(e["data_offsets"][1]) for e in header.values()), default=0):
            raise ValueError(f"{file} is truncated")
        if hasattr(mmap, "MAP_PRIVATE"):
            data = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE)
        else:  # Windows: a copy-on-write view
            data = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        fd = os.dup(f.fileno())
    populate(data)
    return StoredTensors(metadata, header, data, data_offset, fd)


class _Prefetch:
    """One file to be mapped by the background thread of :func:`prefetch_stored_models`."""

    def __init__(self, file: Path):
        self.file = file
        self.result: StoredTensors | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.dropped = threading.Event()  # the load did not take it (or stop_huge_page_moves): its move stops

    def run(self) -> None:
        try:
            self.result = read_tensor_file(self.file)
        except BaseException as exc:  # handed to whoever takes the file
            self.error = exc
        finally:
            self.done.set()

    def take(self) -> StoredTensors:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


_prefetches: dict[Path, _Prefetch] = {}
_prefetches_lock = threading.Lock()
# The threads that map and move stored files, each with the events that stop its moves (appends are atomic).
_mapping_threads: list[tuple[threading.Thread, list[threading.Event]]] = []


def _start_mapping_thread(target, args: tuple, stops: list[threading.Event], name: str) -> None:
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    _mapping_threads.append((thread, stops))
    thread.start()


def wait_for_huge_page_moves() -> None:
    """Wait until every stored file mapped so far has moved into huge pages (or stopped moving): for timings that
    should read the memory decoding settles on, not the moves' first seconds (benchmarks)."""
    while _mapping_threads:
        _mapping_threads.pop()[0].join()


def stop_huge_page_moves() -> None:
    """End every move started so far at its next huge page and wait for it: for a command that drops the models it
    loaded (``fetch``), whose mappings are then released with them instead of moving."""
    for _, stops in list(_mapping_threads):
        for stop in stops:
            stop.set()
    wait_for_huge_page_moves()


def _move_then_close(stored: StoredTensors, stop: threading.Event | None = None) -> None:
    """Move ``stored``'s mapping into huge pages (``huge_pages.py``), then close its file."""
    try:
        move_into_huge_pages(stored.data, stored.fd, stop)
    finally:
        os.close(stored.fd)


def _map_then_move(prefetches: list[_Prefetch]) -> None:
    """Map every file first (a load may be waiting for it), then move each into huge pages."""
    for prefetch in prefetches:
        prefetch.run()
    for prefetch in prefetches:
        if prefetch.result is not None:
            _move_then_close(prefetch.result, prefetch.dropped)
    prefetches.clear()  # the mappings nobody took are unmapped once the thread lets go of them


def take_tensor_file(file: Path) -> StoredTensors:
    """``file``'s contents: from its background mapping when one was started (waiting for it; its move into huge
    pages goes on), else mapped now, its move started on a thread of its own."""
    with _prefetches_lock:
        prefetch = _prefetches.pop(Path(file), None)
    if prefetch is not None:
        return prefetch.take()
    stored = read_tensor_file(file)
    stop = threading.Event()
    _start_mapping_thread(_move_then_close, (stored, stop), [stop], name="sparsespec huge pages")
    return stored


def stored_native_file(ref: str, dtype_name: str) -> Path | None:
    """The stored native build of the GGUF model ``ref`` for ``dtype_name``, when exactly one exists (None when
    ``ref`` is not a GGUF model, is unknown, or has no or several such builds: then nothing is guessed)."""
    root = weight_store_root(True)
    try:
        source = resolve_model(ref)
        if root is None or source.kind != "gguf":
            return None
        candidates = list((root / source_store_key(source)).glob(f"{dtype_name}-native-*.safetensors"))
    except Exception:  # whatever is wrong with ref, load_model says it in its own words
        return None
    return candidates[0] if len(candidates) == 1 else None


def prefetch_stored_models(refs: list[str | None], dtype_name: str, weights: list[str | None]) -> None:
    """Start mapping, on one background thread, the stored native builds of the GGUF models ``refs`` (each with
    its ``--weights`` choice, None meaning auto), for :func:`take_tensor_file` to take; the thread then moves them
    into huge pages.

    Only the default path is guessed: native weights from a GGUF file (``auto`` or ``native``) with one stored
    build for the dtype. ``load_model`` drops what it did not take of its model (:func:`drop_prefetches`), so a
    wrong guess holds its mapping only until then.
    """
    files = []
    for ref, fmt in zip(refs, weights):
        file = stored_native_file(ref, dtype_name) if ref and fmt in (None, "auto", "native") else None
        if file is not None and file not in files:
            files.append(file)
    started = [_Prefetch(file) for file in files]
    with _prefetches_lock:
        _prefetches.update({p.file: p for p in started})
    if started:
        _start_mapping_thread(_map_then_move, (started,), [p.dropped for p in started], name="sparsespec prefetch")


def drop_prefetches(folder: Path | None = None) -> None:
    """Forget the background mappings of files in ``folder`` (one model's key folder; None: every folder) that were
    not taken."""
    with _prefetches_lock:
        for file in [f for f in _prefetches if folder is None or f.parent == folder]:
            _prefetches.pop(file).dropped.set()
