"""Vision inputs of a stage's waves: which frame runs a rank needs for its pieces, who encodes them with
``parallelism.vision_balance``, and what that moved.

Vision inputs travel as *frame runs*: of each image or video a rank receives only the temporal patches whose
placeholder tokens fall in its ranges (Qwen2.5-VL's vision attention never crosses a temporal patch, so encoding a
run alone is exact), each once per rank however many of its ranges need it (the ``n`` responses of a prompt share
one encoding). With vision balancing a wave's runs are spread over the ranks by cost
(``titanrl.parallel.vision_plan``) and their embeddings routed back (``titanrl.parallel.vision_route``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.stage_plan import Piece
from titanrl.parallel.vision_plan import FrameRun, ItemShape, WaveVisionPlan, plan_wave_vision, runs_of
from titanrl.parallel.vision_route import RouteCounter
from titanrl.rl.units import StageUnit, TrajectoryMeta


def frame_runs(pieces: Sequence[Piece], metas: Sequence[TrajectoryMeta | StageUnit]) -> list[FrameRun]:
    """The vision inputs a rank needs for ``pieces`` (stage ids index ``metas``, trajectories or
    units: media tokens sit at the same places in both, the prompt first): per prompt and media
    item, the union of the temporal patches its pieces touch, as maximal runs, sorted."""
    needed: dict[tuple[int, int], set[int]] = {}
    for p in pieces:
        m = metas[p.seq]
        for k, item in enumerate(m.media):
            frames = item.frames(p.start, p.end)
            if frames is not None:
                needed.setdefault((m.group, k), set()).update(range(*frames))
    return runs_of(needed)



@dataclass(frozen=True)
class VisionBalancing:
    """``parallelism.vision_balance``: when ``enabled``, the vision tower's units of a wave are spread
    over ranks by ``cost_model`` (``titanrl.parallel.vision_plan``) and embeddings routed over
    ``group`` (every rank); otherwise every rank encodes what its own tokens use (the cost is still
    planned, for the ``vision/*`` metrics)."""

    enabled: bool
    cost_model: CostModel
    group: object = None
    tol: float = 0.02
    speeds: tuple[float, ...] | None = None  # relative rank speeds (balance.rank_speeds); None: equal

    def __post_init__(self) -> None:
        if self.enabled and float(self.cost_model.vision(1.0)) <= 0.0:
            raise ValueError("vision balancing needs a cost model that prices the vision tower (its vision "
                             "coefficients are 0: every unit would cost nothing and land on one rank)")


@dataclass
class VisionStats:
    """What a step's vision work was planned as and moved (this rank's view; sums over waves)."""

    planned_peak: float = 0.0  # per wave the busiest rank's vision cost
    planned_mean: float = 0.0
    pixel_bytes: int = 0  # pixels this rank sent to other ranks
    route: RouteCounter = field(default_factory=RouteCounter)
    frames_encoded: int = 0  # images and video temporal patches this rank's vision tower encoded
    frames_used: int = 0  # per stage call, the distinct ones its tokens use (the same on every rank)


def plan_vision(pieces: Sequence[Sequence[Piece]], units: Sequence[StageUnit], shapes: dict[tuple[int, int], ItemShape],
                vision: VisionBalancing, *, every_rank: bool = False) -> WaveVisionPlan:
    """Who encodes what of the vision inputs that each rank's ``pieces`` use (a wave's, or a rank's whole share of
    a stage; the same on every rank). Encoders: the ranks with pieces, or with ``every_rank`` any rank (a stage's
    vision pass runs on all of them)."""
    needs = [frame_runs(p, units) for p in pieces]
    eligible = [True] * len(pieces) if every_rank else [bool(p) for p in pieces]
    return plan_wave_vision(needs, shapes, vision.cost_model, eligible=eligible, tol=vision.tol, speeds=vision.speeds)


def run_frames(runs: Sequence[FrameRun]) -> int:
    """Images and video temporal patches in ``runs``."""
    return sum(r.f1 - r.f0 for r in runs)


def item_shapes(metas: Sequence[TrajectoryMeta]) -> dict[tuple[int, int], ItemShape]:
    """(group, media index) -> what the vision planner needs of each image or video."""
    return {(m.group, k): ItemShape(it.patches_per_frame, it.tokens_per_frame, not it.grid.is_video)
            for m in metas for k, it in enumerate(m.media)}
