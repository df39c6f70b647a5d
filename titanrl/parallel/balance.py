"""ODC-style minibatch partitioners (ODC paper sec. 4, appendix C listings 1-3) and bubble rates (G).

- :func:`karmarkar_karp`: k-way largest differencing (the LDM of Karmarkar & Karp, as verl and ODC
  use it), optionally with equal subset sizes (verl's ``equal_size``: sizes differ by at most one).
- :func:`speed_partition`: the same goal over ranks of unequal speed (HetRL sec. 4.2): minimise the
  latest finish ``load_r / speed_r``; :func:`balance_ranks` is what rank splits call (KK when the
  speeds are equal, so equal-speed plans are unchanged).
- :func:`partition_minibatch`: one minibatch over ``world_size`` ranks, per rank a list of
  microbatches (lists of sample indices), every microbatch within ``max_tokens_per_microbatch``:

  ``"native"``   verl's per-minibatch behaviour: samples dealt to ranks in equal contiguous
                 chunks (no balancing inside the minibatch; in verl the balancing happened
                 over the whole global batch before it was cut into minibatches -- see
                 :func:`partition_batch`), then every rank packs its samples into the same number
                 of microbatches (the smallest count feasible on every rank: verl's all-reduce).
  ``"lb_micro"`` balance the minibatch across ranks (KK, equal sample counts by default), every
                 rank packs into the same number of microbatches (KK on its own samples), and each
                 rank orders its microbatches heaviest first so that microbatch ``j`` costs about
                 the same everywhere (what per-layer synchronization pays for).
  ``"lb_mini"``  balance the minibatch across ranks (KK, unequal counts allowed), then
                 each rank independently packs into as many memory-feasible microbatches as it
                 needs (ODC listing 3 with ``same_micro_in_dp = False``).
- :func:`partition_batch`: a whole PPO step: ``"native"`` is listing 2 (balance the global batch,
  shuffle each rank's share, cut it into minibatches), the LB strategies are listing 3 (shuffle,
  cut the global batch into minibatches, balance each).
- :func:`bubble_rate`: idle fraction ``1 - busy / (world_size * step time)`` where the step time is
  ``sum_j max_r cost(r, j)`` when ranks synchronize at every microbatch/layer (FSDP collectives;
  needs equal microbatch counts) and ``max_r sum_j cost(r, j)`` when they synchronize only at the
  minibatch end (ODC). Per-layer synchronization has the same ratio as per-microbatch because every
  layer's cost is proportional to its microbatch's cost.

Costs are per sample and additive over a microbatch (packed varlen attention): ``cost_fn`` maps an
array of lengths to an array of costs; the default is :class:`~titanrl.parallel.cost_model.CostModel`
``().compute`` (7B-shaped attention + linear FLOPs). Everything is deterministic: ties broken by
index, shuffles seeded.
"""

from __future__ import annotations

import heapq
from typing import Callable, Literal, Sequence

import numpy as np

from titanrl.parallel.cost_model import CostModel

Strategy = Literal["native", "lb_micro", "lb_mini"]
Sync = Literal["layer", "minibatch"]
MinibatchPlan = list[list[list[int]]]  # [rank][microbatch] -> sample indices
STRATEGIES: tuple[str, ...] = ("native", "lb_micro", "lb_mini")


