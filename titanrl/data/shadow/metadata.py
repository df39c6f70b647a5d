"""Per-sample metadata from file headers only: sizes, frame counts, grids and token counts.

This is everything a planner (batching, balancing, FlexUlysses sharding) needs to know about a
sample, and nothing more: no pixel is ever decoded here. Header probes (``media.probe_image`` /
``media.probe_video``) cost ~0.03 ms per image and ~0.5 ms per video; their raw results are cached in
``<manifest>.meta.jsonl`` next to the manifest, keyed by each media file's size and mtime, so a second
run stats the files instead of opening them.

What is derived from the probes follows the decode path exactly (the same sampling rule, the same
``sampled_fps`` arithmetic, the same ``smart_resize``), and ``tests/test_shadow.py`` checks that the
grids and prompt ids computed here equal those of ``preprocess.prepare_sample`` on decoded media.

Prompt ids are kept compact: the chat-rendered token ids with one pad per media item, plus the pads'
positions; :attr:`SampleMeta.prompt_ids` expands them on demand. Expanded prompts of long videos are
tens of thousands of tokens, and the planner holds every sample of the dataset.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, Sequence

import numpy as np

from titanrl.data.manifest import SampleRecord, read_manifest
from titanrl.data.media import (
    MediaError,
    VideoInfo,
    is_frame_list,
    num_frames_to_sample,
    probe_image,
    probe_video,
    read_frame_list,
    sample_frame_indices,
)
from titanrl.data.shadow.placeholder import PixelPlaceholder, media_token_offsets, placeholders_for_token_range
from titanrl.data.vision import image_grid_thw, video_grid_thw
from titanrl.models.vision_grid import VisionGrid

if TYPE_CHECKING:
    from titanrl.data.preprocess import MediaSettings
    from titanrl.data.prompt import PromptEncoder

ProblemKind = Literal["missing", "corrupt", "unsupported", "too_long", "decoder_crash"]
PROBLEM_KINDS: tuple[str, ...] = ("missing", "corrupt", "unsupported", "too_long", "decoder_crash")

CACHE_VERSION = 1
CACHE_SUFFIX = ".meta.jsonl"


@dataclass(frozen=True)
class Problem:
    """Why a sample cannot be used; ``kind`` is what gets counted, ``detail`` names the file and cause."""

    kind: ProblemKind
    detail: str


@dataclass(frozen=True)
class HeaderInfo:
    """What a header probe of one media file says (the part that is cached)."""

    kind: Literal["image", "video"]
    width: int
    height: int
    num_frames: int = 1  # 1 for images
    fps: float = 0.0  # native frame rate; 0 for images
    duration: float = 0.0  # seconds; 0 for images
    codec: str = ""  # video codec name; "" for images

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class MediaMeta:
    """One image or video of a sample as the model will see it, computed from its header."""

    kind: Literal["image", "video"]
    path: str  # relative to the manifest's directory
    width: int  # original size
    height: int
    source_frames: int  # frames in the file (1 for an image)
    native_fps: float
    codec: str
    sampled_frames: int  # frames the model sees (1 for an image)
    last_frame_index: int  # the last frame a sequential decoder must reach (decode cost)
    sampled_fps: float  # rate of the sampled clip; 0 for an image
    grid: VisionGrid
    tokens: int  # LLM tokens after patch merging
    file_bytes: int

    @property
    def num_patches(self) -> int:
        return self.grid.num_patches

    @property
    def decode_pixels(self) -> int:
        """Pixels a sequential decoder produces to sample this item: the cost the router balances."""
        return (self.last_frame_index + 1) * self.width * self.height


@dataclass(frozen=True, eq=False)
class SampleMeta:
    """Everything a planner knows about one sample of one epoch. No pixels.

    ``problem`` is set when the headers already show the sample is unusable (missing file, corrupt
    header, unsupported codec, prompt over ``data.max_prompt_tokens``): the sample keeps its place in
    the batch, so every rank plans the same batch, and materializes as a ``BadSample``.
    """

    index: int  # line of the manifest (0-based)
    epoch: int
    record: SampleRecord
    media: tuple[MediaMeta, ...]
    text_ids: np.ndarray  # int64 chat-rendered prompt ids, one pad token per media item (read-only)
    pad_positions: np.ndarray  # int64 index in text_ids of each media item's pad (read-only)
    num_tokens: int  # prompt tokens after every pad is expanded to its media's token count
    patch_dim: int  # features per pixel_values row (3 * temporal_patch * patch**2)
    problem: Problem | None = None

    @property
    def sample_id(self) -> str:
        return self.record.id

    @property
    def key(self) -> tuple[int, int]:
        """(epoch, manifest index): names this use of the sample."""
        return (self.epoch, self.index)

    @property
    def grids(self) -> list[VisionGrid]:
        return [m.grid for m in self.media]

    @property
    def num_patches(self) -> int:
        return sum(m.num_patches for m in self.media)

    @property
    def vision_tokens(self) -> int:
        return sum(m.tokens for m in self.media)

    @property
    def prompt_ids(self) -> np.ndarray:
        """int64 prompt ids with every pad expanded to its media's token count (= PromptEncoder.encode)."""
        repeats = np.ones(len(self.text_ids), dtype=np.int64)
        repeats[self.pad_positions] = [m.tokens for m in self.media]
        return np.repeat(self.text_ids, repeats)

    @property
    def placeholders(self) -> tuple[PixelPlaceholder, ...]:
        """One meta-device placeholder of ``pixel_values`` per media item, in prompt order."""
        return tuple(
            PixelPlaceholder.whole(self.index, self.epoch, self.sample_id, i, m.grid, self.patch_dim)
            for i, m in enumerate(self.media)
        )

    @property
    def token_offsets(self) -> list[int]:
        """Where each media item's vision tokens begin in ``prompt_ids``."""
        return media_token_offsets(self.pad_positions, [m.tokens for m in self.media])

    def placeholders_for_tokens(self, start: int, stop: int) -> list[PixelPlaceholder]:
        """The pixel rows behind prompt tokens [start, stop) (a sequence-parallel shard), per media item."""
        return placeholders_for_token_range(self.placeholders, self.token_offsets, start, stop)

    def with_epoch(self, epoch: int) -> "SampleMeta":
        return dataclasses.replace(self, epoch=epoch)

    def signature(self) -> tuple:
        """A hashable summary, equal on two ranks iff they planned the same sample the same way."""
        return (
            self.index,
            self.epoch,
            self.sample_id,
            tuple((m.path, m.grid, m.tokens) for m in self.media),
            self.text_ids.tobytes(),
            self.problem,
        )


