"""Hierarchical admissible device groups (FlexRL sec. 3.3 / appendix A).

For each power-of-two degree ``p`` the groups are the *aligned* blocks of ``p`` consecutive ranks,
``[k*p, (k+1)*p)``. Every ``p``-group is the union of two ``p/2``-groups, so any two groups are
either disjoint or nested (a laminar family), which is what makes a highest-sharding-first order
deadlock-free.

**num_devices not a power of two.** The admissible degrees are the powers of two up to
``min(p_max, largest power of two <= num_devices)``, and for each degree only the blocks that fit
entirely are admissible: ``num_devices // p`` of them. The ``num_devices % p`` tail ranks belong to
no ``p``-group and take only smaller degrees (e.g. 6 devices: ``{0-3}`` for p=4; ``{0,1} {2,3}
{4,5}`` for p=2). The family stays laminar (aligned blocks), so the HSF deadlock argument and the
simulation in :mod:`titanrl.parallel.flex_ulysses.schedule` hold unchanged; only the "partition of
all devices" property is lost at degrees that do not divide ``num_devices``. Every rank still takes
part in the plan: p=1 work goes to any rank and the tail ranks are filled with it first when they
are idle.
"""

from __future__ import annotations


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def largest_power_of_two_at_most(n: int) -> int:
    if n < 1:
        raise ValueError(f"need n >= 1, got {n}")
    return 1 << (n.bit_length() - 1)


def max_degree(num_devices: int, p_max: int) -> int:
    """The largest admissible sharding degree: ``min(p_max, largest power of two <= num_devices)``."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if not is_power_of_two(p_max):
        raise ValueError(f"p_max must be a power of two >= 1, got {p_max}")
    return min(p_max, largest_power_of_two_at_most(num_devices))


def degree_levels(num_devices: int, p_max: int) -> tuple[int, ...]:
    """Admissible degrees in increasing order: ``(1, 2, 4, ..., max_degree)``."""
    top = max_degree(num_devices, p_max)
    return tuple(1 << k for k in range(top.bit_length()))


def group_ranks(degree: int, block: int) -> tuple[int, ...]:
    """Ranks of the ``block``-th aligned group of ``degree`` ranks."""
    return tuple(range(block * degree, (block + 1) * degree))


def admissible_groups(num_devices: int, p_max: int = 8) -> dict[int, tuple[tuple[int, ...], ...]]:
    """``{p: (group, ...)}`` for every admissible degree, groups as tuples of ranks in rank order.

    A runtime builds one process group / DeviceMesh submesh per entry (p >= 2); p = 1 is listed for
    completeness (every rank alone).
    """
    return {
        p: tuple(group_ranks(p, k) for k in range(num_devices // p)) for p in degree_levels(num_devices, p_max)
    }


def is_admissible(ranks: tuple[int, ...], num_devices: int, p_max: int) -> bool:
    """True when ``ranks`` is one of the admissible groups of its size."""
    p = len(ranks)
    if p < 1 or p not in degree_levels(num_devices, p_max) or ranks[0] % p != 0:
        return False
    return ranks == group_ranks(p, ranks[0] // p) and ranks[-1] < num_devices
