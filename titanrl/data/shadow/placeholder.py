"""Placeholders for ``pixel_values``: shape, dtype and identity of patch rows, without the data.

A :class:`PixelPlaceholder` stands for a contiguous range of one media item's ``pixel_values`` rows
(the layout of ``vision.preprocess_image/preprocess_video``: temporal groups in order; inside each,
merge blocks row-major). Planners and FlexUlysses cut it the way they will cut the real tensor, by

- frame range (``frames``): sampled frames, aligned to the temporal patch (2 frames per group),
- temporal group range (``temporal``),
- LLM token range (``tokens``): one token = ``merge_size**2`` consecutive rows,
- row range (``rows``),

and the materializer turns a cut placeholder into exactly those rows, fetching only the frames they
need (``frame_span``). ``.meta`` gives a torch tensor on the ``meta`` device with the same shape and
dtype for code that traces shapes (no storage is allocated).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from titanrl.models.vision_grid import VisionGrid

MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2


@dataclass(frozen=True)
class PixelPlaceholder:
    """Rows ``[row_start, row_stop)`` of media item ``media_index`` of sample ``index`` (epoch ``epoch``)."""

    index: int  # manifest index of the sample
    epoch: int
    sample_id: str
    media_index: int
    grid: VisionGrid
    patch_dim: int
    row_start: int
    row_stop: int
    merge_size: int = MERGE_SIZE
    temporal_patch_size: int = TEMPORAL_PATCH_SIZE

    @classmethod
    def whole(
        cls, index: int, epoch: int, sample_id: str, media_index: int, grid: VisionGrid, patch_dim: int,
        merge_size: int = MERGE_SIZE, temporal_patch_size: int = TEMPORAL_PATCH_SIZE,
    ) -> "PixelPlaceholder":
        return cls(index, epoch, sample_id, media_index, grid, patch_dim, 0, grid.num_patches,
                   merge_size, temporal_patch_size)

    # -------------------------------------------------------------------------- tensor-like

    @property
    def shape(self) -> tuple[int, int]:
        return (self.row_stop - self.row_start, self.patch_dim)

    @property
    def dtype(self):
        import torch

        return torch.float32

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.patch_dim * 4

    @property
    def meta(self):
        """A ``meta``-device float32 tensor of this shape: shape inference without storage."""
        import torch

        return torch.empty(self.shape, dtype=torch.float32, device="meta")

    @property
    def is_whole(self) -> bool:
        return self.row_start == 0 and self.row_stop == self.grid.num_patches

    @property
    def rows_per_group(self) -> int:
        """Rows of one temporal group (one image, or two sampled frames)."""
        return self.grid.h * self.grid.w

    @property
    def rows_per_token(self) -> int:
        return self.merge_size**2

    @property
    def num_tokens(self) -> int:
        return self.shape[0] // self.rows_per_token

    # -------------------------------------------------------------------------- slicing

    def rows(self, start: int, stop: int) -> "PixelPlaceholder":
        """Rows [start, stop) of this placeholder (relative to it)."""
        n = self.shape[0]
        if not 0 <= start <= stop <= n:
            raise IndexError(f"row range [{start}, {stop}) outside [0, {n}) of {self.describe()}")
        return replace(self, row_start=self.row_start + start, row_stop=self.row_start + stop)

    def tokens(self, start: int, stop: int) -> "PixelPlaceholder":
        """LLM tokens [start, stop) of this placeholder (relative to it); must start on a token boundary."""
        if self.row_start % self.rows_per_token:
            raise ValueError(f"{self.describe()} does not start on a token boundary")
        return self.rows(start * self.rows_per_token, stop * self.rows_per_token)

    def temporal(self, start: int, stop: int) -> "PixelPlaceholder":
        """Temporal groups [start, stop) of the whole media item (absolute, not relative)."""
        if not 0 <= start <= stop <= self.grid.t:
            raise IndexError(f"temporal range [{start}, {stop}) outside [0, {self.grid.t}) of {self.describe()}")
        whole = replace(self, row_start=0, row_stop=self.grid.num_patches)
        return whole.rows(start * self.rows_per_group, stop * self.rows_per_group)

    def frames(self, start: int, stop: int) -> "PixelPlaceholder":
        """Sampled frames [start, stop) of the whole media item; both ends on temporal-patch boundaries
        (the last may be the frame count of a clip whose final group is padded)."""
        tp = self.temporal_patch_size if self.grid.is_video else 1
        if start % tp or (stop % tp and -(-stop // tp) != self.grid.t):
            raise ValueError(f"frame range [{start}, {stop}) is not aligned to temporal patches of {tp} frames")
        return self.temporal(start // tp, -(-stop // tp))

    def image(self) -> "PixelPlaceholder":
        """The whole media item (for multi-image samples: pick one by ``media_index`` first)."""
        return replace(self, row_start=0, row_stop=self.grid.num_patches)

    # -------------------------------------------------------------------------- what to fetch

    def group_span(self) -> tuple[int, int]:
        """Temporal groups [first, stop) these rows fall in."""
        per = self.rows_per_group
        return self.row_start // per, -(-self.row_stop // per)

    def frame_span(self) -> tuple[int, int]:
        """Sampled frames [first, stop) a rank must fetch to compute these rows (stop may exceed the
        clip's frame count when its last group is padded; fetchers clamp it)."""
        g0, g1 = self.group_span()
        tp = self.temporal_patch_size if self.grid.is_video else 1
        return g0 * tp, g1 * tp

    def describe(self) -> str:
        return (f"sample {self.sample_id!r} (index {self.index}, epoch {self.epoch}) media {self.media_index} "
                f"rows [{self.row_start}, {self.row_stop}) of {self.grid.num_patches}")


def media_token_offsets(pad_positions: np.ndarray, tokens: Sequence[int]) -> list[int]:
    """Position in the expanded prompt where each media item's vision tokens begin."""
    offsets, shift = [], 0
    for pos, n in zip(pad_positions.tolist(), tokens):
        offsets.append(int(pos) + shift)
        shift += n - 1
    return offsets


def placeholders_for_token_range(
    placeholders: Sequence[PixelPlaceholder], offsets: Sequence[int], start: int, stop: int
) -> list[PixelPlaceholder]:
    """The pixel rows behind prompt tokens [start, stop) of one sequence: for each media item whose
    vision tokens overlap the range, the overlapping token slice (what a sequence-parallel rank that
    holds that token range must embed)."""
    out = []
    for ph, first in zip(placeholders, offsets):
        lo, hi = max(start, first), min(stop, first + ph.num_tokens)
        if lo < hi:
            out.append(ph.tokens(lo - first, hi - first))
    return out
