"""Where every sequence of a training stage runs: waves of sequence placements, identical on every rank.

A stage (old/reference log-probs over a step's sequences, or one update minibatch) runs as a
number of *waves*: one model forward (and backward) on every rank, with each rank's share under
``max_tokens`` tokens. Every rank computes the same :class:`StagePlan` from the all-gathered lengths
and home ranks, so no plan is ever sent.

Methods:
- ``none``: every sequence stays on the rank that generated it; each rank splits its own sequences
  greedily, in order, into microbatches of at most ``max_tokens``, and the wave count is the largest
  rank's (the others idle through the rest: what a data-parallel trainer without balancing does).
- ``flex``: FlexUlysses (:func:`plan_shards`) over all sequences: per-sequence degrees, nested groups.
- ``fixed``: one Ulysses degree for every sequence (:func:`plan_fixed_sp`), the paper's baseline.
- ``bucketing``: whole sequences dealt to ranks, equal counts (:func:`plan_bucketing`), verl's way.

For the global methods the sequences are split into the fewest waves (Karmarkar-Karp on cost, so
waves are alike) whose plans keep every rank within ``max_tokens``; each wave is planned on its own.

``strategy`` (``balance.strategy``, the ODC paper's names) says how ranks synchronise:

- ``native`` (method ``none`` only): as above, every rank runs every wave (FSDP collectives per layer).
- ``lb_micro``: the minibatch is balanced across ranks and every rank runs every wave; with method
  ``none`` the sequences are re-partitioned by Karmarkar-Karp into equal microbatch counts
  (:func:`partition_minibatch`), with the Ulysses methods the waves above.
- ``lb_mini``: one synchronisation per minibatch (``sync = "minibatch"``, run by
  ``titanrl.parallel.odc.minibatch_sync``): ranks run only the waves they have work in, different
  numbers of them. Method ``none``: Karmarkar-Karp per minibatch with unequal counts, each rank's share
  packed into as many microbatches as its budget needs. Ulysses methods: the waves' sharded groups come
  first (their members run them together), then each rank's whole sequences of all waves, repacked into
  its own microbatches, so no all-to-all follows any rank's final (gradient-reducing) microbatch.

A sequence whose share is over ``max_tokens`` even at the highest degree the method allows cannot be
made to fit: it runs in a wave of its own (split as far as allowed), and the plan lists it in
``over_budget`` so the run can report it instead of failing on one outlier.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from titanrl.parallel.balance import karmarkar_karp, pack_microbatches, partition_minibatch
from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.flex_ulysses import ShardPlan, plan_bucketing, plan_fixed_sp, plan_shards
from titanrl.parallel.flex_ulysses.groups import max_degree

StageMethod = Literal["none", "flex", "fixed", "bucketing"]
BalanceStrategy = Literal["native", "lb_micro", "lb_mini"]
Sync = Literal["wave", "minibatch"]


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, end)`` of stage sequence ``seq``, placed on one rank."""

    seq: int
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardedStep:
    """A sequence group run by ``ranks`` together; ``slices[s][m]`` is member ``m``'s range of ``seqs[s]``."""

    degree: int
    ranks: tuple[int, ...]
    seqs: tuple[int, ...]
    slices: tuple[tuple[tuple[int, int], ...], ...]

    def pieces(self, rank: int) -> list[Piece]:
        m = self.ranks.index(rank)
        return [Piece(s, *per_member[m]) for s, per_member in zip(self.seqs, self.slices)]


@dataclass(frozen=True)
class RankWave:
    """One rank's share of a wave, in the order of its packed stream: sharded groups (highest
    sharding first), then whole sequences."""

    sharded: tuple[ShardedStep, ...] = ()
    local: tuple[int, ...] = ()

    def pieces(self, rank: int, lengths: Sequence[int]) -> list[Piece]:
        out = [p for step in self.sharded for p in step.pieces(rank)]
        return out + [Piece(s, 0, int(lengths[s])) for s in self.local]

    @property
    def empty(self) -> bool:
        return not self.sharded and not self.local


