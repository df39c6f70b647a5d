"""Which rank encodes which images and video frames of a wave, and where their embeddings go
(FlexRL sec. 3.3, "Vision Tower Balancing", at run time).

Input: each rank's *needs* in a wave - the frame runs whose placeholder tokens fall in its pieces
(:func:`frame_runs`; of each image or video a rank needs only the temporal patches its ranges touch, each once
however many of its ranges use it: the ``n`` responses of a prompt share one encoding). Units: a whole image, or one temporal patch of a video
(Qwen2.5-VL's vision attention, windowed and full, never crosses a temporal patch, so a frame
encoded alone gives exactly its rows of the whole clip). A unit needed by several ranks (the ``n``
responses of a prompt on different ranks, a frame cut by a slice boundary) is encoded once.

Units go to ranks by :func:`~titanrl.parallel.flex_ulysses.vision.assign_units` on vision cost:
first to the lowest rank that needs them (no traffic), then the overloaded ranks shed and the rest
is placed longest-first on the least-loaded rank. Only ranks with work in the wave encode (a rank
without any runs a two-token dummy, no vision). Adjacent frames of one video on one rank are
encoded as one run.

The route (:class:`RouteIndices`, per rank): the encoder's output rows to send to each rank, in
the order of the destination's needs, and on the destination the permutation that puts the
received rows into its need order - the rows the unbalanced path would have encoded itself, so
everything after the route is unchanged. All of it is derived from the plan on every rank: no
size handshake.

A stage's vision plan (:func:`plan_stage_vision`, what the trajectory exchange moves and the assembly indexes): per
wave, or with a stage's vision *table* once for all of a rank's waves, who encodes what; with
``parallelism.vision_balance`` off every rank encodes what its own tokens use (its cost still planned, for the
``vision/*`` metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.flex_ulysses.vision import assign_units
from titanrl.parallel.stage_plan import Piece, StagePlan

if TYPE_CHECKING:
    from titanrl.rl.units import StageUnit, TrajectoryMeta

ItemKey = tuple[int, int]  # (owner, media item of the owner): MediaItem.owner / .index


@dataclass(frozen=True)
class FrameRun:
    """Temporal patches ``[f0, f1)`` of media item ``item`` of ``group``: the owner of the item (the prompt's group,
    or a multi-turn trajectory's key for its observations' images: ``titanrl.rl.units.MediaItem.owner``)."""

    group: int
    item: int
    f0: int
    f1: int

    @property
    def key(self) -> ItemKey:
        return self.group, self.item


@dataclass(frozen=True)
class ItemShape:
    patches_per_frame: int
    tokens_per_frame: int
    is_image: bool


@dataclass(frozen=True)
class Segment:
    """Frames ``[f0, f1)`` of item ``key`` that ``encoder`` sends to the rank needing them."""

    encoder: int
    key: ItemKey
    f0: int
    f1: int


@dataclass(frozen=True)
class WaveVisionPlan:
    num_devices: int
    encode: tuple[tuple[FrameRun, ...], ...]  # per rank: the runs it encodes, sorted
    needs: tuple[tuple[FrameRun, ...], ...]  # per rank: the runs its tokens use, sorted
    segments: tuple[tuple[Segment, ...], ...]  # per rank: where its needed rows come from, in need order
    encode_cost: tuple[float, ...]  # per rank, cost-model units
    need_cost: tuple[float, ...]  # per rank: what it would encode without balancing

    def moves(self) -> bool:
        """Whether any embedding row crosses ranks."""
        return any(s.encoder != r for r, segs in enumerate(self.segments) for s in segs)

    def rows_sent(self, shapes: Mapping[ItemKey, ItemShape]) -> int:
        """Embedding rows that cross ranks."""
        return sum((s.f1 - s.f0) * shapes[s.key].tokens_per_frame
                   for r, segs in enumerate(self.segments) for s in segs if s.encoder != r)


def runs_of(frames_by_key: Mapping[ItemKey, Sequence[int]]) -> list[FrameRun]:
    """Maximal runs of each item's frames, sorted by item then frame."""
    runs = []
    for key in sorted(frames_by_key):
        frames = sorted(set(frames_by_key[key]))
        start = prev = frames[0]
        for f in frames[1:] + [None]:
            if f is None or f != prev + 1:
                runs.append(FrameRun(key[0], key[1], start, prev + 1))
                start = f
            prev = f
    return runs


def runs_cost(runs: Sequence[FrameRun], shapes: Mapping[ItemKey, ItemShape], cost_model: CostModel) -> float:
    """Vision cost of encoding ``runs``."""
    return sum(float(cost_model.vision((r.f1 - r.f0) * shapes[r.key].patches_per_frame)) for r in runs)


