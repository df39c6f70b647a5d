"""Decoding images and videos into uint8 RGB arrays, and header-only probes of their sizes.

The probes read only container/file headers (Pillow's lazy open; PyAV stream metadata), so a planner can
learn every sample's size in well under a millisecond per file without decoding pixels.

Every failure to read a file (missing, unreadable, corrupt, truncated) raises :class:`MediaError`, which
names the path: a bare PyAV/Pillow traceback from deep inside a data-loader worker says neither which
sample failed nor why.

decord is optional: it is imported only when ``backend="decord"`` is asked for.

A video may also be a list of frames (image files, as many datasets ship a video): a *frame list* file
(``*.frames.json``: ``{"frames": [paths, absolute or relative to the file], "fps": rate}``) stands for it. It is
probed (every frame's header: one size for all) and loaded through the same two functions as a video file, its
frames sampled by the same rule, each decoded like an image. ``fps`` is the rate the frames were taken at
(default 2.0, qwen-vl-utils' assumption for a frame list).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal

import numpy as np

VideoBackend = Literal["pyav", "decord"]

# Qwen2.5-VL's vision tower patches video in pairs of frames (temporal_patch_size=2); sampling an even
# number of frames avoids the processor padding the last pair with a duplicated frame.
TEMPORAL_PATCH_SIZE = 2
FRAME_LIST_SUFFIX = ".frames.json"
FRAME_LIST_FPS = 2.0  # the rate of a frame list that names none (qwen-vl-utils' default for one)


class MediaError(Exception):
    """A media file that cannot be read. ``str(error)`` is ``"<path>: <reason>"``."""

    def __init__(self, path: str | Path, reason: str) -> None:
        # args = (path, reason) keeps the exception picklable across process-based loader workers.
        super().__init__(str(path), reason)
        self.path = str(path)
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True)
class VideoInfo:
    """Header metadata of a video's first video stream.

    ``sampled_indices`` is empty from :func:`probe_video`; :func:`load_video` fills it with the indices of
    the frames it returned, which the model needs for its time axis (see :meth:`sampled_fps`).
    """

    num_frames: int
    fps: float
    duration: float  # seconds
    width: int
    height: int
    codec: str
    sampled_indices: tuple[int, ...] = ()
    decoded_frames: int = 0  # frames the codec decoded for load_video (a range may need a lead-in)

    def sampled_fps(self) -> float:
        """Frames per second of the sampled clip (frames returned / source duration)."""
        if not self.sampled_indices or self.duration <= 0:
            return self.fps
        return len(self.sampled_indices) / self.duration


def _require_file(path: Path) -> None:
    if not path.exists():
        raise MediaError(path, "file does not exist")
    if not path.is_file():
        raise MediaError(path, "not a regular file")


# ---------------------------------------------------------------------------------------------- images


def probe_image(path: str | Path) -> tuple[int, int]:
    """(width, height) from the image header, without decoding pixels."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    _require_file(path)
    try:
        with Image.open(path) as image:  # lazy: reads the header only
            return image.size
    except UnidentifiedImageError:
        raise MediaError(path, "not a recognised image format (corrupt header?)") from None
    except (OSError, SyntaxError, ValueError) as error:
        raise MediaError(path, f"cannot read image header ({error})") from None


