"""The model's input format: packed variable-length sequences, no padding.

A ``PackedBatch`` is what FlexUlysses and the balancers cut and move: a flat token stream
with per-sequence boundaries (``cu_seqlens``), 3D rotary positions computed per sequence
before packing (so packing, sharding or reordering never changes a token's position), and
the vision patches of every image/video in order of appearance with their grids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from titanrl.models.vision_grid import VisionGrid


@dataclass
class SequenceInput:
    """One sequence before packing (prompt + optional response)."""

    token_ids: np.ndarray  # [L] int64
    position_ids: np.ndarray  # [3, L] int64 (mrope, vLLM rule)
    grids: list[VisionGrid] = field(default_factory=list)
    pixel_values: torch.Tensor | None = None  # [sum(grid.num_patches), patch_dim]
    # Sequences with the same key carry the same media (the n responses of one prompt): the
    # vision tower encodes it once per pack and every copy reads the same embeddings.
    vision_key: object | None = None

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


class VisionRows:
    """``PackedBatch.vision_embeds``: rows of a vision pass, ``[rows, hidden]``. A plain holder, not a tensor field:
    FSDP2 hooks every forward input that requires grad and reduces the root unit's gradients when that input's
    gradient arrives, which for these rows comes before the vision tower's backward adds its share to the root
    (merger, patch embedding): one more reduction of the root per minibatch. A plain object is passed through as is."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [N] int64
    position_ids: torch.Tensor  # [3, N] int64
    cu_seqlens: torch.Tensor  # [S + 1] int64, cu_seqlens[0] == 0, cu_seqlens[-1] == N
    max_seqlen: int
    grids: list[VisionGrid]
    pixel_values: torch.Tensor | None  # [P, patch_dim] float, P = sum of grid patches
    # Row of the vision tower's output for each image/video placeholder token, in order; None
    # when every sequence has its own media (row i for placeholder i).
    vision_token_index: torch.Tensor | None = None
    # Attention metadata of the decoder precomputed outside the model (a sequence-parallel
    # layout: titanrl.parallel.ulysses.UlyssesLayout), handed to every ``inner_attention`` as is;
    # None = every sequence of ``cu_seqlens`` is whole in this stream.
    attention_layout: object | None = None
    # Vision balancing (titanrl.parallel.vision_route.VisionRoute): a callable from the rows this
    # rank's vision tower produced to the rows this stream's placeholders need (encoded on other
    # ranks too); None = the rows produced here are the ones needed.
    vision_route: object | None = None
    # Vision rows encoded beforehand (``Qwen2_5_VLModel.forward(vision_only=True)``: a stage's vision pass,
    # each image or frame once per rank for all its microbatches), read through ``vision_token_index``; with
    # them the vision tower does not run in this forward and ``pixel_values`` / ``vision_route`` are unused.
    vision_embeds: VisionRows | None = None
    # Shared prefixes: per sequence of ``cu_seqlens``, the lengths of a prompt and of the responses
    # that follow it and share it (``titanrl.models.attention.make_varlen_meta``); None = every
    # sequence is plain causal.
    segments: list[tuple[int, ...]] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    def seq_lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "PackedBatch":
        pv = self.pixel_values
        if pv is not None:
            pv = pv.to(device=device, dtype=dtype or pv.dtype)
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
            max_seqlen=self.max_seqlen,
            grids=self.grids,
            pixel_values=pv,
            vision_token_index=None if self.vision_token_index is None else self.vision_token_index.to(device),
            attention_layout=self.attention_layout,
            vision_route=self.vision_route,
            vision_embeds=None if self.vision_embeds is None else VisionRows(self.vision_embeds.rows.to(device)),
            segments=self.segments,
        )


def pack_sequences(seqs: Sequence[SequenceInput], *, spatial_merge_size: int = 2) -> PackedBatch:
    if not seqs:
        raise ValueError("cannot pack an empty list of sequences")
    lengths = [len(s) for s in seqs]
    if min(lengths) == 0:
        raise ValueError(f"sequence {lengths.index(0)} is empty")
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    for i, s in enumerate(seqs):
        expected = sum(g.num_patches for g in s.grids)
        got = 0 if s.pixel_values is None else s.pixel_values.shape[0]
        if expected != got:
            raise ValueError(f"sequence {i}: grids describe {expected} patches but pixel_values has {got}")
    grids: list[VisionGrid] = []
    pixel_chunks: list[torch.Tensor] = []
    first_row: dict[object, tuple[int, int]] = {}  # vision key -> (first embedding row, rows)
    token_rows: list[torch.Tensor] = []
    shared = False
    rows = 0
    for i, s in enumerate(seqs):
        if not s.grids:
            continue
        key = s.vision_key if s.vision_key is not None else ("seq", i)
        if key not in first_row:
            start = rows
            n = sum(g.num_tokens(spatial_merge_size) for g in s.grids)
            first_row[key] = (start, n)
            grids.extend(s.grids)
            pixel_chunks.append(s.pixel_values)
            rows += n
        else:
            shared = True
        start, n = first_row[key]
        token_rows.append(torch.arange(start, start + n))
    return PackedBatch(
        input_ids=torch.from_numpy(np.concatenate([s.token_ids for s in seqs]).astype(np.int64)),
        position_ids=torch.from_numpy(np.concatenate([s.position_ids for s in seqs], axis=1).astype(np.int64)),
        cu_seqlens=cu,
        max_seqlen=max(lengths),
        grids=grids,
        pixel_values=torch.cat(pixel_chunks) if pixel_chunks else None,
        vision_token_index=torch.cat(token_rows) if shared else None,
    )
