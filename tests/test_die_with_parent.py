"""Processes a rank starts die with it (``titanrl._platform_compat._die_with_parent``, the start-up hook), and what
they leave in /dev/shm goes with them: a process armed with TITANRL_DIE_WITH_PARENT=1 that created shared memory (as
vLLM's engine core creates its message queues) is killed within moments of its parent's kill -9, and
multiprocessing's resource tracker, which the hook leaves unarmed, then unlinks the segment. (End to end, with vLLM's
engine in child processes: test_async's kill -9 test.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")

CHILD = """
import os, sys, time
from multiprocessing import shared_memory
shm = shared_memory.SharedMemory(create=True, size=1 << 20)
open(sys.argv[1], "w").write(f"{os.getpid()} {shm.name}")
time.sleep(600)
"""

PARENT = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env={**os.environ, "TITANRL_DIE_WITH_PARENT": "1"})
time.sleep(600)
"""


def _wait(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _tracker(pid: int) -> int | None:
    """The resource tracker process among ``pid``'s children."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"multiprocessing.resource_tracker" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    return None


def test_a_killed_parents_child_dies_and_its_shared_memory_is_unlinked(tmp_path):
    out = tmp_path / "child.txt"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(out)])
    try:
        assert _wait(lambda: out.exists() and len(out.read_text().split()) == 2, 60), "the child never started"
        pid, name = out.read_text().split()
        segment = Path("/dev/shm") / name
        assert segment.exists()
        # the child's resource tracker is up and past its start-up hook (where the signal would be armed)
        assert _wait(lambda: _tracker(int(pid)) is not None), "the child started no resource tracker"
        time.sleep(2.0)
    finally:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
    assert _wait(lambda: not _alive(int(pid))), "the child outlived its parent's kill -9"
    assert _wait(lambda: not segment.exists()), f"{segment} was left behind"
