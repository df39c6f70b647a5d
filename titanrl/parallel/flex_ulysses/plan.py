"""The plan every rank computes identically from the batch metadata: :class:`ShardPlan`.

A plan fixes, for every sequence, its sharding degree ``p`` and device group ``G`` (an admissible
group of :mod:`.groups`) and splits its tokens into ``p`` contiguous slices, slice ``j`` on
``G[j]``. Sequences on the same ``(p, G)`` are packed into *sequence groups* (FlexRL sec. 3.4): a
sequence longer than ``h_pack`` is a group on its own, shorter ones are concatenated greedily until
the next one would take the pack past ``H_pack`` tokens. Sequence groups with ``p > 1`` are put in
one global highest-sharding-first (HSF) order; each rank's :class:`RankSchedule` is the ordered
subsequence of the groups it belongs to, with this rank's token slice of every sequence, and its
``p = 1`` groups listed separately (they need no collective).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.flex_ulysses.groups import admissible_groups, group_ranks

DEFAULT_H_PACK = 4096  # sequences up to this many tokens may share a sequence group
DEFAULT_H_PACK_CAP = 16384  # a packed sequence group stops growing at this many tokens


@dataclass(frozen=True)
class SequenceGroup:
    """Sequences run as one Ulysses unit on ``ranks`` (one all2all pair per attention layer)."""

    index: int  # position in ShardPlan.sequence_groups (HSF order for p > 1, then p = 1 groups)
    degree: int
    ranks: tuple[int, ...]
    seq_ids: tuple[int, ...]
    tokens: int


@dataclass(frozen=True)
class ScheduleStep:
    """One sequence group as seen by one rank: what it holds and whom it talks to."""

    group_index: int  # index into ShardPlan.sequence_groups
    degree: int
    ranks: tuple[int, ...]
    seq_ids: tuple[int, ...]
    slices: tuple[tuple[int, int], ...]  # this rank's [start, end) token range of each sequence


@dataclass(frozen=True)
class RankSchedule:
    """Per-rank execution order (FlexRL Algorithm 1): ``collectives`` in HSF order, ``local`` p=1."""

    rank: int
    collectives: tuple[ScheduleStep, ...]
    local: tuple[ScheduleStep, ...]

    @property
    def tokens(self) -> int:
        return sum(end - start for step in (*self.collectives, *self.local) for start, end in step.slices)


@dataclass(frozen=True)
class ShardPlan:
    """Where every token of every sequence goes, and in which order ranks run their collectives.

    Per-device loads: ``device_tokens`` (exact slice sizes, sum = total tokens),
    ``device_attention_cost`` (sum of ``h**2 / p``, the paper's attention proxy) and ``device_cost``
    (sum of ``cost_model.compute(h) / p``, what the planner balanced). ``memory_ok`` says whether
    every device is within ``memory_cap`` tokens (``alpha`` times the mean); when it is False the
    plan is still complete and valid, only over the cap.
    """

    method: str
    lengths: tuple[int, ...]
    num_devices: int
    p_max: int
    degrees: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    slices: tuple[tuple[tuple[int, int], ...], ...]  # per sequence, per position in its group
    device_tokens: tuple[int, ...]
    device_attention_cost: tuple[float, ...]
    device_cost: tuple[float, ...]
    memory_cap: float
    memory_ok: bool
    sequence_groups: tuple[SequenceGroup, ...]
    schedule: tuple[RankSchedule, ...]
    alltoall_volume: float  # tokens sent per all-to-all round, summed over devices: sum h (p-1)/p
    max_device_alltoall_volume: float  # max over devices of sum (h/p)(p-1)/p
    split_cost: float  # FlexRL appendix A TotalCost = sum SplitCost(h_i, p_i)
    attention_lower_bound: float  # max(mean, max_i h_i**2 / degree cap_i): no plan can do better
    cost_lower_bound: float  # the same for device_cost
    info: tuple[tuple[str, float], ...] = field(default=(), compare=True)

    # ------------------------------------------------------------------ ratios

    @staticmethod
    def _ratio(values: Sequence[float]) -> float:
        arr = np.asarray(values, dtype=np.float64)
        mean = float(arr.mean()) if arr.size else 0.0
        return float(arr.max()) / mean if mean > 0 else 1.0

    @property
    def balance_ratio(self) -> float:
        """max / mean per-device attention cost (FlexRL Fig. 7's "balance ratio")."""
        return self._ratio(self.device_attention_cost)

    @property
    def memory_ratio(self) -> float:
        """max / mean per-device tokens."""
        return self._ratio(self.device_tokens)

    @property
    def cost_balance_ratio(self) -> float:
        """max / mean of the planner's cost-model objective per device."""
        return self._ratio(self.device_cost)

    @property
    def attention_bound_ratio(self) -> float:
        """The best balance_ratio any plan with these degrees allowed could reach."""
        mean = float(np.mean(self.device_attention_cost))
        return self.attention_lower_bound / mean if mean > 0 else 1.0

    @property
    def admissible_groups(self) -> dict[int, tuple[tuple[int, ...], ...]]:
        return admissible_groups(self.num_devices, self.p_max)

    @property
    def collective_groups(self) -> tuple[tuple[int, ...], ...]:
        """The distinct groups with ``p > 1`` this plan uses, in HSF order (what needs a process
        group / DeviceMesh submesh this step)."""
        seen: dict[tuple[int, ...], None] = {}
        for sg in self.sequence_groups:
            if sg.degree > 1:
                seen.setdefault(sg.ranks, None)
        return tuple(seen)


# ---------------------------------------------------------------------------------- building


def split_slices(length: int, degree: int) -> tuple[tuple[int, int], ...]:
    """``degree`` contiguous [start, end) slices of ``length`` tokens; the first ``length % degree``
    slices get one token more."""
    base, extra = divmod(length, degree)
    out = []
    start = 0
    for j in range(degree):
        end = start + base + (1 if j < extra else 0)
        out.append((start, end))
        start = end
    return tuple(out)


def _slices_from_sizes(length: int, degree: int, sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    sizes = [int(x) for x in sizes]
    if len(sizes) != degree or sum(sizes) != length or max(sizes) - min(sizes) > 1:
        raise ValueError(f"bad slice sizes {sizes} for {length} tokens on {degree} ranks")
    out = []
    start = 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return tuple(out)


def pack_sequences(
    seq_ids: Sequence[int], lengths: Sequence[int], h_pack: int, h_pack_cap: int
) -> list[tuple[int, ...]]:
    """FlexRL sec. 3.4 dynamic shard packing for the sequences of one (p, G).

    Long sequences (> ``h_pack``) are groups on their own; short ones, in decreasing length (ties by
    id), are concatenated first-fit-decreasing into packs of at most ``h_pack_cap`` tokens. Groups
    come out in decreasing token count (ties by their first sequence id): a consistent order that
    every rank derives identically.
    """
    ordered = sorted(seq_ids, key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    pack_tokens: list[int] = []
    packs: list[list[int]] = []
    for i in ordered:
        if lengths[i] > h_pack:
            groups.append([i])
            continue
        for k, tokens in enumerate(pack_tokens):
            if tokens + lengths[i] <= h_pack_cap:
                packs[k].append(i)
                pack_tokens[k] += lengths[i]
                break
        else:
            packs.append([i])
            pack_tokens.append(lengths[i])
    groups.extend(packs)
    sized = [(tuple(g), sum(lengths[i] for i in g)) for g in groups]
    sized.sort(key=lambda item: (-item[1], item[0][0]))
    return [g for g, _ in sized]


def build_plan(
    method: str,
    lengths: Sequence[int],
    num_devices: int,
    p_max: int,
    degrees: Sequence[int],
    blocks: Sequence[int],
    *,
    sizes: Sequence[Sequence[int]] | None = None,
    cost_model: CostModel,
    alpha: float,
    max_degree: int,
    h_pack: int = DEFAULT_H_PACK,
    h_pack_cap: int = DEFAULT_H_PACK_CAP,
    info: dict[str, float] | None = None,
) -> ShardPlan:
    """Materialize a :class:`ShardPlan` from per-sequence (degree, aligned block index).

    For ``degree == 1`` the block index is the rank itself. ``sizes`` gives each sequence's slice
    sizes in group order (they must sum to its length and differ by at most one); by default the
    first ``h % p`` slices get the extra token.
    """
    n = len(lengths)
    h = np.asarray(lengths, dtype=np.int64)
    deg = np.asarray(degrees, dtype=np.int64)
    blk = np.asarray(blocks, dtype=np.int64)
    lens = [int(x) for x in h]
    groups = tuple(group_ranks(int(deg[i]), int(blk[i])) for i in range(n))
    if sizes is None:
        slices = tuple(split_slices(lens[i], int(deg[i])) for i in range(n))
    else:
        slices = tuple(_slices_from_sizes(lens[i], int(deg[i]), sizes[i]) for i in range(n))

    hf = h.astype(np.float64)
    # per-device sums: one entry per (sequence, member rank), summed with bincount
    flat_ranks = np.asarray([r for g in groups for r in g], dtype=np.int64)
    flat_sizes = np.asarray([e - s for sl in slices for s, e in sl], dtype=np.float64)

    def per_device(per_seq: np.ndarray) -> np.ndarray:
        if not n:
            return np.zeros(num_devices)
        return np.bincount(flat_ranks, weights=np.repeat(per_seq, deg), minlength=num_devices)

    attention = per_device(hf * hf / deg)
    cost = per_device(np.asarray(cost_model.compute(hf), dtype=np.float64) / deg)
    a2a_dev = per_device(hf / deg * (deg - 1) / deg)
    tokens = (np.bincount(flat_ranks, weights=flat_sizes, minlength=num_devices).round().astype(np.int64)
              if n else np.zeros(num_devices, dtype=np.int64))
    mean_tokens = float(h.sum()) / num_devices
    memory_cap = alpha * mean_tokens
    memory_ok = bool(tokens.max() <= memory_cap + 1e-9) if n else True

    # Sequence groups: per (p, G), packed; HSF order = degree desc, group start asc, pack order.
    by_key: dict[tuple[int, int], list[int]] = {}
    for i in range(n):
        by_key.setdefault((int(deg[i]), groups[i][0]), []).append(i)
    sharded_keys = sorted((k for k in by_key if k[0] > 1), key=lambda k: (-k[0], k[1]))
    local_keys = sorted((k for k in by_key if k[0] == 1), key=lambda k: k[1])
    seq_groups: list[SequenceGroup] = []
    for p, start in (*sharded_keys, *local_keys):
        for members in pack_sequences(by_key[(p, start)], lens, h_pack, h_pack_cap):
            seq_groups.append(
                SequenceGroup(
                    index=len(seq_groups),
                    degree=p,
                    ranks=tuple(range(start, start + p)),
                    seq_ids=members,
                    tokens=sum(lens[i] for i in members),
                )
            )

    collectives: list[list[ScheduleStep]] = [[] for _ in range(num_devices)]
    local: list[list[ScheduleStep]] = [[] for _ in range(num_devices)]
    for sg in seq_groups:
        for pos, r in enumerate(sg.ranks):
            step = ScheduleStep(
                group_index=sg.index,
                degree=sg.degree,
                ranks=sg.ranks,
                seq_ids=sg.seq_ids,
                slices=tuple(slices[i][pos] for i in sg.seq_ids),
            )
            (collectives if sg.degree > 1 else local)[r].append(step)
    schedule = tuple(
        RankSchedule(rank=r, collectives=tuple(collectives[r]), local=tuple(local[r])) for r in range(num_devices)
    )

    w_att = hf * hf
    w_cost = np.asarray(cost_model.compute(hf), dtype=np.float64)
    # no sequence can be split finer than max_degree or than one token per rank
    cap = np.minimum(np.left_shift(1, np.floor(np.log2(np.maximum(hf, 1))).astype(np.int64)), max_degree)
    attention_lb = max(float(w_att.sum()) / num_devices, float((w_att / cap).max())) if n else 0.0
    cost_lb = max(float(w_cost.sum()) / num_devices, float((w_cost / cap).max())) if n else 0.0
    return ShardPlan(
        method=method,
        lengths=tuple(lens),
        num_devices=num_devices,
        p_max=p_max,
        degrees=tuple(int(x) for x in deg),
        groups=groups,
        slices=slices,
        device_tokens=tuple(int(x) for x in tokens),
        device_attention_cost=tuple(float(x) for x in attention),
        device_cost=tuple(float(x) for x in cost),
        memory_cap=float(memory_cap),
        memory_ok=memory_ok,
        sequence_groups=tuple(seq_groups),
        schedule=schedule,
        alltoall_volume=float((hf * (deg - 1) / deg).sum()),
        max_device_alltoall_volume=float(a2a_dev.max()) if num_devices else 0.0,
        split_cost=float(np.sum(cost_model.split_cost(hf, deg))) if n else 0.0,
        attention_lower_bound=attention_lb,
        cost_lower_bound=cost_lb,
        info=tuple(sorted((info or {}).items())),
    )
