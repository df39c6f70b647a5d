"""Trajectory exchange, the *move* of a stage: every rank knows the step's trajectories by their metadata
(``titanrl.rl.units``); a stage plan places token ranges of them on ranks and a vision plan says who encodes which
frames (``titanrl.parallel.vision_plan``); one all-to-all per wave (per stage with a vision table) moves each range
from the rank that generated it (its *home*) to the rank that computes it, and log-probs come back the same way.

The wire format, built at home. For a piece (a token range of a unit's stream): token ids, mrope positions
(computed at home on the whole trajectory, so a slice keeps its positions), the next-token targets of its scored
positions (the target of a slice's last token is the first token of the next slice), and the stage's per-token
inputs (old / reference log-probs). For a frame run without slice-aware loading: its float32 patch rows. Both sides
derive every shape from the plan and the metadata (``piece_specs``, ``run_spec``), so buffers move without a size
handshake. With slice-aware loading (``slices``, ``titanrl.rl.slice_loading``) no pixels travel: the encoding rank
fetches the frames of its runs from the media preprocessors itself.

What a move returns (:class:`Delivery`) is keyed by piece and run; ``titanrl.rl.assemble`` builds the model
inputs from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from titanrl.distributed import all_to_all_arrays
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.models.qwen2_5_vl.positions import mrope_position_ids
from titanrl.parallel.stage_plan import Piece, StagePlan
from titanrl.parallel.vision_plan import FrameRun, StageVision
from titanrl.rl.slice_loading import StepSlices
from titanrl.rl.units import StageUnit, TrajectoryMeta, media_owners


class TrajectoryTokens:
    """Whole-trajectory token arrays built at home once per step: ids, mrope positions."""

    def __init__(self, args: Qwen2_5_VLArgs) -> None:
        self.args = args
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def get(self, traj) -> tuple[np.ndarray, np.ndarray]:
        key = id(traj)
        if key not in self._cache:
            ids = np.concatenate([traj.prompt.prompt_ids, traj.response_ids]).astype(np.int64)
            v = self.args.vision
            pos = mrope_position_ids(ids, traj.grids, image_token_id=self.args.image_token_id,
                                     video_token_id=self.args.video_token_id, spatial_merge_size=v.spatial_merge_size,
                                     tokens_per_second=v.tokens_per_second)
            self._cache[key] = (ids, pos)
        return self._cache[key]



def piece_specs(p: Piece, u: StageUnit, fields: Sequence[str]) -> list[tuple[tuple[int, ...], np.dtype]]:
    n = p.num_tokens
    k = len(u.scored(p.start, p.end).positions)
    specs = [((n,), np.dtype(np.int64)), ((3, n), np.dtype(np.int64)), ((k,), np.dtype(np.int64))]
    return specs + [((k,), np.dtype(np.float32)) for _ in fields]


def run_spec(run: FrameRun, by_owner: dict[int, TrajectoryMeta], patch_dim: int):
    item = by_owner[run.group].media[run.item]
    return ((run.f1 - run.f0) * item.patches_per_frame, patch_dim), np.dtype(np.float32)


class HomeSide:
    """The arrays this rank sends for the units and runs whose home it is (``trajs``: its trajectories;
    ``metas[i].index`` indexes them)."""

    def __init__(self, args: Qwen2_5_VLArgs, trajs: Sequence, metas: Sequence[TrajectoryMeta]) -> None:
        self.trajs = trajs
        self.metas = metas
        self.tokens = TrajectoryTokens(args)
        self._streams: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.by_owner = media_owners(metas)

    def traj(self, u: StageUnit, k: int):
        return self.trajs[self.metas[u.trajs[k]].index]

    def stream(self, u: StageUnit) -> tuple[np.ndarray, np.ndarray]:
        """A unit's token ids and mrope positions: the prompt, then each response with the positions
        it has in its own trajectory (each continues from the prompt)."""
        if len(u.trajs) == 1:
            return self.tokens.get(self.traj(u, 0))
        key = ("unit", u.trajs)
        if key not in self._streams:
            parts = [self.tokens.get(self.traj(u, k)) for k in range(len(u.trajs))]
            p = u.prompt_len
            self._streams[key] = (np.concatenate([parts[0][0][:p]] + [ids[p:] for ids, _ in parts]),
                                  np.concatenate([parts[0][1][:, :p]] + [pos[:, p:] for _, pos in parts], axis=1))
        return self._streams[key]

    def piece_arrays(self, p: Piece, u: StageUnit, fields: Sequence[str]) -> list[np.ndarray]:
        ids, pos = self.stream(u)
        sc = u.scored(p.start, p.end)
        out = [ids[p.start:p.end], pos[:, p.start:p.end], ids[sc.targets]]
        for f in fields:
            values = np.empty(len(sc.positions), dtype=np.float32)
            for k in np.unique(sc.response):
                sel = sc.response == k
                values[sel] = np.asarray(getattr(self.traj(u, int(k)), f), dtype=np.float32)[sc.token[sel]]
            out.append(values)
        return out

    def run_pixels(self, run: FrameRun) -> np.ndarray | None:
        """The run's patch rows from the home's trajectory (None: the prompt came without pixels - a disaggregated
        placement with slice-aware loading - and the encoder fetches them)."""
        m = self.by_owner[run.group]
        item = m.media[run.item]
        traj = self.trajs[m.index]
        pixels, first = traj.prompt.pixel_values, item.row_start
        if run.group < 0:  # an observation's image (multi-turn): its rows follow the prompt's
            pixels, first = traj.turn_pixels, first - sum(g.num_patches for g in traj.prompt.grids)
        if pixels is None:
            return None
        lo = first + run.f0 * item.patches_per_frame
        return pixels[lo:lo + (run.f1 - run.f0) * item.patches_per_frame]


@dataclass
class Delivery:
    """What a move delivered to this rank: the arrays of each of its pieces (``pieces[(wave, i)]``, the ``i``-th of
    ``plan.pieces(wave, rank)``: ids, positions, targets, then one array per field) and the pixel rows of each run
    it encodes (``pixels[(g, run)]``, ``g`` the vision group of :class:`StageVision`)."""

    pieces: dict[tuple[int, int], list[np.ndarray]]
    pixels: dict[tuple[int, FrameRun], np.ndarray]
    bytes_sent: int  # everything this rank sent to other ranks
    pixel_bytes: int  # of which pixels


class TrajectoryExchange:
    """Moves a stage's pieces between ranks (see the module docstring). ``trajs`` are this rank's
    trajectories (``metas[i].index`` indexes them on their home); a stage is a list of
    :class:`StageUnit` (plan sequence ``s`` is ``units[s]``)."""

    def __init__(self, args: Qwen2_5_VLArgs, rank: int, world: int, device: torch.device, trajs: Sequence,
                 metas: Sequence[TrajectoryMeta], slices: StepSlices | None = None, group=None) -> None:
        self.args = args
        self.group = group  # the process group whose ranks rank / world count (None: all ranks)
        self.rank = rank
        self.world = world
        self.device = device
        self.home = HomeSide(args, trajs, metas)
        self.home_of_owner = {g: m.home for g, m in self.home.by_owner.items()}
        self.slices = slices

    def move(self, plan: StagePlan, units: Sequence[StageUnit], vision: StageVision, *, fields: Sequence[str] = (),
             collective: bool = True) -> Delivery:
        """Every rank's pieces of ``vision.groups``' waves, and the pixels of the runs each encodes, from their
        homes, with one all-to-all (skipped when ``collective`` is False and no pixels move, which every rank agrees
        on). Pixels of a run reach its encoder in that all-to-all or, with slice-aware loading, fetched by the
        encoder itself in one round of fetches."""
        me, patch_dim = self.rank, self.args.vision.patch_dim
        home = lambda run: self.home_of_owner[run.group]  # noqa: E731
        # with slice-aware loading the encoder fetches a prompt's frames itself; a multi-turn observation's image
        # (owner < 0) exists only where it was rolled out, and a prompt carried from an earlier step (partial
        # rollouts) is not in this step's loader: those are sent
        sent_here = lambda run: self.slices is None or not self.slices.fetches(run.group)  # noqa: E731
        send: list[list[np.ndarray]] = [[] for _ in range(self.world)]
        specs: list[list] = [[] for _ in range(self.world)]
        pixel_bytes = 0
        # what each source sends me, in its send order: (key, pieces' array count or None for a run's pixels)
        expected: list[list[tuple]] = [[] for _ in range(self.world)]
        for g, ws in enumerate(vision.groups):
            for w in ws:
                for dest in range(self.world):
                    for p in plan.pieces(w, dest):
                        if units[p.seq].home == me:
                            send[dest] += self.home.piece_arrays(p, units[p.seq], fields)
                for i, p in enumerate(plan.pieces(w, me)):
                    src = units[p.seq].home
                    expected[src].append(((w, i), 3 + len(fields)))
                    if src != me:
                        specs[src] += piece_specs(p, units[p.seq], fields)
            for dest in range(self.world):
                for run in vision.encode[g][dest]:
                    if home(run) == me and sent_here(run):
                        send[dest].append(self.home.run_pixels(run))
                        if dest != me:
                            pixel_bytes += send[dest][-1].nbytes
            for run in vision.encode[g][me]:
                if sent_here(run):
                    expected[home(run)].append(((g, run), None))
                    if home(run) != me:
                        specs[home(run)].append(run_spec(run, self.home.by_owner, patch_dim))
        collective = collective or vision.moves_pixels(self.home_of_owner, sent_here)
        received, sent = all_to_all_arrays(send, specs, rank=me, device=self.device, collective=collective,
                                           group=self.group)
        out = Delivery({}, {}, sent, pixel_bytes)
        for src in range(self.world):
            cursor = 0
            for key, count in expected[src]:
                if count is None:
                    out.pixels[key] = received[src][cursor]
                    cursor += 1
                else:
                    out.pieces[key] = received[src][cursor:cursor + count]
                    cursor += count
        if self.slices is not None:
            enc = [(g, run) for g in range(len(vision.groups)) for run in vision.encode[g][me]
                   if self.slices.fetches(run.group)]
            local = lambda run: self.home.run_pixels(run) if home(run) == me else None  # noqa: E731
            fetched = dict(zip([run for _, run in enc], self.slices.rows([run for _, run in enc], local)))
            out.pixels.update({(g, run): fetched[run] for g, run in enc})
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

    def begin_results(self, attr: str, ids: Sequence[int]) -> None:
        """Give each home trajectory among ``ids`` (global trajectory ids, the stage's) an empty ``attr`` for
        :meth:`return_logprobs` to fill; the others keep theirs (none: a stage that skipped them wrote nothing)."""
        for i in ids:
            meta = self.home.metas[i]
            if meta.home == self.rank:
                t = self.home.trajs[meta.index]
                setattr(t, attr, torch.zeros(t.num_response_tokens, dtype=torch.float32))