def load_image(path: str | Path) -> np.ndarray:
    """Decode an image to an (H, W, 3) uint8 RGB array (alpha and palettes are converted away)."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    _require_file(path)
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB")  # forces a full decode: truncation surfaces here
            return np.array(rgb, dtype=np.uint8)
    except UnidentifiedImageError:
        raise MediaError(path, "not a recognised image format (corrupt header?)") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise MediaError(path, f"cannot decode image ({error})") from None


# ---------------------------------------------------------------------------------------------- videos


def num_frames_to_sample(
    total_frames: int, native_fps: float, *, fps: float | None = None, max_frames: int | None = None
) -> int:
    """How many frames to sample from a video of `total_frames` frames at `native_fps`.

    `fps` (None: keep the native rate) sets the target rate, `max_frames` caps the count, and the
    result is rounded down to an even number (at least 2 when the video has 2 frames) so that frames
    pair up into Qwen2.5-VL's temporal patches.
    """
    if total_frames <= 0:
        raise ValueError(f"total_frames must be positive, got {total_frames}")
    if max_frames is not None and max_frames < TEMPORAL_PATCH_SIZE:
        raise ValueError(f"max_frames must be at least {TEMPORAL_PATCH_SIZE}, got {max_frames}")
    if fps is not None and fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    target = float(total_frames)
    if fps is not None and native_fps > 0:
        target = total_frames / native_fps * fps
    if max_frames is not None:
        target = min(target, max_frames)
    target = min(target, total_frames)
    count = math.floor(target / TEMPORAL_PATCH_SIZE) * TEMPORAL_PATCH_SIZE
    return max(count, min(TEMPORAL_PATCH_SIZE, total_frames))


def sample_frame_indices(total_frames: int, num_samples: int) -> np.ndarray:
    """Uniform-in-time frame indices: the frame under the centre of each of `num_samples` equal slices.

    Integer arithmetic, so the same indices come out on every machine; strictly increasing whenever
    ``num_samples <= total_frames``, and the identity when they are equal.
    """
    if not 0 < num_samples <= total_frames:
        raise ValueError(f"need 0 < num_samples <= total_frames, got {num_samples} and {total_frames}")
    slots = np.arange(num_samples, dtype=np.int64)
    return ((2 * slots + 1) * total_frames) // (2 * num_samples)


def _as_float(rate: Fraction | float | None) -> float:
    return float(rate) if rate else 0.0


def _open_container(path: Path):
    import av

    try:
        return av.open(str(path), mode="r")
    except av.error.FFmpegError as error:
        raise MediaError(path, f"cannot open video container ({error.strerror or error})") from None


def _count_video_packets(container, stream) -> int:
    # Containers such as mkv/webm store no frame count. Demuxing reads packets without decoding them,
    # and one video packet carries one displayed frame for h264/hevc/vp9/av1.
    count = 0
    for packet in container.demux(stream):
        if packet.size > 0:
            count += 1
    return count


# -------------------------------------------------------------------------------------- frame lists


def is_frame_list(path: str | Path) -> bool:
    """Whether ``path`` names a frame list (a video given as image files) rather than a video file."""
    return str(path).endswith(FRAME_LIST_SUFFIX)


def write_frame_list(path: str | Path, frames: list[str | Path], fps: float | None = None) -> Path:
    """A frame list file for ``frames`` (image paths, in display order) taken at ``fps`` frames per second."""
    path = Path(path)
    if not is_frame_list(path):
        raise ValueError(f"{path}: a frame list's name ends in {FRAME_LIST_SUFFIX!r}")
    rate = FRAME_LIST_FPS if fps is None else float(fps)
    if not frames or not rate > 0:
        raise ValueError(f"{path}: a frame list needs at least one frame and a positive fps, got {len(frames)} "
                         f"frame(s) at {rate}")
    path.write_text(json.dumps({"frames": [str(f) for f in frames], "fps": rate}) + "\n")
    return path


def read_frame_list(path: str | Path) -> tuple[list[Path], float]:
    """The frames (absolute paths) and rate of a frame list file; MediaError naming the file and key if malformed."""
    path = Path(path)
    _require_file(path)
    try:
        spec = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MediaError(path, f"not a readable frame list ({error})") from None
    frames = spec.get("frames") if isinstance(spec, dict) else None
    if not isinstance(frames, list) or not frames or not all(isinstance(f, str) and f for f in frames):
        raise MediaError(path, "key 'frames' must be a non-empty list of image paths")
    fps = spec.get("fps", FRAME_LIST_FPS)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise MediaError(path, f"key 'fps' must be a positive number, got {fps!r}")
    return [f if f.is_absolute() else path.parent / f for f in map(Path, frames)], float(fps)


def _probe_frame_list(path: Path) -> VideoInfo:
    frames, fps = read_frame_list(path)
    sizes = []
    for i, frame in enumerate(frames):
        try:
            sizes.append(probe_image(frame))
        except MediaError as error:
            raise MediaError(path, f"frame {i} ({frame}): {error.reason}") from None
        if sizes[-1] != sizes[0]:
            raise MediaError(path, f"frame {i} ({frame}) is {sizes[-1][0]}x{sizes[-1][1]}, frame 0 "
                                   f"{sizes[0][0]}x{sizes[0][1]}: a video's frames share one size")
    width, height = sizes[0]
    return VideoInfo(num_frames=len(frames), fps=fps, duration=len(frames) / fps, width=width, height=height,
                     codec="frames")


def _decode_frame_list(path: Path, indices: np.ndarray) -> tuple[np.ndarray, int]:
    frames, _ = read_frame_list(path)
    out = []
    for i in indices:
        try:
            out.append(load_image(frames[int(i)]))
        except MediaError as error:
            raise MediaError(path, f"frame {int(i)} ({frames[int(i)]}): {error.reason}") from None
        if out[-1].shape != out[0].shape:
            raise MediaError(path, f"frame {int(i)} ({frames[int(i)]}) decodes to {out[-1].shape[1]}x"
                                   f"{out[-1].shape[0]}, not {out[0].shape[1]}x{out[0].shape[0]}")
    return np.stack(out), len(out)


def probe_video(path: str | Path) -> VideoInfo:
    """Metadata of the first video stream, from container/stream headers (no frame is decoded); of a frame list,
    from its frames' image headers."""
    import av

    path = Path(path)
    if is_frame_list(path):
        return _probe_frame_list(path)
    _require_file(path)
    container = _open_container(path)
    try:
        if not container.streams.video:
            raise MediaError(path, "container has no video stream")
        stream = container.streams.video[0]
        fps = _as_float(stream.average_rate) or _as_float(stream.guessed_rate) or _as_float(stream.base_rate)
        if stream.duration is not None and stream.time_base is not None:
            duration = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            duration = container.duration / av.time_base
        else:
            duration = 0.0
        num_frames = stream.frames
        if num_frames <= 0:
            num_frames = _count_video_packets(container, stream)
        if duration <= 0 and fps > 0:
            duration = num_frames / fps
        if fps <= 0 and duration > 0:
            fps = num_frames / duration
        codec_context = stream.codec_context
        if num_frames <= 0:
            raise MediaError(path, "video stream has no frames")
        return VideoInfo(
            num_frames=int(num_frames),
            fps=fps,
            duration=duration,
            width=int(codec_context.width),
            height=int(codec_context.height),
            codec=str(codec_context.name),
        )
    except av.error.FFmpegError as error:
        raise MediaError(path, f"cannot read video headers ({error.strerror or error})") from None
    finally:
        container.close()


