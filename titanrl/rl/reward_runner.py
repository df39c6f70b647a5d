"""Running the reward function: worker processes, a time limit per call, errors and metrics.

``RewardRunner(spec, timeout_s, workers, on_error)`` scores ``(response, record)`` pairs and returns
one ``RewardResult`` per pair. With ``workers >= 1`` each call runs in one of that many worker
processes (started with ``spawn``: nothing of the trainer's threads, CUDA or vLLM state is inherited;
each worker loads the reward from its spec itself, so rewards defined in a file by path work too).
A call that runs longer than ``timeout_s`` has its worker killed and replaced. With ``workers = 0``
calls run in the trainer's process, with no time limit.

A failed call -- an exception, a timeout, a dead worker, a non-finite score or a malformed return
value -- is, per ``on_error``: ``"zero"``, a score of 0 with ``correct`` = 0, counted in
``reward/errors``; or ``"error"``, a ``RewardError`` naming the sample and what went wrong.
"""

from __future__ import annotations

import math as _math
import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable, Sequence

from titanrl.data.manifest import SampleRecord


# reward/<name> metrics the trainer logs itself; a reward's extras may not use these names
RESERVED_EXTRAS = frozenset({"accuracy", "errors", "mean", "uniform_group_fraction"})


class RewardError(RuntimeError):
    """A reward call failed and ``rl.on_reward_error = "error"``; the message names the sample."""


@dataclass
class RewardResult:
    score: float
    correct: float | None = None  # None: the reward does not say what is correct
    extras: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the call failed (score 0 then)