@dataclass(frozen=True)
class Wave:
    ranks: tuple[RankWave, ...]
    planned_cost: tuple[float, ...]  # per rank, in the cost model's units
    tokens: tuple[int, ...]  # per rank
    # per rank, planned_cost in time on ranks of the plan's unequal speeds: a sharded sequence's share at its
    # group's slowest member's speed, a whole one at the rank's (None: planned for equal speeds, or no sharding)
    planned_time: tuple[float, ...] | None = None


@dataclass(frozen=True)
class StagePlan:
    method: str
    lengths: tuple[int, ...]
    homes: tuple[int, ...]
    waves: tuple[Wave, ...]
    plan_seconds: float
    degrees: tuple[int, ...]  # per sequence (1 = whole on one rank)
    over_budget: tuple[int, ...] = ()  # sequences that cannot fit max_tokens at any allowed degree
    sync: Sync = "wave"  # "minibatch": a rank runs only its non-empty waves (lb_mini)

    @property
    def num_devices(self) -> int:
        return len(self.waves[0].ranks) if self.waves else 0

    def pieces(self, wave: int, rank: int) -> list[Piece]:
        return self.waves[wave].ranks[rank].pieces(rank, self.lengths)

    def moves_data(self) -> bool:
        """Whether any piece is placed away from its home rank (then the stage exchanges data)."""
        for w in range(len(self.waves)):
            for r in range(self.num_devices):
                if any(self.homes[p.seq] != r for p in self.pieces(w, r)):
                    return True
        return False

    @property
    def degree_max(self) -> int:
        return max(self.degrees, default=1)

    @property
    def sharded_sequences(self) -> int:
        return sum(1 for d in self.degrees if d > 1)

    def rank_waves(self, rank: int) -> list[int]:
        """The waves ``rank`` runs: all of them, or (minibatch sync) only those it has work in."""
        if self.sync == "wave":
            return list(range(len(self.waves)))
        return [w for w, wave in enumerate(self.waves) if not wave.ranks[rank].empty]

    def microbatch_counts(self) -> list[int]:
        return [len(self.rank_waves(r)) for r in range(self.num_devices)]

    @property
    def planned_times(self) -> tuple[float, float]:
        """(planned stage time, mean per-rank cost), in cost units: per wave the most loaded rank
        when waves synchronise, the most loaded rank's total under minibatch sync."""
        return self.times_at(None)

    def times_at(self, speeds: Sequence[float] | None) -> tuple[float, float]:
        """:attr:`planned_times` on ranks of relative ``speeds`` (a rank's cost over its speed; None: equal)."""
        if not self.waves:
            return 0.0, 0.0
        cost = np.asarray([w.planned_cost for w in self.waves], dtype=np.float64)
        if speeds is not None and all(w.planned_time is not None for w in self.waves):
            cost = np.asarray([w.planned_time for w in self.waves], dtype=np.float64)  # (Ulysses groups)
        elif speeds is not None:
            cost = cost / np.asarray(speeds, dtype=np.float64)
        totals = cost.sum(axis=0)
        peak = float(totals.max()) if self.sync == "minibatch" else float(cost.max(axis=1).sum())
        return peak, float(totals.mean())

    def rank_costs(self) -> np.ndarray:
        """Each rank's planned cost over the stage's waves."""
        return np.sum([w.planned_cost for w in self.waves], axis=0) if self.waves else np.zeros(self.num_devices)

    @property
    def balance_planned(self) -> float:
        """Planned stage time over the time if every rank carried the mean load."""
        peak, mean = self.planned_times
        return peak / mean if mean > 0 else 1.0

    @property
    def bubble_planned(self) -> float:
        """Planned idle fraction: 1 - mean / planned time (ODC appendix G)."""
        peak, mean = self.planned_times
        return 1.0 - mean / peak if peak > 0 else 0.0


