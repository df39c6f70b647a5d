"""The README and the reports index quote only what is committed: every file they name exists, every report in
``benchmarks/`` is listed in ``benchmarks/README.md``, and the README stays short (at most ~200 lines)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w/])((?:benchmarks|docs|configs|scripts|tests|titanrl)/[\w./-]*[\w/])")


def named_files(text: str) -> set[str]:
    """Repository paths quoted in ``text``, less patterns (``scripts/bench_*.py``) and placeholders."""
    return {m.group(1).rstrip("/.") for m in PATH.finditer(text) if text[m.end():m.end() + 1] not in "*<"}


def test_every_file_the_readme_names_exists():
    text = (ROOT / "README.md").read_text()
    names = named_files(text)
    assert "benchmarks/e2e.md" in names and "benchmarks/README.md" in names  # the pattern finds what it must
    missing = sorted(n for n in names if not (ROOT / n).exists())
    assert not missing, f"README.md names files that are not in the repository: {missing}"
    assert len(text.splitlines()) <= 200


def test_the_reports_index_names_every_report_and_nothing_missing():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    quoted = set(re.findall(r"`([\w./-]+\.(?:md|json|jsonl|png))`", text)) | {
        m + "/" for m in re.findall(r"`([\w.-]+)/`", text)}
    reports = {p.name for p in (ROOT / "benchmarks").glob("*.md") if p.name != "README.md"}
    missing = sorted(q for q in quoted if not ((ROOT / "benchmarks" / q).exists() or (ROOT / q).exists()))
    assert not missing, f"benchmarks/README.md quotes reports that are not committed: {missing}"
    unlisted = sorted(reports - quoted)
    assert not unlisted, f"reports missing from benchmarks/README.md: {unlisted}"
    missing_files = sorted(n for n in named_files(text) if not (ROOT / n).exists())
    assert not missing_files, missing_files
