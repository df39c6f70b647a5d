"""What a loader hands the trainer: a step's plan (``StepData``) and its materialized samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from titanrl.data.manifest import SampleRecord
from titanrl.data.preprocess import DecodedMedia, PreparedSample
from titanrl.data.shadow.metadata import SampleMeta
from titanrl.data.shadow.placeholder import PixelPlaceholder
from titanrl.models.vision_grid import VisionGrid


class BadSampleError(RuntimeError):
    """Raised with ``data.on_bad_sample = "error"``; the message names the sample, its file and the cause."""


class DataUnavailableError(RuntimeError):
    """A rank could not get its data (Ray unreachable, preprocessor gone for good, fetch timed out)."""


@dataclass
class Materialized:
    """One sample ready for the rollout engine and the trainer.

    ``pixel_values`` rows follow ``grids`` (the layout of ``preprocess.prepare_sample``, bit-equal to it);
    ``media`` holds the decoded uint8 frames and sampled fps the rollout engine takes (vLLM resizes raw
    frames itself), so nothing is decoded twice. Frames fetched through Ray are read-only views into the
    object store.
    """

    position: int  # in StepData.metas
    meta: SampleMeta
    prompt_ids: np.ndarray
    grids: list[VisionGrid]
    pixel_values: np.ndarray | None
    media: list[DecodedMedia]

    @property
    def record(self) -> SampleRecord:
        return self.meta.record

    def as_prepared(self) -> PreparedSample:
        return PreparedSample(self.meta.record, self.prompt_ids, self.grids, self.pixel_values, self.media)


@dataclass(frozen=True)
class BadSample:
    """A sample that cannot be used this step; ``reason`` is one of metadata.PROBLEM_KINDS."""

    position: int
    index: int
    sample_id: str
    reason: str  # missing | corrupt | unsupported | too_long | decoder_crash
    detail: str

    def error(self, manifest: str = "") -> BadSampleError:
        where = f" ({manifest})" if manifest else ""
        return BadSampleError(f"sample {self.sample_id!r}{where}: {self.reason}: {self.detail}")


@dataclass
class StepData:
    """One step's global batch (identical on every rank) and this rank's share of it.

    ``assignment[r]`` lists the positions in ``metas`` that rank r consumes; ``mine`` is this rank's.
    ``materialize()`` returns this rank's samples in ``mine`` order and blocks only if they are not
    fetched yet; with ``data.on_bad_sample = "error"`` it raises BadSampleError naming the first bad
    sample. For the centralized loader it is a collective: every rank must call it.
    ``fetch_slices(placeholders, stats=None)`` returns exactly the pixel rows of cut placeholders (any
    sample of the step), fetching only the frames they need (``Materializer.fetch_slices``).
    """

    step: int
    metas: list[SampleMeta]
    assignment: list[list[int]]
    rank: int
    _materialize: Callable[[], list[Materialized | BadSample]] = field(repr=False)
    _fetch_slices: Callable[..., list[np.ndarray]] | None = field(default=None, repr=False)
    _result: list[Materialized | BadSample] | None = field(default=None, repr=False)
    wait_s: float = 0.0  # time materialize() blocked
    # this rank's fetches of the step by origin (ShadowLoader): samples_local / samples_remote (whole
    # samples from this host's preprocessor / another host's), slice_frames_local / slice_frames_remote
    fetch_counts: dict[str, float] = field(default_factory=dict)
    # the loader's state_dict() positioned at this step (before it was handed out): resuming there hands it
    # out again (an asynchronous run's checkpoint holds steps already handed out but not yet trained)
    resume_state: dict | None = None

    @property
    def mine(self) -> list[int]:
        return self.assignment[self.rank]

    def materialize(self) -> list[Materialized | BadSample]:
        if self._result is None:
            import time

            t0 = time.perf_counter()
            self._result = self._materialize()
            self.wait_s += time.perf_counter() - t0
        return self._result

    @property
    def can_fetch_slices(self) -> bool:
        return self._fetch_slices is not None

    def fetch_slices(self, placeholders: Sequence[PixelPlaceholder],
                     stats: dict[str, float] | None = None) -> list[np.ndarray]:
        if self._fetch_slices is None:
            raise NotImplementedError("this loader cannot fetch slices")
        return self._fetch_slices(placeholders, stats)


def bad_from_meta(position: int, meta: SampleMeta) -> BadSample:
    assert meta.problem is not None
    return BadSample(position, meta.index, meta.sample_id, meta.problem.kind, meta.problem.detail)


def raise_or_keep(results: list[Materialized | BadSample], on_bad_sample: str, manifest: str) -> None:
    if on_bad_sample == "error":
        for r in results:
            if isinstance(r, BadSample):
                raise r.error(manifest)
