"""The local preprocessor: decodes samples routed to it and serves them to the ranks that consume them.

One per node, as a Ray actor (see ``ray_runtime.start_preprocessors``); this module is plain Python
so it can be tested without Ray (``put`` / ``get`` default to keeping arrays in the process).

- ``prefetch(tasks)`` queues decodes (idempotent per key); ``num_threads`` background threads decode
  them in order (PyAV releases the GIL, so threads overlap). With 0 threads nothing is decoded ahead.
- ``fetch(task, ...)`` returns a sample's decoded media, waiting for a queued or running decode, or
  decoding it right there when the task is unknown: a restarted actor (empty cache) or an evicted
  entry therefore re-decodes on demand, and the caller's fetch still returns the right data. A
  frame-range fetch of an unknown task decodes only that range (seeking to the keyframe before it)
  and caches nothing: FlexUlysses-aware loading never pays for a whole clip it does not hold.
- Decoded frames go to the Ray object store (``put``); a full fetch returns references, so consumers on
  the same node map them without a copy, and a frame-range fetch returns just those frames by value.
- An entry is evicted when its last consumer has fetched it (``consume=True``) or released it; a
  byte budget bounds what is decoded ahead: background decodes wait while the cache is over budget, and
  after ``stall_s`` evict the oldest steps' entries (which then re-decode if still wanted).
- A file that crashes the decoder kills the process; Ray restarts it, and the ``CrashJournal`` (on the
  node's disk) tells the new process which sample did it: that sample becomes a ``decoder_crash`` bad
  sample (skipped and counted, or a named error), never decoded again; samples that were decoding beside
  it are decoded again one at a time.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from titanrl.data.manifest import SampleRecord
from titanrl.data.media import MediaError
from titanrl.data.preprocess import MediaSettings, decode_media
from titanrl.data.shadow.crash_journal import CrashJournal
from titanrl.data.shadow.metadata import classify_media_error

# Fault injection for tests: media file names (comma-separated) whose decode reads address 0 - a
# synchronous SIGSEGV in the decoding thread, as a crash inside FFmpeg is (a signal sent to the process
# with os.kill would be handled by another thread while this one went on decoding).
FAULT_DECODE_CRASH_ENV = "TITANRL_FAULT_DECODE_CRASH"


@dataclass(frozen=True)
class DecodeTask:
    key: str  # unique per (step, position): "step:position:sample_id"
    step: int
    record: SampleRecord
    consumers: int  # ranks that will fetch it in full


@dataclass
class MediaPayload:
    data: Any  # an ObjectRef (full fetch under Ray) or a uint8 array (T, H, W, 3)
    sampled_fps: float
    kind: str
    frame_start: int = 0  # first frame of `data` within the sampled clip


@dataclass
class FetchReply:
    key: str
    media: list[MediaPayload] = field(default_factory=list)
    error_kind: str = ""  # "" when ok
    error_detail: str = ""
    decoded_frames: int = 0  # frames the codec decoded to serve this fetch (0: served from the cache)

    @property
    def ok(self) -> bool:
        return not self.error_kind


QUEUED, DECODING, DONE, FAILED = "queued", "decoding", "done", "failed"

STAT_KEYS = (
    "prefetched",  # tasks queued by prefetch
    "decoded",  # samples decoded (successfully or not)
    "failed",  # samples whose decode failed (bad files)
    "on_demand",  # decoded because a fetch asked for an unknown key (first sight, evicted, restarted)
    "range_decodes",  # of those, frame-range fetches: only the range was decoded, nothing cached
    "stolen",  # queued decodes a waiting fetch ran itself
    "fetched",  # fetch calls served
    "frames",  # frames the codec decoded (a sampled clip decodes up to its last sampled frame)
    "decode_s",  # seconds spent decoding (summed over threads)
    "decoded_bytes",  # uint8 bytes produced
    "evicted_consumed", "evicted_released", "evicted_budget",
)


@dataclass
class _Entry:
    task: DecodeTask
    state: str
    seq: int
    consumers_left: int
    refs: list[Any] = field(default_factory=list)
    fps: list[float] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    nbytes: int = 0
    counted: bool = False  # nbytes is in the cache total
    error_kind: str = ""
    error_detail: str = ""


class PreprocessorCore:
    def __init__(
        self,
        manifest_dir: str,
        settings: MediaSettings,
        num_threads: int = 1,
        cache_bytes: int = 1 << 30,
        stall_s: float = 2.0,
        put: Callable[[Any], Any] | None = None,
        get: Callable[[Any], Any] | None = None,
        journal_path: str | None = None,
    ) -> None:
        self.manifest_dir = Path(manifest_dir)
        self.settings = settings
        self.cache_bytes = cache_bytes
        self.stall_s = stall_s
        self._put = put or (lambda x: x)
        self._get = get or (lambda x: x)
        self._cond = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._queue: collections.deque[str] = collections.deque()
        self._seq = 0
        self._cached_bytes = 0
        self._closed = False
        self.stats: dict[str, float] = collections.defaultdict(float, {k: 0.0 for k in STAT_KEYS})
        self._journal = CrashJournal(journal_path)  # raises when restarts loop without a culprit
        self.stats["restarts"] = self._journal.restarts
        self._active_decodes = 0
        self._exclusive = False  # a suspect of a past crash decodes alone
        self._crash_on = {n for n in os.environ.get(FAULT_DECODE_CRASH_ENV, "").split(",") if n}
        self._threads = [threading.Thread(target=self._worker, name=f"decode-{i}", daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------------------ API

    def ping(self) -> int:
        import os

        return os.getpid()

    def probe(self, nbytes: int) -> np.ndarray:
        """``nbytes`` zeros: a reply as large as a frame slice, to check that a rank can receive one."""
        return np.zeros(nbytes, np.uint8)

    def prefetch(self, tasks: list[DecodeTask]) -> int:
        """Queue decodes; tasks already known are ignored. Returns how many were queued."""
        queued = 0
        with self._cond:
            for task in tasks:
                if task.key in self._entries:
                    continue
                self._entries[task.key] = _Entry(task, QUEUED, self._next_seq(), task.consumers)
                self._queue.append(task.key)
                queued += 1
            self.stats["prefetched"] += queued
            self._cond.notify_all()
        return queued

    def fetch(
        self, task: DecodeTask, frame_ranges: dict[int, tuple[int, int]] | None = None, consume: bool = True
    ) -> FetchReply:
        """A sample's decoded media (all of it, or the given frame range per media index)."""
        with self._cond:
            entry = self._entries.get(task.key)
            decode_here = False
            if entry is None and frame_ranges is not None:  # a slice of a sample nobody holds
                self.stats["on_demand"] += 1
                self.stats["range_decodes"] += 1
                self.stats["fetched"] += 1
            elif entry is None:  # unknown: first sight, evicted, or this actor was restarted
                entry = _Entry(task, DECODING, self._next_seq(), task.consumers)
                self._entries[task.key] = entry
                decode_here = True
                self.stats["on_demand"] += 1
            elif entry.state == QUEUED:  # do not wait behind the queue: decode it in this thread
                entry.state = DECODING
                decode_here = True
                self.stats["stolen"] += 1
        if entry is None:
            return self._decode_ranges(task, frame_ranges)  # type: ignore[arg-type]
        decoded = self._decode(entry) if decode_here else 0
        with self._cond:
            while entry.state == DECODING:
                self._cond.wait(timeout=1.0)
            reply = self._reply(entry, frame_ranges)
            reply.decoded_frames = decoded
            if consume:
                entry.consumers_left -= 1
                if entry.consumers_left <= 0:
                    self._evict(entry, "evicted_consumed")
            self.stats["fetched"] += 1
        return reply

    def release(self, keys: list[str]) -> None:
        """A consumer is done with these samples (whether or not it fetched them)."""
        with self._cond:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    continue
                entry.consumers_left -= 1
                if entry.consumers_left <= 0 and entry.state in (DONE, FAILED, QUEUED):
                    self._evict(entry, "evicted_released")
            self._cond.notify_all()

    def get_stats(self) -> dict[str, float]:
        with self._cond:
            out = dict(self.stats)
            out["cached_bytes"] = self._cached_bytes
            out["entries"] = len(self._entries)
            out["queued"] = sum(1 for e in self._entries.values() if e.state == QUEUED)
        return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._journal.remove()
            self._cond.notify_all()

    # ------------------------------------------------------------------------------ internals

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _evict(self, entry: _Entry, why: str) -> None:
        # Only the table's reference goes: a fetch still holding the entry can reply from it, and the
        # frames leave the object store once the last reference (ours or a consumer's) is gone.
        if self._entries.get(entry.task.key) is entry:
            del self._entries[entry.task.key]
        if entry.counted:
            self._cached_bytes -= entry.nbytes
            entry.counted = False
        self.stats[why] += 1

    def _reply(self, entry: _Entry, frame_ranges: dict[int, tuple[int, int]] | None) -> FetchReply:
        if entry.state == FAILED:
            return FetchReply(entry.task.key, error_kind=entry.error_kind, error_detail=entry.error_detail)
        media = []
        for i, (ref, fps, kind) in enumerate(zip(entry.refs, entry.fps, entry.kinds)):
            if frame_ranges is not None and i in frame_ranges:
                start, stop = frame_ranges[i]
                frames = self._get(ref)
                media.append(MediaPayload(np.ascontiguousarray(frames[start:stop]), fps, kind, start))
            elif frame_ranges is not None:
                continue  # media the caller did not ask for
            else:
                media.append(MediaPayload(ref, fps, kind, 0))
        return FetchReply(entry.task.key, media)

    def _decode_record(
        self, record: SampleRecord, frame_ranges: dict[int, tuple[int, int]] | None
    ) -> tuple[list, str, str, int]:
        """Decode ``record`` (or its frame ranges) under the crash journal: (media, error kind, error
        detail, frames the codec decoded)."""
        media: list = []
        decoded = 0
        error_kind = error_detail = ""
        exclusive = False
        with self._cond:
            verdict = self._journal.verdict(record.id)
            if verdict == "condemned":
                return [], "decoder_crash", self._journal.crash_detail(record.id), 0
            exclusive = verdict == "suspect"
            while self._exclusive or (exclusive and self._active_decodes):
                self._cond.wait(timeout=0.2)
            self._exclusive = exclusive
            self._active_decodes += 1
            self._journal.start(record.id, [str(self.manifest_dir / m.path) for m in record.media])
        try:
            if any(Path(m.path).name in self._crash_on for m in record.media):
                ctypes.string_at(0)  # a NULL read: a real SIGSEGV in this decoding thread, as FFmpeg's would be
            media = decode_media(record, self.manifest_dir, self.settings, frame_ranges)
            decoded = sum(m.decoded_frames for m in media)
        except MediaError as error:
            error_kind, error_detail = classify_media_error(error), str(error)
        except Exception as error:  # a Python-level decoder failure fails this sample, not the actor
            error_kind, error_detail = "corrupt", f"{type(error).__name__}: {error}"
        with self._cond:
            self._journal.finish(record.id)
            self._active_decodes -= 1
            self._exclusive = False if exclusive else self._exclusive
            self.stats["frames"] += decoded
        return media, error_kind, error_detail, decoded

    def _decode_ranges(self, task: DecodeTask, frame_ranges: dict[int, tuple[int, int]]) -> FetchReply:
        """Only the asked frames of a sample nobody cached, by value (not cached: the whole clip's
        consumers, if any, fetch it whole)."""
        t0 = time.perf_counter()
        media, error_kind, error_detail, decoded = self._decode_record(task.record, frame_ranges)
        with self._cond:
            self.stats["decoded"] += 1
            self.stats["failed"] += bool(error_kind)
            self.stats["decode_s"] += time.perf_counter() - t0
            self.stats["decoded_bytes"] += sum(m.frames.nbytes for m in media)
        if error_kind:
            return FetchReply(task.key, error_kind=error_kind, error_detail=error_detail, decoded_frames=decoded)
        payloads = [MediaPayload(m.frames, m.sampled_fps, m.kind, frame_ranges[i][0])
                    for i, m in zip(sorted(frame_ranges), media)]
        return FetchReply(task.key, payloads, decoded_frames=decoded)

    def _decode(self, entry: _Entry) -> int:
        """Decode a whole sample into the cache; returns the frames the codec decoded."""
        t0 = time.perf_counter()
        refs, fps, kinds, nbytes = [], [], [], 0
        media, error_kind, error_detail, decoded = self._decode_record(entry.task.record, None)
        for m in media:
            refs.append(self._put(m.frames))
            fps.append(m.sampled_fps)
            kinds.append(m.kind)
            nbytes += m.frames.nbytes
        with self._cond:
            if error_kind:
                entry.state, entry.error_kind, entry.error_detail = FAILED, error_kind, error_detail
                self.stats["failed"] += 1
            else:
                entry.refs, entry.fps, entry.kinds, entry.nbytes = refs, fps, kinds, nbytes
                entry.state = DONE
                if self._entries.get(entry.task.key) is entry:
                    self._cached_bytes += nbytes
                    entry.counted = True
            if entry.consumers_left <= 0:  # every consumer released it while it decoded
                self._evict(entry, "evicted_released")
            self.stats["decoded"] += 1
            self.stats["decode_s"] += time.perf_counter() - t0
            self.stats["decoded_bytes"] += nbytes
            self._cond.notify_all()
        return decoded

    def _worker(self) -> None:
        while True:
            with self._cond:
                entry = None
                waited = 0.0
                while not self._closed:
                    if self._queue and self._cached_bytes >= self.cache_bytes:
                        if waited >= self.stall_s:
                            self._evict_oldest()
                        else:
                            self._cond.wait(timeout=0.2)
                            waited += 0.2
                            continue
                    if not self._queue:
                        self._cond.wait(timeout=1.0)
                        continue
                    key = self._queue.popleft()
                    candidate = self._entries.get(key)
                    if candidate is not None and candidate.state == QUEUED:
                        candidate.state = DECODING
                        entry = candidate
                        break
                if self._closed:
                    return
            assert entry is not None
            self._decode(entry)

    def _evict_oldest(self) -> None:
        done = [e for e in self._entries.values() if e.state == DONE]
        done.sort(key=lambda e: (e.task.step, e.seq))
        for e in done:
            if self._cached_bytes < self.cache_bytes:
                break
            self._evict(e, "evicted_budget")
