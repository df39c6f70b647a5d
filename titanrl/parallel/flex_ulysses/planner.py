"""FlexUlysses shard planner: FlexRL appendix A (Algorithms 2 and 3), with the open parts filled in.

Objective (appendix A, eq. 1), lexicographic: minimize the maximum per-device compute
``C_d = sum_i w_i / p_i`` over the sequences ``i`` with a shard on ``d`` (``w_i = h_i**2`` in the
paper, ``cost_model.compute(h_i)`` when a :class:`CostModel` is given), then the communication,
subject to the memory cap ``M_d <= M_th = alpha * M*`` (``M_d`` the exact tokens of the slices on
``d``, ``M*`` their mean). Loads within ``balance_tol`` of the lower bound
``max(mean C, max_i w_i / p_cap_i)`` count as ties, so communication decides among them.

Ranks of unequal speed (``speeds``, HetRL sec. 4.2; ours): ``C_d`` is then device ``d``'s time, each shard's
``w_i / p_i`` divided by its group's slowest member's speed (the group's all-to-alls keep its members in step),
and every stage below compares those times; with equal speeds they are the loads above, bit for bit. Stage 1 then
places each sequence at the (degree, group) where it ends earliest (ties: the least device time) instead of the
first degree that fits: a group holding a slow member would otherwise take shards a faster group ends as early.

Communication is ``sum_i comm(h_i, p_i)`` with ``comm = p * SplitCost(h, p) = h (p-1)/p`` (times
``gamma`` beyond ``tau``): the all-to-all volume of the whole group. The paper sums ``SplitCost``
itself, the volume of *one* member, which falls as ``p`` grows (h/4, 3h/16, 7h/64 for p = 2, 4, 8),
so using it literally would make every merge look like a loss (see ``CostModel.comm_cost``).

Pipeline:

1. **BaselineSplitPlace** (Alg. 3 l. 1-15). Sequences longest first. ``GetSPSize``, which the paper
   leaves open, is the smallest degree with ``w/p <= split_granularity * mean C`` -- deliberately
   fine (0.02: anything above a fiftieth of a device's load is split), so the start is balanced
   in compute and memory and the merges only have to win communication back. The degree doubles
   while no admissible group can take the shard under ``M_th`` (the paper's loop); among the
   groups that can, the one whose most-loaded member ends lowest (the paper takes the one with most
   free memory; compute is the primary objective). If none can even at the top degree, the group
   with the least memory overflow.
2. **Refine** (ours): local search on the most loaded device (below) to reach the bound or get as
   close as it can; the bound for the merges is ``B = max(that load, (1 + balance_tol) * bound)``.
3. **Merge** (Alg. 2 l. 5-12, Alg. 3 l. 16-37), levels ``p = p_max .. 2``, each ``p``-group ``G``:
   first a *bulk* merge (ours): KK-partition all sequences on ``(p, G)`` in two, move them to the
   halves of ``G`` at ``p/2`` (heavier side to the half with more slack) and, while that breaks
   ``B`` or ``M_th``, keep back at ``p`` the sequence that best closes the gap. Then the paper's
   FindMergeCandidates / ExecuteMerge loop: candidates are the ``m'`` shortest sequences of
   ``(p, G)`` for ``m' = 2..merge_candidates`` two-way packed into ``(S1, S2)``, plus (ours) each
   single sequence and each pair of length-neighbours; the feasible candidate (no member of ``G``
   above ``B``, memory under ``M_th``) saving the most communication runs, until none is left.
4. **ShortItemReorder** (Alg. 3 l. 38-47): sequences at ``p <= 2`` are taken out and put back
   whole, heaviest first, on the least-loaded device with room under ``M_th`` (else the one with
   least memory); a ``p = 2`` one goes back to the best 2-group instead when whole it would pass
   ``B``. The paper applies it unconditionally; we keep its result only when the maximum stays
   within ``max(B, before)`` and a memory cap that held still holds.
5. **Refine** again (below).
6. **Memory rescue** (ours), only when the result breaks ``M_th``: a memory-first greedy (longest
   first, each where its fullest member ends lowest), else a bounded depth-first search for a
   placement under the cap (exact on small batches), then Refine. If neither finds one the plan
   is returned with ``memory_ok = False``.

Refine, one step relieves the most loaded device ``d``: re-insert one sequence holding
   a shard of ``d`` at the smallest degree (then the least-loaded group) where every member stays
   strictly below ``d``'s load and under ``M_th``; else swap a whole sequence of ``d`` with a
   lighter whole one on one of the 8 least-loaded devices. Stops at the bound or when ``d`` cannot
   be relieved; every step strictly lowers the sorted load vector, so it terminates.

Everything is deterministic: stable sorts with explicit index tie-breaks, ``argmin`` taking the
lowest index, no iteration over sets, no randomness.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

import numpy as np

from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.flex_ulysses.groups import degree_levels
from titanrl.parallel.flex_ulysses.plan import DEFAULT_H_PACK, DEFAULT_H_PACK_CAP, ShardPlan, build_plan

DEFAULT_M_CANDIDATES = 4  # the paper's DEFAULT_M_CANDIDATES is not given
MEMORY_SEARCH_BUDGET = 5000  # placements the exact memory search may try before giving up
_EPS = 1e-12
_MAX = np.maximum.reduce
_MIN = np.minimum.reduce


def _pow2_floor(x: np.ndarray) -> np.ndarray:
    """Largest power of two <= x, elementwise (x >= 1)."""
    return np.left_shift(1, np.floor(np.log2(np.maximum(x, 1))).astype(np.int64))


class _State:
    """Loads of a partial placement. ``deg[i] == 0`` means sequence ``i`` is not placed.

    ``C`` is each device's time: a shard of ``w / p`` on a group runs at the group's slowest member's speed
    (its all-to-alls keep the members in step), so it adds ``w / p * g`` to every member, ``g`` the group's
    ``1 / min speed`` (``gf[p][b]``; speeds normalised to mean 1). Equal speeds: ``g = 1.0`` exactly, and every
    load is the paper's ``sum w / p``, bit for bit."""

    def __init__(self, h: np.ndarray, w: np.ndarray, num_devices: int, slowness: np.ndarray | None = None):
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
        self.ext: list[np.ndarray | None] = [None] * self.n
        self.uniform = slowness is None
        self.f = np.ones(num_devices) if slowness is None else np.asarray(slowness, dtype=np.float64)
        self.gf: dict[int, np.ndarray] = {}

    def g(self, p: int) -> np.ndarray:
        """Per ``p``-group: the slowness of its slowest member (1.0 everywhere with equal speeds)."""
        if p not in self.gf:
            self.gf[p] = self.block_max(self.f, p)
        return self.gf[p]

    def after(self, p: int, w: float) -> np.ndarray:
        """Per ``p``-group: its most loaded member's time once a shard of ``w / p`` is added."""
        return self.block_max(self.C, p) + w / p * self.g(p)

    def add(self, i: int, p: int, b: int) -> None:
        """Place sequence ``i`` at degree ``p`` on block ``b``. When ``h % p`` slices get one token
        more, they go to the members with the fewest tokens (ties: lower position)."""
        lo = b * p
        self.C[lo : lo + p] += self.wl[i] / p * float(self.g(p)[b])
        base, extra = divmod(self.hl[i], p)
        self.M[lo : lo + p] += base
        if extra:
            pos = np.argsort(self.M[lo : lo + p], kind="stable")[:extra]
            self.M[lo + pos] += 1
            self.ext[i] = pos
        else:
            self.ext[i] = None
        self.deg[i] = p
        self.blk[i] = b

    def remove(self, i: int) -> tuple[int, int]:
        p, b = int(self.deg[i]), int(self.blk[i])
        lo = b * p
        self.C[lo : lo + p] -= self.wl[i] / p * float(self.g(p)[b])
        self.M[lo : lo + p] -= self.hl[i] // p
        if self.ext[i] is not None:
            self.M[lo + self.ext[i]] -= 1
            self.ext[i] = None
        self.deg[i] = 0
        self.blk[i] = -1
        return p, b

    def slice_sizes(self, i: int) -> tuple[int, ...]:
        p = int(self.deg[i])
        base, extra = divmod(self.hl[i], p)
        sizes = [base] * p
        if self.ext[i] is not None:
            for j in self.ext[i]:
                sizes[int(j)] += 1
        return tuple(sizes)

    def block_max(self, arr: np.ndarray, p: int) -> np.ndarray:
        if p == 1:
            return arr
        nb = self.D // p
        return _MAX(arr[: nb * p].reshape(nb, p), axis=1)


