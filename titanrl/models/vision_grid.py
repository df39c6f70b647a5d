"""``VisionGrid``: one image or video as a vision tower sees it. Family-neutral, so the packed
format, the data pipeline and the planners use it without importing a model family."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionGrid:
    """One image or video as the vision tower sees it: a (t, h, w) patch grid.

    ``second_per_grid`` is the time one temporal patch spans (temporal_patch_size / fps);
    it scales temporal rotary positions of videos. Images use 1.0 and are not scaled.
    """

    t: int
    h: int
    w: int
    is_video: bool = False
    second_per_grid: float = 1.0

    @property
    def num_patches(self) -> int:
        return self.t * self.h * self.w

    def num_tokens(self, merge_size: int) -> int:
        return self.t * (self.h // merge_size) * (self.w // merge_size)
