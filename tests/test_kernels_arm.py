"""The kernels' C++ as a standalone program (no torch): every SIMD path equals the scalar path bit for bit.

Built natively (the x86 paths) and, with Debian's ``g++-aarch64-linux-gnu``, for AArch64 and run under
``qemu-aarch64 -cpu max`` (the NEON dot-product path the edge boards use). ``.ci/run`` installs both packages; a
machine without them skips the AArch64 check, saying what to install.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "src" / "sparsespec" / "kernels" / "csrc"
HARNESS = ROOT / "tests" / "native" / "isa_agreement.cpp"
KERNEL_SOURCES = ["qmatmul_scalar.cpp", "qmatmul_avx2.cpp", "qmatmul_avx512.cpp", "qmatmul_amx.cpp", "qmatmul_neon.cpp",
                  "fmatmul.cpp", "fmatmul_avx2.cpp", "fmatmul_avx512.cpp", "fmatmul_neon.cpp"]

pytestmark = pytest.mark.arm


def build_and_run(compiler: str, runner: list[str], out: Path, extra: list[str]) -> str:
    cmd = [compiler, "-O2", "-std=c++20", "-ffp-contract=off", *extra, f"-I{CSRC}", str(HARNESS),
           *[str(CSRC / s) for s in KERNEL_SOURCES], "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    result = subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def require(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not installed (apt-get install g++-aarch64-linux-gnu qemu-user)")


def test_aarch64_neon_path_equals_scalar_under_qemu(tmp_path):
    require("aarch64-linux-gnu-g++")
    require("qemu-aarch64")
    out = build_and_run("aarch64-linux-gnu-g++", ["qemu-aarch64", "-cpu", "max"], tmp_path / "isa_arm", ["-static"])
    assert "neon-dotprod" in out
    assert out.strip().endswith(" 0 failed")


def test_native_build_of_the_standalone_check(tmp_path):
    require("g++")
    out = build_and_run("g++", [], tmp_path / "isa_native", [])
    assert out.strip().endswith(" 0 failed")
