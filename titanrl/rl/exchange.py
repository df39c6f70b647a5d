"""Trajectory exchange: every rank knows the step's trajectories by their metadata; a stage plan
places token ranges of them on ranks; one all-to-all per wave moves each range from the rank that
generated it (its *home*) to the rank that computes it, and log-probs come back the same way.

- :func:`gather_metadata` all-gathers :class:`TrajectoryMeta` (lengths, home, GRPO group,
  advantage, vision grids; never pixels) after scoring; every rank sorts it the same way.
- A :class:`~titanrl.parallel.stage_plan.Piece` is a token range of one trajectory. What travels for
  it: token ids, mrope positions (computed at home on the whole trajectory, so a slice keeps its
  positions), the next-token targets of its scored positions (the target of a slice's last token
  is the first token of the next slice), and the stage's per-token inputs (old / reference
  log-probs).
- Vision inputs travel as *frame runs*: of each image or video a rank receives only the temporal
  patches whose placeholder tokens fall in its ranges (Qwen2.5-VL's vision attention never crosses
  a temporal patch, so encoding a run alone is exact), each once per rank however many of its
  ranges need it (the ``n`` responses of a prompt share one encoding). With slice-aware loading
  (``slices``, :mod:`titanrl.rl.slice_loading`) they do not travel at all: the encoding rank
  fetches the frames of its runs from the media preprocessors and patchifies them itself.
- :func:`assemble_wave` builds a rank's ``PackedBatch`` (with the Ulysses attention layout when it
  holds slices of sharded groups), log-prob targets and per-token loss inputs.

- The unit a plan places is a :class:`StageUnit`: one trajectory, or with shared-prefix packing a
  prompt once followed by responses that share it (``titanrl.models.attention`` keeps siblings
  apart). Its token stream is built at home; a piece is a range of that stream, and a scored
  position may predict several tokens (the prompt's last token predicts every response's first).

Both sides derive every size from the plan and the metadata, so buffers are exchanged without a
size handshake.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
import torch

from titanrl.distributed import all_gather_objects, all_to_all_arrays
from titanrl.models.packed import PackedBatch
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.models.qwen2_5_vl.model import LogprobTargets
from titanrl.models.qwen2_5_vl.positions import mrope_position_ids
from titanrl.models.vision_grid import VisionGrid
from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.stage_plan import Piece, StagePlan
from titanrl.parallel.vision_plan import (FrameRun, ItemShape, WaveVisionPlan, plan_wave_vision, route_indices, runs_cost,
                                         runs_of)
from titanrl.parallel.vision_route import RouteCounter, VisionRoute
from titanrl.rl.slice_loading import StepSlices

# Per-token inputs a stage can ask for, beside ids / positions / targets.
FIELDS = ("old_logprobs", "ref_logprobs")


@dataclass(frozen=True)
class MediaItem:
    """One image or video of a prompt: its grid, first placeholder token and first pixel row."""

    grid: VisionGrid
    token_start: int
    row_start: int
    merge: int

    @property
    def tokens_per_frame(self) -> int:
        return (self.grid.h // self.merge) * (self.grid.w // self.merge)

    @property
    def patches_per_frame(self) -> int:
        return self.grid.h * self.grid.w

    @property
    def token_end(self) -> int:
        return self.token_start + self.grid.t * self.tokens_per_frame

    def frames(self, start: int, end: int) -> tuple[int, int] | None:
        """Temporal patches ``[f0, f1)`` whose tokens meet the token range ``[start, end)``."""
        a, b = max(start, self.token_start), min(end, self.token_end)
        if a >= b:
            return None
        tpf = self.tokens_per_frame
        return (a - self.token_start) // tpf, (b - 1 - self.token_start) // tpf + 1


@dataclass(frozen=True)
class TrajectoryMeta:
    home: int
    index: int  # position in the home rank's trajectory list
    group: int  # global batch position of the prompt (GRPO group, minibatch key)
    prompt_len: int
    response_len: int
    advantage: float
    media: tuple[MediaItem, ...]
    name: str  # sample id, for messages

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.response_len


class Scored(NamedTuple):
    """The log-probs computed from a range of a unit's stream, response by response: the stream
    position each is computed at, the stream index of the token it scores, and which response
    (index into ``StageUnit.trajs``) and token of that response it is."""

    positions: np.ndarray
    targets: np.ndarray
    response: np.ndarray
    token: np.ndarray


@functools.lru_cache(maxsize=1 << 16)
def _scored(prompt_len: int, response_lens: tuple[int, ...], start: int, end: int) -> Scored:
    positions, targets, response, token = [], [], [], []
    offset = prompt_len
    for k, r in enumerate(response_lens):
        pos = np.arange(offset - 1, offset + r - 1)
        if r:
            pos[0] = prompt_len - 1  # every response's first token is predicted by the prompt's last
        keep = np.flatnonzero((pos >= start) & (pos < end))
        positions.append(pos[keep])
        targets.append(offset + keep)
        response.append(np.full(keep.size, k))
        token.append(keep)
        offset += r
    out = Scored(*(np.concatenate(x).astype(np.int64) for x in (positions, targets, response, token)))
    for a in out:
        a.setflags(write=False)  # shared by every caller through the cache
    return out


@dataclass(frozen=True)
class StageUnit:
    """What a stage plan places: a prompt followed by the responses in ``trajs`` (indices into the
    step's metadata; one trajectory, or with shared-prefix packing a sub-group of a GRPO group,
    all from one home), computed as one stream of ``prompt_len + sum(response_lens)`` tokens."""

    trajs: tuple[int, ...]
    home: int
    group: int
    prompt_len: int
    response_lens: tuple[int, ...]
    media: tuple[MediaItem, ...]
    name: str

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + sum(self.response_lens)

    @property
    def segments(self) -> tuple[int, ...]:
        """Shared-prefix segments of the stream (``PackedBatch.segments``)."""
        return (self.prompt_len, *self.response_lens)

    def response_start(self, k: int) -> int:
        return self.prompt_len + sum(self.response_lens[:k])

    def scored(self, start: int, end: int) -> Scored:
        """The log-probs computed from stream positions ``[start, end)``."""
        return _scored(self.prompt_len, self.response_lens, start, end)


def split_responses(prompt_len: int, response_lens: Sequence[int], max_tokens: int | None) -> list[list[int]]:
    """Responses of one prompt in consecutive sub-groups, each with the prompt within ``max_tokens``
    (a response that cannot fit even alone is a sub-group of its own): as few as possible, and of
    near-equal size so no sub-group is a straggler. Each extra sub-group recomputes the prompt."""
    n, total = len(response_lens), sum(response_lens)
    if max_tokens is None or prompt_len + total <= max_tokens or n <= 1:
        return [list(range(n))]
    cum = np.cumsum(response_lens)
    count = min(n, math.ceil(total / max(max_tokens - prompt_len, 1)))
    while True:
        cuts, prev = [], 0
        for k in range(1, count):  # cut nearest to k/count of the tokens, leaving room for the rest
            lo, hi = prev + 1, n - (count - k)
            cut = lo + int(np.argmin(np.abs(cum[lo - 1:hi] - k * total / count)))
            cuts.append(cut)
            prev = cut
        chunks = [list(range(a, b)) for a, b in zip([0, *cuts], [*cuts, n])]
        if count >= n or all(prompt_len + sum(response_lens[i] for i in c) <= max_tokens for c in chunks):
            return chunks
        count += 1


def stage_units(metas: Sequence[TrajectoryMeta], ids: Sequence[int], *, shared_prefix: bool,
                max_tokens: int | None = None) -> list[StageUnit]:
    """The units of a stage over the trajectories ``ids`` (indices into ``metas``), in order: each
    trajectory alone, or (``shared_prefix``) each prompt once per home with its responses, split
    by :func:`split_responses` at ``max_tokens``."""
    def unit(members: Sequence[int]) -> StageUnit:
        m = metas[members[0]]
        return StageUnit(tuple(members), m.home, m.group, m.prompt_len,
                         tuple(metas[i].response_len for i in members), m.media, m.name)

    if not shared_prefix:
        return [unit([i]) for i in ids]
    groups: dict[tuple[int, int], list[int]] = {}
    for i in ids:
        groups.setdefault((metas[i].group, metas[i].home), []).append(i)
    out = []
    for members in groups.values():
        lens = [metas[i].response_len for i in members]
        out += [unit([members[k] for k in chunk])
                for chunk in split_responses(metas[members[0]].prompt_len, lens, max_tokens)]
    return out


def media_items(grids: Sequence[VisionGrid], prompt_ids: np.ndarray, args: Qwen2_5_VLArgs) -> tuple[MediaItem, ...]:
    vision = np.flatnonzero((prompt_ids == args.image_token_id) | (prompt_ids == args.video_token_id))
    merge = args.vision.spatial_merge_size
    items, token, row = [], 0, 0
    for g in grids:
        start = int(vision[token])
        items.append(MediaItem(g, start, row, merge))
        token += g.num_tokens(merge)
        row += g.num_patches
    return tuple(items)


def gather_metadata(trajs: Sequence, rank: int, args: Qwen2_5_VLArgs) -> list[TrajectoryMeta]:
    """Every trajectory of the step on every rank, sorted by (group, index): the same list on any
    number of ranks. Media descriptions are built once per prompt."""
    items_of: dict[int, tuple[MediaItem, ...]] = {}
    mine = []
    for i, t in enumerate(trajs):
        key = id(t.prompt)
        if key not in items_of:
            items_of[key] = media_items(t.prompt.grids, t.prompt.prompt_ids, args)
        mine.append(TrajectoryMeta(rank, i, int(t.group), len(t.prompt.prompt_ids), t.num_response_tokens,
                                   float(t.advantage), items_of[key], str(t.prompt.record.id)))
    every = [m for part in all_gather_objects(mine) for m in part]
    return sorted(every, key=lambda m: (m.group, m.home, m.index))


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
            pos = mrope_position_ids(ids, traj.prompt.grids, image_token_id=self.args.image_token_id,
                                     video_token_id=self.args.video_token_id, spatial_merge_size=v.spatial_merge_size,
                                     tokens_per_second=v.tokens_per_second)
            self._cache[key] = (ids, pos)
        return self._cache[key]


def _piece_specs(p: Piece, u: StageUnit, fields: Sequence[str]) -> list[tuple[tuple[int, ...], np.dtype]]:
    n = p.num_tokens
    k = len(u.scored(p.start, p.end).positions)
    specs = [((n,), np.dtype(np.int64)), ((3, n), np.dtype(np.int64)), ((k,), np.dtype(np.int64))]
    return specs + [((k,), np.dtype(np.float32)) for _ in fields]


def _run_spec(run: FrameRun, metas_by_group: dict[int, TrajectoryMeta], patch_dim: int):
    item = metas_by_group[run.group].media[run.item]
    return ((run.f1 - run.f0) * item.patches_per_frame, patch_dim), np.dtype(np.float32)


@dataclass
class WaveInputs:
    """One rank's inputs for one wave, ready for the model."""

    pieces: list[Piece]
    batch: PackedBatch | None  # None: this rank has nothing in the wave (it runs a dummy)
    targets: LogprobTargets | None
    scored_counts: list[int]  # scored log-probs per piece, in order
    seq_index: torch.Tensor | None  # [K] local response (a piece's response) of each scored log-prob
    seq_lengths: torch.Tensor | None  # [local responses] full length of each
    advantages: torch.Tensor | None  # [K]
    fields: dict[str, torch.Tensor]  # [K] per requested field
    bytes_sent: int = 0
    # set when vision balancing routes embeddings in this wave: every rank's forward (a dummy's
    # too) must call it, since it is a collective
    vision_route: VisionRoute | None = None

    @property
    def num_tokens(self) -> int:
        return 0 if self.batch is None else self.batch.num_tokens


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


