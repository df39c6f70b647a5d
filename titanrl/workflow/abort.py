"""Ending a run: a failure on one rank stops every rank; SIGTERM stops at a step boundary with a checkpoint.

**Failure.** The rank whose node raised writes the cause into torch.distributed's key-value store (the
rendezvous store every rank shares, alive while the job runs) before it tears down, then exits; its
console line names the node, the rank and the cause. Every rank has a watcher thread polling that key:
a rank that sees another rank's cause knows its own errors are consequences (a collective whose peer
left), logs the cause to its own log only, and exits; one still busy after ``grace_s`` (a generation or
a data fetch that waits for nobody) is ended by the watcher. So every rank stops within seconds, one
line names the cause, and nothing waits out ``job.collective_timeout_s``. When it sees the cause, the
watcher writes every thread's Python stack into the rank's log: where a rank that hangs was stuck is what the
failing rank's timeout cannot say. An error every rank meets alike (a checkpoint that does not load, a check that
needs the world size) is written once per host, by its first rank; the host's other ranks wait until it is written
before they exit, since torchrun ends a host's workers as soon as one of them exits.

**SIGTERM** (what a cluster scheduler sends before preemption, and torchrun forwards to its workers, killing them
30 s later): the launcher's grace is ``job.preempt_grace_s``. A thread of every rank wakes on the signal at once
(``signal.set_wakeup_fd``: the main thread may be blocked in a collective, where Python's handler cannot run) and
the first rank to wake decides for all, through the store: **finish** when the current step's remaining time (the
median step less what has run) plus the last checkpoint save fit in the grace, else **abandon**. Finish: at the end
of the step the ranks agree (one all-reduce) to stop, every rank saves a checkpoint of that step and the run ends
with exit code 0 and a line saying where the checkpoint is; if that still overruns the grace, the thread ends the
process at its deadline. Abandon: every rank writes one line and ends at once (exit 143); the last periodic
checkpoint stands (a save cut off half-way has no DCP metadata and is removed at the next start). Processes a rank
started die with it (``titanrl._platform_compat``: the parent-death signal). A SIGTERM that arrives because another
rank failed (torchrun stops the siblings of a failed worker) is a failure, not a stop: the store says so.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

KEY = "titanrl/abort"
COUNT_KEY = "titanrl/abort_count"
SAID_KEY = "titanrl/said"  # the console line of an error every rank met is written
PREEMPT_KEY = "titanrl/preempt"
PREEMPT_COUNT_KEY = "titanrl/preempt_count"
ABANDON_EXIT = 143  # 128 + SIGTERM: what a process ended by the signal reports


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
        self._previous_fd = -1
        self._wakeup: tuple[int, int] | None = None
        self._preempt_thread: threading.Thread | None = None
        self._followed = False
        self._said_stopped = False
        self._lock = threading.Lock()
        self._grace_s = 25.0
        self._time_to_stop = self._abandon_line = None

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
            if self._preempt_thread is None and self._preempt_decision() is not None:
                self._follow(self._preempt_decision())  # a SIGTERM reached another rank only
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
                try:  # first: a clean-up that hangs must not keep the line from the console
                    self.say_stopped()
                except Exception:  # noqa: BLE001 - a console gone; the process still ends
                    pass
                if self._cleanup is not None:
                    self._cleanup()
            finally:
                os._exit(1)

    def say_stopped(self) -> None:
        """The line of a rank that stops because another rank failed: ``rank R stopped: rank F: <cause>``, on the
        console of a host that does not hold rank F (from its first rank: the cause once per host), in the log
        otherwise. Said by the rank's error path or, where the rank stayed busy past ``grace_s``, by the watcher."""
        from titanrl.console import say

        with self._lock:  # once: the error path and the watcher may both reach it
            if self._said_stopped:
                return
            self._said_stopped = True
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        say(f"[titanrl] rank {self.rank} stopped: {self.failed_elsewhere}", error=True,
            log_only=not shows_cause(self.rank, local_rank, self.failed_rank))

    def close(self) -> None:
        """Stop the watchers and wait for them: a daemon thread still inside a store call when the interpreter
        finalises aborts the process."""
        self._done.set()
        if self._wakeup is not None:
            os.write(self._wakeup[1], b"\0")  # the SIGTERM thread reads it and sees _done
        for thread in (getattr(self, "_thread", None), self._preempt_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=10.0)
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            signal.set_wakeup_fd(self._previous_fd)
            self._previous = None
        if self._wakeup is not None:
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    # -------------------------------------------------------------------- SIGTERM

    def handle_sigterm(self, grace_s: float = 25.0, time_to_stop: Callable[[], float | None] | None = None,
                       abandon_line: Callable[[], str] | None = None) -> None:
        """Take SIGTERM (main thread only, as Python requires): a thread wakes on it at once and decides, for every
        rank, to finish the step (``time_to_stop()``: the seconds the step and its checkpoint still need, None if
        unknown, within ``grace_s``) or to abandon it (``abandon_line()``: what the rank says as it ends)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._grace_s, self._time_to_stop, self._abandon_line = grace_s, time_to_stop, abandon_line

        def handler(signum, frame):  # noqa: ARG001 - the decision is the thread's; the flag is for the step loop
            pass

        self._wakeup = os.pipe()
        os.set_blocking(self._wakeup[1], False)
        self._previous = signal.signal(signal.SIGTERM, handler)
        self._previous_fd = signal.set_wakeup_fd(self._wakeup[1], warn_on_full_buffer=False)
        self._preempt_thread = threading.Thread(target=self._on_sigterm, name="titanrl-sigterm", daemon=True)
        self._preempt_thread.start()

    def _on_sigterm(self) -> None:
        while True:
            try:
                byte = os.read(self._wakeup[0], 1)
            except OSError:
                return
            if self._done.is_set() or not byte:
                return
            if byte[0] == signal.SIGTERM:
                break
        woke = time.monotonic()
        if self.cause_elsewhere() is not None:  # torchrun stopping the siblings of a failed rank: not a preemption
            return
        needed = self._time_to_stop() if self._time_to_stop is not None else None
        mine = "finish" if needed is not None and needed <= self._grace_s else "abandon"
        decision = self._publish(mine)
        print(f"[titanrl] rank {self.rank}: SIGTERM; the step and its checkpoint need "
              f"{'an unknown time' if needed is None else f'~{needed:.0f} s'} of job.preempt_grace_s="
              f"{self._grace_s:g} s: {decision}", file=sys.stderr, flush=True)
        self._follow(decision, woke)

    def _publish(self, mine: str) -> str:
        """The first rank to wake decides for all; returns the decision in force."""
        if self._store is None:
            return mine
        try:
            if self._store.add(PREEMPT_COUNT_KEY, 1) == 1:
                self._store.set(PREEMPT_KEY, mine)
                return mine
            self._store.wait([PREEMPT_KEY], timedelta(seconds=5))
            return self._store.get(PREEMPT_KEY).decode()
        except Exception:  # the store is gone (torchrun's agent ended): decide alone
            return mine

    def _preempt_decision(self) -> str | None:
        if self._store is None:
            return None
        try:
            return self._store.get(PREEMPT_KEY).decode() if self._store.check([PREEMPT_KEY]) else None
        except Exception:
            return None

    def _follow(self, decision: str, woke: float | None = None) -> None:
        """Finish: the step loop stops and saves at the step's end, and the process ends by the grace's end at the
        latest. Abandon: end now."""
        if self._followed:
            return
        self._followed = True
        woke = time.monotonic() if woke is None else woke
        if decision == "finish":
            self.stop_requested = True
            threading.Thread(target=self._deadline, args=(woke + self._grace_s,), name="titanrl-deadline",
                             daemon=True).start()
            return
        self._abandon()

    def _deadline(self, at: float) -> None:
        if self._done.wait(max(at - time.monotonic(), 0.0)):
            return
        print(f"[titanrl] rank {self.rank}: still running job.preempt_grace_s={self._grace_s:g} s after SIGTERM: "
              "ending now (a checkpoint cut off half-way is removed at the next start)", file=sys.stderr, flush=True)
        self._abandon()

    def _abandon(self) -> None:
        line = self._abandon_line() if self._abandon_line is not None else "abandoned the step"
        if self.rank == 0:
            from titanrl.console import say

            say(f"[titanrl] {line}")
        print(f"[titanrl] rank {self.rank}: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(ABANDON_EXIT)

    def should_stop(self) -> bool:
        """Collective: every rank calls it at the end of each step; True when any rank got SIGTERM."""
        from titanrl.distributed import all_reduce_max

        return all_reduce_max(1.0 if self.stop_requested else 0.0) > 0


def shows_cause(rank: int, local_rank: int, failing: int | None) -> bool:
    """Whether ``rank`` repeats rank ``failing``'s cause on its console: the first rank of a host (torchrun numbers a
    host's ranks contiguously; ``LOCAL_WORLD_SIZE`` of them) that does not hold the failing rank."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    first = rank - local_rank
    return local_rank == 0 and (failing is None or not first <= failing < first + local_world)