# ------------------------------------------------------------------------------ stage 1


def _baseline_split_place(
    st: _State, order: Sequence[int], p0: np.ndarray, p_cap: np.ndarray, m_th: float
) -> None:
    for i in order:
        h, w = st.hl[i], st.wl[i]
        start, top = int(p0[i]), int(p_cap[i])
        # p0, 2 p0, ..., top (the paper's doubling), then p0/2, ..., 1 before giving up on the cap
        degrees = []
        p = start
        while p <= top:
            degrees.append(p)
            p *= 2
        p = start // 2
        while p >= 1:
            degrees.append(p)
            p //= 2
        if not st.uniform:
            if _place_earliest(st, i, degrees, m_th):
                continue
            degrees = []  # no degree fits the cap: the least overflow below
        placed = False
        overflow = None
        for p in degrees:
            if float(_MAX(st.M)) + -(-h // p) <= m_th:  # memory cannot bind: every group is valid
                st.add(i, p, int(np.argmin(st.block_max(st.C, p))))
                placed = True
                break
            mb = st.block_max(st.M, p) + -(-h // p)
            valid = mb <= m_th
            if valid.any():
                cb = st.after(p, w)
                st.add(i, p, int(np.argmin(np.where(valid, cb, np.inf))))
                placed = True
                break
            b = int(np.argmin(mb))
            if overflow is None or mb[b] < overflow[0]:
                overflow = (float(mb[b]), p, b)
        if not placed:  # no group can take it under the cap: least memory overflow
            if overflow is None:
                overflow = min((float(_MIN(st.block_max(st.M, q) + -(-h // q))), q,
                                int(np.argmin(st.block_max(st.M, q) + -(-h // q)))) for q in degree_levels(st.D, top))
            st.add(i, overflow[1], overflow[2])


def _place_earliest(st: _State, i: int, degrees: Sequence[int], m_th: float) -> bool:
    """Ranks of unequal speed: sequence ``i`` at the (degree, group) under the cap where its group's most loaded
    member ends earliest (ties within 1e-9: the group using the least device time, ``w`` over its slowest speed,
    then the paper's degree order); False if no degree fits. The paper's first-fitting degree would put a shard on
    a group with a slow member while a group of faster ones finishes it as early."""
    h, w = st.hl[i], st.wl[i]
    best = None
    for k, p in enumerate(degrees):
        valid = st.block_max(st.M, p) + -(-h // p) <= m_th
        if not valid.any():
            continue
        cb = np.where(valid, st.after(p, w), np.inf)
        b = int(np.argmin(cb))
        cand = (float(cb[b]), w * float(st.g(p)[b]), k, p, b)
        if best is None or cand[0] < best[0] * (1 - 1e-9) or (cand[0] <= best[0] * (1 + 1e-9) and cand[1:] < best[1:]):
            best = cand
    if best is None:
        return False
    st.add(i, best[3], best[4])
    return True


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


def _kk_two_way(items: Sequence[int], w: Sequence[float]) -> tuple[list[int], list[int], float]:
    """Karmarkar-Karp two-way differencing: (heavier side, lighter side, difference)."""
    heap = [(-w[i], i, [i], []) for i in items]
    heapq.heapify(heap)
    serial = len(w) + 1
    while len(heap) > 1:
        v1, _, a1, b1 = heapq.heappop(heap)
        v2, _, a2, b2 = heapq.heappop(heap)
        heapq.heappush(heap, (v1 - v2, serial, a1 + b2, b1 + a2))  # v1 <= v2 <= 0: -(|v1| - |v2|)
        serial += 1
    if not heap:
        return [], [], 0.0
    v, _, a, b = heap[0]
    return a, b, -v


def _apply_merge(st: _State, p: int, b: int, to_a: Sequence[int], to_b: Sequence[int]) -> None:
    for i in (*to_a, *to_b):
        st.remove(i)
    for i in to_a:
        st.add(i, p // 2, 2 * b)
    for i in to_b:
        st.add(i, p // 2, 2 * b + 1)


def _bulk_merge(st: _State, p: int, b: int, members: list[int], bound: float, m_th: float) -> int:
    """Move as many of the sequences on (p, G) as possible to the halves of G at p/2 in one go.

    Starting from all of them (everything on (p, G) loads every member of G equally, so the state is
    feasible), KK-partition the movers in two, send the heavier side to the half with more slack,
    and while that breaks the bound or the memory cap drop from the movers the sequence that best
    closes the gap (they stay at p). Returns the number moved."""
    wl, hl = st.wl, st.hl
    half = p // 2
    lo, mid, hi = b * p, b * p + half, (b + 1) * p
    slack_a, slack_b = bound - float(st.C[lo:mid].max()), bound - float(st.C[mid:hi].max())
    mem_a, mem_b = m_th - float(st.M[lo:mid].max()), m_th - float(st.M[mid:hi].max())
    if min(slack_a, slack_b) < 0:
        return 0
    movers = sorted(members, key=lambda k: (-wl[k], k))
    g_whole, g_a, g_b = float(st.g(p)[b]), float(st.g(half)[2 * b]), float(st.g(half)[2 * b + 1])
    while len(movers) >= 2:
        heavy, light, diff = _kk_two_way(movers, wl)
        dm = (sum(hl[i] for i in heavy) - sum(hl[i] for i in light)) / p
        # the half taking the heavier side gains dc time and dm tokens per member, the other loses
        # (equal speeds: dc, dm) them (+2 tokens of slack for slice rounding; the exact check follows)
        orient = None
        for heavy_to_a in (True, False):
            s_heavy, m_heavy, m_light = (slack_a, mem_a, mem_b) if heavy_to_a else (slack_b, mem_b, mem_a)
            dc = diff / p if st.uniform else (2 * sum(wl[i] for i in heavy) * (g_a if heavy_to_a else g_b)
                                              - sum(wl[i] for i in movers) * g_whole) / p
            if dc <= s_heavy and dm + 2 <= m_heavy and -dm + 2 <= m_light:
                orient = (heavy, light) if heavy_to_a else (light, heavy)
                break
        if orient is not None:
            snap = _snapshot(st)
            _apply_merge(st, p, b, orient[0], orient[1])
            if float(st.C[lo:hi].max()) <= bound * (1 + _EPS) and float(st.M[lo:hi].max()) <= m_th:
                return len(movers)
            _restore(st, snap)  # slice rounding broke it: undo, then shrink the movers
        # drop the mover that best closes the compute gap (or the biggest if none helps)
        best = None
        for i in heavy:
            gap = abs(diff - wl[i])
            if best is None or (gap, -wl[i], i) < best[0]:
                best = ((gap, -wl[i], i), i)
        drop = best[1] if best is not None and best[0][0] < diff else movers[0]
        movers.remove(drop)
    return 0


def _merge_phase(
    st: _State,
    levels: Sequence[int],
    bound: float,
    m_th: float,
    m_cand: int,
    comm_cost: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> int:
    merges = 0
    wl, hl = st.wl, st.hl
    hf = np.asarray(hl, dtype=np.float64)
    comm = {q: [float(x) for x in comm_cost(hf, np.full(hf.shape, q))] for q in levels}
    for p in reversed(levels[1:]):
        half = p // 2
        on_level = np.nonzero(st.deg == p)[0]
        if on_level.size == 0:
            continue
        by_block: dict[int, list[int]] = {}
        for i in (int(x) for x in on_level):  # ascending index, so each list is in index order
            by_block.setdefault(int(st.blk[i]), []).append(i)
        for b in sorted(by_block):
            lo, mid, hi = b * p, b * p + half, (b + 1) * p
            merges += _bulk_merge(st, p, b, list(by_block[b]), bound, m_th)
            while True:
                members = [i for i in by_block[b] if st.deg[i] == p and st.blk[i] == b]
                if not members:
                    break
                members.sort(key=lambda k: (wl[k], hl[k], k))
                ca, cb = float(st.C[lo:mid].max()), float(st.C[mid:hi].max())
                g_whole, g_a, g_b = float(st.g(p)[b]), float(st.g(half)[2 * b]), float(st.g(half)[2 * b + 1])
                cands: list[tuple[float, float, int, list[int], list[int]]] = []
                serial = 0
                subsets: list[tuple[list[int], list[int]]] = []
                for m in range(2, min(m_cand, len(members)) + 1):
                    s1, s2 = _two_way_pack(members[:m], wl)
                    subsets.append((s1, s2))
                for i in members:
                    subsets.append(([i], []))
                for a_, b_ in zip(members, members[1:]):  # near-equal neighbours balance each other
                    subsets.append(([b_], [a_]))
                for s1, s2 in subsets:
                    removed = (sum(wl[i] for i in s1) / p + sum(wl[i] for i in s2) / p) * g_whole
                    w1 = sum(wl[i] for i in s1) / half
                    w2 = sum(wl[i] for i in s2) / half
                    # orientation: heavier part to the half where the maximum ends lower
                    opt1 = max(ca - removed + w1 * g_a, cb - removed + w2 * g_b)
                    opt2 = max(ca - removed + w2 * g_a, cb - removed + w1 * g_b)
                    if opt2 < opt1:
                        sa, sb, new_max = s2, s1, opt2
                    else:
                        sa, sb, new_max = s1, s2, opt1
                    if new_max > bound + _EPS * max(1.0, bound):
                        continue
                    delta = sum(comm[half][i] - comm[p][i] for i in (*s1, *s2))
                    cands.append((delta, new_max, serial, sa, sb))
                    serial += 1
                cands.sort(key=lambda c: (c[0], c[1], c[2]))
                chosen = None
                for delta, new_max, _, sa, sb in cands:
                    if delta >= 0:
                        break
                    # conservative: every member loses floor(h/p), gains ceil(h/(p/2))
                    mem_a = float(st.M[lo:mid].max()) - sum(hl[i] // p for i in (*sa, *sb))
                    mem_b = float(st.M[mid:hi].max()) - sum(hl[i] // p for i in (*sa, *sb))
                    mem_a += sum(-(-hl[i] // half) for i in sa)
                    mem_b += sum(-(-hl[i] // half) for i in sb)
                    if max(mem_a, mem_b) <= max(m_th, float(st.M[lo:hi].max())) + 1e-9:
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


def _snapshot(st: _State) -> tuple:
    return st.deg.copy(), st.blk.copy(), st.C.copy(), st.M.copy(), list(st.ext)


def _restore(st: _State, snap: tuple) -> None:
    st.deg[:], st.blk[:], st.C[:], st.M[:] = snap[:4]
    st.ext[:] = snap[4]


def _short_item_reorder(st: _State, bound: float, m_th: float) -> bool:
    """Alg. 3 ShortItemReorder; kept only if it does not raise the maximum load above
    ``max(bound, current max)`` or break a memory cap that held. Returns True when kept."""
    snap = _snapshot(st)
    before_c, before_m = float(st.C.max()), float(st.M.max())
    _short_item_reorder_raw(st, bound, m_th)
    after_c, after_m = float(st.C.max()), float(st.M.max())
    if after_c > max(bound, before_c) * (1 + _EPS) or (after_m > m_th and after_m > before_m):
        _restore(st, snap)
        return False
    return True


def _short_item_reorder_raw(st: _State, bound: float, m_th: float) -> None:
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
            d = int(np.argmin(np.where(fits, st.C if st.uniform else st.C + w * st.f, np.inf)))
        else:
            d = int(np.argmin(st.M))
        whole_load = float(st.C[d]) + w * float(st.f[d])
        if was[i] == 2 and (whole_load > bound or not fits.any()) and h >= 2 and st.D >= 2:
            mb = st.block_max(st.M, 2) + -(-h // 2)
            valid = mb <= m_th
            cb = st.after(2, w)
            if valid.any():
                b = int(np.argmin(np.where(valid, cb, np.inf)))
                if cb[b] < whole_load or not fits.any():
                    st.add(i, 2, b)
                    continue
        st.add(i, 1, d)


# ------------------------------------------------------------------------------ stage 4


def _first_placement(st: _State, i: int, m_th: float, p_top: int, limit: float) -> tuple[int, int] | None:
    """The smallest degree (then the least-loaded group) at which sequence ``i`` (not placed) fits
    with every member below ``limit`` and under the memory cap; None if no degree does."""
    h, w = st.hl[i], st.wl[i]
    p = 1
    while p <= p_top:
        cb = st.after(p, w)
        ok = (cb < limit) & (st.block_max(st.M, p) + -(-h // p) <= m_th)
        if ok.any():
            return p, int(np.argmin(np.where(ok, cb, np.inf)))
        p *= 2
    return None


def _refine(st: _State, target: float, m_th: float, p_top: np.ndarray, max_steps: int) -> int:
    """Relieve the most loaded device until it cannot be relieved (see module docstring)."""
    wl, hl = st.wl, st.hl
    top_all = int(p_top.max()) if len(p_top) else 1
    steps = 0
    while steps < max_steps:
        d = int(np.argmax(st.C))
        cmax = float(st.C[d])
        if cmax <= target:
            break
        limit = cmax - _EPS * max(1.0, cmax)
        touching = np.nonzero((st.deg >= 1) & (st.blk * st.deg <= d) & (d < (st.blk + 1) * st.deg))[0]
        cand = sorted((int(i) for i in touching),
                      key=lambda k: (-wl[k] / st.deg[k] * float(st.g(int(st.deg[k]))[st.blk[k]]), k))
        moved = False
        # A cheap necessary test before trying a sequence: after removing it (degree p0, share
        # w/p0 on each member) a group that does not overlap its old one keeps its maximum (at
        # least the lightest group's), and one that does ends at least at its maximum minus the
        # share; degree q can only help if one of them plus w/q stays under the limit. Groups
        # at q >= p0 that overlap contain d (load cmax). Tokens likewise against the cap.
        lightest, emptiest = {}, {}
        q = 1
        while q <= top_all:
            lightest[q] = float(_MIN(st.block_max(st.C, q)))
            emptiest[q] = float(_MIN(st.block_max(st.M, q)))
            q *= 2
        # (a) re-insert one sequence on d at its best (degree, group): smallest degree that helps
        for i in cand:
            p_i = int(st.deg[i])
            share, held = wl[i] / p_i * float(st.g(p_i)[st.blk[i]]), -(-hl[i] // p_i)
            q, hopeful = 1, False
            lo0 = int(st.blk[i]) * p_i
            while q <= int(p_top[i]):
                add = wl[i] / q * float(_MIN(st.g(q)))  # the fastest q-group's: a necessary test
                if q < p_i:  # sub-groups of its old group
                    ovl = float(_MIN(_MAX(st.C[lo0 : lo0 + p_i].reshape(-1, q), axis=1))) if q > 1 else float(
                        _MIN(st.C[lo0 : lo0 + p_i]))
                else:
                    ovl = cmax
                if min(lightest[q], ovl - share) + add < limit and emptiest[q] - held + hl[i] // q <= m_th:
                    hopeful = True
                    break
                q *= 2
            if not hopeful:
                continue
            p0, b0 = st.remove(i)
            found = _first_placement(st, i, m_th, int(p_top[i]), limit)
            if found is not None and found != (p0, b0):
                st.add(i, *found)
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
                        new_max = max(cmax + (wl[j] - wl[i]) * float(st.f[d]),
                                      float(st.C[e]) + (wl[i] - wl[j]) * float(st.f[e])) if not st.uniform else \
                            max(cmax - wl[i] + wl[j], float(st.C[e]) + wl[i] - wl[j])
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


def _memory_first(st: _State, order: Sequence[int], p_cap: np.ndarray) -> None:
    """Rescue placement when the compute-driven plan breaks the memory cap: longest first, each at
    the (degree, group) whose fullest member ends with the fewest tokens (ties: lower compute,
    lower degree, lower group)."""
    for i in order:
        h, w = st.hl[i], st.wl[i]
        best = None
        p = 1
        while p <= int(p_cap[i]):
            mb = st.block_max(st.M, p) + -(-h // p)
            cb = st.after(p, w)
            b = int(np.lexsort((cb, mb))[0])
            key = (float(mb[b]), float(cb[b]), p, b)
            if best is None or key < best:
                best = key
            p *= 2
        st.add(i, best[2], best[3])


def _memory_search(st: _State, order: Sequence[int], p_cap: np.ndarray, m_th: float, budget: int) -> bool:
    """Depth-first search for a placement with every device under the memory cap (longest first,
    options by fullest member, then degree, then group); gives up after ``budget`` placements.
    Exact on small batches, where the greedy stages can miss a feasible packing."""
    tried = 0

    def options(i: int) -> list[tuple[int, int]]:
        h = st.hl[i]
        out = []
        p = 1
        while p <= int(p_cap[i]):
            mb = st.block_max(st.M, p) + h // p  # necessary; the exact check follows the add
            for b in np.nonzero(mb <= m_th)[0]:
                out.append((float(mb[b]), p, int(b)))
            p *= 2
        out.sort()
        return [(p, b) for _, p, b in out]

    depth = 0
    stack: list[list[tuple[int, int]]] = [options(order[0])] if order else []
    while stack:
        if depth == len(order):
            return True
        if not stack[-1]:
            stack.pop()
            depth -= 1
            if depth >= 0 and stack:
                st.remove(order[depth])
            continue
        p, b = stack[-1].pop(0)
        i = order[depth]
        st.add(i, p, b)
        tried += 1
        lo = b * p
        if float(st.M[lo : lo + p].max()) > m_th:
            st.remove(i)
            continue
        if tried > budget:
            return False
        depth += 1
        if depth == len(order):
            return True
        stack.append(options(order[depth]))
    return False


# ------------------------------------------------------------------------------ driver


def _slowness(speeds: Sequence[float] | None, num_devices: int) -> np.ndarray | None:
    """Each rank's time per unit of work, speeds normalised to mean 1; None when every speed is equal."""
    if speeds is None:
        return None
    s = np.asarray(speeds, dtype=np.float64)
    if s.shape != (num_devices,) or not (s > 0).all():
        raise ValueError(f"speeds must be {num_devices} positive numbers, got {list(speeds)}")
    if (s == s[0]).all():
        return None
    return 1.0 / (s / s.mean())


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
    split_granularity: float = 0.02,
    merge_candidates: int = DEFAULT_M_CANDIDATES,
    refine: bool = True,
    h_pack: int = DEFAULT_H_PACK,
    h_pack_cap: int = DEFAULT_H_PACK_CAP,
    speeds: Sequence[float] | None = None,
) -> ShardPlan:
    """FlexUlysses placement of ``lengths`` over ``num_devices`` ranks (see the module docstring).

    ``speeds`` (relative, one per rank; None or all equal: the paper's planner exactly): every stage minimises
    the latest finish instead of the largest load, a shard running at its group's slowest member's speed.

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
    slowness = _slowness(speeds, num_devices)
    # (speeds normalised to mean 1: the ideal finish is still the mean load)
    mean_c = float(w.sum()) / num_devices
    m_th = alpha * float(h.sum()) / num_devices
    p_cap = np.minimum(_pow2_floor(h), top)  # per-sequence top degree
    st = _State(h, w, num_devices, slowness)
    fastest = np.asarray([float(_MIN(st.g(int(q)))) for q in p_cap])  # each sequence's best group at its cap
    lower = max(mean_c, float((w / p_cap * fastest).max()))
    target = (1.0 + balance_tol) * lower

    # GetSPSize: smallest level with w/p <= split_granularity * mean load (capped).
    need = np.maximum(w / max(split_granularity * mean_c, _EPS), 1.0)
    p0 = np.minimum(np.left_shift(1, np.ceil(np.log2(need)).astype(np.int64)), p_cap)
    order = [int(i) for i in np.lexsort((np.arange(n), -h))]

    _baseline_split_place(st, order, p0, p_cap, m_th)  # stage 1
    first = float(st.C.max())
    steps = _refine(st, target, m_th, p_cap, 8 * n) if refine else 0
    bound = max(float(st.C.max()), target)
    merges = _merge_phase(st, levels, bound, m_th, merge_candidates, model.comm_cost)  # stage 2
    _short_item_reorder(st, bound, m_th)  # stage 3
    if refine:
        steps += _refine(st, target, m_th, p_cap, 8 * n)
    rescued = 0.0
    hopeless = float((-(-h // p_cap)).max()) > m_th  # one sequence alone breaks the cap
    if float(st.M.max()) > m_th and not hopeless:  # the compute-first stages missed the cap
        alt = _State(h, w, num_devices, slowness)
        _memory_first(alt, order, p_cap)
        if float(alt.M.max()) > m_th:
            alt = _State(h, w, num_devices, slowness)
            if not _memory_search(alt, order, p_cap, m_th, MEMORY_SEARCH_BUDGET):
                alt = None
        if alt is not None:
            if refine:
                steps += _refine(alt, target, m_th, p_cap, 8 * n)
            st, rescued = alt, 1.0

    return build_plan(
        "flex_ulysses",
        h,
        num_devices,
        p_max,
        st.deg,
        st.blk,
        sizes=[st.slice_sizes(i) for i in range(n)],
        cost_model=model,
        alpha=alpha,
        max_degree=top,
        h_pack=h_pack,
        h_pack_cap=h_pack_cap,
        info={
            "merged": float(merges),
            "refine_steps": float(steps),
            "stage1_max_over_mean": first / mean_c,
            "memory_rescue": rescued,
        },
    )