@dataclass
class VisionStats:
    """What a step's vision work was planned as and moved (this rank's view; sums over waves)."""

    planned_peak: float = 0.0  # per wave the busiest rank's vision cost
    planned_mean: float = 0.0
    pixel_bytes: int = 0  # pixels this rank sent to other ranks
    route: RouteCounter = field(default_factory=RouteCounter)


class TrajectoryExchange:
    """Moves a stage's pieces between ranks (see the module docstring). ``trajs`` are this rank's
    trajectories (``metas[i].index`` indexes them on their home); a stage is a list of
    :class:`StageUnit` (plan sequence ``s`` is ``units[s]``)."""

    def __init__(self, args: Qwen2_5_VLArgs, rank: int, world: int, device: torch.device, dtype: torch.dtype,
                 trajs: Sequence, metas: Sequence[TrajectoryMeta], vision: VisionBalancing | None = None,
                 slices: StepSlices | None = None) -> None:
        self.args = args
        self.rank = rank
        self.world = world
        self.device = device
        self.dtype = dtype
        self.trajs = trajs
        self.metas = metas
        self.tokens = TrajectoryTokens(args)
        self._streams: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.by_group = {m.group: m for m in metas}
        self.vision = vision
        self.slices = slices
        self.vision_stats = VisionStats()
        self.shapes = {(m.group, k): ItemShape(it.patches_per_frame, it.tokens_per_frame, not it.grid.is_video)
                       for m in metas for k, it in enumerate(m.media)}

    # ------------------------------------------------------------------ home side

    def _traj(self, u: StageUnit, k: int):
        return self.trajs[self.metas[u.trajs[k]].index]

    def _stream(self, u: StageUnit) -> tuple[np.ndarray, np.ndarray]:
        """A unit's token ids and mrope positions: the prompt, then each response with the positions
        it has in its own trajectory (each continues from the prompt)."""
        if len(u.trajs) == 1:
            return self.tokens.get(self._traj(u, 0))
        key = ("unit", u.trajs)
        if key not in self._streams:
            parts = [self.tokens.get(self._traj(u, k)) for k in range(len(u.trajs))]
            p = u.prompt_len
            self._streams[key] = (np.concatenate([parts[0][0][:p]] + [ids[p:] for ids, _ in parts]),
                                  np.concatenate([parts[0][1][:, :p]] + [pos[:, p:] for _, pos in parts], axis=1))
        return self._streams[key]

    def _piece_arrays(self, p: Piece, u: StageUnit, fields: Sequence[str]) -> list[np.ndarray]:
        ids, pos = self._stream(u)
        sc = u.scored(p.start, p.end)
        out = [ids[p.start:p.end], pos[:, p.start:p.end], ids[sc.targets]]
        for f in fields:
            values = np.empty(len(sc.positions), dtype=np.float32)
            for k in np.unique(sc.response):
                sel = sc.response == k
                values[sel] = np.asarray(getattr(self._traj(u, int(k)), f), dtype=np.float32)[sc.token[sel]]
            out.append(values)
        return out

    def _run_pixels(self, run: FrameRun) -> np.ndarray:
        m = self.by_group[run.group]
        item = m.media[run.item]
        pixels = self.trajs[m.index].prompt.pixel_values
        lo = item.row_start + run.f0 * item.patches_per_frame
        return pixels[lo:lo + (run.f1 - run.f0) * item.patches_per_frame]

    # ------------------------------------------------------------------ one wave

    def vision_plan(self, plan: StagePlan, metas: Sequence[StageUnit], wave: int) -> WaveVisionPlan:
        """Who encodes what in ``wave`` (the same on every rank)."""
        pieces = [plan.pieces(wave, r) for r in range(self.world)]
        needs = [frame_runs(p, metas) for p in pieces]
        return plan_wave_vision(needs, self.shapes, self.vision.cost_model, eligible=[bool(p) for p in pieces],
                                tol=self.vision.tol)

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
            vplans = {w: self.vision_plan(plan, metas, w) for w in waves}
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
                        send[dest] += self._piece_arrays(p, metas[p.seq], fields)
                # with slice loading the encoder fetches its pixels itself: none are sent
                runs = [] if self.slices is not None else vplans[w].encode[dest] if vplans else frame_runs(theirs,
                                                                                                         metas)
                for run in runs:
                    if home(run) == self.rank:
                        send[dest].append(self._run_pixels(run))
                        if dest != self.rank:
                            self.vision_stats.pixel_bytes += send[dest][-1].nbytes
            runs = vplans[w].encode[self.rank] if vplans else frame_runs(mine, metas)
            for src in range(self.world):
                if src == self.rank:
                    continue
                specs[src] += [spec for p in mine if metas[p.seq].home == src
                               for spec in _piece_specs(p, metas[p.seq], fields)]
                if self.slices is None:
                    specs[src] += [_run_spec(run, self.by_group, patch_dim) for run in runs if home(run) == src]
        if vplans and self.slices is None:  # pixels move to encoders even where every piece stays home
            collective = collective or any(home(run) != r for vp in vplans.values()
                                           for r, runs in enumerate(vp.encode) for run in runs)
        received, sent = all_to_all_arrays(send, specs, rank=self.rank, device=self.device, collective=collective)
        fetched: dict[FrameRun, np.ndarray] = {}
        if self.slices is not None:  # every run this rank encodes in these waves, in one round of fetches
            enc = [run for w in waves for run in (vplans[w].encode[self.rank] if vplans
                                                  else frame_runs(plan.pieces(w, self.rank), metas))]
            local = lambda run: self._run_pixels(run) if home(run) == self.rank else None  # noqa: E731
            fetched = dict(zip(enc, self.slices.rows(enc, local)))
        cursor = [0] * self.world  # next array of each source, consumed wave by wave in send order
        out = [self._assemble(plan, w, plan.pieces(w, self.rank), metas, received, cursor, fields, temperature,
                              return_entropy, layout_builder, vplans.get(w), fetched) for w in waves]
        if out:
            out[0].bytes_sent = sent
        return out

    def _assemble(self, plan, wave, mine, metas, received, cursor, fields, temperature, return_entropy,
                  layout_builder, vplan: WaveVisionPlan | None, fetched: dict[FrameRun, np.ndarray]) -> WaveInputs:
        route = None
        if vplan is not None and (vplan.moves() or mine):
            route = VisionRoute(route_indices(vplan, self.rank, self.shapes), self.rank, self.vision.group,
                                collective=vplan.moves(), counter=self.vision_stats.route)
        if not mine:  # a dummy forward still joins the route's collective
            return WaveInputs([], None, None, [], None, None, None, {}, vision_route=route)
        per_piece = []
        for p in mine:
            src = metas[p.seq].home
            k = 3 + len(fields)
            per_piece.append(received[src][cursor[src]:cursor[src] + k])
            cursor[src] += k
        need_runs = frame_runs(mine, metas)
        enc_runs = list(vplan.encode[self.rank]) if vplan is not None else need_runs
        pixels = []
        for run in enc_runs:
            if self.slices is not None:
                pixels.append(fetched[run])
                continue
            src = self.by_group[run.group].home
            pixels.append(received[src][cursor[src]])
            cursor[src] += 1

        # vision: one grid per encoded run, in run order; the row of each placeholder token in the
        # rows of the runs it needs (what the route returns, or the encoded rows themselves)
        grids: list[VisionGrid] = []
        for run in enc_runs:
            g = self.by_group[run.group].media[run.item].grid
            grids.append(VisionGrid(run.f1 - run.f0, g.h, g.w, g.is_video, g.second_per_grid))
        run_rows: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (group, item) -> (f0, f1, first row)
        rows = 0
        for run in need_runs:
            item = self.by_group[run.group].media[run.item]
            run_rows.setdefault((run.group, run.item), []).append((run.f0, run.f1, rows))
            rows += (run.f1 - run.f0) * item.tokens_per_frame
        token_rows = []
        ids, pos, tgt_pos, tgt_ids, seq_index, adv, seq_lengths = [], [], [], [], [], [], []
        extra: dict[str, list[np.ndarray]] = {f: [] for f in fields}
        scored_counts, offset = [], 0
        for p, arrays in zip(mine, per_piece):
            m = metas[p.seq]
            ids.append(arrays[0])
            pos.append(arrays[1])
            sc = m.scored(p.start, p.end)
            tgt_pos.append(sc.positions - p.start + offset)
            tgt_ids.append(arrays[2])
            # every response of the piece's unit is a local sequence of the loss (those without a
            # scored token here contribute nothing)
            seq_index.append(sc.response + len(seq_lengths))
            seq_lengths += list(m.response_lens)
            adv.append(np.asarray([self.metas[t].advantage for t in m.trajs], dtype=np.float32)[sc.response])
            for f, values in zip(fields, arrays[3:]):
                extra[f].append(values)
            scored_counts.append(len(sc.positions))
            for j, item in enumerate(m.media):
                frames = item.frames(p.start, p.end)
                if frames is None:
                    continue
                # a piece's frames of one item lie inside one run (runs are maximal)
                f0, _, base = next(r for r in run_rows[(m.group, j)] if r[0] <= frames[0] < r[1])
                lo, hi = max(p.start, item.token_start), min(p.end, item.token_end)
                start_row = base + (lo - item.token_start) - f0 * item.tokens_per_frame
                token_rows.append(np.arange(start_row, start_row + hi - lo))
            offset += p.num_tokens
        dev = self.device
        lengths = [p.num_tokens for p in mine]
        layout = layout_builder(plan.waves[wave].ranks[self.rank]) if layout_builder is not None else None
        batch = PackedBatch(
            input_ids=torch.from_numpy(np.concatenate(ids)).to(dev),
            position_ids=torch.from_numpy(np.concatenate(pos, axis=1)).to(dev),
            cu_seqlens=torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(dev),
            max_seqlen=max(lengths),
            grids=grids,
            pixel_values=torch.from_numpy(np.concatenate(pixels)).to(dev, self.dtype) if pixels else None,
            vision_token_index=torch.from_numpy(np.concatenate(token_rows)).to(dev) if token_rows else None,
            attention_layout=layout,
            vision_route=route,
            # whole units only here: sharded ones get their segments from the layout
            segments=[metas[p.seq].segments for p in mine] if any(len(metas[p.seq].trajs) > 1 for p in mine)
            else None,
        )
        targets = LogprobTargets(
            positions=torch.from_numpy(np.concatenate(tgt_pos).astype(np.int64)).to(dev),
            token_ids=torch.from_numpy(np.concatenate(tgt_ids)).to(dev),
            temperature=temperature, return_entropy=return_entropy,
        )
        return WaveInputs(
            pieces=mine, batch=batch, targets=targets, scored_counts=scored_counts,
            seq_index=torch.from_numpy(np.concatenate(seq_index).astype(np.int64)).to(dev),
            seq_lengths=torch.tensor(seq_lengths, device=dev),
            advantages=torch.from_numpy(np.concatenate(adv)).to(dev),
            fields={f: torch.from_numpy(np.concatenate(v)).to(dev) for f, v in extra.items()},
        )

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
        received, sent = all_to_all_arrays(send, specs, rank=self.rank, device=self.device, collective=collective)
        for src in range(self.world):
            for p, chunk in zip(placed[src], received[src]):
                u = metas[p.seq]
                sc = u.scored(p.start, p.end)
                values = torch.from_numpy(np.array(chunk))
                for k in np.unique(sc.response):
                    sel = sc.response == k
                    getattr(self._traj(u, int(k)), attr)[torch.from_numpy(sc.token[sel])] = values[torch.from_numpy(sel)]
        return sent

    def begin_results(self, attr: str) -> None:
        """Give every home trajectory an empty ``attr`` for :meth:`return_logprobs` to fill."""
        for t in self.trajs:
            setattr(t, attr, torch.zeros(t.num_response_tokens, dtype=torch.float32))
