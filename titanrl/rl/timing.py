"""Per-stage wall-clock of one RL step, and a named error when a stage's collective times out.

A rank that dies or hangs leaves the others blocked in a collective. With gloo the waiting ranks'
collective raises after the process group's timeout (``job.collective_timeout_s``) - or at once with
"connection closed" when the peer's process is gone - with a message that names neither the stage
nor the cause. ``StageTimer`` turns both into ``CollectiveError`` naming the stage, the rank and the
timeout. (With NCCL, PyTorch's watchdog aborts the process at the same timeout with its own message
naming the collective.)
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

_TIMED_OUT = ("timed out", "timeout")
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe")


class CollectiveError(RuntimeError):
    """A collective inside an RL stage did not complete: another rank died or hangs."""


def _classify(err: BaseException) -> str | None:
    text = str(err).lower()
    if any(s in text for s in _TIMED_OUT):
        return "timeout"
    if any(s in text for s in _PEER_LOST):
        return "peer_lost"
    return None


class StageTimer:
    """``with timer("update"): ...`` adds the block's seconds to ``times["time/update"]``."""

    def __init__(self, rank: int = 0, collective_timeout_s: float | None = None) -> None:
        self.rank = rank
        self.collective_timeout_s = collective_timeout_s
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
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