def dump_stacks() -> None:
    """Every thread's Python stack into stderr (the rank's log when output is routed); best effort."""
    try:
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except Exception:  # stderr closed or not a real file: nothing to write to
        pass


def said(host: int) -> None:
    """This rank has written the console line of an error every rank met (a checkpoint that does not load): the
    silent ranks of its host (``host``: the host's first rank) may exit now (``wait_for_the_speaker``)."""
    store = _store()
    if store is not None:
        try:
            store.set(f"{SAID_KEY}/{host}", "1")
        except Exception:  # the store is gone with rank 0's agent: nobody waits
            pass


def wait_for_the_speaker(host: int, timeout_s: float = 60.0) -> None:
    """A rank that leaves an error every rank met to its host's speaking rank (``host``: the host's first rank) waits
    until that rank's console line is written: torchrun ends a host's workers once one of them exits, and would cut
    the speaker off (it may still be closing its engine or the Ray daemons it started). Should the speaker exit
    first, torchrun ends this rank; without a store, it waits a few seconds."""
    store = _store()
    deadline = time.monotonic() + (timeout_s if store is not None else 3.0)
    while time.monotonic() < deadline:
        try:
            if store is not None and store.check([f"{SAID_KEY}/{host}"]):
                return
        except Exception:  # the store is gone: so is the speaker
            return
        time.sleep(0.2)
