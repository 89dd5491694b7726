"""Every anchor that the code and the docs cite in benchmarks/RESULTS.md or benchmarks/history/ exists, so those
anchors stay stable: a heading's slug (as GitHub renders it) or an explicit ``<a id="...">``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
# A citation in any text: benchmarks/RESULTS.md#anchor or benchmarks/history/FILE.md#anchor.
CITATION = re.compile(r"benchmarks/(RESULTS\.md|history/[\w.\-]+\.md)#([\w\-]+)")
# A Markdown link with a fragment: [text](path#anchor) or [text](#anchor).
MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]*)#([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, _ and - kept), spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        found.update(re.findall(r'<a id="([^"]+)"', line))
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def cited_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(BENCHMARKS.glob("*.md")),
             *sorted((BENCHMARKS / "history").glob("*.md"))]
    files += [p for p in sorted((ROOT / "src").rglob("*")) if p.suffix in (".py", ".h", ".cpp", ".c", ".md")]
    return files


def citations() -> list[tuple[Path, Path, str]]:
    """(citing file, cited file, anchor) for every citation of a file under benchmarks/ with an anchor."""
    out = []
    for path in cited_files():
        text = path.read_text()
        for target, anchor in CITATION.findall(text):
            out.append((path, BENCHMARKS / target, anchor))
        if path.suffix == ".md":
            for target, anchor in MARKDOWN_LINK.findall(text):
                cited = (path.parent / target).resolve() if target else path
                if cited.suffix == ".md" and BENCHMARKS in cited.parents:
                    out.append((path, cited, anchor))
    return out


def test_cited_anchors_exist():
    cache: dict[Path, set[str]] = {}
    missing = []
    for citing, cited, anchor in citations():
        if not cited.exists():
            missing.append(f"{citing.relative_to(ROOT)}: {cited.relative_to(ROOT)} does not exist")
            continue
        if anchor not in cache.setdefault(cited, anchors(cited)):
            missing.append(f"{citing.relative_to(ROOT)}: no #{anchor} in {cited.relative_to(ROOT)}")
    assert not missing, "anchors cited but not found:\n" + "\n".join(sorted(set(missing)))


def test_the_source_cites_measurements_by_anchor():
    """src/ names a measurement by its anchor, not by a section's title that a move would lose."""
    loose = [f"{p.relative_to(ROOT)}:{n}" for p in cited_files() if ROOT / "src" in p.parents
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"RESULTS\.md(?!#)", line)]
    assert not loose, f"RESULTS.md cited without an anchor: {loose}"


def test_slug_follows_github():
    assert slug("Two serial costs off every native call, γ = 3 by default (2026-12-03, late)") == \
        "two-serial-costs-off-every-native-call-γ--3-by-default-2026-12-03-late"
    assert slug("Draft budget against context (`bench_draft_budget.py`)") == \
        "draft-budget-against-context-bench_draft_budgetpy"
