"""Rank side of ShadowLoader: turn planned samples (or cut placeholders) into real arrays.

The materializer asks the preprocessor that the routing table names for each sample (no lookup
round trip: every rank computed the same table), maps the decoded uint8 frames out of the object
store, and does the last, cheap step itself: resize, normalise and patchify with
``preprocess.media_to_patches``, the very function the inline path uses, so the result is bit-equal
to ``prepare_sample``. Patchifying late keeps transfers at uint8 (4x smaller than float32 rows) and
lets a rank that needs only some frames fetch only those.

Faults: a preprocessor that dies is restarted by Ray (``max_restarts``); a fetch that fails because
of it (actor died/unavailable, object lost with its owner) is retried against the restarted actor,
which re-decodes the sample on demand. A fetch that outlives ``fetch_timeout_s`` raises
``DataUnavailableError`` naming the samples, the host of the preprocessor that holds them and the
asking rank's host, never hangs.

``stats`` counts what came from this host's preprocessor and what crossed hosts (``samples_local`` /
``samples_remote`` for whole samples, ``slice_frames_local`` / ``slice_frames_remote`` for slices).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from titanrl.data.preprocess import DecodedMedia, MediaSettings, media_to_patches
from titanrl.data.shadow.metadata import SampleMeta
from titanrl.data.shadow.placeholder import PixelPlaceholder
from titanrl.data.shadow.plan import Route
from titanrl.data.shadow.preprocessor import DecodeTask, FetchReply
from titanrl.data.vision import _video_max_pixels  # the processor's rule itself, not a copy
from titanrl.data.shadow.types import BadSample, DataUnavailableError, Materialized, bad_from_meta


# Frames mapped from the object store are read-only; vision.py wraps them with torch.from_numpy
# only to copy them (permute + contiguous), so torch's warning about non-writable arrays is moot.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


@dataclass
class StepPlan:
    """Everything one rank knows about a planned step."""

    step: int
    metas: list[SampleMeta]
    assignment: list[list[int]]
    routes: list[Route | None]
    tasks: dict[int, DecodeTask]  # position -> task, for routed samples
    state: dict[str, Any]  # loader state that resumes at this step
    future: Any = None  # this rank's background fetch (concurrent.futures.Future)
    released: bool = False
    index_of: dict[tuple[int, int], int] = field(default_factory=dict)  # (epoch, index) -> position
    # this rank's fetches of the step by where they came from (Materializer.stats' host keys)
    counts: dict[str, float] = field(default_factory=dict)

    def position_of(self, placeholder: PixelPlaceholder) -> int:
        if not self.index_of:
            self.index_of = {(m.epoch, m.index): p for p, m in enumerate(self.metas)}
        try:
            return self.index_of[(placeholder.epoch, placeholder.index)]
        except KeyError:
            raise KeyError(f"{placeholder.describe()} is not in step {self.step}") from None


def assemble_sample(
    position: int, meta: SampleMeta, media: list[DecodedMedia], settings: MediaSettings
) -> Materialized:
    """Decoded frames -> model inputs, exactly as ``preprocess.prepare_sample`` builds them."""
    patches = [media_to_patches(m, settings) for m in media]
    grids = [g for _, g in patches]
    pixel_values = np.concatenate([p for p, _ in patches]).astype(np.float32) if patches else None
    if grids != meta.grids:
        raise RuntimeError(f"sample {meta.sample_id!r}: decoded grids {grids} differ from planned {meta.grids}")
    return Materialized(position, meta, meta.prompt_ids, grids, pixel_values, media)


def _retryable_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    return tuple(
        getattr(rex, name) for name in ("RayActorError", "ActorUnavailableError", "ObjectLostError",
                                        "OwnerDiedError", "ObjectFetchTimedOutError")
        if hasattr(rex, name)
    )


class Materializer:
    def __init__(
        self,
        handles: Sequence[Any],
        settings: MediaSettings,
        *,
        fetch_timeout_s: float = 300.0,
        max_attempts: int = 4,
        hosts: Sequence[str] = (),
        here: str = "",
        rank: int = 0,
    ) -> None:
        self.handles = list(handles)
        self.settings = settings
        self.fetch_timeout_s = fetch_timeout_s
        self.max_attempts = max_attempts
        # each preprocessor's host and this rank's (for messages, and the local / cross-host counts)
        self.hosts = list(hosts) or [""] * len(self.handles)
        self.here = here
        self.rank = rank
        self.stats: dict[str, float] = {"fetch_s": 0.0, "patchify_s": 0.0, "fetched_bytes": 0.0, "retries": 0.0,
                                        "samples": 0.0, "samples_local": 0.0, "samples_remote": 0.0,
                                        "slice_frames_local": 0.0, "slice_frames_remote": 0.0}

    def _count_host(self, plan: StepPlan, preprocessor: int, what: str, n: float) -> None:
        key = f"{what}_{'local' if self.hosts[preprocessor] == self.here else 'remote'}"
        self.stats[key] += n
        plan.counts[key] = plan.counts.get(key, 0.0) + n

    def _where(self, plan: StepPlan, positions: Sequence[int]) -> str:
        """'samples [...] held by the preprocessor on host H' per preprocessor, and who asked."""
        by_host: dict[str, list[str]] = {}
        for pos in positions:
            host = self.hosts[self._route(plan, pos)] or f"preprocessor {self._route(plan, pos)}"
            by_host.setdefault(host, []).append(plan.metas[pos].sample_id)
        held = "; ".join(f"samples {ids} held by the preprocessor on host {host}" for host, ids in by_host.items())
        return f"{held}, asked by rank {self.rank} on host {self.here or '?'}"

    # ------------------------------------------------------------------------------- fetching

    @staticmethod
    def _route(plan: StepPlan, pos: int) -> int:
        route = plan.routes[pos]
        assert route is not None, f"position {pos} of step {plan.step} is not routed"
        return route.preprocessor

    def _handle(self, plan: StepPlan, pos: int) -> Any:
        return self.handles[self._route(plan, pos)]

    def _fetch_replies(
        self, plan: StepPlan, requests: list[tuple[int, dict[int, tuple[int, int]] | None]]
    ) -> list[tuple[FetchReply, list[np.ndarray]]]:
        """Fetch (position, frame_ranges) requests, all in flight at once, retrying those hit by a
        preprocessor failure. Returns (reply, frames per returned media) per request, in order."""
        import ray

        retryable = _retryable_errors()
        deadline = time.monotonic() + self.fetch_timeout_s
        pending = list(enumerate(requests))
        out: dict[int, tuple[FetchReply, list[np.ndarray]]] = {}
        for _ in range(self.max_attempts):
            refs = [self._handle(plan, pos).fetch.remote(plan.tasks[pos], ranges, False)
                    for _, (pos, ranges) in pending]
            failed = []
            for (req, (pos, ranges)), ref in zip(pending, refs):
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise ray.exceptions.GetTimeoutError("deadline passed")
                    reply: FetchReply = ray.get(ref, timeout=remaining)
                    frames = [
                        m.data if isinstance(m.data, np.ndarray) else ray.get(m.data, timeout=max(remaining, 1.0))
                        for m in reply.media
                    ] if reply.ok else []
                    out[req] = (reply, frames)
                except ray.exceptions.GetTimeoutError:
                    # name only the requests whose replies have not arrived (not those merely behind them)
                    left = [(r, p, ref) for (r, (p, _)), ref in zip(pending, refs) if r not in out]
                    _, missing = ray.wait([ref for *_, ref in left], num_returns=len(left), timeout=0)
                    waiting = [p for _, p, ref in left if ref in missing] or [p for _, p, _ in left]
                    raise DataUnavailableError(
                        f"step {plan.step}: no data after data.fetch_timeout_s={self.fetch_timeout_s:.0f} s: "
                        f"{self._where(plan, waiting)}"
                    ) from None
                except retryable as error:
                    failed.append(((req, (pos, ranges)), error))
            if not failed:
                return [out[r] for r in range(len(requests))]
            self.stats["retries"] += len(failed)
            pending = [req for req, _ in failed]
            self._wait_for_restart({self._route(plan, pos) for _, (pos, _) in pending}, deadline)
        raise DataUnavailableError(
            f"step {plan.step}: the preprocessor failed {self.max_attempts} times: "
            f"{self._where(plan, [p for _, (p, _) in pending])}: {failed[-1][1]}"
        )

    def _wait_for_restart(self, preprocessors: set[int], deadline: float) -> None:
        """Until each preprocessor answers again (Ray queues calls while it restarts); a preprocessor
        that keeps failing at once is dead for good (restarts exhausted)."""
        import ray

        for i in preprocessors:
            failures = 0
            while True:
                try:
                    ray.get(self.handles[i].ping.remote(), timeout=max(1.0, min(10.0, deadline - time.monotonic())))
                    break
                except ray.exceptions.GetTimeoutError:
                    if time.monotonic() >= deadline:
                        raise DataUnavailableError(
                            f"preprocessor {i} did not come back before the fetch deadline"
                        ) from None
                except ray.exceptions.RayActorError as error:
                    failures += 1
                    if failures >= 5 or time.monotonic() >= deadline:
                        raise DataUnavailableError(f"preprocessor {i} is gone: {error}") from None
                    time.sleep(0.5)

    # ------------------------------------------------------------------------------- samples

    def fetch_samples(self, plan: StepPlan, positions: Sequence[int]) -> list[Materialized | BadSample]:
        """Whole samples at `positions` of the step, in that order."""
        t0 = time.perf_counter()
        wanted = [p for p in positions if p in plan.tasks]  # routed: good samples with media
        replies = dict(zip(wanted, self._fetch_replies(plan, [(p, None) for p in wanted]))) if wanted else {}
        t1 = time.perf_counter()
        out: list[Materialized | BadSample] = []
        for pos in positions:
            meta = plan.metas[pos]
            if meta.problem is not None:
                out.append(bad_from_meta(pos, meta))
                continue
            if pos not in replies:  # text only
                out.append(assemble_sample(pos, meta, [], self.settings))
                continue
            reply, frames = replies[pos]
            if not reply.ok:
                out.append(BadSample(pos, meta.index, meta.sample_id, reply.error_kind, reply.error_detail))
                continue
            media = [DecodedMedia(m.kind, f, m.sampled_fps) for m, f in zip(reply.media, frames)]  # type: ignore
            out.append(assemble_sample(pos, meta, media, self.settings))
            self.stats["fetched_bytes"] += sum(f.nbytes for f in frames)
            self._count_host(plan, self._route(plan, pos), "samples", 1)
        self.stats["fetch_s"] += t1 - t0
        self.stats["patchify_s"] += time.perf_counter() - t1
        self.stats["samples"] += len(positions)
        return out

    # ------------------------------------------------------------------------------- slices

    def fetch_slices(self, plan: StepPlan, placeholders: Sequence[PixelPlaceholder],
                     stats: dict[str, float] | None = None) -> list[np.ndarray]:
        """The pixel rows of each cut placeholder, fetching only the frames each one needs (all
        fetches in flight at once). ``stats`` (optional) gains ``frames`` (sampled frames received),
        ``bytes`` (their uint8 bytes) and ``decoded_frames`` (what the preprocessors decoded for
        these fetches: 0 for frames still cached from the sample's whole fetch)."""
        requests: list[tuple[int, dict[int, tuple[int, int]] | None]] = []
        starts = []
        for ph in placeholders:
            pos = plan.position_of(ph)
            meta = plan.metas[pos]
            if meta.problem is not None or pos not in plan.tasks:
                raise ValueError(f"{ph.describe()}: sample is bad ({meta.problem}) or not routed")
            mm = meta.media[ph.media_index]
            f0, f1 = ph.frame_span()
            f1 = min(f1, mm.sampled_frames)
            starts.append(f0)
            requests.append((pos, {ph.media_index: (f0, f1)}))
        t0 = time.perf_counter()
        replies = self._fetch_replies(plan, requests) if requests else []
        t1 = time.perf_counter()
        out = []
        for f0, ph, (pos, _), (reply, frames) in zip(starts, placeholders, requests, replies):
            if not reply.ok:
                raise ValueError(f"{ph.describe()}: {reply.error_kind}: {reply.error_detail}")
            mm = plan.metas[pos].media[ph.media_index]
            settings = self._settings_for_clip(mm.sampled_frames)
            pixels, grid = media_to_patches(DecodedMedia(mm.kind, frames[0], mm.sampled_fps), settings)
            if (grid.h, grid.w) != (mm.grid.h, mm.grid.w):
                raise RuntimeError(f"{ph.describe()}: frame-range resize gave grid {grid}, planned {mm.grid}")
            first_row = (f0 // (ph.temporal_patch_size if mm.kind == "video" else 1)) * ph.rows_per_group
            out.append(pixels[ph.row_start - first_row: ph.row_stop - first_row])
            self.stats["fetched_bytes"] += frames[0].nbytes
            self._count_host(plan, self._route(plan, pos), "slice_frames", frames[0].shape[0])
            if stats is not None:
                stats["frames"] = stats.get("frames", 0.0) + frames[0].shape[0]
                stats["bytes"] = stats.get("bytes", 0.0) + frames[0].nbytes
                stats["decoded_frames"] = stats.get("decoded_frames", 0.0) + reply.decoded_frames
        self.stats["fetch_s"] += t1 - t0
        self.stats["patchify_s"] += time.perf_counter() - t1
        return out

    def _settings_for_clip(self, clip_frames: int) -> MediaSettings:
        """Settings under which a run of frames resizes exactly as inside the whole clip: with
        cap_pixels_per_frame the per-frame pixel limit depends on the clip's length, so it is fixed
        here (by the processor's own rule) for the whole clip's frame count."""
        s = self.settings
        if not s.cap_pixels_per_frame:
            return s
        frame_max = _video_max_pixels(clip_frames, s.video_min_pixels, s.video_max_pixels,
                                      s.patch_size * s.merge_size, s.temporal_patch_size, True, s.max_video_tokens)
        return dataclasses.replace(s, video_max_pixels=frame_max, cap_pixels_per_frame=False)