# ------------------------------------------------------------------------------------- problems


def classify_media_error(error: MediaError) -> ProblemKind:
    """Map a MediaError to the kind of bad sample it is (what the skip counters count)."""
    reason = error.reason
    if reason.startswith(("file does not exist", "not a regular file")):
        return "missing"
    if reason.startswith(("container has no video stream", "unsupported")):
        return "unsupported"
    return "corrupt"


def _decoder_supports(codec: str, backend: str) -> bool:
    # PyAV can open a stream whose codec FFmpeg was built without a decoder for; decode would then fail
    # on the worker. decord's bundled FFmpeg (2021) has no AV1 decoder. A frame list's frames are images.
    if codec == "frames":
        return True
    if backend == "decord" and codec in ("av1", "libdav1d", "libaom-av1"):
        return False
    try:
        import av

        av.codec.Codec(codec, "r")
    except Exception:
        return False
    return True


# ------------------------------------------------------------------------------------- probing


def probe_header(path: Path, kind: str) -> HeaderInfo:
    """Header-only probe of one media file; raises MediaError (never decodes pixels)."""
    if kind == "image":
        width, height = probe_image(path)
        return HeaderInfo("image", width, height)
    info = probe_video(path)
    return HeaderInfo("video", info.width, info.height, info.num_frames, info.fps, info.duration, info.codec)


def _stat_key(path: Path) -> tuple[int, int] | None:
    """(bytes, latest mtime) of a media file; of a frame list, over the list and its frames (a frame replaced
    makes its cached header stale)."""
    try:
        st = path.stat()
    except OSError:
        return None
    if not is_frame_list(path):
        return st.st_size, st.st_mtime_ns
    size, mtime = st.st_size, st.st_mtime_ns
    try:
        frames, _ = read_frame_list(path)
    except MediaError:
        return size, mtime  # the probe names what is wrong with it
    for frame in frames:
        try:
            fs = frame.stat()
        except OSError:
            continue  # (the probe names the missing frame)
        size, mtime = size + fs.st_size, max(mtime, fs.st_mtime_ns)
    return size, mtime


def cache_path_for(manifest_path: str | Path) -> Path:
    manifest_path = Path(manifest_path)
    return manifest_path.with_name(manifest_path.stem + CACHE_SUFFIX)