# ------------------------------------------------------------------------------ Karmarkar-Karp


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Partition indices ``0..len(costs)-1`` into ``k`` subsets with balanced cost sums (LDM).

    Each state is ``k`` subsets sorted by sum; the two states with the largest spread (max - min
    sum) are combined by pairing the heaviest subset of one with the lightest of the other. With
    ``equal_size`` the items are sorted and dealt ``k`` at a time into singleton subsets, so every
    combination keeps the subset sizes equal (the last, short chunk is padded with zero-cost
    placeholders, so sizes differ by at most one). Subsets are returned with their indices
    ascending, heaviest subset first (ties by smallest index). Worst case (known bounds): max sum
    <= (4/3 - 1/(3k)) OPT unconstrained, <= (2 - 1/k) OPT with equal sizes.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    values = [float(c) for c in costs]
    n = len(values)
    if n == 0:
        return [[] for _ in range(k)]
    if any(v < 0 for v in values):
        raise ValueError("costs must be non-negative")
    serial = 0
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []

    def push(subsets: list[tuple[float, list[int]]]) -> None:
        nonlocal serial
        subsets.sort(key=lambda s: (-s[0], s[1][0] if s[1] else n))
        heapq.heappush(heap, (-(subsets[0][0] - subsets[-1][0]), serial, subsets))
        serial += 1

    if equal_size:
        order = sorted(range(n), key=lambda i: (-values[i], i))
        padded = order + [-1] * ((-n) % k)
        for start in range(0, len(padded), k):
            chunk = padded[start : start + k]
            push([(values[i], [i]) if i >= 0 else (0.0, []) for i in chunk])
    else:
        for i in range(n):
            push([(values[i], [i])] + [(0.0, []) for _ in range(k - 1)])
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # first/second are sorted heaviest first: pair heavy with light
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))]
        push(merged)
    subsets = heap[0][2]
    out = [sorted(items) for _, items in subsets]
    sums = [sum(values[i] for i in items) for items in out]
    order = sorted(range(k), key=lambda j: (-sums[j], out[j][0] if out[j] else n))
    return [out[j] for j in order]


def _uniform(speeds: Sequence[float] | None) -> bool:
    return speeds is None or len(set(float(s) for s in speeds)) <= 1


def speed_partition(costs: Sequence[float], speeds: Sequence[float], max_rounds: int = 1000) -> list[list[int]]:
    """Partition indices of ``costs`` over ranks of relative ``speeds`` minimising the latest finish
    ``sum(costs of rank r) / speeds[r]`` (HetRL sec. 4.2: longer work to faster devices).

    Longest-processing-time first (each item, heaviest first, to the rank it would finish earliest
    on), then local search from the latest-finishing rank: move one of its items, or swap one for a
    lighter item of another rank, whenever that lowers the later of the two finishes below the current
    latest; until no such step exists (or ``max_rounds``). Subset ``j`` is rank ``j``'s, indices
    ascending. Deterministic (ties by index)."""
    k = len(speeds)
    if k < 1:
        raise ValueError("speeds must name at least one rank")
    sp = [float(s) for s in speeds]
    if any(not s > 0 for s in sp):
        raise ValueError(f"every speed must be > 0, got {sp}")
    values = [float(c) for c in costs]
    if any(v < 0 for v in values):
        raise ValueError("costs must be non-negative")
    parts: list[list[int]] = [[] for _ in range(k)]
    load = [0.0] * k
    for i in sorted(range(len(values)), key=lambda i: (-values[i], i)):
        r = min(range(k), key=lambda r: ((load[r] + values[i]) / sp[r], r))
        parts[r].append(i)
        load[r] += values[i]
    for _ in range(max_rounds):
        finish = [load[r] / sp[r] for r in range(k)]
        a = max(range(k), key=lambda r: (finish[r], -r))
        best = None  # (new worst of the pair, item from a, other rank, item from the other or -1)
        for b in range(k):
            if b == a:
                continue
            for i in parts[a]:
                for j in [-1] + parts[b]:
                    delta = values[i] - (values[j] if j >= 0 else 0.0)
                    if delta <= 0:
                        continue
                    worst = max((load[a] - delta) / sp[a], (load[b] + delta) / sp[b])
                    if worst < finish[a] * (1 - 1e-12) and (best is None or worst < best[0]):
                        best = (worst, i, b, j)
        if best is None:
            break
        _, i, b, j = best
        parts[a].remove(i)
        parts[b].append(i)
        delta = values[i]
        if j >= 0:
            parts[b].remove(j)
            parts[a].append(j)
            delta -= values[j]
        load[a] -= delta
        load[b] += delta
    return [sorted(p) for p in parts]


