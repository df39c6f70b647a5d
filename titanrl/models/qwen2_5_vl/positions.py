"""Position bookkeeping of Qwen2.5-VL, as plain functions of token ids and grid sizes.

- ``mrope_position_ids``: the 3D (t, h, w) rotary positions of one sequence, by the rule of the
  original Qwen2.5-VL release and of vLLM: text after an image or video continues at
  max(previous position) + 1. transformers 5.x advances by max(h, w) instead, which differs
  for videos whose temporal extent exceeds their spatial one; rollouts are scored by vLLM, so
  the trainer must use vLLM's rule or rollout and training log-probs disagree.
- ``vision_rotary_positions`` / ``vision_window_index``: the (h, w) patch coordinates and the
  window permutation of the vision tower, per image or video (frames attend only within
  themselves, which is what lets the vision tower be split by frames later).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from titanrl.models.vision_grid import VisionGrid

__all__ = ["VisionGrid", "mrope_position_ids", "vision_frame_cu_seqlens", "vision_rotary_positions",
           "vision_window_index"]


def mrope_position_ids(
    token_ids: Sequence[int] | np.ndarray,
    grids: Sequence[VisionGrid],
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    tokens_per_second: float,
) -> np.ndarray:
    """[3, len(token_ids)] int64 positions for one sequence (prompt + response)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    n = len(ids)
    out = np.empty((3, n), dtype=np.int64)
    is_vision = (ids == image_token_id) | (ids == video_token_id)
    vision_starts = np.flatnonzero(is_vision & ~np.concatenate(([False], is_vision[:-1])))
    grid_iter = iter(grids)
    cursor = 0  # next token to place
    next_pos = 0  # max position so far + 1
    for start in vision_starts:
        if start < cursor:
            continue  # inside a video/image already placed (adjacent items without separators)
        text_len = start - cursor
        out[:, cursor:start] = np.arange(text_len) + next_pos
        next_pos += text_len
        try:
            grid = next(grid_iter)
        except StopIteration:
            raise ValueError(f"sequence has more vision placeholder runs than grids ({len(grids)})") from None
        lt, lh, lw = grid.t, grid.h // spatial_merge_size, grid.w // spatial_merge_size
        count = lt * lh * lw
        expected_id = video_token_id if grid.is_video else image_token_id
        if start + count > n or not np.all(ids[start : start + count] == expected_id):
            raise ValueError(
                f"placeholder run at token {start} does not hold {count} "
                f"{'video' if grid.is_video else 'image'} tokens for grid (t={grid.t}, h={grid.h}, w={grid.w})"
            )
        t_idx, h_idx, w_idx = np.indices((lt, lh, lw)).reshape(3, -1)
        if grid.is_video:
            t_factor = grid.second_per_grid * tokens_per_second
            if t_factor != 1.0:
                t_idx = (t_idx * t_factor).astype(np.int64)
        block = np.stack([t_idx, h_idx, w_idx]) + next_pos
        out[:, start : start + count] = block
        next_pos = int(block.max()) + 1
        cursor = start + count
    if next(grid_iter, None) is not None:
        raise ValueError("more grids than vision placeholder runs in the sequence")
    out[:, cursor:] = np.arange(n - cursor) + next_pos
    return out


def vision_rotary_positions(grids: Sequence[VisionGrid], merge: int) -> torch.Tensor:
    """[num_patches, 2] (h, w) coordinates of every patch, in the processor's patch order
    (merge-block-major within each frame, frames in order)."""
    chunks = []
    for g in grids:
        h_idx = torch.arange(g.h).view(g.h // merge, merge, 1, 1).expand(-1, -1, g.w // merge, merge)
        w_idx = torch.arange(g.w).view(1, 1, g.w // merge, merge).expand(g.h // merge, merge, -1, -1)
        # processor order: (h_block, w_block, h_in_block, w_in_block)
        hw = torch.stack([h_idx.permute(0, 2, 1, 3).flatten(), w_idx.permute(0, 2, 1, 3).flatten()], dim=-1)
        chunks.append(hw.repeat(g.t, 1))
    return torch.cat(chunks, dim=0)


def vision_frame_cu_seqlens(grids: Sequence[VisionGrid]) -> torch.Tensor:
    """Full-attention segments of the vision tower: one per temporal patch (frame pair)."""
    lengths = [g.h * g.w for g in grids for _ in range(g.t)]
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)


def vision_window_index(
    grids: Sequence[VisionGrid], *, window_size: int, patch_size: int, merge: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation of merge units that makes every attention window contiguous, and the
    window boundaries in patches. Windows tile each frame in squares of
    ``window_size / patch_size / merge`` merge units; edge windows are smaller."""
    units_per_window = window_size // merge // patch_size
    merge_unit = merge * merge
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    offset = 0
    for g in grids:
        lh, lw = g.h // merge, g.w // merge
        idx = torch.arange(g.t * lh * lw).view(g.t, lh, lw)
        for t in range(g.t):
            for h0 in range(0, lh, units_per_window):
                for w0 in range(0, lw, units_per_window):
                    window = idx[t, h0 : h0 + units_per_window, w0 : w0 + units_per_window].flatten()
                    order.append(window + offset)
                    lengths.append(window.numel() * merge_unit)
        offset += g.t * lh * lw
    window_index = torch.cat(order) if order else torch.zeros(0, dtype=torch.int64)
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    return window_index, cu
