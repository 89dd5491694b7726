"""Where the native kernels fail to build, the tests that need them fail on a host that builds them and skip
elsewhere (``conftest.py``: ``native_kernels``): a broken build must not turn a run green by skipping."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sparsespec
from conftest import kernels_must_build

ROOT = Path(__file__).resolve().parents[1]
# A C++ compiler that answers torch's version queries (through the real one) and fails every compilation.
FAILING_COMPILER = """#!/bin/sh
for a in "$@"; do [ "$a" = -c ] && { echo "ops.cpp:1:1: error: a test double compiles nothing" >&2; exit 1; }; done
exec c++ "$@"
"""


def run_native_tests(tmp_path: Path, **env: str | None) -> subprocess.CompletedProcess:
    """``pytest tests/test_native_ops.py`` in a fresh kernel cache, with ``env`` set (None: unset)."""
    environ = dict(os.environ, SPARSESPEC_HOME=str(tmp_path / "home"),
                   PYTHONPATH=os.pathsep.join([str(Path(sparsespec.__file__).parents[1]),
                                               os.environ.get("PYTHONPATH", "")]))
    for key, value in env.items():
        environ.pop(key, None) if value is None else environ.__setitem__(key, value)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_native_ops.py"],
                          cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to stand behind the failing one")
def test_a_failed_build_fails_the_run_naming_the_compilers_error(tmp_path):
    compiler = tmp_path / "c++"
    compiler.write_text(FAILING_COMPILER)
    compiler.chmod(0o755)
    out = run_native_tests(tmp_path, CXX=str(compiler), CI=None, SPARSESPEC_KERNELS=None)
    assert out.returncode != 0, out.stdout
    assert "the native kernels failed to build" in out.stdout and "passed" not in out.stdout
    assert "native kernels: failed to build (ops.cpp:1:1: error: a test double compiles nothing)" in out.stdout


def test_without_a_compiler_the_native_tests_skip(tmp_path):
    """A user's machine without a compiler (and not CI): skipped, saying why."""
    out = run_native_tests(tmp_path, CXX=str(tmp_path / "no-such-c++"), CI=None, SPARSESPEC_KERNELS=None)
    assert out.returncode == 0, out.stdout + out.stderr
    counts = out.stdout.splitlines()[-1]
    assert "skipped" in counts and "passed" not in counts and "failed" not in counts
    summary = next(line for line in out.stdout.splitlines() if line.startswith("native kernels: "))
    assert summary.startswith("native kernels: not tested (") and "no-such-c++" in summary  # the shell's complaint


@pytest.mark.parametrize(("machine", "env", "must"), [
    ("x86_64", dict(CXX="c++", CI=None), True),
    ("aarch64", dict(CXX="c++", CI=None), True),
    ("riscv64", dict(CXX="c++", CI="true"), False),  # no kernels are written for it
    ("x86_64", dict(CXX="/no/such/c++", CI=None), False),
    ("x86_64", dict(CXX="/no/such/c++", CI="true"), True),
])
def test_which_hosts_must_build_the_kernels(monkeypatch, machine, env, must):
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr("platform.machine", lambda: machine)
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    assert kernels_must_build() == must
