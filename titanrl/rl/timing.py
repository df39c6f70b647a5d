"""Per-stage wall-clock and busy time of one RL step, and a named error when a stage's collective
times out.

Busy time is what the rank itself computed: the process's CPU time on CPU (a rank blocked in a
collective, or waiting for the media preprocessors, burns none; its own background threads count),
on CUDA the device time between CUDA events recorded on the current stream, read only when the step's
metrics are (``Busy``): no host-device synchronisation is added per microbatch or vision forward. Summed over ranks and divided by their number it is
the step time of a perfect schedule (no exposed data wait, no idle at synchronisation points):
``step/limit_s`` in the trainer's metrics.

A rank that dies or hangs leaves the others blocked in a collective. With gloo the waiting ranks'
collective raises after the process group's timeout (``job.collective_timeout_s``) - or at once with
"connection closed" when the peer's process is gone - with a message that names neither the stage
nor the cause. ``StageTimer`` turns both into ``CollectiveError`` naming the stage, the rank and the
timeout. (With NCCL, PyTorch's watchdog aborts the process at the same timeout with its own message
naming the collective.)
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed

_TIMED_OUT = ("timed out", "timeout")
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe")


class CollectiveError(RuntimeError):
    """A collective inside an RL stage did not complete: another rank died or hangs."""


def _classify(err: BaseException) -> str | None:
    """'timeout' / 'peer_lost' for a collective's own failure (gloo raises plain RuntimeError, c10d its
    DistError subclasses); None for anything else, titanrl's own errors included, whatever they say."""
    if not (type(err) is RuntimeError or isinstance(err, torch.distributed.DistError)):
        return None
    text = str(err).lower()
    if any(s in text for s in _TIMED_OUT):
        return "timeout"
    if any(s in text for s in _PEER_LOST):
        return "peer_lost"
    return None


Mark = "float | torch.cuda.Event"


def runnable_seconds() -> float:
    """This process's CPU time (all threads) plus the time its main thread - where the model runs - was ready to
    run but waited for a core (Linux ``/proc/thread-self/schedstat``: time on a CPU, time on a run queue): how
    long its work took on the cores it had. A rank sharing its core with another busy process is charged the
    time its work took - the busy time of a slower device - while time blocked (a collective, I/O) still counts
    nothing. (Other threads' waits are left out: several threads waiting at once would count that time twice.)"""
    with open(_MAIN_SCHEDSTAT) as f:
        waiting = int(f.read().split()[1])
    return time.process_time() + waiting / 1e9


_MAIN_SCHEDSTAT = f"/proc/self/task/{os.getpid()}/schedstat"


class BusyClock:
    """Marks busy-time points without synchronising: on CPU the process's CPU time (``kind = "cpu"``), or
    :func:`runnable_seconds` (``kind = "runnable"``, ``metrics.busy_clock``), plus ``extra()``: seconds other
    processes worked for this rank (a rollout engine in child processes); on CUDA an event recorded on the
    current stream (its time is read later, by ``Busy.seconds``)."""

    def __init__(self, device: torch.device, extra: Callable[[], float] | None = None, kind: str = "cpu") -> None:
        self.cuda = device.type == "cuda"
        self.extra = extra
        if kind not in ("cpu", "runnable"):
            raise ValueError(f"busy clock {kind!r}: expected 'cpu' or 'runnable'")
        self.read = runnable_seconds if kind == "runnable" else time.process_time

    def mark(self) -> Mark:
        if not self.cuda:
            return self.read() + (self.extra() if self.extra is not None else 0.0)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


class Busy:
    """A sum of busy spans (pairs of ``BusyClock`` marks), resolved when read: CPU spans at once, CUDA spans at
    ``seconds()`` (one wait for the last event; by then the step's metrics have synchronised anyway)."""

    __slots__ = ("_value", "_spans")

    def __init__(self) -> None:
        self._value = 0.0
        self._spans: list = []

    def add(self, start: Mark, end: Mark) -> None:
        if isinstance(start, float):
            self._value += end - start
        else:
            self._spans.append((start, end))

    def seconds(self) -> float:
        if self._spans:
            self._spans[-1][1].synchronize()
            self._value += sum(a.elapsed_time(b) for a, b in self._spans) / 1000.0  # ms
            self._spans.clear()
        return self._value

    def __float__(self) -> float:
        return self.seconds()


class StageTimer:
    """``with timer("update"): ...`` adds the block's seconds to ``times["time/update"]`` and, with a
    ``clock``, its busy seconds to ``busy["update"]``."""

    def __init__(self, rank: int = 0, collective_timeout_s: float | None = None,
                 clock: "BusyClock | Callable[[], float] | None" = None) -> None:
        self.rank = rank
        self.collective_timeout_s = collective_timeout_s
        self.clock = clock.mark if isinstance(clock, BusyClock) else clock
        self.times: dict[str, float] = {}
        self._busy: dict[str, Busy] = {}

    @property
    def busy(self) -> dict[str, float]:
        """Busy seconds per stage (CUDA spans resolved here)."""
        return {name: b.seconds() for name, b in self._busy.items()}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        b0 = self.clock() if self.clock is not None else 0.0
        try:
            yield
        except RuntimeError as err:
            kind = None if isinstance(err, CollectiveError) else _classify(err)
            if kind is None:
                raise
            waited = time.perf_counter() - t0
            cause = (f"waited more than job.collective_timeout_s={self.collective_timeout_s:g} s for a collective"
                     if kind == "timeout" else "lost its connection to another rank in a collective")
            raise CollectiveError(
                f"stage {name!r}: rank {self.rank} {cause} ({waited:.0f} s into the stage): another rank died or "
                f"hangs - its log says which and why ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
            ) from err
        self.times[f"time/{name}"] = self.times.get(f"time/{name}", 0.0) + time.perf_counter() - t0
        if self.clock is not None:
            self._busy.setdefault(name, Busy()).add(b0, self.clock())


def busy_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """``busy/<stage>`` (mean over ranks), ``busy/<stage>_max``, and the step's two busy-time bounds:
    ``step/limit_s`` = the sum over stages of the mean (every rank equally busy, nothing exposed) and
    ``step/busy_critical_s`` = the sum over stages of the busiest rank (each stage waits for it); and
    ``balance/busy_ratio/<stage>``: the busiest rank's busy time over the mean of the ranks that ran the stage
    (1 = balanced; what speed-aware balancing aims at on ranks of unequal speed)."""
    stages = list(dict.fromkeys(k for busy in per_rank for k in busy))
    out: dict[str, float] = {}
    for name in stages:
        values = [busy.get(name, 0.0) for busy in per_rank]
        out[f"busy/{name}"] = sum(values) / len(values)
        out[f"busy/{name}_max"] = max(values)
        ran = [busy[name] for busy in per_rank if name in busy]
        if sum(ran) > 0:
            out[f"balance/busy_ratio/{name}"] = max(ran) * len(ran) / sum(ran)
    out["step/limit_s"] = sum(out[f"busy/{n}"] for n in stages)
    out["step/busy_critical_s"] = sum(out[f"busy/{n}_max"] for n in stages)
    return out
