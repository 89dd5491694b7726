"""benchmarks/README.md lists every script in benchmarks/ with its module docstring's first line, and each script
writes its records under a results folder of its own.

When this fails after adding or changing a script, regenerate the list:
    python tests/test_benchmark_scripts.py > /tmp/scripts.md   # then paste it between the markers
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
BEGIN = "<!-- scripts: begin (tests/test_benchmark_scripts.py checks this list) -->"
END = "<!-- scripts: end -->"


def first_docstring_line(script: Path) -> str:
    doc = ast.get_docstring(ast.parse(script.read_text()))
    return (doc or "").split("\n")[0].strip()


def expected_rows() -> list[str]:
    return [f"| [`{p.name}`]({p.name}) | {first_docstring_line(p)} |" for p in sorted(BENCHMARKS.glob("*.py"))]


def listed_rows() -> list[str]:
    text = (BENCHMARKS / "README.md").read_text()
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    return [line for line in block.splitlines() if line.startswith("| [")]


def test_every_script_has_a_docstring_line():
    missing = [p.name for p in sorted(BENCHMARKS.glob("*.py")) if not first_docstring_line(p)]
    assert not missing, f"scripts without a module docstring: {missing}"


def test_readme_lists_every_script_with_its_docstring_line():
    expected, listed = expected_rows(), listed_rows()
    assert listed == expected, (
        "benchmarks/README.md's script list differs from the scripts' docstrings:\n"
        + "\n".join(f"  missing or changed: {row}" for row in expected if row not in listed)
        + "\n" + "\n".join(f"  listed but stale: {row}" for row in listed if row not in expected)
        + "\nregenerate it with: python tests/test_benchmark_scripts.py")


def test_scripts_write_into_their_own_results_folder():
    """No script writes straight into results/: a default output path names RESULTS_DIR only through results_dir()."""
    offenders = [p.name for p in sorted(BENCHMARKS.glob("*.py"))
                 if p.name != "common.py" and "RESULTS_DIR" in p.read_text()]
    assert not offenders, f"use common.results_dir(__file__) instead of RESULTS_DIR in: {offenders}"
    stray = [p.name for p in (BENCHMARKS / "results").iterdir() if not p.is_dir()]
    assert not stray, f"files directly under benchmarks/results/ (move them into the folder of their script): {stray}"


if __name__ == "__main__":
    sys.stdout.write("\n".join(["| script | what it measures or does |", "|---|---|", *expected_rows()]) + "\n")