class HeaderCache:
    """``<manifest>.meta.jsonl``: raw header probes keyed by media path, file size and mtime.

    Only probes of files that exist are cached (a missing file is re-checked every run, by one stat),
    and an entry whose size or mtime changed is probed again. Writes are atomic (temp file + rename),
    so ranks that write the same cache at once leave one complete copy.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path  # None: in memory only (never read or saved)
        self.entries: dict[str, dict[str, Any]] = {}
        self.dirty = False
        self.hits = 0
        self.probes = 0
        self._load()

    def _load(self) -> None:
        if self.path is None:
            return
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except OSError:
            return
        if not lines:
            return
        try:
            header = json.loads(lines[0])
            if header.get("titanrl_media_meta") != CACHE_VERSION:
                return
            for line in lines[1:]:
                entry = json.loads(line)
                self.entries[entry["path"]] = entry
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            self.entries = {}  # a damaged cache is rebuilt, never trusted

    def lookup(self, rel_path: str, stat_key: tuple[int, int]) -> dict[str, Any] | None:
        entry = self.entries.get(rel_path)
        if entry is None or (entry["size"], entry["mtime_ns"]) != stat_key:
            return None
        self.hits += 1
        return entry

    def store(self, rel_path: str, stat_key: tuple[int, int], header: HeaderInfo | None, error: MediaError | None):
        entry: dict[str, Any] = {"path": rel_path, "size": stat_key[0], "mtime_ns": stat_key[1]}
        if header is not None:
            entry["header"] = header.to_json()
        else:
            assert error is not None
            entry["error"] = error.reason
        self.entries[rel_path] = entry
        self.dirty = True

    def save(self) -> None:
        if not self.dirty or self.path is None:
            return
        lines = [json.dumps({"titanrl_media_meta": CACHE_VERSION})]
        lines += [json.dumps(self.entries[k], sort_keys=True) for k in sorted(self.entries)]
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError as error:  # a read-only dataset folder: run without a cache
            warnings.warn(f"cannot write the media metadata cache {self.path} ({error}); headers will be re-probed")
            tmp.unlink(missing_ok=True)


def probe_media_file(
    manifest_dir: Path, rel_path: str, kind: str, cache: HeaderCache | None
) -> tuple[HeaderInfo | None, MediaError | None, int]:
    """(header, error, file size) for one media entry, from the cache when the file is unchanged."""
    path = manifest_dir / rel_path
    stat_key = _stat_key(path)
    if stat_key is None:
        error = MediaError(path, "file does not exist")
        return None, error, 0
    if cache is not None:
        entry = cache.lookup(rel_path, stat_key)
        if entry is not None and entry.get("header", {}).get("kind", kind) == kind:
            if "header" in entry:
                return HeaderInfo(**entry["header"]), None, stat_key[0]
            return None, MediaError(path, entry["error"]), stat_key[0]
    header, error = None, None
    try:
        header = probe_header(path, kind)
    except MediaError as e:
        error = e
    if cache is not None:
        cache.probes += 1
        cache.store(rel_path, stat_key, header, error)
    return header, error, stat_key[0]


# ------------------------------------------------------------------------------ derived sizes


def media_meta_from_header(
    rel_path: str, header: HeaderInfo, file_bytes: int, settings: "MediaSettings"
) -> MediaMeta:
    """Sampling, grid and tokens for one media item, by the same rules as the decode path."""
    common = dict(patch_size=settings.patch_size, merge_size=settings.merge_size)
    if header.kind == "image":
        t, h, w = image_grid_thw(
            header.height, header.width, min_pixels=settings.image_min_pixels,
            max_pixels=settings.image_max_pixels, **common,
        )
        grid = VisionGrid(t, h, w)
        return MediaMeta(
            "image", rel_path, header.width, header.height, 1, 0.0, header.codec, 1, 0, 0.0,
            grid, grid.num_tokens(settings.merge_size), file_bytes,
        )
    count = num_frames_to_sample(header.num_frames, header.fps, fps=settings.fps, max_frames=settings.max_frames)
    last = int(sample_frame_indices(header.num_frames, count)[-1])
    # The same arithmetic as load_video's VideoInfo.sampled_fps() and media_to_patches: the model's
    # time axis (second_per_grid) must equal what decoding gives, bit for bit.
    info = VideoInfo(header.num_frames, header.fps, header.duration, header.width, header.height, header.codec,
                     sampled_indices=tuple(range(count)))
    sampled_fps = info.sampled_fps()
    t, h, w = video_grid_thw(
        count, header.height, header.width, temporal_patch_size=settings.temporal_patch_size,
        min_pixels=settings.video_min_pixels, max_pixels=settings.video_max_pixels,
        cap_pixels_per_frame=settings.cap_pixels_per_frame, max_video_tokens=settings.max_video_tokens, **common,
    )
    second_per_grid = settings.temporal_patch_size / sampled_fps if sampled_fps > 0 else 1.0
    grid = VisionGrid(t, h, w, is_video=True, second_per_grid=second_per_grid)
    return MediaMeta(
        "video", rel_path, header.width, header.height, header.num_frames, header.fps, header.codec, count,
        last, sampled_fps, grid, grid.num_tokens(settings.merge_size), file_bytes,
    )


# ------------------------------------------------------------------------------------- the table


@dataclass
class MetadataStats:
    samples: int = 0
    media: int = 0
    cache_hits: int = 0
    probes: int = 0
    problems: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclass
class MetadataTable:
    """Metadata of every manifest sample (epoch 0), in manifest order."""

    manifest_path: Path
    metas: list[SampleMeta]
    stats: MetadataStats

    def __len__(self) -> int:
        return len(self.metas)

    def get(self, index: int, epoch: int) -> SampleMeta:
        meta = self.metas[index]
        return meta if epoch == meta.epoch else meta.with_epoch(epoch)

    def nbytes(self) -> int:
        """Rough in-memory size of the arrays the table holds (the bulk of it besides records)."""
        return sum(m.text_ids.nbytes + m.pad_positions.nbytes for m in self.metas)


def _readonly(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def build_sample_meta(
    index: int,
    record: SampleRecord,
    manifest_dir: Path,
    settings: "MediaSettings",
    encoder: "PromptEncoder",
    max_prompt_tokens: int | None,
    cache: HeaderCache | None,
) -> SampleMeta:
    """Probe one sample's media headers and compute its grids, tokens and prompt ids."""
    text = encoder.render(record.prompt, record.system, record.history)
    text_ids = np.asarray(encoder.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    pad_positions = np.flatnonzero((text_ids == encoder.image_token_id) | (text_ids == encoder.video_token_id))
    patch_dim = 3 * settings.temporal_patch_size * settings.patch_size**2
    media: list[MediaMeta] = []
    problem: Problem | None = None
    for entry in record.media:
        header, error, size = probe_media_file(manifest_dir, entry.path, entry.kind, cache)
        if error is not None:
            problem = Problem(classify_media_error(error), str(error))
            break
        assert header is not None
        if header.kind == "video" and not _decoder_supports(header.codec, settings.video_backend):
            problem = Problem(
                "unsupported", f"{manifest_dir / entry.path}: codec {header.codec!r} cannot be decoded by "
                f"the {settings.video_backend} backend")
            break
        try:
            media.append(media_meta_from_header(entry.path, header, size, settings))
        except ValueError as e:  # e.g. smart_resize's aspect-ratio limit
            problem = Problem("unsupported", f"{manifest_dir / entry.path}: {e}")
            break
    if problem is None and len(pad_positions) != len(record.media):
        problem = Problem("unsupported", f"rendered prompt has {len(pad_positions)} media pads for "
                          f"{len(record.media)} media items")
    if problem is not None:
        media = []
        pad_positions = np.zeros(0, dtype=np.int64)
    num_tokens = len(text_ids) + sum(m.tokens - 1 for m in media)
    if problem is None and max_prompt_tokens is not None and num_tokens > max_prompt_tokens:
        problem = Problem("too_long", f"prompt has {num_tokens} tokens > data.max_prompt_tokens={max_prompt_tokens}")
    return SampleMeta(
        index=index, epoch=0, record=record, media=tuple(media), text_ids=_readonly(text_ids),
        pad_positions=_readonly(np.asarray(pad_positions, dtype=np.int64)), num_tokens=num_tokens,
        patch_dim=patch_dim, problem=problem,
    )


def load_metadata(
    manifest_path: str | Path,
    settings: "MediaSettings",
    encoder: "PromptEncoder",
    *,
    max_prompt_tokens: int | None = None,
    use_cache: bool = True,
    records: Sequence[SampleRecord] | None = None,
) -> MetadataTable:
    """Metadata of every sample of a manifest, from header probes (cached next to the manifest)."""
    manifest_path = Path(manifest_path)
    manifest_dir = manifest_path.parent
    if records is None:
        records = read_manifest(manifest_path)
    cache = HeaderCache(cache_path_for(manifest_path)) if use_cache else None
    metas = [
        build_sample_meta(i, r, manifest_dir, settings, encoder, max_prompt_tokens, cache)
        for i, r in enumerate(records)
    ]
    stats = MetadataStats(samples=len(metas), media=sum(len(r.media) for r in records))
    for m in metas:
        if m.problem is not None:
            stats.problems[m.problem.kind] = stats.problems.get(m.problem.kind, 0) + 1
    if cache is not None:
        cache.save()
        stats.cache_hits, stats.probes = cache.hits, cache.probes
    else:
        stats.probes = stats.media
    return MetadataTable(manifest_path, metas, stats)


def metas_for(table: MetadataTable, keys: Iterable[tuple[int, int]]) -> list[SampleMeta]:
    """SampleMeta of each (epoch, index) key."""
    return [table.get(index, epoch) for epoch, index in keys]