def balance_ranks(costs: Sequence[float], k: int, *, equal_size: bool = False,
                  speeds: Sequence[float] | None = None) -> list[list[int]]:
    """Split work over ``k`` ranks: :func:`karmarkar_karp` (``equal_size`` as there) when ``speeds`` is None
    or uniform, else :func:`speed_partition` (subset ``j`` for rank ``j``; a faster rank takes more
    items, so ``equal_size`` does not apply)."""
    if speeds is not None and len(speeds) != k:
        raise ValueError(f"{len(speeds)} speeds for {k} ranks")
    if _uniform(speeds):
        return karmarkar_karp(costs, k, equal_size=equal_size)
    return speed_partition(costs, speeds)


# ------------------------------------------------------------------------------ helpers


def default_cost_fn() -> Callable[[np.ndarray], np.ndarray]:
    model = CostModel()
    return lambda lengths: np.asarray(model.compute(np.asarray(lengths, dtype=np.float64)), dtype=np.float64)


def _costs(lengths: np.ndarray, cost_fn: Callable[[np.ndarray], np.ndarray] | None) -> np.ndarray:
    fn = cost_fn or default_cost_fn()
    out = np.asarray(fn(lengths.astype(np.float64)), dtype=np.float64).reshape(-1)
    if out.shape != lengths.shape:
        raise ValueError(f"cost_fn returned shape {out.shape} for {lengths.shape} lengths")
    return out


def _microbatches(
    samples: list[int], lengths: np.ndarray, costs: np.ndarray, k: int
) -> list[list[int]]:
    """KK-partition one rank's samples into ``k`` microbatches (indices into the global arrays)."""
    parts = karmarkar_karp([costs[i] for i in samples], k, equal_size=False)
    return [[samples[j] for j in part] for part in parts]


def _fits(microbatches: list[list[int]], lengths: np.ndarray, max_tokens: int) -> bool:
    return all(int(lengths[mb].sum()) <= max_tokens for mb in microbatches if mb)


