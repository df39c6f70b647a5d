"""Decode and preprocess the media of one manifest sample into model inputs.

Split in two steps so a loader can run them in different places: ``decode_media`` (files ->
uint8 frames, the expensive part, done by worker-side preprocessors) and ``media_to_patches``
(frames -> patch rows + grid). The pixel limits come from the checkpoint's processor config,
the same values vLLM applies, unless the run's config overrides them for both sides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from titanrl.data.manifest import SampleRecord
from titanrl.data.media import load_image, load_video
from titanrl.data.prompt import PromptEncoder
from titanrl.data.vision import preprocess_image, preprocess_video
from titanrl.models.vision_grid import VisionGrid


@dataclass(frozen=True)
class MediaSettings:
    image_min_pixels: int
    image_max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    fps: float
    max_frames: int
    video_backend: Literal["pyav", "decord"] = "pyav"
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    temporal_patch_size: int = 2
    patch_size: int = 14
    merge_size: int = 2

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str | Path,
        *,
        fps: float,
        max_frames: int,
        video_backend: Literal["pyav", "decord"] = "pyav",
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> "MediaSettings":
        model_dir = Path(model_dir)
        image_cfg = _read_json(model_dir / "preprocessor_config.json")
        video_cfg = _read_json(model_dir / "video_preprocessor_config.json") or image_cfg
        return cls(
            image_min_pixels=min_pixels if min_pixels is not None else image_cfg.get("min_pixels", 56 * 56),
            image_max_pixels=max_pixels if max_pixels is not None else image_cfg.get("max_pixels", 28 * 28 * 1280),
            video_min_pixels=min_pixels if min_pixels is not None else video_cfg.get("min_pixels", 128 * 28 * 28),
            video_max_pixels=max_pixels if max_pixels is not None else video_cfg.get("max_pixels", 28 * 28 * 768),
            fps=fps,
            max_frames=max_frames,
            video_backend=video_backend,
            cap_pixels_per_frame=bool(video_cfg.get("cap_pixels_per_frame", False)),
            max_video_tokens=int(video_cfg.get("max_video_tokens", 128000)),
            temporal_patch_size=image_cfg.get("temporal_patch_size", 2),
            patch_size=image_cfg.get("patch_size", 14),
            merge_size=image_cfg.get("merge_size", 2),
        )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass
class DecodedMedia:
    """uint8 frames of one media item: (1, H, W, 3) for an image, (T, H, W, 3) for a video."""

    kind: Literal["image", "video"]
    frames: np.ndarray
    sampled_fps: float = 0.0
    decoded_frames: int = 0  # frames the codec decoded to produce these (an image counts 1)


@dataclass
class PreparedSample:
    """Everything the trainer needs of one prompt; ``pixel_values`` rows follow ``grids``."""

    record: SampleRecord
    prompt_ids: np.ndarray  # int64, placeholders expanded
    grids: list[VisionGrid]
    pixel_values: np.ndarray | None  # float32 [sum of grid patches, patch_dim]
    media: list[DecodedMedia]


def decode_media(record: SampleRecord, manifest_dir: str | Path, settings: MediaSettings,
                 frame_ranges: dict[int, tuple[int, int]] | None = None) -> list[DecodedMedia]:
    """Every media item of ``record``, or with ``frame_ranges`` only the items it names, each only the
    sampled frames ``[start, stop)`` (a video is decoded by seeking, not decoded whole and sliced)."""
    out = []
    for i, entry in enumerate(record.media):
        if frame_ranges is not None and i not in frame_ranges:
            continue
        path = Path(manifest_dir) / entry.path
        if entry.kind == "image":
            out.append(DecodedMedia("image", load_image(path)[None], decoded_frames=1))
        else:
            frames, info = load_video(
                path, fps=settings.fps, max_frames=settings.max_frames, backend=settings.video_backend,
                frame_range=None if frame_ranges is None else frame_ranges[i],
            )
            out.append(DecodedMedia("video", frames, info.sampled_fps(), info.decoded_frames))
    return out


def media_to_patches(media: DecodedMedia, settings: MediaSettings) -> tuple[np.ndarray, VisionGrid]:
    common = dict(patch_size=settings.patch_size, temporal_patch_size=settings.temporal_patch_size,
                  merge_size=settings.merge_size)
    if media.kind == "image":
        pixels, grid = preprocess_image(
            media.frames[0], min_pixels=settings.image_min_pixels, max_pixels=settings.image_max_pixels, **common
        )
        t, h, w = (int(x) for x in np.asarray(grid).reshape(-1))
        return pixels, VisionGrid(t, h, w)
    pixels, grid = preprocess_video(
        media.frames,
        min_pixels=settings.video_min_pixels,
        max_pixels=settings.video_max_pixels,
        cap_pixels_per_frame=settings.cap_pixels_per_frame,
        max_video_tokens=settings.max_video_tokens,
        **common,
    )
    t, h, w = (int(x) for x in np.asarray(grid).reshape(-1))
    # One temporal patch spans temporal_patch_size sampled frames.
    second_per_grid = settings.temporal_patch_size / media.sampled_fps if media.sampled_fps > 0 else 1.0
    return pixels, VisionGrid(t, h, w, is_video=True, second_per_grid=second_per_grid)


def prepare_sample(
    record: SampleRecord, manifest_dir: str | Path, encoder: PromptEncoder, settings: MediaSettings
) -> PreparedSample:
    media = decode_media(record, manifest_dir, settings)
    patches = [media_to_patches(m, settings) for m in media]
    grids = [g for _, g in patches]
    pixel_values = np.concatenate([p for p, _ in patches]).astype(np.float32) if patches else None
    ids = encoder.encode(record.prompt, grids, record.system, record.history)
    return PreparedSample(record, ids, grids, pixel_values, media)
