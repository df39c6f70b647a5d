"""What the benchmark scripts share: the commit a report measured, a process's peak resident memory."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """HEAD, with ``+dirty`` when tracked files other than the reports (``benchmarks/``) differ from it: the report
    then measured uncommitted code."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


class PeakRSS:
    """Samples this process's resident memory every ``interval_s``; ``stop()`` returns ``peak - start`` in bytes,
    what the code between construction and ``stop`` added."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._rss()) - self.start
