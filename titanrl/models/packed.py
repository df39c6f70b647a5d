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

from titanrl.models.qwen2_5_vl.positions import VisionGrid


@dataclass
class SequenceInput:
    """One sequence before packing (prompt + optional response)."""

    token_ids: np.ndarray  # [L] int64
    position_ids: np.ndarray  # [3, L] int64 (mrope, vLLM rule)
    grids: list[VisionGrid] = field(default_factory=list)
    pixel_values: torch.Tensor | None = None  # [sum(grid.num_patches), patch_dim]

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [N] int64
    position_ids: torch.Tensor  # [3, N] int64
    cu_seqlens: torch.Tensor  # [S + 1] int64, cu_seqlens[0] == 0, cu_seqlens[-1] == N
    max_seqlen: int
    grids: list[VisionGrid]
    pixel_values: torch.Tensor | None  # [P, patch_dim] float, P = sum of grid patches

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
        )


def pack_sequences(seqs: Sequence[SequenceInput]) -> PackedBatch:
    if not seqs:
        raise ValueError("cannot pack an empty list of sequences")
    lengths = [len(s) for s in seqs]
    if min(lengths) == 0:
        raise ValueError(f"sequence {lengths.index(0)} is empty")
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    grids = [g for s in seqs for g in s.grids]
    pixel_chunks = [s.pixel_values for s in seqs if s.pixel_values is not None and s.pixel_values.numel() > 0]
    for i, s in enumerate(seqs):
        expected = sum(g.num_patches for g in s.grids)
        got = 0 if s.pixel_values is None else s.pixel_values.shape[0]
        if expected != got:
            raise ValueError(f"sequence {i}: grids describe {expected} patches but pixel_values has {got}")
    return PackedBatch(
        input_ids=torch.from_numpy(np.concatenate([s.token_ids for s in seqs]).astype(np.int64)),
        position_ids=torch.from_numpy(np.concatenate([s.position_ids for s in seqs], axis=1).astype(np.int64)),
        cu_seqlens=cu,
        max_seqlen=max(lengths),
        grids=grids,
        pixel_values=torch.cat(pixel_chunks) if pixel_chunks else None,
    )