def rank_sums(plan: StagePlan, values: Sequence[float], speeds: Sequence[float] | None = None) -> np.ndarray:
    """Per rank, the sum over the stage's waves of ``values[s]`` of the sequences it computes, a sequence
    sharded ``p`` ways counting ``1/p`` on each member (how the planned costs are built; used to fit the cost
    model to measured times). ``speeds``: each term over the speed it runs at (a whole sequence the rank's, a
    sharded one its group's slowest member's): the values in time."""
    out = np.zeros(plan.num_devices)
    for wave in plan.waves:
        out += _wave_sums(wave, values, speeds)
    return out


def _wave_sums(wave: Wave, values: Sequence[float], speeds: Sequence[float] | None = None) -> np.ndarray:
    """:func:`rank_sums` of one wave."""
    out = np.zeros(len(wave.ranks))
    for r, rw in enumerate(wave.ranks):
        mine = 1.0 if speeds is None else float(speeds[r])
        out[r] += sum(float(values[s]) for s in rw.local) / mine
        for step in rw.sharded:
            slowest = 1.0 if speeds is None else min(float(speeds[q]) for q in step.ranks)
            out[r] += sum(float(values[s]) / step.degree for s in step.seqs) / slowest
    return out


def _timed(waves: Sequence[Wave], costs: Sequence[float], speeds: Sequence[float]) -> tuple[Wave, ...]:
    """Waves with ``planned_time``: each rank's planned cost scaled by the time its sequences take at the speeds
    they run at (``costs`` tell the whole and sharded parts apart)."""
    out = []
    for wave in waves:
        work, took = _wave_sums(wave, costs), _wave_sums(wave, costs, speeds)
        times = tuple(float(c) * (float(t) / float(w) if w > 0 else 1.0 / float(sp))
                      for c, w, t, sp in zip(wave.planned_cost, work, took, speeds))
        out.append(dataclasses.replace(wave, planned_time=times))
    return tuple(out)


class PlanError(ValueError):
    pass


def _wave_from_shard_plan(plan: ShardPlan, ids: Sequence[int]) -> Wave:
    """Map a plan over a wave's sequences (wave-local indices) to stage sequence ids."""
    ranks = []
    for sched in plan.schedule:
        sharded = tuple(
            ShardedStep(step.degree, step.ranks, tuple(ids[i] for i in step.seq_ids),
                        tuple(plan.slices[i] for i in step.seq_ids))
            for step in sched.collectives
        )
        local = tuple(ids[i] for step in sched.local for i in step.seq_ids)
        ranks.append(RankWave(sharded, local))
    return Wave(tuple(ranks), tuple(plan.device_cost), tuple(plan.device_tokens))


def _local_microbatches(lengths: Sequence[int], homes: Sequence[int], num_devices: int,
                        max_tokens: int) -> list[list[list[int]]]:
    """native: each rank's own sequences, in order, cut greedily at ``max_tokens``."""
    per_rank: list[list[list[int]]] = []
    for r in range(num_devices):
        mbs: list[list[int]] = []
        used = 0
        for s in (i for i, h in enumerate(homes) if h == r):
            if not mbs or used + lengths[s] > max_tokens:
                mbs.append([])
                used = 0
            mbs[-1].append(s)
            used += lengths[s]
        per_rank.append(mbs)
    return per_rank


def _waves_of_microbatches(per_rank: Sequence[Sequence[Sequence[int]]], lengths: Sequence[int],
                           costs: Sequence[float]) -> list[Wave]:
    """Wave ``w`` = every rank's ``w``-th microbatch of whole sequences (or nothing)."""
    waves = []
    for w in range(max((len(m) for m in per_rank), default=0)):
        members = [tuple(m[w]) if w < len(m) else () for m in per_rank]
        waves.append(Wave(tuple(RankWave(local=ms) for ms in members),
                          tuple(float(sum(costs[s] for s in ms)) for ms in members),
                          tuple(sum(lengths[s] for s in ms) for ms in members)))
    return waves


