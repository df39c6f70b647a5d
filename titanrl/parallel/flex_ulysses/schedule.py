"""Per-rank collective order of a :class:`ShardPlan` and a deadlock check by simulation.

Collectives on one communicator must be issued in the same order by all of its members, and a
blocking collective on group ``G`` completes only when every member of ``G`` has reached it. With
several nested groups per rank, a bad per-rank order waits cyclically (FlexRL sec. 3.3: rank 0 in
an all2all on {0,1} while ranks 1-3 sit in one on {0..3}).

:func:`collective_queues` turns a plan's per-rank schedule into the ordered list of collectives each
rank issues on its communication stream, for every attention layer, forward and (optionally)
backward, either one sequence group at a time (``all2all1``, attention, ``all2all2``) or with
Algorithm 1's overlap, where ``all2all1`` of the next group is issued before ``all2all2`` of the
current one. :func:`simulate` runs all queues against each other: a collective completes when it
is at the head of every member's queue; the run deadlocks when queues are left and no collective
can complete. :func:`check_deadlock_free` raises :class:`DeadlockError` then.

Why the plan's order passes: groups are laminar (two groups are disjoint or nested) and every rank
takes its collectives as a subsequence of one global highest-sharding-first order (degree
descending, then group start, then pack order). Plain order: the globally first unfinished
collective heads the queue of each of its members, so some collective can always complete.
Overlap: let ranks ``a`` and ``b`` share collectives ``X`` before ``Y`` and let ``Z`` lie between
them in the global order with ``a`` in ``Z``. HSF gives ``deg(X) >= deg(Z) >= deg(Y)``; ``Z`` and
``Y`` meet in ``a``, so by laminarity ``Z`` contains ``Y``'s group and thus ``b``. Between their
first and last shared collective two ranks therefore have identical lists, and the one-ahead
interleaving of Algorithm 1 orders their shared collectives identically. The simulation checks
the whole thing, for any number of layers, forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from titanrl.parallel.flex_ulysses.plan import ShardPlan


@dataclass(frozen=True)
class Collective:
    """One collective call: ``key`` identifies it across ranks, ``ranks`` is its communicator."""

    key: tuple[int, ...]  # (pass, layer, sequence group index, phase): pass 0 fwd / 1 bwd
    ranks: tuple[int, ...]


class DeadlockError(RuntimeError):
    pass


@dataclass(frozen=True)
class SimulationResult:
    completed: bool
    completed_collectives: int
    stuck: tuple[tuple[int, tuple[int, ...] | None], ...]  # (rank, key at its head) when stuck


def _rank_order(steps: Sequence[tuple[int, tuple[int, ...]]], overlap: bool) -> list[tuple[int, int, tuple[int, ...]]]:
    """(group index, phase, ranks) in the order one rank issues them within one layer."""
    if not overlap:
        return [(g, phase, ranks) for g, ranks in steps for phase in (1, 2)]
    out: list[tuple[int, int, tuple[int, ...]]] = []
    if steps:
        out.append((steps[0][0], 1, steps[0][1]))
    for t, (g, ranks) in enumerate(steps):
        if t + 1 < len(steps):
            out.append((steps[t + 1][0], 1, steps[t + 1][1]))
        out.append((g, 2, ranks))
    return out


def collective_queues(
    plan: ShardPlan, *, overlap: bool = True, layers: int = 1, backward: bool = True
) -> list[list[Collective]]:
    """Per rank, the ordered collectives it issues (see module docstring).

    The backward pass is each rank's forward list reversed (autograd replays a rank's forward
    collectives in reverse)."""
    queues: list[list[Collective]] = []
    for sched in plan.schedule:
        steps = [(s.group_index, s.ranks) for s in sched.collectives]
        layer_order = _rank_order(steps, overlap)
        fwd = [Collective((0, layer, g, phase), ranks) for layer in range(layers) for g, phase, ranks in layer_order]
        bwd = [Collective((1,) + c.key[1:], c.ranks) for c in reversed(fwd)] if backward else []
        queues.append(fwd + bwd)
    return queues


def simulate(queues: Sequence[Sequence[Collective]]) -> SimulationResult:
    """Run blocking collectives: one completes when it heads the queue of every member."""
    n = len(queues)
    members: dict[tuple[int, ...], tuple[int, ...]] = {}
    for r, queue in enumerate(queues):
        for c in queue:
            known = members.setdefault(c.key, c.ranks)
            if known != c.ranks:
                raise ValueError(f"collective {c.key} has two different groups {known} and {c.ranks}")
            if r not in c.ranks:
                raise ValueError(f"rank {r} issues collective {c.key} on a group without it: {c.ranks}")
    pos = [0] * n
    arrived: dict[tuple[int, ...], int] = {}
    ready: list[tuple[int, ...]] = []

    def arrive(r: int) -> None:
        if pos[r] < len(queues[r]):
            c = queues[r][pos[r]]
            arrived[c.key] = arrived.get(c.key, 0) + 1
            if arrived[c.key] == len(c.ranks):
                ready.append(c.key)

    for r in range(n):
        arrive(r)
    done = 0
    while ready:
        ready.sort()
        key = ready.pop(0)
        done += 1
        for r in members[key]:
            pos[r] += 1
            arrive(r)
    finished = all(pos[r] == len(queues[r]) for r in range(n))
    stuck = tuple(
        (r, queues[r][pos[r]].key if pos[r] < len(queues[r]) else None) for r in range(n) if pos[r] < len(queues[r])
    )
    return SimulationResult(completed=finished, completed_collectives=done, stuck=stuck)


def check_queues(queues: Sequence[Sequence[Collective]]) -> int:
    """Simulate per-rank queues; return how many collectives completed or raise :class:`DeadlockError`."""
    result = simulate(queues)
    if not result.completed:
        raise DeadlockError(f"cyclic wait: (rank, collective at its head) {result.stuck[:8]}")
    return result.completed_collectives


def check_deadlock_free(plan: ShardPlan, *, overlap: bool = True, layers: int = 2, backward: bool = True) -> int:
    """Simulate the plan's collectives; return how many completed or raise :class:`DeadlockError`."""
    return check_queues(collective_queues(plan, overlap=overlap, layers=layers, backward=backward))