def plan_wave_vision(needs: Sequence[Sequence[FrameRun]], shapes: Mapping[ItemKey, ItemShape], cost_model: CostModel, *,
                     eligible: Sequence[bool], tol: float = 0.02,
                     speeds: Sequence[float] | None = None) -> WaveVisionPlan:
    """Balance the vision units of one wave (see the module docstring)."""
    world = len(needs)
    # units: whole images, single temporal patches of videos; preferred = lowest rank needing it
    unit_key, unit_frames, preferred, cost = [], [], [], []
    index: dict[tuple[ItemKey, int], int] = {}
    for r, runs in enumerate(needs):
        for run in runs:
            shape = shapes[run.key]
            frames = [(run.f0, run.f1)] if shape.is_image else [(f, f + 1) for f in range(run.f0, run.f1)]
            for f0, f1 in frames:
                if (run.key, f0) in index:
                    continue
                index[(run.key, f0)] = len(unit_key)
                unit_key.append(run.key)
                unit_frames.append((f0, f1))
                preferred.append(r)
                cost.append(float(cost_model.vision((f1 - f0) * shape.patches_per_frame)))
    device = assign_units(np.asarray(cost), preferred, world, eligible=eligible, tol=tol, speeds=speeds)
    per_rank: list[dict[ItemKey, list[int]]] = [{} for _ in range(world)]
    encoder_of: dict[tuple[ItemKey, int], int] = {}
    encode_cost = np.zeros(world)
    for k, (key, (f0, f1)) in enumerate(zip(unit_key, unit_frames)):
        e = int(device[k])
        per_rank[e].setdefault(key, []).extend(range(f0, f1))
        encode_cost[e] += cost[k]
        for f in range(f0, f1):
            encoder_of[(key, f)] = e
    segments = []
    for runs in needs:
        segs: list[Segment] = []
        for run in runs:
            f = run.f0
            while f < run.f1:
                e, g = encoder_of[(run.key, f)], f + 1
                while g < run.f1 and encoder_of[(run.key, g)] == e:
                    g += 1
                segs.append(Segment(e, run.key, f, g))
                f = g
        segments.append(tuple(segs))
    need_cost = [runs_cost(runs, shapes, cost_model) for runs in needs]
    return WaveVisionPlan(
        num_devices=world,
        encode=tuple(tuple(runs_of(d)) if d else () for d in per_rank),
        needs=tuple(tuple(runs) for runs in needs),
        segments=tuple(segments),
        encode_cost=tuple(float(x) for x in encode_cost),
        need_cost=tuple(need_cost),
    )


@dataclass(frozen=True)
class RouteIndices:
    """One rank's share of a wave's embedding route (rows of the vision tower's output)."""

    send_index: np.ndarray  # rows of this rank's encoded output, destination by destination
    send_counts: tuple[int, ...]  # rows to each rank
    recv_counts: tuple[int, ...]  # rows from each rank
    recv_order: np.ndarray  # received rows (concatenated by source) -> this rank's need order

    @property
    def rows_in(self) -> int:
        return int(self.recv_order.size)


def _run_bases(runs: Sequence[FrameRun], shapes: Mapping[ItemKey, ItemShape]) -> dict[ItemKey, list[tuple[int, int, int]]]:
    """Per item, the (f0, f1, first row) of each of ``runs`` in the concatenated output."""
    out: dict[ItemKey, list[tuple[int, int, int]]] = {}
    row = 0
    for run in runs:
        out.setdefault(run.key, []).append((run.f0, run.f1, row))
        row += (run.f1 - run.f0) * shapes[run.key].tokens_per_frame
    return out


def _rows(bases, key: ItemKey, f0: int, f1: int, tpf: int) -> np.ndarray:
    r0, _, base = next(b for b in bases[key] if b[0] <= f0 < b[1])
    start = base + (f0 - r0) * tpf
    return np.arange(start, start + (f1 - f0) * tpf, dtype=np.int64)


def route_indices(plan: WaveVisionPlan, rank: int, shapes: Mapping[ItemKey, ItemShape]) -> RouteIndices:
    world = plan.num_devices
    enc_bases = _run_bases(plan.encode[rank], shapes)
    send, send_counts = [], []
    for dest in range(world):
        rows = [_rows(enc_bases, s.key, s.f0, s.f1, shapes[s.key].tokens_per_frame)
                for s in plan.segments[dest] if s.encoder == rank]
        send += rows
        send_counts.append(int(sum(r.size for r in rows)))
    recv_counts = [0] * world
    for s in plan.segments[rank]:
        recv_counts[s.encoder] += (s.f1 - s.f0) * shapes[s.key].tokens_per_frame
    offsets = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(np.int64)
    cursor = offsets.copy()
    order = []
    for s in plan.segments[rank]:
        n = (s.f1 - s.f0) * shapes[s.key].tokens_per_frame
        order.append(np.arange(cursor[s.encoder], cursor[s.encoder] + n, dtype=np.int64))
        cursor[s.encoder] += n
    empty = np.zeros(0, dtype=np.int64)
    return RouteIndices(
        send_index=np.concatenate(send) if send else empty,
        send_counts=tuple(send_counts),
        recv_counts=tuple(recv_counts),
        recv_order=np.concatenate(order) if order else empty,
    )