def normalize_output(value: Any) -> RewardResult:
    """A reward function's return value as a RewardResult; ValueError says what is wrong with it."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score' (keys {sorted(value)})")
        score = _number(value["score"], "score")
        correct = None
        if value.get("correct") is not None:
            correct = _number(value["correct"], "correct")
        extras = {str(k): _number(v, str(k)) for k, v in value.items() if k not in ("score", "correct")}
        reserved = sorted(set(extras) & RESERVED_EXTRAS)
        if reserved:
            raise ValueError(f"returned extra key(s) {reserved}, reserved for the trainer's reward/ metrics")
        return RewardResult(score=score, correct=correct, extras=extras)
    return RewardResult(score=_number(value, "score"))


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool):
        return float(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"returned a non-number for {key!r}: {value!r}") from None
    if not _math.isfinite(number):
        raise ValueError(f"returned a non-finite {key!r}: {number}")
    return number


def _call(fn: Callable, response: str, record: SampleRecord) -> RewardResult:
    try:
        return normalize_output(fn(response, record))
    except Exception as e:  # the reward's own bug: reported per sample
        return RewardResult(score=0.0, error=f"{type(e).__name__}: {e}")


def _worker_main(spec: str, conn: Connection) -> None:
    import signal

    from titanrl.rl.rewards import load_reward

    # The trainer owns this process: SIGTERM / SIGINT sent to the job's process group (torchrun forwards a
    # scheduler's SIGTERM) are the trainer's to handle - it checkpoints and then closes its workers. A worker whose
    # trainer is gone sees its pipe close and exits.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    try:
        fn = load_reward(spec)
    except Exception as e:
        conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        if item is None:
            return
        response, record = item
        try:
            conn.send(("result", _call(fn, response, record)))
        except Exception:
            conn.send(("result", RewardResult(score=0.0, error=traceback.format_exc(limit=1))))


class _Worker:
    def __init__(self, ctx, spec: str) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(spec, child), daemon=True, name="titanrl-reward")
        self.process.start()
        child.close()
        try:
            kind, payload = self.conn.recv() if self.conn.poll(120) else ("load_error", "did not start in 120 s")
        except EOFError:  # the process ended before it said ready (it re-imports __main__ first: spawn)
            self.process.join(5)
            kind, payload = "load_error", (
                f"the worker process exited with code {self.process.exitcode} before it was ready; it starts "
                "with multiprocessing's spawn, which imports the main module again: a script that starts "
                "training needs `if __name__ == '__main__':` around it")
        if kind != "ready":
            self.kill()
            raise RewardError(f"reward worker for {spec!r}: {payload}")
        self.task: int | None = None
        self.started = 0.0

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class RewardRunner:
    """Scores responses with the reward ``spec`` (see titanrl.rl.rewards); reusable across steps."""

    def __init__(self, spec: str, *, timeout_s: float = 10.0, workers: int = 1,
                 on_error: str = "zero") -> None:
        from titanrl.rl.rewards import load_reward

        if on_error not in ("zero", "error"):
            raise ValueError(f"on_error must be 'zero' or 'error', got {on_error!r}")
        self.spec, self.timeout_s, self.on_error = spec, timeout_s, on_error
        self.fn = load_reward(spec)  # ConfigError here, in the trainer, for a bad spec
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = [_Worker(self._ctx, spec) for _ in range(workers)]

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            w.kill()
        self._workers = []

    def __del__(self) -> None:  # best effort; daemonic workers also die with the trainer
        try:
            self.close()
        except Exception:
            pass

    def score(self, items: Sequence[tuple[str, SampleRecord]]) -> list[RewardResult]:
        results = self._run(items) if self._workers else [_call(self.fn, r, rec) for r, rec in items]
        for (_, record), result in zip(items, results):
            if result.error is not None:
                if self.on_error == "error":
                    raise RewardError(
                        f"reward {self.spec!r} failed on sample {record.id!r} (source {record.source!r}): "
                        f"{result.error} (rl.on_reward_error='zero' scores such a response 0 and counts it)"
                    )
                result.score, result.correct, result.extras = 0.0, 0.0, {}
                result.error = f"sample {record.id!r} (source {record.source!r}): {result.error}"
        return results

    def _run(self, items: Sequence[tuple[str, SampleRecord]]) -> list[RewardResult | None]:
        results: list[RewardResult | None] = [None] * len(items)
        pending = list(range(len(items)))[::-1]
        idle = list(self._workers)
        busy: dict[Connection, _Worker] = {}
        while pending or busy:
            while pending and idle:
                w = idle.pop()
                w.task, w.started = pending.pop(), time.monotonic()
                try:
                    w.conn.send(items[w.task])
                except OSError:  # the worker died while idle (killed from outside): a fresh one takes the call
                    w = self._replace(w)
                    w.started = time.monotonic()
                    w.conn.send(items[w.task])
                busy[w.conn] = w
            soonest = min(w.started for w in busy.values()) + self.timeout_s
            ready = wait(list(busy), timeout=max(0.0, soonest - time.monotonic()))
            for conn in ready:
                w = busy.pop(conn)
                try:
                    _, result = conn.recv()
                except (EOFError, OSError):
                    result = RewardResult(score=0.0, error=f"the reward worker died (exit code {w.process.exitcode})")
                    w = self._replace(w)
                results[w.task] = result
                idle.append(w)
            now = time.monotonic()
            for conn, w in list(busy.items()):
                if now - w.started >= self.timeout_s:
                    del busy[conn]
                    results[w.task] = RewardResult(score=0.0, error=f"timed out after {self.timeout_s:g} s")
                    idle.append(self._replace(w))
        return results

    def _replace(self, worker: _Worker) -> _Worker:
        task = worker.task
        worker.kill()
        fresh = _Worker(self._ctx, self.spec)
        fresh.task = task
        self._workers[self._workers.index(worker)] = fresh
        return fresh


def reward_sums(results: Iterable[RewardResult]) -> dict[str, tuple[float, float]]:
    """Per metric (``accuracy``, ``errors`` and each extra): (sum, count) over ``results``.
    ``accuracy`` covers the results that report ``correct`` (a failed call counts as 0 there)."""
    sums: dict[str, tuple[float, float]] = {"errors": (0.0, 0.0)}
    reported = 0.0
    for r in results:
        s, n = sums["errors"]
        sums["errors"] = (s + (r.error is not None), n + 1)
        if r.correct is not None:
            s, n = sums.get("accuracy", (0.0, 0.0))
            sums["accuracy"] = (s + r.correct, n + 1)
            reported += r.error is None
        for k, v in r.extras.items():
            s, n = sums.get(k, (0.0, 0.0))
            sums[k] = (s + v, n + 1)
    sums["_reported_correct"] = (reported, 0.0)
    return sums


def reward_metrics(per_rank: Iterable[dict[str, tuple[float, float]]]) -> dict[str, float]:
    """``reward/accuracy`` (only when some call reported ``correct``), ``reward/errors`` (failed calls,
    summed) and ``reward/<extra>`` (means), from every rank's ``reward_sums``."""
    total: dict[str, list[float]] = {}
    for sums in per_rank:
        for k, (s, n) in sums.items():
            acc = total.setdefault(k, [0.0, 0.0])
            acc[0] += s
            acc[1] += n
    out: dict[str, float] = {}
    reported = total.pop("_reported_correct", [0.0, 0.0])[0]
    for k, (s, n) in total.items():
        if k == "errors":
            out["reward/errors"] = s
        elif k == "accuracy":
            if reported > 0:
                out["reward/accuracy"] = s / max(n, 1.0)
        elif n > 0:
            out[f"reward/{k}"] = s / n
    return out