def _min_feasible_k(samples: list[int], lengths: np.ndarray, costs: np.ndarray, max_tokens: int) -> int:
    """Smallest microbatch count whose KK partition fits (ODC listing 1's check_oom loop)."""
    if not samples:
        return 1
    k = max(1, -(-int(lengths[samples].sum()) // max_tokens))
    while not _fits(_microbatches(samples, lengths, costs, k), lengths, max_tokens):
        k += 1
    return k


def _by_cost_desc(microbatches: list[list[int]], costs: np.ndarray) -> list[list[int]]:
    keyed = [(-float(costs[mb].sum()) if mb else 0.0, mb[0] if mb else 1 << 62, mb) for mb in microbatches]
    keyed.sort(key=lambda t: (t[0], t[1]))
    return [mb for _, _, mb in keyed]


def pack_microbatches(samples: Sequence[int], lengths: Sequence[int], costs: Sequence[float],
                      max_tokens: int) -> list[list[int]]:
    """One rank's ``samples`` in the fewest memory-feasible microbatches (KK on cost), heaviest
    first; a sample longer than ``max_tokens`` can only be alone, and is."""
    lens, cs = np.asarray(lengths, dtype=np.int64), np.asarray(costs, dtype=np.float64)
    return _pack_ranks([list(samples)], np.minimum(lens, max_tokens), cs, max_tokens, same_count=False)[0]


def _pack_ranks(
    rank_samples: list[list[int]], lengths: np.ndarray, costs: np.ndarray, max_tokens: int, same_count: bool
) -> MinibatchPlan:
    if same_count:
        k = max(_min_feasible_k(s, lengths, costs, max_tokens) for s in rank_samples)
        while True:
            plan = [_microbatches(s, lengths, costs, k) for s in rank_samples]
            if all(_fits(p, lengths, max_tokens) for p in plan):
                break
            k += 1
        return [_by_cost_desc(p, costs) for p in plan]
    plan = []
    for s in rank_samples:
        k = _min_feasible_k(s, lengths, costs, max_tokens)
        plan.append(_by_cost_desc(_microbatches(s, lengths, costs, k), costs))
    return plan


def _check(lengths: np.ndarray, world_size: int, max_tokens: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens}")
    if lengths.size and lengths.min() < 1:
        raise ValueError("every length must be >= 1")
    if lengths.size and int(lengths.max()) > max_tokens:
        raise ValueError(
            f"a sample of {int(lengths.max())} tokens exceeds max_tokens_per_microbatch={max_tokens}"
        )


# ------------------------------------------------------------------------------ public API


def partition_minibatch(
    lengths: Sequence[int],
    world_size: int,
    *,
    strategy: Strategy,
    max_tokens_per_microbatch: int,
    cost_fn: Callable[[np.ndarray], np.ndarray] | None = None,
    equal_size: bool | None = None,
    costs: Sequence[float] | None = None,
    speeds: Sequence[float] | None = None,
) -> MinibatchPlan:
    """Per rank, the microbatches (lists of indices into ``lengths``) of one minibatch.

    ``costs`` (per sample) overrides ``cost_fn``: the caller may pass lengths capped at the budget
    (a longer sample then fills a microbatch alone) while balancing its true cost.

    ``equal_size`` (equal sample counts per rank) defaults to True for ``lb_micro`` (verl's
    constraint); ``lb_mini`` by default runs KK both with and without it and keeps the partition
    whose heaviest rank is lighter (ODC listing 1 sets ``equal_size = False`` for LB-Mini; keeping
    the better of the two makes LB-Mini never worse than LB-Micro's rank balance). ``native`` always
    deals equal contiguous chunks.

    ``speeds`` (relative, one per rank; ``lb_micro`` / ``lb_mini``): ranks of unequal speed get work in
    proportion (:func:`speed_partition`, the latest finish minimised, sample counts free); None or equal
    speeds: the plans above, unchanged.
    """
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    _check(lens, world_size, max_tokens_per_microbatch)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {STRATEGIES}")
    costs = _costs(lens, cost_fn) if costs is None else np.asarray(costs, dtype=np.float64).reshape(-1)
    n = int(lens.size)
    if strategy == "native":
        bounds = [(n * r) // world_size for r in range(world_size + 1)]
        ranks = [list(range(int(bounds[r]), int(bounds[r + 1]))) for r in range(world_size)]
        return _pack_ranks(ranks, lens, costs, max_tokens_per_microbatch, same_count=True)
    if not _uniform(speeds):
        if len(speeds) != world_size:
            raise ValueError(f"{len(speeds)} speeds for {world_size} ranks")
        ranks = speed_partition(costs.tolist(), speeds)
    elif strategy == "lb_mini" and equal_size is None:
        # both KK variants; keep the one with the lighter heaviest rank (ties: equal counts)
        options = [karmarkar_karp(costs.tolist(), world_size, equal_size=eq) for eq in (True, False)]
        heaviest = [max((float(costs[r].sum()) for r in ranks), default=0.0) for ranks in options]
        ranks = options[0] if heaviest[0] <= heaviest[1] else options[1]
    else:
        eq = (strategy == "lb_micro") if equal_size is None else equal_size
        ranks = karmarkar_karp(costs.tolist(), world_size, equal_size=eq)
    return _pack_ranks(ranks, lens, costs, max_tokens_per_microbatch, same_count=(strategy == "lb_micro"))


def partition_batch(
    lengths: Sequence[int],
    world_size: int,
    minibatch_size: int,
    *,
    strategy: Strategy,
    max_tokens_per_microbatch: int,
    cost_fn: Callable[[np.ndarray], np.ndarray] | None = None,
    equal_size: bool | None = None,
    seed: int = 0,
) -> list[MinibatchPlan]:
    """A PPO step's minibatches, each a per-rank microbatch plan with global sample indices.

    ``minibatch_size`` is per rank (ODC's "minibatch size"), so a minibatch has
    ``minibatch_size * world_size`` samples. ``native`` follows ODC listing 2 (global KK with equal
    counts, per-rank seeded shuffle, per-rank slicing into minibatches); ``lb_micro`` and ``lb_mini``
    follow listing 3 (seeded global shuffle, slicing, :func:`partition_minibatch` per minibatch).
    """
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    _check(lens, world_size, max_tokens_per_microbatch)
    if minibatch_size < 1:
        raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}")
    costs = _costs(lens, cost_fn)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xBA7C]))
    if strategy == "native":
        ranks = karmarkar_karp(costs.tolist(), world_size, equal_size=True if equal_size is None else equal_size)
        shuffled = [[r[int(j)] for j in rng.permutation(len(r))] for r in ranks]
        steps = max(-(-len(r) // minibatch_size) for r in shuffled) if shuffled else 0
        out = []
        for m in range(steps):
            per_rank = [r[m * minibatch_size : (m + 1) * minibatch_size] for r in shuffled]
            out.append(_pack_ranks(per_rank, lens, costs, max_tokens_per_microbatch, same_count=True))
        return out
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {STRATEGIES}")
    order = [int(j) for j in rng.permutation(lens.size)]
    size = minibatch_size * world_size
    out = []
    for start in range(0, len(order), size):
        chunk = order[start : start + size]
        local = partition_minibatch(
            lens[chunk], world_size, strategy=strategy, max_tokens_per_microbatch=max_tokens_per_microbatch,
            cost_fn=cost_fn, equal_size=equal_size,
        )
        out.append([[[chunk[i] for i in mb] for mb in rank] for rank in local])
    return out


def _microbatch_costs(
    plan: MinibatchPlan, cost_fn: Callable[[list[int]], float] | Sequence[float] | np.ndarray
) -> list[list[float]]:
    if callable(cost_fn):
        return [[float(cost_fn(mb)) for mb in rank] for rank in plan]
    per_sample = np.asarray(cost_fn, dtype=np.float64)
    return [[float(per_sample[mb].sum()) if mb else 0.0 for mb in rank] for rank in plan]


def minibatch_time(plan: MinibatchPlan, cost_fn, sync: Sync) -> tuple[float, float]:
    """(step time, busy time summed over ranks) of one minibatch."""
    costs = _microbatch_costs(plan, cost_fn)
    busy = sum(sum(r) for r in costs)
    if sync == "minibatch":
        return max((sum(r) for r in costs), default=0.0), busy
    if sync != "layer":
        raise ValueError(f"sync={sync!r}: expected 'layer' or 'minibatch'")
    counts = {len(r) for r in costs}
    if len(counts) > 1:
        raise ValueError(
            f"per-layer synchronization needs the same microbatch count on every rank, got {sorted(counts)}"
        )
    steps = counts.pop() if counts else 0
    return sum(max(r[j] for r in costs) for j in range(steps)), busy


def bubble_rate(
    plan: MinibatchPlan,
    cost_fn: Callable[[list[int]], float] | Sequence[float] | np.ndarray,
    sync: Sync = "layer",
) -> float:
    """Idle fraction of one minibatch plan (ODC appendix G).

    ``cost_fn`` is either per-sample costs (indexable by sample index; a microbatch costs their
    sum) or a callable taking a microbatch's sample indices and returning its cost.
    """
    time, busy = minibatch_time(plan, cost_fn, sync)
    world = len(plan)
    return 0.0 if time <= 0 or world == 0 else 1.0 - busy / (world * time)


def batch_bubble_rate(
    plans: Sequence[MinibatchPlan],
    cost_fn: Callable[[list[int]], float] | Sequence[float] | np.ndarray,
    sync: Sync = "layer",
) -> float:
    """Idle fraction of a whole step (minibatches run one after another)."""
    total_time = total_busy = 0.0
    world = 0
    for plan in plans:
        time, busy = minibatch_time(plan, cost_fn, sync)
        total_time += time
        total_busy += busy
        world = max(world, len(plan))
    return 0.0 if total_time <= 0 or world == 0 else 1.0 - total_busy / (world * total_time)
