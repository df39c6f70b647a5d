"""FlexUlysses shard planner: FlexRL appendix A, Algorithms 2 and 3, with the unspecified parts filled.

Objective (appendix A, eq. 1), lexicographic: minimize the maximum per-device compute
``C_d = sum_i w_i / p_i`` (``w_i = h_i**2`` in the paper; ``cost_model.compute(h_i)`` here), then
the communication ``sum_i SplitCost(h_i, p_i)``, subject to the memory cap
``M_d = sum_i |slice of i on d| <= M_th = alpha * M*`` (``M*`` the mean tokens per device).

Stages (appendix A's three, plus one):

1. **BaselineSplitPlace** (Alg. 3 l. 1-15). Sequences in decreasing length. ``GetSPSize``, which the
   paper leaves open, picks the smallest admissible degree whose per-device share ``w/p`` is at
   most ``split_granularity`` times the mean device load (deliberately fine: merges undo it). The
   degree doubles while no admissible group can take the shard under ``M_th``. Among groups that
   can, the one whose most-loaded member ends lowest wins (the paper takes the group with most
   free memory; ours is the compute-aware variant, ties to the lowest rank).
2. **Merge** (Alg. 2 l. 5-12, Alg. 3 l. 16-37). For each level ``p`` from high to low and each
   ``p``-group ``G``: candidates are the ``m'`` shortest sequences on ``(p, G)`` for
   ``m' = 2..merge_candidates``, two-way packed (largest first into the lighter side) into
   ``S1, S2`` that move to the two halves of ``G`` at degree ``p/2``; we add single-sequence
   moves into one half (``S2`` empty), which the paper's ``S1, S2 != {}`` excludes. A candidate is
   feasible when no member of ``G`` ends above the bound ``B`` and the memory cap holds. The
   feasible candidate with the most negative ``ΔCost`` (SplitCost saved) runs; repeat until none.
   ``B = max(current max load, (1 + balance_tol) * lower bound)``, so merges never worsen the
   primary objective beyond the tolerance (a load within ``balance_tol`` of the bound counts as a
   tie and communication decides).
3. **ShortItemReorder** (Alg. 3 l. 38-47). Sequences at ``p <= 2`` are taken out and put back,
   longest first, whole (``p = 1``) on the least-loaded device with room under ``M_th`` (else the
   one with least memory). A ``p = 2`` sequence stays at ``p = 2`` (best 2-group) when putting it
   whole would exceed ``B`` -- the paper always makes it whole, which can undo the balance.
4. **Refine** (ours). Local search on the most loaded device: move one of its whole sequences to
   the least-loaded device with memory room, else swap a pair, else raise the degree of one of its
   sequences (``p -> 2p`` over the parent group), as long as the maximum strictly drops. Stops when
   the most loaded device cannot be relieved or the load is within ``balance_tol`` of the bound.

Stage 1-3-4 run first to find the achievable load, then 2 (merge under that bound), 3 and 4 again.
Everything is deterministic: stable sorts with explicit index tie-breaks, ``argmin`` taking the
lowest index, no sets or hashing, no randomness.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.flex_ulysses.groups import degree_levels
from titanrl.parallel.flex_ulysses.plan import DEFAULT_H_PACK, DEFAULT_H_PACK_CAP, ShardPlan, build_plan

DEFAULT_M_CANDIDATES = 4
_EPS = 1e-12


def _pow2_floor(x: np.ndarray) -> np.ndarray:
    """Largest power of two <= x, elementwise (x >= 1)."""
    return np.left_shift(1, np.floor(np.log2(np.maximum(x, 1))).astype(np.int64))


class _State:
    """Loads of a partial placement. ``deg[i] == 0`` means sequence ``i`` is not placed."""

    def __init__(self, h: np.ndarray, w: np.ndarray, num_devices: int):
        self.h = h
        self.w = w
        self.hl = [int(x) for x in h]
        self.wl = [float(x) for x in w]
        self.n = len(h)
        self.D = num_devices
        self.deg = np.zeros(self.n, dtype=np.int64)
        self.blk = np.full(self.n, -1, dtype=np.int64)
        self.C = np.zeros(num_devices, dtype=np.float64)
        self.M = np.zeros(num_devices, dtype=np.int64)

    def add(self, i: int, p: int, b: int) -> None:
        lo = b * p
        self.C[lo : lo + p] += self.wl[i] / p
        base, extra = divmod(self.hl[i], p)
        self.M[lo : lo + p] += base
        if extra:
            self.M[lo : lo + extra] += 1
        self.deg[i] = p
        self.blk[i] = b

    def remove(self, i: int) -> tuple[int, int]:
        p, b = int(self.deg[i]), int(self.blk[i])
        lo = b * p
        self.C[lo : lo + p] -= self.wl[i] / p
        base, extra = divmod(self.hl[i], p)
        self.M[lo : lo + p] -= base
        if extra:
            self.M[lo : lo + extra] -= 1
        self.deg[i] = 0
        self.blk[i] = -1
        return p, b

    def block_max(self, arr: np.ndarray, p: int) -> np.ndarray:
        nb = self.D // p
        if p == 1:
            return arr
        return arr[: nb * p].reshape(nb, p).max(axis=1)


def _slice_sizes(h: int, p: int) -> np.ndarray:
    base, extra = divmod(h, p)
    sizes = np.full(p, base, dtype=np.int64)
    sizes[:extra] += 1
    return sizes


# ------------------------------------------------------------------------------ stage 1


def _baseline_split_place(
    st: _State, order: Sequence[int], p0: np.ndarray, p_cap: np.ndarray, m_th: float
) -> None:
    for i in order:
        h = st.hl[i]
        p = int(p0[i])
        top = int(p_cap[i])
        while True:
            mb = st.block_max(st.M, p) + -(-h // p)
            valid = mb <= m_th
            if valid.any() or p >= top:
                break
            p *= 2
        if valid.any():
            cb = st.block_max(st.C, p) + st.wl[i] / p
            b = int(np.argmin(np.where(valid, cb, np.inf)))
        else:  # no group can take it under the cap: least memory overflow at the top degree
            b = int(np.argmin(mb))
        st.add(i, p, b)


# ------------------------------------------------------------------------------ stage 2


def _two_way_pack(items: Sequence[int], w: Sequence[float]) -> tuple[list[int], list[int]]:
    """Largest first into the lighter side (ties: first side); returns (heavier, lighter)."""
    a: list[int] = []
    b: list[int] = []
    sa = sb = 0.0
    for i in sorted(items, key=lambda k: (-w[k], k)):
        if sa <= sb:
            a.append(i)
            sa += w[i]
        else:
            b.append(i)
            sb += w[i]
    return (a, b) if sa >= sb else (b, a)


def _merge_phase(
    st: _State,
    levels: Sequence[int],
    bound: float,
    m_th: float,
    m_cand: int,
    split_cost: "callable",
) -> int:
    merges = 0
    wl, hl = st.wl, st.hl
    for p in reversed(levels[1:]):
        half = p // 2
        on_level = np.nonzero(st.deg == p)[0]
        if on_level.size == 0:
            continue
        blocks = np.unique(st.blk[on_level])
        for b in (int(x) for x in blocks):
            lo, mid, hi = b * p, b * p + half, (b + 1) * p
            while True:
                members = [int(i) for i in np.nonzero((st.deg == p) & (st.blk == b))[0]]
                if not members:
                    break
                members.sort(key=lambda k: (wl[k], hl[k], k))
                ca, cb = float(st.C[lo:mid].max()), float(st.C[mid:hi].max())
                cands: list[tuple[float, float, int, list[int], list[int]]] = []
                serial = 0
                subsets: list[tuple[list[int], list[int]]] = []
                for m in range(2, min(m_cand, len(members)) + 1):
                    s1, s2 = _two_way_pack(members[:m], wl)
                    subsets.append((s1, s2))
                for i in members:
                    subsets.append(([i], []))
                for s1, s2 in subsets:
                    removed = sum(wl[i] for i in s1) / p + sum(wl[i] for i in s2) / p
                    w1 = sum(wl[i] for i in s1) / half
                    w2 = sum(wl[i] for i in s2) / half
                    # orientation: heavier part to the half with the lower current max
                    opt1 = max(ca - removed + w1, cb - removed + w2)
                    opt2 = max(ca - removed + w2, cb - removed + w1)
                    if opt2 < opt1:
                        sa, sb, new_max = s2, s1, opt2
                    else:
                        sa, sb, new_max = s1, s2, opt1
                    if new_max > bound + _EPS * max(1.0, bound):
                        continue
                    delta = sum(float(split_cost(hl[i], half)) - float(split_cost(hl[i], p)) for i in (*s1, *s2))
                    cands.append((delta, new_max, serial, sa, sb))
                    serial += 1
                cands.sort(key=lambda c: (c[0], c[1], c[2]))
                chosen = None
                for delta, new_max, _, sa, sb in cands:
                    if delta >= 0:
                        break
                    mem = st.M[lo:hi].copy()
                    for i in (*sa, *sb):
                        mem -= _slice_sizes(hl[i], p)
                    for i in sa:
                        mem[: half] += _slice_sizes(hl[i], half)
                    for i in sb:
                        mem[half:] += _slice_sizes(hl[i], half)
                    if mem.max() <= max(m_th, float(st.M[lo:hi].max())) + 1e-9:
                        chosen = (sa, sb)
                        break
                if chosen is None:
                    break
                sa, sb = chosen
                for i in (*sa, *sb):
                    st.remove(i)
                for i in sa:
                    st.add(i, half, 2 * b)
                for i in sb:
                    st.add(i, half, 2 * b + 1)
                merges += len(sa) + len(sb)
    return merges


# ------------------------------------------------------------------------------ stage 3


def _short_item_reorder(st: _State, bound: float, m_th: float) -> None:
    wl, hl = st.wl, st.hl
    short = [int(i) for i in np.nonzero((st.deg >= 1) & (st.deg <= 2))[0] if hl[int(i)] >= 1]
    short.sort(key=lambda k: (-wl[k], -hl[k], k))
    was = {i: int(st.deg[i]) for i in short}
    for i in short:
        st.remove(i)
    for i in short:
        h, w = hl[i], wl[i]
        fits = st.M + h <= m_th
        if fits.any():
            d = int(np.argmin(np.where(fits, st.C, np.inf)))
        else:
            d = int(np.argmin(st.M))
        whole_load = float(st.C[d]) + w
        if was[i] == 2 and (whole_load > bound or not fits.any()) and h >= 2 and st.D >= 2:
            mb = st.block_max(st.M, 2) + -(-h // 2)
            valid = mb <= m_th
            cb = st.block_max(st.C, 2) + w / 2
            if valid.any():
                b = int(np.argmin(np.where(valid, cb, np.inf)))
                if cb[b] < whole_load or not fits.any():
                    st.add(i, 2, b)
                    continue
        st.add(i, 1, d)


# ------------------------------------------------------------------------------ stage 4


def _placements(st: _State, i: int, m_th: float, p_top: int) -> list[tuple[float, int, int]]:
    """For each degree up to ``p_top``: (resulting block max, degree, block) of the best
    memory-feasible group for sequence ``i`` (not currently placed)."""
    out = []
    h, w = st.hl[i], st.wl[i]
    p = 1
    while p <= p_top:
        mb = st.block_max(st.M, p) + -(-h // p)
        valid = mb <= m_th
        if valid.any():
            cb = np.where(valid, st.block_max(st.C, p) + w / p, np.inf)
            b = int(np.argmin(cb))
            out.append((float(cb[b]), p, b))
        p *= 2
    return out


def _refine(st: _State, target: float, m_th: float, p_top: np.ndarray, max_steps: int) -> int:
    """Relieve the most loaded device until it cannot be relieved (see module docstring)."""
    wl, hl = st.wl, st.hl
    steps = 0
    while steps < max_steps:
        d = int(np.argmax(st.C))
        cmax = float(st.C[d])
        if cmax <= target:
            break
        limit = cmax - _EPS * max(1.0, cmax)
        touching = np.nonzero((st.deg >= 1) & (st.blk * st.deg <= d) & (d < (st.blk + 1) * st.deg))[0]
        cand = sorted((int(i) for i in touching), key=lambda k: (-wl[k] / st.deg[k], k))
        moved = False
        # (a) re-insert one sequence on d at its best (degree, group): smallest degree that helps
        for i in cand:
            p0, b0 = st.remove(i)
            options = [o for o in _placements(st, i, max(m_th, 0.0), int(p_top[i])) if o[0] < limit]
            if options and (options[0][1], options[0][2]) != (p0, b0):
                _, p, b = min(options, key=lambda o: (o[1], o[0], o[2]))
                st.add(i, p, b)
                moved = True
                break
            st.add(i, p0, b0)
        if not moved:
            # (b) swap a whole sequence of d with a lighter whole one on a lightly loaded device
            local = [i for i in cand if st.deg[i] == 1]
            order = np.argsort(st.C, kind="stable")
            best = None
            for e in (int(x) for x in order[: min(8, st.D)]):
                if e == d:
                    continue
                others = [int(j) for j in np.nonzero((st.deg == 1) & (st.blk == e))[0]]
                for i in local:
                    for j in others:
                        if wl[j] >= wl[i]:
                            continue
                        new_max = max(cmax - wl[i] + wl[j], float(st.C[e]) + wl[i] - wl[j])
                        if new_max >= limit:
                            continue
                        if st.M[d] - hl[i] + hl[j] > max(m_th, st.M[d]) or st.M[e] + hl[i] - hl[j] > m_th:
                            continue
                        if best is None or (new_max, i, j) < best[:3]:
                            best = (new_max, i, j, e)
                if best is not None:
                    break
            if best is not None:
                _, i, j, e = best
                st.remove(i)
                st.remove(j)
                st.add(i, 1, e)
                st.add(j, 1, d)
                moved = True
        if not moved:
            break
        steps += 1
    return steps


# ------------------------------------------------------------------------------ driver


def _validate(lengths: Sequence[int], num_devices: int) -> np.ndarray:
    h = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    if h.size and h.min() < 1:
        raise ValueError("every sequence length must be >= 1")
    return h


def plan_shards(
    lengths: Sequence[int],
    num_devices: int,
    *,
    p_max: int = 8,
    alpha: float = 1.1,
    cost_model: CostModel | None = None,
    balance_tol: float = 0.01,
    split_granularity: float = 0.5,
    merge_candidates: int = DEFAULT_M_CANDIDATES,
    refine: bool = True,
    h_pack: int = DEFAULT_H_PACK,
    h_pack_cap: int = DEFAULT_H_PACK_CAP,
) -> ShardPlan:
    """FlexUlysses placement of ``lengths`` over ``num_devices`` ranks (see the module docstring).

    ``cost_model=None`` balances the paper's attention proxy ``h**2 / p``; a :class:`CostModel`
    balances its full compute (attention + linear) instead. ``num_devices`` need not be a power of
    two (see :mod:`.groups`). Degrees are also capped at the largest power of two <= the sequence
    length, so no rank gets an empty slice.
    """
    if alpha < 1.0:
        raise ValueError(f"alpha must be >= 1, got {alpha}")
    h = _validate(lengths, num_devices)
    model = cost_model or CostModel.attention_only()
    levels = degree_levels(num_devices, p_max)
    top = levels[-1]
    n = int(h.size)
    if n == 0:
        return build_plan("flex_ulysses", [], num_devices, p_max, [], [], cost_model=model, alpha=alpha,
                          max_degree=top, h_pack=h_pack, h_pack_cap=h_pack_cap)
    w = np.asarray(model.compute(h.astype(np.float64)), dtype=np.float64)
    mean_c = float(w.sum()) / num_devices
    m_th = alpha * float(h.sum()) / num_devices
    p_cap = np.minimum(_pow2_floor(h), top)  # per-sequence top degree
    lower = max(mean_c, float((w / p_cap).max()))
    target = (1.0 + balance_tol) * lower

    # GetSPSize: smallest level with w/p <= split_granularity * mean load (capped).
    need = np.maximum(w / max(split_granularity * mean_c, _EPS), 1.0)
    p0 = np.minimum(np.left_shift(1, np.ceil(np.log2(need)).astype(np.int64)), p_cap)
    order = [int(i) for i in np.lexsort((np.arange(n), -h))]

    st = _State(h, w, num_devices)
    _baseline_split_place(st, order, p0, p_cap, m_th)
    first = float(st.C.max())
    _short_item_reorder(st, max(first, target), m_th)
    steps = _refine(st, target, m_th, p_cap, 8 * n) if refine else 0
    bound = max(float(st.C.max()), target)
    merges = _merge_phase(st, levels, bound, m_th, merge_candidates, model.split_cost)
    _short_item_reorder(st, bound, m_th)
    if refine:
        steps += _refine(st, target, m_th, p_cap, 8 * n)

    return build_plan(
        "flex_ulysses",
        h,
        num_devices,
        p_max,
        st.deg,
        st.blk,
        cost_model=model,
        alpha=alpha,
        max_degree=top,
        h_pack=h_pack,
        h_pack_cap=h_pack_cap,
        info={"merged": float(merges), "refine_steps": float(steps), "stage1_max_over_mean": first / mean_c},
    )