def _sharded_first(waves: Sequence[Wave], lengths: Sequence[int], costs: Sequence[float], num_devices: int,
                   max_tokens: int) -> list[Wave]:
    """lb_mini with Ulysses: the waves' sharded groups first, then every rank's whole sequences of
    all waves repacked into its own microbatches (see the module docstring)."""
    out = []
    for wave in waves:
        if not any(rw.sharded for rw in wave.ranks):
            continue
        ranks = tuple(RankWave(sharded=rw.sharded) for rw in wave.ranks)
        cost, tokens = [0.0] * num_devices, [0] * num_devices
        for r, rw in enumerate(ranks):
            for step in rw.sharded:
                for p in step.pieces(r):
                    cost[r] += costs[p.seq] / step.degree
                    tokens[r] += p.num_tokens
        out.append(Wave(ranks, tuple(cost), tuple(tokens)))
    local = [[s for wave in waves for s in wave.ranks[r].local] for r in range(num_devices)]
    per_rank = [pack_microbatches(range(len(ls)), [lengths[s] for s in ls], [costs[s] for s in ls], max_tokens)
                if ls else []
                for ls in local]
    per_rank = [[[ls[i] for i in mb] for mb in mbs] for ls, mbs in zip(local, per_rank)]
    return out + _waves_of_microbatches(per_rank, lengths, costs)


def top_degree(method: StageMethod, num_devices: int, p_max: int, degree: int) -> int:
    if method == "flex":
        return max_degree(num_devices, p_max)
    if method == "fixed":
        return degree
    return 1


