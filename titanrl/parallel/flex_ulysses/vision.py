"""Vision-tower balancing (FlexRL sec. 3.3, "Vision Tower Balancing").

The vision tower encodes every image and every video frame independently (Qwen2.5-VL: windowed
attention plus full attention *within* one image / one temporal slice of 2 frames), so its cost is
a sum over *units* -- images and temporal frame slices -- and units can go to any rank. The text
positions of a sample, on the other hand, live where the shard plan put them. ``plan_vision``
assigns units to ranks so that every rank encodes the same patch cost, and says where to send each
unit's embeddings: to the rank(s) holding the unit's token positions in the sample's sequence.

Algorithm (deterministic, near-linear):

1. *Locality first*: with a shard plan, each unit starts on the rank that holds the first of its
   token positions (no embedding traffic for it); without one, units start nowhere.
2. *Shed*: a rank above ``(1 + tol) * mean`` gives away units -- each time the cheapest unit that
   alone brings it under the cap, else its largest -- until it is under the cap.
3. *Place* every unassigned unit, most expensive first (ties by unit index), on the least-loaded
   rank (ties by rank): LPT, so the maximum is within one unit of the mean when units are small.

Units are listed sample by sample, images first then frames, in order. ``patches`` gives the
patch count of every unit of a sample, either one number for all of them or one per unit; a unit
becomes ``patches // merge_size**2`` LLM tokens. Its token positions start at
``token_offsets[sample]`` (default 0) and follow each other in unit order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.flex_ulysses.plan import ShardPlan


@dataclass(frozen=True)
class VisionUnit:
    index: int  # position in VisionPlan.units
    sample: int
    kind: str  # "image" | "frame"
    ordinal: int  # which image / which frame slice of its sample
    patches: int
    token_start: int  # first token position of its embeddings in the sample's sequence
    tokens: int
    device: int  # rank that encodes it
    # (rank, start, end): the slice [start, end) of this unit's sequence positions held by rank
    destinations: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class VisionPlan:
    num_devices: int
    units: tuple[VisionUnit, ...]
    device_cost: tuple[float, ...]
    device_patches: tuple[int, ...]
    device_units: tuple[tuple[int, ...], ...]  # per rank, the units it encodes, in unit order
    # send_tokens[src][dst]: embedding tokens rank src sends to rank dst (src == dst stays local);
    # empty when no shard plan was given
    send_tokens: tuple[tuple[int, ...], ...]

    @property
    def balance_ratio(self) -> float:
        costs = np.asarray(self.device_cost)
        mean = float(costs.mean()) if costs.size else 0.0
        return float(costs.max()) / mean if mean > 0 else 1.0

    @property
    def remote_tokens(self) -> int:
        """Embedding tokens that cross ranks."""
        if not self.send_tokens:
            return 0
        m = np.asarray(self.send_tokens)
        return int(m.sum() - np.trace(m))


def _unit_patches(images: Sequence[int], frames: Sequence[int], patches: Sequence) -> list[list[int]]:
    if not (len(images) == len(frames) == len(patches)):
        raise ValueError(
            f"images_per_sample ({len(images)}), frames_per_sample ({len(frames)}) and patches "
            f"({len(patches)}) must have one entry per sample"
        )
    out = []
    for i, (n_img, n_frm, p) in enumerate(zip(images, frames, patches)):
        count = int(n_img) + int(n_frm)
        if n_img < 0 or n_frm < 0:
            raise ValueError(f"sample {i}: negative image/frame count")
        per = [int(p)] * count if np.ndim(p) == 0 else [int(x) for x in p]
        if len(per) != count:
            raise ValueError(f"sample {i}: {len(per)} patch counts for {count} images + frames")
        if any(x < 1 for x in per):
            raise ValueError(f"sample {i}: every image / frame needs at least one patch")
        out.append(per)
    return out


def assign_units(
    cost: Sequence[float] | np.ndarray,
    preferred: Sequence[int],
    num_devices: int,
    *,
    eligible: Sequence[bool] | None = None,
    tol: float = 0.02,
    speeds: Sequence[float] | None = None,
) -> np.ndarray:
    """The rank that encodes each unit (steps 1-3 of the module docstring): ``preferred[k]`` is the
    rank holding unit ``k``'s tokens (-1: none), ``eligible[r]`` whether rank ``r`` may encode at all
    (default: every rank), ``speeds[r]`` its relative speed (default: all equal; a rank's cap and its
    finish time in step 3 are its load over its speed). Deterministic: every rank computes the same answer."""
    cost = np.asarray(cost, dtype=np.float64).reshape(-1)
    u = cost.size
    ok = np.ones(num_devices, dtype=bool) if eligible is None else np.asarray(eligible, dtype=bool)
    if u and not ok.any():
        raise ValueError("no rank is eligible to encode vision units")
    device = np.asarray([r if r >= 0 and ok[r] else -1 for r in preferred], dtype=np.int64).reshape(-1)
    if device.size != u:
        raise ValueError(f"{device.size} preferred ranks for {u} units")
    loads = np.zeros(num_devices, dtype=np.float64)
    speed = np.ones(num_devices) if speeds is None else np.asarray(speeds, dtype=np.float64).reshape(-1)
    if speed.size != num_devices or not (speed > 0).all():
        raise ValueError(f"speeds must be {num_devices} positive numbers, got {speeds}")
    uniform = bool((speed == speed[0]).all())
    if uniform:
        cap_of = np.full(num_devices, (1.0 + tol) * float(cost.sum()) / int(ok.sum()) if u else 0.0)
    else:  # each rank's share of the total in proportion to its speed
        cap_of = (1.0 + tol) * float(cost.sum()) * speed / float(speed[ok].sum()) if u else np.zeros(num_devices)
    placed = device >= 0
    if placed.any():
        loads = np.bincount(device[placed], weights=cost[placed], minlength=num_devices).astype(np.float64)
        for r in range(num_devices):
            cap = cap_of[r]
            if loads[r] <= cap:
                continue
            mine = [int(k) for k in np.nonzero(device == r)[0]]
            mine.sort(key=lambda k: (cost[k], k))
            while loads[r] > cap and mine:
                excess = loads[r] - cap
                pick = next((k for k in mine if cost[k] >= excess), mine[-1])
                mine.remove(pick)
                device[pick] = -1
                loads[r] -= cost[pick]
    todo = [int(k) for k in np.nonzero(device < 0)[0]]
    todo.sort(key=lambda k: (-cost[k], k))
    if not uniform:  # each unit, heaviest first, to the rank it would finish earliest on
        for k in todo:
            r = min((r for r in range(num_devices) if ok[r]), key=lambda r: ((loads[r] + cost[k]) / speed[r], r))
            device[k] = r
            loads[r] += cost[k]
        return device
    heap = [(float(loads[r]), r) for r in range(num_devices) if ok[r]]
    heapq.heapify(heap)
    for k in todo:
        load, r = heapq.heappop(heap)
        device[k] = r
        loads[r] = load + cost[k]
        heapq.heappush(heap, (float(loads[r]), r))
    return device


def plan_vision(
    images_per_sample: Sequence[int],
    frames_per_sample: Sequence[int],
    patches: Sequence[int] | Sequence[Sequence[int]],
    num_devices: int,
    *,
    shard_plan: ShardPlan | None = None,
    token_offsets: Sequence[int] | None = None,
    cost_model: CostModel | None = None,
    merge_size: int = 2,
    tol: float = 0.02,
) -> VisionPlan:
    """Spread images and frame slices over ``num_devices`` ranks by vision-tower cost."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    model = cost_model or CostModel()
    per_sample = _unit_patches(images_per_sample, frames_per_sample, patches)
    n = len(per_sample)
    offsets = [0] * n if token_offsets is None else [int(x) for x in token_offsets]
    if len(offsets) != n:
        raise ValueError(f"token_offsets has {len(offsets)} entries for {n} samples")
    if shard_plan is not None and (len(shard_plan.lengths) != n or shard_plan.num_devices != num_devices):
        raise ValueError("shard_plan must cover the same samples and devices")

    merge = merge_size * merge_size
    sample_of, kind_of, ordinal_of, patch_of, start_of, tokens_of = [], [], [], [], [], []
    for i, per in enumerate(per_sample):
        pos = offsets[i]
        n_img = int(images_per_sample[i])
        for j, p in enumerate(per):
            t = p // merge
            sample_of.append(i)
            kind_of.append("image" if j < n_img else "frame")
            ordinal_of.append(j if j < n_img else j - n_img)
            patch_of.append(p)
            start_of.append(pos)
            tokens_of.append(t)
            pos += t
        if shard_plan is not None and pos > shard_plan.lengths[i]:
            raise ValueError(f"sample {i}: vision tokens end at {pos}, past its length {shard_plan.lengths[i]}")
    u = len(patch_of)
    cost = np.asarray(model.vision(np.asarray(patch_of, dtype=np.float64)), dtype=np.float64).reshape(-1)

    # destinations: which rank holds which part of the unit's token positions
    dests: list[tuple[tuple[int, int, int], ...]] = [()] * u
    if shard_plan is not None:
        for k in range(u):
            i, a, b = sample_of[k], start_of[k], start_of[k] + tokens_of[k]
            out = []
            for r, (s, e) in zip(shard_plan.groups[i], shard_plan.slices[i]):
                lo, hi = max(a, s), min(b, e)
                if lo < hi:
                    out.append((r, lo, hi))
            dests[k] = tuple(out)

    preferred = [d[0][0] if d else -1 for d in dests]
    device = assign_units(cost, preferred, num_devices, tol=tol)
    units = tuple(
        VisionUnit(
            index=k, sample=sample_of[k], kind=kind_of[k], ordinal=ordinal_of[k], patches=patch_of[k],
            token_start=start_of[k], tokens=tokens_of[k], device=int(device[k]), destinations=dests[k],
        )
        for k in range(u)
    )
    device_units = [[] for _ in range(num_devices)]
    for k in range(u):
        device_units[int(device[k])].append(k)
    patches_per_device = np.bincount(device, weights=np.asarray(patch_of, dtype=np.float64), minlength=num_devices)
    cost_per_device = np.bincount(device, weights=cost, minlength=num_devices) if u else np.zeros(num_devices)
    send: tuple[tuple[int, ...], ...] = ()
    if shard_plan is not None:
        matrix = np.zeros((num_devices, num_devices), dtype=np.int64)
        for k in range(u):
            for r, lo, hi in dests[k]:
                matrix[device[k], r] += hi - lo
        send = tuple(tuple(int(x) for x in row) for row in matrix)
    return VisionPlan(
        num_devices=num_devices,
        units=units,
        device_cost=tuple(float(x) for x in cost_per_device),
        device_patches=tuple(int(round(x)) for x in patches_per_device),
        device_units=tuple(tuple(x) for x in device_units),
        send_tokens=send,
    )
