"""What the benchmark scripts share: the commit a report measured, the machine, a process's peak resident memory."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def machine() -> str:
    """The machine a report measured: architecture, CPU model and its widest vector units (the same code ran ~40%
    slower in training on one 2-core VM than on another: reports of different days compare only with this),
    cores. E.g. 'x86_64, AMD EPYC (avx512f), 2 cores, CPU only'."""
    import platform

    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    units = [f for f in ("amx_tile", "avx512f", "avx2") if f in flags][:1]
    cpu = f"{model} ({units[0]})" if model and units else model
    return ", ".join(x for x in (platform.machine(), cpu, f"{os.cpu_count()} cores", "CPU only") if x)


def git_commit() -> str:
    """HEAD, with ``+dirty`` when tracked files other than the reports (``benchmarks/``) and the prose (``*.md``)
    differ from it: the report then measured uncommitted code."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks",
                            ":!*.md"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def provenance() -> dict:
    """What every report records of its measurement: the commit (:func:`git_commit`), the machine and the date."""
    import time

    return {"commit": git_commit(), "machine": machine(), "date": time.strftime("%Y-%m-%d")}


def provenance_text(d: dict) -> str:
    """A report's "commit ...; machine, date" from a record :func:`provenance` filled (older records lack fields)."""
    return (f"commit {d.get('commit', 'not recorded')}; {d.get('machine', 'machine not recorded')}, "
            f"{d.get('date', 'date not recorded')}")


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
            self.sample()

    def sample(self) -> int:
        rss = self._rss()
        self.peak = max(self.peak, rss)
        return rss

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._rss()) - self.start


class HeapSampler(PeakRSS):
    """PeakRSS plus the allocator's view of a CPU process, the analogue of CUDA's ``max_memory_allocated``: at
    every sample it reads glibc's ``mallinfo2`` (summed over arenas) and keeps the peak of the bytes in use
    (``uordblks + hblkhd``: live ``malloc`` memory, where torch's CPU tensors are), and, at the sampled peak
    of RSS, the free bytes glibc keeps (``fordblks``: freed chunks it has not returned to the system).
    Sampling misses peaks shorter than the interval. Python objects (pymalloc's own mmap arenas), shared
    libraries and the Ray object store's mapped pages are RSS but not heap."""

    def __init__(self, interval_s: float = 0.01) -> None:
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in
                        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallinfo2.restype = MallInfo2
        self.peak_live = self.free_at_peak_rss = 0
        super().__init__(interval_s)

    def sample(self) -> int:
        m = self._libc.mallinfo2()
        before = self.peak
        rss = super().sample()
        self.peak_live = max(self.peak_live, m.uordblks + m.hblkhd)
        if rss > before:
            self.free_at_peak_rss = m.fordblks
        return rss

    def report(self) -> dict:
        self.sample()
        return {"peak_heap_live_bytes": self.peak_live, "heap_free_at_rss_peak_bytes": self.free_at_peak_rss}
