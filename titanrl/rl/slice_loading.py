"""Slice-aware loading (FlexRL sec. 4): the rank that encodes a run of frames in the log-prob and
update stages fetches exactly those frames from the media preprocessors and patchifies them itself,
instead of receiving float32 patch rows from the rank that generated the prompt (its home).

Why: patch rows are float32 (4x the uint8 frames), and under FlexUlysses or vision balancing the
encoder of a frame is often not its home, so the whole-sample path ships rows rank to rank. Here
the frames come from the preprocessor of the node (zero-copy there; across nodes only the frames
asked for travel). While the step runs, its samples are still cached from the homes' whole fetches,
so a slice costs no decode; a slice of a sample nobody holds any more is decoded alone, by seeking
(``PreprocessorCore.fetch`` with frame ranges).

A :class:`FrameRun` names temporal patches ``[f0, f1)`` of media item ``item`` of the prompt at
global batch position ``group`` - the position of its ``SampleMeta`` in the step, so the run maps
to a cut :class:`~titanrl.data.shadow.placeholder.PixelPlaceholder` without any lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from titanrl.data.shadow.types import StepData
from titanrl.parallel.vision_plan import FrameRun


@dataclass
class SliceStats:
    """What one rank loaded for the runs it encoded in a step (sums over stages)."""

    frames_fetched: int = 0  # sampled frames fetched from preprocessors (an image counts 1)
    bytes_fetched: int = 0  # their uint8 bytes
    frames_decoded: int = 0  # frames the preprocessors decoded for those fetches (0: still cached)
    frames_local: int = 0  # frames of runs whose prompt this rank generated (rows it already had)


class StepSlices:
    """The pixel rows of frame runs of one step, fetched through the step's loader and kept for the
    step (the update reuses what the log-prob stages fetched)."""

    def __init__(self, step: StepData) -> None:
        if not step.can_fetch_slices:
            raise ValueError("slice-aware loading needs a loader that fetches slices (data.loader = 'shadow')")
        self.step = step
        self.stats = SliceStats()
        self._rows: dict[FrameRun, np.ndarray] = {}
        self._local: set[FrameRun] = set()

    def fetches(self, group: int) -> bool:
        """Whether the frames of prompt ``group`` come from this step's loader: its own prompts do; a multi-turn
        observation (group < 0) and a prompt group carried from an earlier step (partial rollouts: ids past the
        step's prompts) do not, and their rows travel from their home instead."""
        return 0 <= group < len(self.step.metas)

    def _frames(self, run: FrameRun) -> int:
        """Sampled frames behind a run (an image is one; a clip's last pair may be padded)."""
        media = self.step.metas[run.group].media[run.item]
        if media.kind != "video":
            return 1
        tp = self.step.metas[run.group].placeholders[run.item].temporal_patch_size
        return min(run.f1 * tp, media.sampled_frames) - run.f0 * tp

    def rows(self, runs: Sequence[FrameRun], local: Callable[[FrameRun], np.ndarray | None]) -> list[np.ndarray]:
        """Rows of each run, in order: ``local(run)`` where this rank has them (its own prompts),
        otherwise fetched - all missing runs in one round of fetches."""
        out: dict[FrameRun, np.ndarray] = {}
        for r in runs:
            rows = local(r)
            if rows is not None:
                out[r] = rows
                if r not in self._local:
                    self._local.add(r)
                    self.stats.frames_local += self._frames(r)
        missing = list(dict.fromkeys(r for r in runs if r not in out and r not in self._rows))
        if missing:
            cuts = [self.step.metas[r.group].placeholders[r.item].temporal(r.f0, r.f1) for r in missing]
            counts: dict[str, float] = {}
            for run, rows in zip(missing, self.step.fetch_slices(cuts, counts)):
                self._rows[run] = rows
            self.stats.frames_fetched += int(counts.get("frames", 0))
            self.stats.bytes_fetched += int(counts.get("bytes", 0))
            self.stats.frames_decoded += int(counts.get("decoded_frames", 0))
        return [out[r] if r in out else self._rows[r] for r in runs]