def plan_stage(
    lengths: Sequence[int],
    homes: Sequence[int],
    num_devices: int,
    *,
    method: StageMethod,
    max_tokens: int,
    cost_model: CostModel,
    strategy: BalanceStrategy | None = None,
    p_max: int = 1,
    degree: int = 1,
    costs: Sequence[float] | None = None,
    speeds: Sequence[float] | None = None,
) -> StagePlan:
    """Plan one stage (see the module docstring). ``homes[s]`` is the rank holding sequence ``s``;
    ``strategy`` None = ``native`` for method ``none``, ``lb_micro`` for the others. ``costs``: each
    sequence's cost when it is not ``cost_model.compute(length)`` (a shared-prefix unit attends less:
    ``CostModel.prefix_compute``); it drives the wave partition and the microbatching, while the
    FlexUlysses degree planner prices a unit by its length (overstating the attention a shared
    prompt saves, never the tokens). ``speeds`` (relative, one per rank): method ``none`` under ``lb_micro`` /
    ``lb_mini`` gives ranks work in proportion (:func:`~titanrl.parallel.balance.speed_partition`), ``fixed``
    and ``flex`` place so that the latest finish is earliest, a Ulysses group running at its slowest member's
    speed; ``bucketing`` deals equal counts and refuses unequal speeds."""
    t0 = time.perf_counter()
    if strategy is None:
        strategy = "native" if method == "none" else "lb_micro"
    h = [int(x) for x in lengths]
    if len(homes) != len(h):
        raise ValueError(f"{len(h)} lengths but {len(homes)} home ranks")
    if strategy == "native" and method != "none":
        raise ValueError(f"balance.strategy='native' keeps sequences where they are; method {method!r} places them")
    if speeds is not None and len(set(speeds)) > 1 and method == "bucketing":
        raise ValueError("bucketing deals equal counts as if every rank were equally fast; unequal rank speeds need "
                         "another method")
    top = top_degree(method, num_devices, p_max, degree)
    over = tuple(i for i, length in enumerate(h) if math.ceil(length / top) > max_tokens)
    if costs is None:
        costs = np.asarray(cost_model.compute(np.asarray(h, dtype=float)), dtype=float)
    elif len(costs) != len(h):
        raise ValueError(f"{len(h)} lengths but {len(costs)} costs")
    costs = [float(c) for c in costs]
    sync: Sync = "minibatch" if strategy == "lb_mini" else "wave"
    if method == "none":
        if strategy == "native":
            per_rank = _local_microbatches(h, homes, num_devices, max_tokens)
        else:  # lengths capped at the budget: a longer sequence fills a microbatch alone
            per_rank = partition_minibatch([min(x, max_tokens) for x in h], num_devices, strategy=strategy,
                                           max_tokens_per_microbatch=max_tokens, costs=costs, speeds=speeds) if h else []
        waves = _waves_of_microbatches(per_rank, h, costs)
        return StagePlan(method, tuple(h), tuple(homes), tuple(waves), time.perf_counter() - t0,
                         tuple(1 for _ in h), over, sync)

    def plan_one(ids: list[int]) -> ShardPlan:
        sub = [h[i] for i in ids]
        if method == "flex":
            mean = sum(sub) / num_devices
            alpha = max(1.0, max_tokens / mean) if mean > 0 else 1.0
            return plan_shards(sub, num_devices, p_max=p_max, alpha=alpha, cost_model=cost_model, speeds=speeds)
        if method == "fixed":
            return plan_fixed_sp(sub, num_devices, degree, cost_model=cost_model, speeds=speeds)
        if method == "bucketing":
            return plan_bucketing(sub, num_devices)
        raise ValueError(f"unknown stage method {method!r}")

    rest = [i for i in range(len(h)) if i not in set(over)]
    n = len(rest)
    num_waves = max(1, math.ceil(sum(h[i] for i in rest) / (num_devices * max_tokens))) if n else 0
    plans: list[tuple[list[int], ShardPlan]] = []
    while n:
        parts = (karmarkar_karp([costs[i] for i in rest], num_waves, equal_size=False) if num_waves > 1
                 else [list(range(n))])
        parts = [sorted(rest[k] for k in part) for part in parts if part]
        plans = [(ids, plan_one(ids)) for ids in parts]
        if all(max(plan.device_tokens) <= max_tokens for _, plan in plans):
            break
        if num_waves >= n:
            raise PlanError(f"no {method} plan keeps every rank within balance.max_tokens_per_microbatch="
                            f"{max_tokens}, even with one sequence per wave (lengths {sorted(h)[-4:]} ...)")
        num_waves = min(n, num_waves + max(1, num_waves // 8))
    plans += [([i], plan_one([i])) for i in over]  # each alone, split as far as the method allows
    stage = stage_from_shard_plans(method, h, homes, plans, time.perf_counter() - t0, over)
    if sync == "minibatch":
        waves = _sharded_first(stage.waves, h, costs, num_devices, max_tokens)
        stage = dataclasses.replace(stage, waves=tuple(waves), sync=sync, plan_seconds=time.perf_counter() - t0)
    if speeds is not None and len(set(speeds)) > 1:
        stage = dataclasses.replace(stage, waves=_timed(stage.waves, costs, speeds))
    return stage


def stage_from_shard_plans(method: str, lengths: Sequence[int], homes: Sequence[int],
                           plans: Sequence[tuple[Sequence[int], ShardPlan]], seconds: float = 0.0,
                           over_budget: Sequence[int] = ()) -> StagePlan:
    """A stage whose waves are the given shard plans, each over the stage sequences ``ids``."""
    degrees = [1] * len(lengths)
    for ids, plan in plans:
        for i, d in zip(ids, plan.degrees):
            degrees[i] = int(d)
    waves = tuple(_wave_from_shard_plan(plan, ids) for ids, plan in plans)
    return StagePlan(method, tuple(int(x) for x in lengths), tuple(homes), waves, seconds, tuple(degrees),
                     tuple(over_budget))