def _presentation_pts(container, stream) -> tuple[list[int], list[int]] | None:
    """Every frame's presentation timestamp in display order and the keyframes' ones, from packets
    alone (no decoding); None when the container does not give them all."""
    packets = [(packet.pts, packet.is_keyframe) for packet in container.demux(stream) if packet.size > 0]
    if not packets or any(p is None for p, _ in packets):
        return None
    return sorted(p for p, _ in packets), sorted(p for p, key in packets if key)


def _decode_pyav(path: Path, indices: np.ndarray, seek: bool = False) -> tuple[np.ndarray, int]:
    """Frames at source ``indices`` (increasing) and how many frames the codec decoded for them.

    With ``seek``, when a keyframe after the stream's first lies at or before the first wanted frame,
    the demuxer seeks to the last such keyframe (frames are then mapped to indices by presentation
    timestamp), so a range late in a long clip costs its own frames plus the lead-in from the
    previous keyframe, not the whole clip before it. Without, decoding starts at the first frame
    (what a whole clip needs anyway; finding keyframes costs a pass over the packets)."""
    import av

    wanted = {int(i): slot for slot, i in enumerate(indices)}
    first_wanted, last_wanted = int(indices[0]), int(indices[-1])
    frames: list[np.ndarray | None] = [None] * len(indices)
    decoded = 0  # frames the codec produced
    index_of: dict[int, int] | None = None  # pts -> source index, after a seek
    reached = -1  # highest source index seen
    container = _open_container(path)
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # frame/slice threads; PyAV releases the GIL while decoding
        if seek and first_wanted > 0:
            found = _presentation_pts(container, stream)
            if found is not None and first_wanted < len(found[0]):
                pts, keys = found
                if any(pts[0] < k <= pts[first_wanted] for k in keys):
                    index_of = {p: i for i, p in enumerate(pts)}
                    container.seek(pts[first_wanted], stream=stream, backward=True, any_frame=False)
                else:  # no keyframe to skip to: decode from the start, without a seek
                    container.seek(pts[0], stream=stream, backward=True, any_frame=False)
        for frame in container.decode(stream):
            if index_of is None:
                index = decoded
            else:
                index = index_of.get(frame.pts, -1) if frame.pts is not None else -1
                if index < 0:
                    raise MediaError(path, f"decoded a frame with unknown timestamp {frame.pts} after seeking")
            decoded += 1
            slot = wanted.get(index)
            if slot is not None:
                frames[slot] = frame.to_ndarray(format="rgb24")
            reached = max(reached, index)
            if reached >= last_wanted:
                break  # later frames are not needed: stop decoding early
    except av.error.FFmpegError as error:
        raise MediaError(path, f"cannot decode video ({error.strerror or error})") from None
    finally:
        container.close()
    missing = [int(i) for i, f in zip(indices, frames) if f is None]
    if missing:
        raise MediaError(
            path, f"decoded {decoded} frames but not frame {missing[0]} (truncated or corrupt stream?)"
        )
    return np.stack(frames), decoded  # type: ignore[arg-type]


