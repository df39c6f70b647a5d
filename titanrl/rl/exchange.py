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
from titanrl.rl.assemble import WaveInputs, assemble_wave
from titanrl.rl.slice_loading import StepSlices
from titanrl.rl.units import StageUnit, TrajectoryMeta
from titanrl.rl.vision_inputs import VisionBalancing, VisionStats, frame_runs, item_shapes, wave_vision_plan
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

    def inputs(self, plan: StagePlan, units: Sequence[StageUnit], waves: Sequence[int], *, fields: Sequence[str] = (),
               temperature: float = 1.0, return_entropy: bool = False, layout_builder=None,
               collective: bool = True) -> list[WaveInputs]:
        """This rank's inputs of each of ``waves``, moved with one all-to-all (skipped when
        ``collective`` is False and vision balancing moves no pixels, which every rank agrees on).

        Pixels reach the rank that encodes them (the one whose tokens use them, or with vision
        balancing the one the wave's vision plan names) in that all-to-all from their home, or with
        slice-aware loading from the preprocessors, fetched by the encoder itself."""
        metas = units
        patch_dim = self.args.vision.patch_dim
        vplans: dict[int, WaveVisionPlan] = {}
        if self.vision is not None and self.vision.enabled:
            vplans = {w: wave_vision_plan(plan, metas, w, self.world, self.shapes, self.vision) for w in waves}
            for vp in vplans.values():
                self._count_vision(vp.encode_cost)
        elif self.vision is not None:  # what each rank's own needs cost (the metric's baseline)
            for w in waves:
                self._count_vision([runs_cost(frame_runs(plan.pieces(w, r), metas), self.shapes, self.vision.cost_model)
                                    for r in range(self.world)])
        home = lambda run: self.by_group[run.group].home  # noqa: E731
        send: list[list[np.ndarray]] = [[] for _ in range(self.world)]
        specs: list[list] = [[] for _ in range(self.world)]
        for w in waves:
            mine = plan.pieces(w, self.rank)
            for dest in range(self.world):
                theirs = mine if dest == self.rank else plan.pieces(w, dest)
                for p in theirs:
                    if metas[p.seq].home == self.rank:
                        send[dest] += self.home.piece_arrays(p, metas[p.seq], fields)
                # with slice loading the encoder fetches its pixels itself: none are sent
                runs = [] if self.slices is not None else vplans[w].encode[dest] if vplans else frame_runs(theirs,
                                                                                                         metas)
                for run in runs:
                    if home(run) == self.rank:
                        send[dest].append(self.home.run_pixels(run))
                        if dest != self.rank:
                            self.vision_stats.pixel_bytes += send[dest][-1].nbytes
            runs = vplans[w].encode[self.rank] if vplans else frame_runs(mine, metas)
            for src in range(self.world):
                if src == self.rank:
                    continue
                specs[src] += [spec for p in mine if metas[p.seq].home == src
                               for spec in piece_specs(p, metas[p.seq], fields)]
                if self.slices is None:
                    specs[src] += [run_spec(run, self.by_group, patch_dim) for run in runs if home(run) == src]
        if vplans and self.slices is None:  # pixels move to encoders even where every piece stays home
            collective = collective or any(home(run) != r for vp in vplans.values()
                                           for r, runs in enumerate(vp.encode) for run in runs)
        received, sent = all_to_all_arrays(send, specs, rank=self.rank, device=self.device, collective=collective,
                                           group=self.group)
        fetched: dict[FrameRun, np.ndarray] = {}
        if self.slices is not None:  # every run this rank encodes in these waves, in one round of fetches
            enc = [run for w in waves for run in (vplans[w].encode[self.rank] if vplans
                                                  else frame_runs(plan.pieces(w, self.rank), metas))]
            local = lambda run: self.home.run_pixels(run) if home(run) == self.rank else None  # noqa: E731
            fetched = dict(zip(enc, self.slices.rows(enc, local)))
        cursor = [0] * self.world  # next array of each source, consumed wave by wave in send order
        out = [assemble_wave(self, plan, w, plan.pieces(w, self.rank), metas, received, cursor, fields, temperature,
                              return_entropy, layout_builder, vplans.get(w), fetched) for w in waves]
        if out:
            out[0].bytes_sent = sent
        return out


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

    def begin_results(self, attr: str) -> None:
        """Give every home trajectory an empty ``attr`` for :meth:`return_logprobs` to fill."""
        for t in self.home.trajs:
            setattr(t, attr, torch.zeros(t.num_response_tokens, dtype=torch.float32))
