"""The two baselines of FlexRL sec. 5.2, expressed as :class:`ShardPlan` so they compare one-to-one.

- :func:`plan_bucketing` -- veRL + bucketing: whole sequences (p = 1), Karmarkar-Karp with equal
  sequence counts per rank on verl's workload ``24576 * s + s**2`` (text tokens only).
- :func:`plan_fixed_sp` -- Ulysses-SP with one degree ``sp`` for every sequence: ``num_devices //
  sp`` data-parallel groups of ``sp`` consecutive ranks, whole sequences dealt to the groups by the
  same Karmarkar-Karp. When ``sp`` does not divide ``num_devices`` the ``num_devices % sp`` tail
  ranks get nothing (a fixed-degree run cannot use them). Ranks of unequal speed (HetRL sec. 4.2): a group
  runs at its slowest member's speed (its all-to-alls keep the members in step), and the sequences are dealt
  to the groups by :func:`~titanrl.parallel.balance.speed_partition` on those speeds.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from titanrl.parallel.balance import karmarkar_karp, speed_partition
from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.flex_ulysses.groups import is_power_of_two, max_degree
from titanrl.parallel.flex_ulysses.plan import DEFAULT_H_PACK, DEFAULT_H_PACK_CAP, ShardPlan, build_plan


def _assign(lengths: np.ndarray, parts: int, cost_model: CostModel,
            speeds: Sequence[float] | None = None) -> np.ndarray:
    """Each sequence's part: Karmarkar-Karp with equal counts, or over parts of unequal ``speeds`` the latest
    finish minimised (counts then differ)."""
    costs = np.asarray(cost_model.compute(lengths.astype(np.float64)), dtype=np.float64)
    owner = np.zeros(lengths.size, dtype=np.int64)
    unequal = speeds is not None and len(set(speeds)) > 1
    parted = speed_partition(costs.tolist(), speeds) if unequal else karmarkar_karp(costs.tolist(), parts,
                                                                                    equal_size=True)
    for part, members in enumerate(parted):
        owner[members] = part
    return owner


def plan_bucketing(
    lengths: Sequence[int],
    num_devices: int,
    *,
    cost_model: CostModel | None = None,
    alpha: float = 1.1,
    h_pack: int = DEFAULT_H_PACK,
    h_pack_cap: int = DEFAULT_H_PACK_CAP,
) -> ShardPlan:
    """verl bucketing: every sequence whole on one rank, equal counts, KK on ``cost_model``
    (default :meth:`CostModel.verl_workload`)."""
    h = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    model = cost_model or CostModel.verl_workload()
    owner = _assign(h, num_devices, model)
    return build_plan(
        "bucketing", h, num_devices, 1, np.ones_like(h), owner, cost_model=model, alpha=alpha, max_degree=1,
        h_pack=h_pack, h_pack_cap=h_pack_cap,
    )


def plan_fixed_sp(
    lengths: Sequence[int],
    num_devices: int,
    sp: int,
    *,
    cost_model: CostModel | None = None,
    alpha: float = 1.1,
    h_pack: int = DEFAULT_H_PACK,
    h_pack_cap: int = DEFAULT_H_PACK_CAP,
    speeds: Sequence[float] | None = None,
) -> ShardPlan:
    """Ulysses-SP of degree ``sp`` for every sequence (``sp`` a power of two <= num_devices); ``speeds``: each
    rank's relative speed (None: equal), a group's the slowest of its members'."""
    h = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if not is_power_of_two(sp) or sp > num_devices:
        raise ValueError(f"sp must be a power of two <= num_devices={num_devices}, got {sp}")
    if speeds is not None and len(speeds) != num_devices:
        raise ValueError(f"{len(speeds)} speeds for {num_devices} ranks")
    model = cost_model or CostModel.verl_workload()
    groups = num_devices // sp
    group_speeds = None if speeds is None else [min(speeds[g * sp:(g + 1) * sp]) for g in range(groups)]
    owner = _assign(h, groups, model, group_speeds)
    return build_plan(
        f"fixed_sp{sp}", h, num_devices, sp, np.full_like(h, sp), owner, cost_model=model, alpha=alpha,
        max_degree=max_degree(num_devices, sp), h_pack=h_pack, h_pack_cap=h_pack_cap,
    )
