"""Ending a run: a failure on one rank stops every rank; SIGTERM stops at a step boundary with a checkpoint.

**Failure.** The rank whose node raised writes the cause into torch.distributed's key-value store (the
rendezvous store every rank shares, alive while the job runs) before it tears down, then exits; its
console line names the node, the rank and the cause. Every rank has a watcher thread polling that key:
a rank that sees another rank's cause knows its own errors are consequences (a collective whose peer
left), logs the cause to its own log only, and exits; one still busy after ``grace_s`` (a generation or
a data fetch that waits for nobody) is ended by the watcher. So every rank stops within seconds, one
line names the cause, and nothing waits out ``job.collective_timeout_s``. When it sees the cause, the
watcher writes every thread's Python stack into the rank's log: where a rank that hangs was stuck is what the
failing rank's timeout cannot say.

**SIGTERM** (what a cluster scheduler sends before preemption, and torchrun forwards to its workers):
the handler only sets a flag. At the end of each step the ranks agree (one all-reduce) whether any was
asked to stop; if so every rank saves a checkpoint of that step and the run ends with exit code 0 and
a line saying where the checkpoint is. A SIGTERM that arrives because another rank failed (torchrun
stops the siblings of a failed worker) is a failure, not a stop: the store says so.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Callable

KEY = "titanrl/abort"
COUNT_KEY = "titanrl/abort_count"


def _store():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


class RunControl:
    """The rank's view of how the run must end (one per process)."""

    def __init__(self, rank: int, poll_s: float = 0.5, grace_s: float = 20.0) -> None:
        self.rank = rank
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.stop_requested = False  # SIGTERM seen
        self.failed_elsewhere: str | None = None  # another rank's cause: "rank F: <message>"
        self.failed_rank: int | None = None  # F
        self.announced = False
        self._store = _store()
        self._done = threading.Event()
        self._cleanup: Callable[[], None] | None = None
        self._previous = None

    # -------------------------------------------------------------------- failure

    def announce(self, message: str) -> bool:
        """Tell every rank this one failed; True when it was the first rank to fail."""
        if self.announced or self._store is None:
            return self.failed_elsewhere is None
        self.announced = True
        try:
            first = self._store.add(COUNT_KEY, 1) == 1
            if first:
                self._store.set(KEY, f"rank {self.rank}: {message}")
            return first
        except Exception:  # the store is gone with rank 0's agent: nothing to tell
            return True

    def cause_elsewhere(self) -> str | None:
        """Another rank's announced cause, if any (checked now)."""
        if self.failed_elsewhere is not None or self._store is None:
            return self.failed_elsewhere
        try:
            if self._store.check([KEY]):
                message = self._store.get(KEY).decode()
                failing = int(message.split(":", 1)[0].removeprefix("rank "))  # written by announce
                if failing != self.rank:
                    self.failed_elsewhere, self.failed_rank = message, failing
        except Exception:
            pass
        return self.failed_elsewhere

    def watch(self, cleanup: Callable[[], None] | None = None) -> None:
        """Start the watcher: after another rank's failure, end this process if it has not ended itself
        within ``grace_s`` (``cleanup`` runs first, best effort)."""
        if self._store is None:
            return
        self._cleanup = cleanup
        self._thread = threading.Thread(target=self._watch, name="titanrl-abort-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            if self.announced or self._done.is_set() or self.cause_elsewhere() is None:
                continue
            print(f"[titanrl] rank {self.rank} stopping: {self.failed_elsewhere}; where its threads are:",
                  file=sys.stderr, flush=True)
            dump_stacks()
            if self._done.wait(self.grace_s):
                return
            print(f"[titanrl] rank {self.rank} still busy {self.grace_s:.0f} s after another rank failed: exiting",
                  file=sys.stderr, flush=True)
            try:
                if self._cleanup is not None:
                    self._cleanup()
            finally:
                os._exit(1)

    def close(self) -> None:
        """Stop the watcher and wait for it: a daemon thread still inside a store call when the interpreter
        finalises aborts the process."""
        self._done.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    # -------------------------------------------------------------------- SIGTERM

    def handle_sigterm(self) -> None:
        """SIGTERM sets ``stop_requested`` (main thread only, as Python requires)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):  # noqa: ARG001
            self.stop_requested = True
            print(f"[titanrl] rank {self.rank}: SIGTERM, stopping after this step with a checkpoint",
                  file=sys.stderr, flush=True)

        self._previous = signal.signal(signal.SIGTERM, handler)

    def should_stop(self) -> bool:
        """Collective: every rank calls it at the end of each step; True when any rank got SIGTERM."""
        from titanrl.distributed import all_reduce_max

        return all_reduce_max(1.0 if self.stop_requested else 0.0) > 0


def dump_stacks() -> None:
    """Every thread's Python stack into stderr (the rank's log when output is routed); best effort."""
    try:
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except Exception:  # stderr closed or not a real file: nothing to write to
        pass


def wait_for_peer_failure(control: RunControl, timeout_s: float = 3.0) -> str | None:
    """After an error of this rank that may be a consequence (a collective's peer left): give the failing
    rank a moment to announce itself, and return its cause if it did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cause = control.cause_elsewhere()
        if cause is not None:
            return cause
        time.sleep(0.2)
    return control.cause_elsewhere()
