"""What every benchmark report needs: the commit it measured."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """HEAD, with ``+dirty`` when tracked files other than the reports (``benchmarks/``) differ from it: the report
    then measured uncommitted code."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")
