"""Batch assembly, after the move: one rank's model inputs of one wave (``WaveInputs``: a ``PackedBatch``, log-prob
targets and the per-token loss inputs) and of a stage's vision pass, from what the exchange delivered
(``titanrl.rl.exchange.Delivery``) and the plans. It reads only its arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from titanrl.models.packed import PackedBatch
from titanrl.models.qwen2_5_vl.model import LogprobTargets
from titanrl.models.vision_grid import VisionGrid
from titanrl.parallel.stage_plan import Piece, StagePlan
from titanrl.parallel.vision_plan import FrameRun, ItemKey, ItemShape, WaveVisionPlan, frame_runs, route_indices
from titanrl.parallel.vision_route import RouteCounter, VisionRoute
from titanrl.rl.exchange import Delivery
from titanrl.rl.units import StageUnit, TrajectoryMeta


@dataclass(frozen=True)
class Assembly:
    """What assembly needs of the step, fixed for it: this rank and its device, the trajectories' metadata (their
    advantages; media by owner: ``units.media_owners``), the media shapes, and the embedding route's group and byte
    counter."""

    rank: int
    device: torch.device
    dtype: torch.dtype
    metas: Sequence[TrajectoryMeta]
    by_owner: Mapping[int, TrajectoryMeta]
    shapes: Mapping[ItemKey, ItemShape]
    route_group: object
    route_counter: RouteCounter


@dataclass
class WaveInputs:
    """One rank's inputs for one wave, ready for the model."""

    pieces: list[Piece]
    batch: PackedBatch | None  # None: this rank has nothing in the wave (it runs a dummy)
    targets: LogprobTargets | None
    scored_counts: list[int]  # scored log-probs per piece, in order
    seq_index: torch.Tensor | None  # [K] local response (a piece's response) of each scored log-prob
    seq_lengths: torch.Tensor | None  # [local responses] scored (generated) tokens of each, whole
    advantages: torch.Tensor | None  # [K]
    fields: dict[str, torch.Tensor]  # [K] per requested field
    bytes_sent: int = 0
    # set when vision balancing routes embeddings in this wave: every rank's forward (a dummy's
    # too) must call it, since it is a collective
    vision_route: VisionRoute | None = None
    # per sharded group of the wave (Ulysses), in the stream's order: its process group and the range [lo, hi) of
    # local responses (``seq_lengths``' indices) whose tokens its members hold between them, the same responses
    # in the same order on every member (``titanrl.parallel.ulysses.sum_over_members``)
    sharded_responses: tuple[tuple[object, int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return 0 if self.batch is None else self.batch.num_tokens


@dataclass
class VisionPass:
    """A stage's vision inputs on this rank, encoded once before its waves: ``batch`` (no tokens: the pixels and
    grids of the runs this rank encodes, and the embedding route with vision balancing) goes through
    ``model(batch, vision_only=True)``, whose rows the waves' batches read as ``vision_embeds``. Every rank runs it
    (the route is a collective)."""

    batch: PackedBatch
    rows: int  # rows the waves index: this rank's needed runs, in order


def _encoder_inputs(asm: Assembly, runs: Sequence[FrameRun], delivered: Delivery,
                    g: int) -> tuple[list[VisionGrid], torch.Tensor | None]:
    """Grids and pixels of the runs this rank encodes in vision group ``g``, in run order."""
    pixels, grids = [], []
    for run in runs:
        pixels.append(delivered.pixels[(g, run)])
        grid = asm.by_owner[run.group].media[run.item].grid
        grids.append(VisionGrid(run.f1 - run.f0, grid.h, grid.w, grid.is_video, grid.second_per_grid))
    values = torch.from_numpy(np.concatenate(pixels)).to(asm.device, asm.dtype) if pixels else None
    return grids, values


def _route(asm: Assembly, vplan: WaveVisionPlan) -> VisionRoute:
    return VisionRoute(route_indices(vplan, asm.rank, asm.shapes), asm.rank, asm.route_group,
                       collective=vplan.moves(), counter=asm.route_counter)


def vision_pass(asm: Assembly, encode: Sequence[FrameRun], needs: Sequence[FrameRun], vplan: WaveVisionPlan | None,
                delivered: Delivery, g: int) -> VisionPass:
    """This rank's :class:`VisionPass` of a stage (vision group ``g``): it encodes ``encode`` (with vision balancing
    its plan's runs, else its ``needs``) and ends with the rows of ``needs``."""
    grids, pixels = _encoder_inputs(asm, encode, delivered, g)
    dev = asm.device
    batch = PackedBatch(input_ids=torch.zeros(0, dtype=torch.int64, device=dev),
                        position_ids=torch.zeros(3, 0, dtype=torch.int64, device=dev),
                        cu_seqlens=torch.zeros(1, dtype=torch.int64, device=dev), max_seqlen=0, grids=grids,
                        pixel_values=pixels, vision_route=_route(asm, vplan) if vplan is not None else None)
    rows = sum((r.f1 - r.f0) * asm.by_owner[r.group].media[r.item].tokens_per_frame for r in needs)
    return VisionPass(batch, rows)


def assemble_wave(asm: Assembly, plan: StagePlan, wave: int, units: Sequence[StageUnit], delivered: Delivery,
                  fields: Sequence[str], *, temperature: float, return_entropy: bool, layout_builder,
                  encode: Sequence[FrameRun] = (), vplan: WaveVisionPlan | None = None, g: int = 0,
                  table: Sequence[FrameRun] | None = None) -> WaveInputs:
    """This rank's ``WaveInputs`` of ``wave`` from what was delivered: pieces in plan order, one vision grid per run
    it encodes (``encode``, vision group ``g``; ``vplan`` with vision balancing), the row of each placeholder token
    in the encoded (or routed) rows. ``table``: the runs of the stage's :class:`VisionPass` on this rank; the wave
    encodes nothing and its placeholders index the pass's rows instead."""
    metas = units
    mine = plan.pieces(wave, asm.rank)
    route = None
    if vplan is not None and (vplan.moves() or mine):
        route = _route(asm, vplan)
    if not mine:  # a dummy forward still joins the route's collective
        return WaveInputs([], None, None, [], None, None, None, {}, vision_route=route)
    per_piece = [delivered.pieces[(wave, i)] for i in range(len(mine))]
    need_runs = frame_runs(mine, metas) if table is None else table
    if table is not None:
        grids, pixel_values = [], None
    else:
        grids, pixel_values = _encoder_inputs(asm, encode, delivered, g)

    # the row of each placeholder token in the rows of the runs it needs (what the route returns, the encoded
    # rows themselves, or the vision pass's rows)
    run_rows: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (owner, item) -> (f0, f1, first row)
    rows = 0
    for run in need_runs:
        item = asm.by_owner[run.group].media[run.item]
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
        seq_lengths += list(m.scored_lens)
        adv.append(np.asarray([asm.metas[t].advantage for t in m.trajs], dtype=np.float32)[sc.response])
        for f, values in zip(fields, arrays[3:]):
            extra[f].append(values)
        scored_counts.append(len(sc.positions))
        for item in m.media:
            frames = item.frames(p.start, p.end)
            if frames is None:
                continue
            # a piece's frames of one item lie inside one run (runs are maximal)
            f0, _, base = next(r for r in run_rows[(item.owner, item.index)] if r[0] <= frames[0] < r[1])
            lo, hi = max(p.start, item.token_start), min(p.end, item.token_end)
            start_row = base + (lo - item.token_start) - f0 * item.tokens_per_frame
            token_rows.append(np.arange(start_row, start_row + hi - lo))
        offset += p.num_tokens
    dev = asm.device
    lengths = [p.num_tokens for p in mine]
    rank_wave = plan.waves[wave].ranks[asm.rank]
    layout = layout_builder(rank_wave) if layout_builder is not None else None
    sharded_responses, first = [], 0
    for step, group in zip(rank_wave.sharded, layout.sharded if layout is not None else ()):
        n = sum(len(metas[s].scored_lens) for s in step.seqs)  # its pieces come first, in its order
        sharded_responses.append((group.group, first, first + n))
        first += n
    batch = PackedBatch(
        input_ids=torch.from_numpy(np.concatenate(ids)).to(dev),
        position_ids=torch.from_numpy(np.concatenate(pos, axis=1)).to(dev),
        cu_seqlens=torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(dev),
        max_seqlen=max(lengths),
        grids=grids,
        pixel_values=pixel_values,
        vision_token_index=(torch.from_numpy(np.concatenate(token_rows) if token_rows else np.zeros(0, np.int64)).to(dev)
                            if token_rows or table is not None else None),
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
        sharded_responses=tuple(sharded_responses),
    )