def _decode_decord(path: Path, indices: np.ndarray) -> tuple[np.ndarray, int]:
    try:
        import decord
    except ImportError:
        raise ImportError(
            "backend='decord' needs the optional 'decord' package (pip install 'titanrl[decord]')"
        ) from None
    try:
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)
        if len(reader) <= int(indices[-1]):
            raise MediaError(path, f"decord sees {len(reader)} frames but frame {int(indices[-1])} is needed")
        return reader.get_batch([int(i) for i in indices]).asnumpy(), len(indices)  # decord seeks by itself
    except MediaError:
        raise
    except Exception as error:  # decord raises its own DECORDError / RuntimeError types
        raise MediaError(path, f"decord cannot decode video ({error})") from None


def load_video(
    path: str | Path,
    *,
    fps: float | None = None,
    max_frames: int | None = None,
    backend: VideoBackend = "pyav",
    frame_range: tuple[int, int] | None = None,
) -> tuple[np.ndarray, VideoInfo]:
    """Decode uniformly sampled frames: a (T, H, W, 3) uint8 RGB array and the video's header info.

    T is chosen by :func:`num_frames_to_sample` (target `fps`, capped by `max_frames`, even) and the
    frames by :func:`sample_frame_indices`; the returned info's ``sampled_indices`` lists them (all of
    them, also for a range) and ``decoded_frames`` counts what the codec decoded. ``frame_range``
    ``(start, stop)`` returns only sampled frames ``[start, stop)``, decoded by seeking to the keyframe
    before the first (PyAV) instead of decoding the clip and slicing it.
    """
    path = Path(path)
    info = probe_video(path)
    count = num_frames_to_sample(info.num_frames, info.fps, fps=fps, max_frames=max_frames)
    indices = sample_frame_indices(info.num_frames, count)
    wanted = indices
    if frame_range is not None:
        start, stop = frame_range
        if not 0 <= start < stop <= count:
            raise ValueError(f"{path}: frame range [{start}, {stop}) outside the {count} sampled frames")
        wanted = indices[start:stop]
    if info.codec == "frames" and is_frame_list(path):  # each sampled frame decoded alone, whatever the backend
        frames, decoded = _decode_frame_list(path, wanted)
    elif backend == "pyav":
        frames, decoded = _decode_pyav(path, wanted, seek=frame_range is not None)
    elif backend == "decord":
        frames, decoded = _decode_decord(path, wanted)
    else:
        raise ValueError(f"unknown video backend {backend!r}; expected 'pyav' or 'decord'")
    return frames, dataclasses.replace(info, sampled_indices=tuple(int(i) for i in indices), decoded_frames=decoded)
