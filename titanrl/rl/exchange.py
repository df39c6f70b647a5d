"""Trajectory exchange: every rank knows the step's trajectories by their metadata (``titanrl.rl.units``); a
stage plan places token ranges of them on ranks; one all-to-all per wave moves each range from the rank that
generated it (its *home*) to the rank that computes it, and log-probs come back the same way.

What travels is built at home (``titanrl.rl.wire``); the vision inputs a wave needs and who encodes them come from
``titanrl.rl.vision_inputs`` - with slice-aware loading (``slices``, ``titanrl.rl.slice_loading``) no pixels travel
at all: the encoding rank fetches the frames of its runs from the media preprocessors and patchifies them itself;
``titanrl.rl.assemble`` builds each rank's model inputs of a wave from what arrived.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from titanrl.distributed import all_to_all_arrays
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.parallel.stage_plan import Piece, StagePlan
from titanrl.parallel.vision_plan import FrameRun, WaveVisionPlan, runs_cost
from titanrl.rl.assemble import VisionPass, WaveInputs, assemble_wave, vision_pass
from titanrl.rl.slice_loading import StepSlices
from titanrl.rl.units import StageUnit, TrajectoryMeta
from titanrl.rl.vision_inputs import VisionBalancing, VisionStats, frame_runs, item_shapes, plan_vision, run_frames
from titanrl.rl.wire import HomeSide, piece_specs, run_spec


class TrajectoryExchange:
    """Moves a stage's pieces between ranks (see the module docstring). ``trajs`` are this rank's
    trajectories (``metas[i].index`` indexes them on their home); a stage is a list of
    :class:`StageUnit` (plan sequence ``s`` is ``units[s]``)."""

    def __init__(self, args: Qwen2_5_VLArgs, rank: int, world: int, device: torch.device, dtype: torch.dtype,
                 trajs: Sequence, metas: Sequence[TrajectoryMeta], vision: VisionBalancing | None = None,
                 slices: StepSlices | None = None, group=None) -> None:
        self.args = args
        self.group = group  # the process group whose ranks rank / world count (None: all ranks)
        self.rank = rank
        self.world = world
        self.device = device
        self.dtype = dtype
        self.metas = metas
        self.home = HomeSide(args, trajs, metas)
        self.by_group = self.home.by_group
        self.vision = vision
        self.slices = slices
        self.vision_stats = VisionStats()
        self.shapes = item_shapes(metas)

    def _count_vision(self, costs: Sequence[float]) -> None:
        """One wave's planned vision cost per rank (``vision/balance_planned``)."""
        self.vision_stats.planned_peak += max(costs)
        self.vision_stats.planned_mean += float(np.mean(costs))

    def inputs(self, plan: StagePlan, units: Sequence[StageUnit], waves: Sequence[int], **kw) -> list[WaveInputs]:
        """This rank's inputs of each of ``waves``, each wave encoding its own vision inputs
        (:meth:`stage_inputs` with ``table=False``)."""
        return self.stage_inputs(plan, units, waves, **kw)[0]

    def stage_inputs(self, plan: StagePlan, units: Sequence[StageUnit], waves: Sequence[int], *,
                     fields: Sequence[str] = (), temperature: float = 1.0, return_entropy: bool = False,
                     layout_builder=None, collective: bool = True,
                     table: bool = False) -> tuple[list[WaveInputs], VisionPass | None]:
        """This rank's inputs of each of ``waves``, moved with one all-to-all (skipped when
        ``collective`` is False and vision balancing moves no pixels, which every rank agrees on).

        Pixels reach the rank that encodes them (the one whose tokens use them, or with vision
        balancing the one the vision plan names) in that all-to-all from their home, or with
        slice-aware loading from the preprocessors, fetched by the encoder itself. Each wave encodes what
        its tokens use; with ``table`` (every rank passes the same) the rank's whole share of ``waves`` is
        planned and encoded at once instead, before them: the returned :class:`VisionPass`, whose rows the
        waves' batches index (each image or frame once per rank whatever the balancer did with the responses
        that read it, and with vision balancing one embedding route for all the waves)."""
        metas = units
        patch_dim = self.args.vision.patch_dim
        # the waves one vision plan serves: each alone, or all at once (the table); every rank encodes in a
        # table's vision pass, only ranks with work in a wave encode in it
        vgroups = [list(waves)] if table else [[w] for w in waves]
        pieces_of = lambda ws, r: [p for w in ws for p in plan.pieces(w, r)]  # noqa: E731
        vplans: list[WaveVisionPlan] = []
        if self.vision is not None and self.vision.enabled:
            vplans = [plan_vision([pieces_of(ws, r) for r in range(self.world)], metas, self.shapes, self.vision,
                                  every_rank=table) for ws in vgroups]
            for vp in vplans:
                self._count_vision(vp.encode_cost)
        elif self.vision is not None:  # what each rank's own needs cost (the metric's baseline)
            for ws in vgroups:
                self._count_vision([runs_cost(frame_runs(pieces_of(ws, r), metas), self.shapes, self.vision.cost_model)
                                    for r in range(self.world)])
        encoded = lambda g, r: vplans[g].encode[r] if vplans else frame_runs(pieces_of(vgroups[g], r), metas)  # noqa: E731
        home = lambda run: self.by_group[run.group].home  # noqa: E731
        send: list[list[np.ndarray]] = [[] for _ in range(self.world)]
        specs: list[list] = [[] for _ in range(self.world)]
        for g, ws in enumerate(vgroups):
            for w in ws:
                mine = plan.pieces(w, self.rank)
                for dest in range(self.world):
                    for p in mine if dest == self.rank else plan.pieces(w, dest):
                        if metas[p.seq].home == self.rank:
                            send[dest] += self.home.piece_arrays(p, metas[p.seq], fields)
                for src in range(self.world):
                    if src != self.rank:
                        specs[src] += [spec for p in mine if metas[p.seq].home == src
                                       for spec in piece_specs(p, metas[p.seq], fields)]
            if self.slices is not None:  # the encoder fetches its pixels itself: none are sent
                continue
            for dest in range(self.world):
                for run in encoded(g, dest):
                    if home(run) == self.rank:
                        send[dest].append(self.home.run_pixels(run))
                        if dest != self.rank:
                            self.vision_stats.pixel_bytes += send[dest][-1].nbytes
            for src in range(self.world):
                if src != self.rank:
                    specs[src] += [run_spec(run, self.by_group, patch_dim) for run in encoded(g, self.rank)
                                   if home(run) == src]
        if vplans and self.slices is None:  # pixels move to encoders even where every piece stays home
            collective = collective or any(home(run) != r for vp in vplans for r, runs in enumerate(vp.encode)
                                           for run in runs)
        received, sent = all_to_all_arrays(send, specs, rank=self.rank, device=self.device, collective=collective,
                                           group=self.group)
        fetched: dict[FrameRun, np.ndarray] = {}
        if self.slices is not None:  # every run this rank encodes in these waves, in one round of fetches
            enc = [run for g in range(len(vgroups)) for run in encoded(g, self.rank)]
            local = lambda run: self.home.run_pixels(run) if home(run) == self.rank else None  # noqa: E731
            fetched = dict(zip(enc, self.slices.rows(enc, local)))
        self.vision_stats.frames_encoded += sum(run_frames(encoded(g, self.rank)) for g in range(len(vgroups)))
        cursor = [0] * self.world  # next array of each source, consumed in send order
        out, vpass = [], None
        for g, ws in enumerate(vgroups):
            vplan = vplans[g] if vplans else None
            if table:
                needs = frame_runs(pieces_of(ws, self.rank), metas)
                out += [assemble_wave(self, plan, w, plan.pieces(w, self.rank), metas, received, cursor, fields,
                                      temperature, return_entropy, layout_builder, None, fetched, table=needs)
                        for w in ws]
                vpass = vision_pass(self, encoded(g, self.rank), needs, vplan, received, cursor, fetched)
            else:
                out += [assemble_wave(self, plan, w, plan.pieces(w, self.rank), metas, received, cursor, fields,
                                      temperature, return_entropy, layout_builder, vplan, fetched) for w in ws]
        if out:
            out[0].bytes_sent = sent
        return out, vpass

    # ------------------------------------------------------------------ results home

    def return_logprobs(self, plan: StagePlan, units: Sequence[StageUnit], results, attr: str, *,
                        waves: Sequence[int], collective: bool = True) -> int:
        """Send each piece's log-probs to its home, which writes them into ``traj.<attr>`` (set up by
        :meth:`begin_results`). ``results``: (wave, inputs, log-probs) of the waves this rank ran among
        ``waves`` (every rank passes the same ``waves``); one all-to-all. Returns the bytes sent."""
        metas = units
        send: list[list[np.ndarray]] = [[] for _ in range(self.world)]
        by_wave = {w: (inputs, logprobs) for w, inputs, logprobs in results}
        for w in waves:
            if w not in by_wave:
                continue
            inputs, logprobs = by_wave[w]
            values = logprobs.detach().float().cpu().numpy()
            for p, chunk in zip(inputs.pieces, np.split(values, np.cumsum(inputs.scored_counts)[:-1])):
                send[metas[p.seq].home].append(chunk)
        specs: list[list] = [[] for _ in range(self.world)]
        placed: list[list[Piece]] = [[] for _ in range(self.world)]
        for w in waves:
            for src in range(self.world):
                for p in plan.pieces(w, src):
                    if metas[p.seq].home == self.rank:
                        placed[src].append(p)
                        if src != self.rank:
                            k = len(metas[p.seq].scored(p.start, p.end).positions)
                            specs[src].append(((k,), np.dtype(np.float32)))
        received, sent = all_to_all_arrays(send, specs, rank=self.rank, device=self.device, collective=collective,
                                           group=self.group)
        for src in range(self.world):
            for p, chunk in zip(placed[src], received[src]):
                u = metas[p.seq]
                sc = u.scored(p.start, p.end)
                values = torch.from_numpy(np.array(chunk))
                for k in np.unique(sc.response):
                    sel = sc.response == k
                    getattr(self.home.traj(u, int(k)), attr)[torch.from_numpy(sc.token[sel])] = values[torch.from_numpy(sel)]
        return sent

    def count_frames_used(self, plan: StagePlan, units: Sequence[StageUnit]) -> None:
        """The distinct images and temporal patches a stage's tokens use (``vision/encode_repeats``' denominator)."""
        pieces = [p for wave in range(len(plan.waves)) for r in range(self.world) for p in plan.pieces(wave, r)]
        self.vision_stats.frames_used += run_frames(frame_runs(pieces, units))

    def begin_results(self, attr: str, ids: Sequence[int]) -> None:
        """Give each home trajectory among ``ids`` (global trajectory ids, the stage's) an empty ``attr`` for
        :meth:`return_logprobs` to fill; the others keep theirs (none: a stage that skipped them wrote nothing)."""
        for i in ids:
            meta = self.home.metas[i]
            if meta.home == self.rank:
                t = self.home.trajs[meta.index]
                setattr(t, attr, torch.zeros(t.num_response_tokens, dtype=torch.float32))