# ------------------------------------------------------------------------------------------ a stage's vision plan

def frame_runs(pieces: Sequence[Piece], metas: Sequence[TrajectoryMeta | StageUnit]) -> list[FrameRun]:
    """The vision inputs a rank needs for ``pieces`` (stage ids index ``metas``, trajectories or
    units: media tokens sit at the same places in both, the prompt first): per prompt and media
    item, the union of the temporal patches its pieces touch, as maximal runs, sorted."""
    needed: dict[tuple[int, int], set[int]] = {}
    for p in pieces:
        for item in metas[p.seq].media:
            frames = item.frames(p.start, p.end)
            if frames is not None:
                needed.setdefault((item.owner, item.index), set()).update(range(*frames))
    return runs_of(needed)


def run_frames(runs: Sequence[FrameRun]) -> int:
    """Images and video temporal patches in ``runs``."""
    return sum(r.f1 - r.f0 for r in runs)


def item_shapes(metas: Sequence[TrajectoryMeta]) -> dict[ItemKey, ItemShape]:
    """(owner, media index) -> what the vision planner needs of each image or video."""
    return {(it.owner, it.index): ItemShape(it.patches_per_frame, it.tokens_per_frame, not it.grid.is_video)
            for m in metas for it in m.media}


@dataclass(frozen=True)
class VisionBalancing:
    """``parallelism.vision_balance``: when ``enabled``, the vision tower's units of a wave are spread
    over ranks by ``cost_model`` and embeddings routed over ``group`` (every rank); otherwise every rank
    encodes what its own tokens use (the cost is still planned, for the ``vision/*`` metrics)."""

    enabled: bool
    cost_model: CostModel
    group: object = None
    tol: float = 0.02
    speeds: tuple[float, ...] | None = None  # relative rank speeds (balance.rank_speeds); None: equal

    def __post_init__(self) -> None:
        if self.enabled and float(self.cost_model.vision(1.0)) <= 0.0:
            raise ValueError("vision balancing needs a cost model that prices the vision tower (its vision "
                             "coefficients are 0: every unit would cost nothing and land on one rank)")


@dataclass(frozen=True)
class StageVision:
    """Who encodes what in a stage's ``waves`` (the same on every rank). ``groups``: the waves each vision plan
    serves, each wave alone or, with a ``table``, all of them at once (every rank encodes in the table's vision
    pass; only ranks with work in a wave encode in it)."""

    groups: tuple[tuple[int, ...], ...]
    needs: tuple[tuple[tuple[FrameRun, ...], ...], ...]  # [group][rank]: the runs the rank's pieces use
    plans: tuple[WaveVisionPlan, ...]  # one per group with vision balancing; empty without
    encode: tuple[tuple[tuple[FrameRun, ...], ...], ...]  # [group][rank]: the runs the rank encodes
    costs: tuple[tuple[float, ...], ...]  # [group][rank]: their planned vision cost
    table: bool

    def plan(self, g: int) -> WaveVisionPlan | None:
        return self.plans[g] if self.plans else None

    def moves_pixels(self, home_of_owner: Mapping[int, int], sent=lambda run: True) -> bool:
        """Whether balancing gives some rank runs of media generated elsewhere (pixels then move even where
        every piece stays home); ``sent``: the runs whose pixels travel (the others are fetched)."""
        return any(home_of_owner[run.group] != r and sent(run) for vp in self.plans
                   for r, runs in enumerate(vp.encode) for run in runs)


def plan_stage_vision(plan: StagePlan, units: Sequence[StageUnit], waves: Sequence[int], *, world: int,
                      shapes: Mapping[ItemKey, ItemShape], vision: VisionBalancing, table: bool) -> StageVision:
    """The vision plan of ``waves`` of a stage placed by ``plan`` over ``world`` ranks (see :class:`StageVision`;
    a stage with nothing to place has no waves, and still a share, empty, for every rank)."""
    groups = (tuple(waves),) if table else tuple((w,) for w in waves)
    needs = tuple(tuple(tuple(frame_runs([p for w in ws for p in plan.pieces(w, r)], units)) for r in range(world))
                  for ws in groups)
    if vision.enabled:
        plans = tuple(plan_wave_vision(need, shapes, vision.cost_model, eligible=[True] * world if table
                                       else [any(plan.pieces(w, r) for w in ws) for r in range(world)],
                                       tol=vision.tol, speeds=vision.speeds) for ws, need in zip(groups, needs))
        return StageVision(groups, needs, plans, tuple(vp.encode for vp in plans),
                           tuple(vp.encode_cost for vp in plans), table)
    return StageVision(groups, needs, (), needs,
                       tuple(tuple(runs_cost(n, shapes, vision.cost_model) for n in need) for need in needs), table)
