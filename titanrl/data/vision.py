"""Qwen2-VL / Qwen2.5-VL vision preprocessing: resize, normalise and cut into merged patch order.

Our own implementation of the rule transformers' Qwen2-VL processors apply (Qwen2.5-VL reuses them), so
that pixels we prepare in data-loader workers give the model exactly what the reference processors and
vLLM (which calls them) would give it. Two resize paths, chosen by ``resample``:

- ``"torch"`` (default): ``torch.nn.functional.interpolate(uint8, mode="bicubic", antialias=True)``,
  which is what torchvision's resize runs for uint8 tensors on CPU. Matches
  ``Qwen2VLImageProcessor`` (the default, torchvision-backed image processor of transformers 5) and
  ``Qwen2VLVideoProcessor`` bit for bit on CPU (max abs difference 0.0; see
  tests/test_vision_preprocess.py).
- ``"pil"``: Pillow's bicubic resize, then float64 rescale and float32 normalise. Matches
  ``Qwen2VLImageProcessorPil`` (the slow PIL/numpy processor) bit for bit.

The two paths differ from each other by up to one uint8 level after resizing (~0.015 after
normalisation, more on noise), which is why the choice is explicit.

Patch layout (both paths): rows are patches in merge order -- for each temporal group, each
``merge_size x merge_size`` block of patches row-major, the patches inside the block row-major -- and
each row is ``C x temporal_patch_size x patch_size x patch_size`` flattened. A single image is
repeated ``temporal_patch_size`` times along time (grid_t = 1); a video with an odd frame count gets
its last frame repeated.

The token counts (:func:`vision_tokens_for_image`, :func:`vision_tokens_for_video`) need sizes only,
so planners can cost a sample from header probes without touching pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F

Resample = Literal["torch", "pil"]

OPENAI_CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
RESCALE_FACTOR = 1 / 255

# transformers' processor defaults (what a plain Qwen2VL*Processor() uses).
IMAGE_MIN_PIXELS = 56 * 56
IMAGE_MAX_PIXELS = 28 * 28 * 1280
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 28 * 28 * 768
# qwen-vl-utils' total-video budget, used only with cap_pixels_per_frame=True.
MAX_VIDEO_TOKENS = 128000


@dataclass(frozen=True)
class PixelLimits:
    """Per-image and per-frame pixel bounds for smart_resize."""

    image_min_pixels: int
    image_max_pixels: int
    video_min_pixels: int
    video_max_pixels: int


# The tiny (CPU) configuration: media of 56..224 px keep their size instead of being blown up to
# transformers' video minimum of 128*28*28 pixels per frame, which would erase the length skew.
TINY_PIXEL_LIMITS = PixelLimits(
    image_min_pixels=56 * 56, image_max_pixels=224 * 224, video_min_pixels=56 * 56, video_max_pixels=112 * 112
)
# The paper-scale configuration: transformers' processor defaults.
PAPER_PIXEL_LIMITS = PixelLimits(
    image_min_pixels=IMAGE_MIN_PIXELS,
    image_max_pixels=IMAGE_MAX_PIXELS,
    video_min_pixels=VIDEO_MIN_PIXELS,
    video_max_pixels=VIDEO_MAX_PIXELS,
)
PIXEL_LIMITS_BY_SCALE: dict[str, PixelLimits] = {"tiny": TINY_PIXEL_LIMITS, "paper": PAPER_PIXEL_LIMITS}


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = IMAGE_MIN_PIXELS,
    max_pixels: int = IMAGE_MAX_PIXELS,
) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of `factor`, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible. Returns (height, width)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > 200:
        aspect = max(height, width) / min(height, width)
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {aspect}")
    # Python's round() (banker's rounding) is part of the rule: 42/28 = 1.5 rounds to 2, 70/28 = 2.5 to 2.
    resized_h = round(height / factor) * factor
    resized_w = round(width / factor) * factor
    if resized_h * resized_w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        resized_h = max(factor, math.floor(height / beta / factor) * factor)
        resized_w = max(factor, math.floor(width / beta / factor) * factor)
    elif resized_h * resized_w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        resized_h = math.ceil(height * beta / factor) * factor
        resized_w = math.ceil(width * beta / factor) * factor
    return resized_h, resized_w


def _video_max_pixels(
    num_frames: int,
    min_pixels: int,
    max_pixels: int,
    factor: int,
    temporal_patch_size: int,
    cap_pixels_per_frame: bool,
    max_video_tokens: int,
) -> int:
    # qwen-vl-utils bounds the whole video: each frame gets an even share of a total pixel budget
    # (90% of max_video_tokens tokens), but never less than 1.05 * min_pixels.
    if not cap_pixels_per_frame:
        return max_pixels
    total_pixels = int(max_video_tokens * factor * factor * 0.9)
    return max(min(max_pixels, total_pixels * temporal_patch_size // num_frames), int(min_pixels * 1.05))


# ----------------------------------------------------------------------------------- sizes only


def image_grid_thw(
    height: int,
    width: int,
    *,
    patch_size: int = 14,
    merge_size: int = 2,
    min_pixels: int = IMAGE_MIN_PIXELS,
    max_pixels: int = IMAGE_MAX_PIXELS,
) -> tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) in patches for one image of height x width pixels."""
    resized_h, resized_w = smart_resize(height, width, patch_size * merge_size, min_pixels, max_pixels)
    return 1, resized_h // patch_size, resized_w // patch_size


def video_grid_thw(
    num_frames: int,
    height: int,
    width: int,
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    min_pixels: int = VIDEO_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
    cap_pixels_per_frame: bool = False,
    max_video_tokens: int = MAX_VIDEO_TOKENS,
) -> tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) in patches for `num_frames` frames (as fed, i.e. already sampled)."""
    if num_frames <= 0:
        raise ValueError(f"num_frames must be positive, got {num_frames}")
    factor = patch_size * merge_size
    frame_max_pixels = _video_max_pixels(
        num_frames, min_pixels, max_pixels, factor, temporal_patch_size, cap_pixels_per_frame, max_video_tokens
    )
    resized_h, resized_w = smart_resize(height, width, factor, min_pixels, frame_max_pixels)
    grid_t = -(-num_frames // temporal_patch_size)  # an odd last frame is padded, not dropped
    return grid_t, resized_h // patch_size, resized_w // patch_size


def vision_tokens_for_image(
    height: int,
    width: int,
    *,
    patch_size: int = 14,
    merge_size: int = 2,
    min_pixels: int = IMAGE_MIN_PIXELS,
    max_pixels: int = IMAGE_MAX_PIXELS,
) -> int:
    """LLM tokens (``<|image_pad|>`` count) for one image: patches / merge_size**2."""
    t, h, w = image_grid_thw(
        height, width, patch_size=patch_size, merge_size=merge_size, min_pixels=min_pixels, max_pixels=max_pixels
    )
    return t * h * w // merge_size**2


def vision_tokens_for_video(
    num_frames: int,
    height: int,
    width: int,
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    min_pixels: int = VIDEO_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
    cap_pixels_per_frame: bool = False,
    max_video_tokens: int = MAX_VIDEO_TOKENS,
) -> int:
    """LLM tokens (``<|video_pad|>`` count) for `num_frames` sampled frames: patches / merge_size**2."""
    t, h, w = video_grid_thw(
        num_frames,
        height,
        width,
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=merge_size,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        cap_pixels_per_frame=cap_pixels_per_frame,
        max_video_tokens=max_video_tokens,
    )
    return t * h * w // merge_size**2


# ----------------------------------------------------------------------------------- pixels


def _check_frames(frames: np.ndarray, what: str) -> None:
    if frames.dtype != np.uint8:
        raise ValueError(f"{what} must be uint8, got {frames.dtype}")
    if frames.shape[-1] != 3:
        raise ValueError(f"{what} must be RGB with channels last (..., H, W, 3), got shape {frames.shape}")


def _resize_normalize_torch(
    frames: np.ndarray, size: tuple[int, int], mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """(T, H, W, 3) uint8 -> (T, 3, h, w) float32, the way the torchvision-backed processors do it."""
    batch = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    if tuple(batch.shape[-2:]) != size:
        # torchvision resizes uint8 natively on CPU for bicubic (rounding and clamping inside the kernel).
        batch = F.interpolate(batch, size=list(size), mode="bicubic", align_corners=False, antialias=True)
    # Rescale folded into normalise, in the same float32 order as the processors:
    # (x - mean * 255) / (std * 255).
    scaled_mean = torch.tensor(list(mean)) * (1.0 / RESCALE_FACTOR)
    scaled_std = torch.tensor(list(std)) * (1.0 / RESCALE_FACTOR)
    pixels = batch.to(torch.float32)
    return (pixels - scaled_mean.view(1, -1, 1, 1)) / scaled_std.view(1, -1, 1, 1)


def _resize_normalize_pil(
    frames: np.ndarray, size: tuple[int, int], mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """(T, H, W, 3) uint8 -> (T, 3, h, w) float32, the way the PIL/numpy processor does it."""
    from PIL import Image

    height, width = size
    resized = []
    for frame in frames:
        image = Image.fromarray(frame)
        if image.size != (width, height):
            image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
        resized.append(np.asarray(image))
    stacked = np.stack(resized)
    # float64 rescale then float32 cast, then float32 normalise: the exact order keeps it bit-equal.
    pixels = (stacked.astype(np.float64) * RESCALE_FACTOR).astype(np.float32)
    pixels = (pixels - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 3, 1, 2)))


def _patchify(
    pixels: torch.Tensor, patch_size: int, temporal_patch_size: int, merge_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(T, C, H, W) float32 with T a multiple of temporal_patch_size -> (rows, features), grid (1, 3)."""
    num_frames, channels, height, width = pixels.shape
    grid_t = num_frames // temporal_patch_size
    grid_h, grid_w = height // patch_size, width // patch_size
    patches = pixels.reshape(
        grid_t,
        temporal_patch_size,
        channels,
        grid_h // merge_size,
        merge_size,
        patch_size,
        grid_w // merge_size,
        merge_size,
        patch_size,
    )
    # -> (grid_t, block_row, block_col, row_in_block, col_in_block, C, t, patch_row, patch_col)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    rows = patches.reshape(grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size * patch_size)
    grid = np.array([[grid_t, grid_h, grid_w]], dtype=np.int64)
    return rows.contiguous().numpy(), grid


def _resize_normalize(
    frames: np.ndarray, size: tuple[int, int], mean: Sequence[float], std: Sequence[float], resample: Resample
) -> torch.Tensor:
    if resample == "torch":
        return _resize_normalize_torch(frames, size, mean, std)
    if resample == "pil":
        return _resize_normalize_pil(frames, size, mean, std)
    raise ValueError(f"unknown resample {resample!r}; expected 'torch' or 'pil'")


def preprocess_image(
    image: np.ndarray,
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    min_pixels: int = IMAGE_MIN_PIXELS,
    max_pixels: int = IMAGE_MAX_PIXELS,
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
    resample: Resample = "torch",
) -> tuple[np.ndarray, np.ndarray]:
    """One (H, W, 3) uint8 RGB image -> (pixel_values float32 [N, 3*T*P*P], grid_thw int64 (1, 3))."""
    image = np.asarray(image)
    if image.ndim != 3:
        raise ValueError(f"image must have shape (H, W, 3), got {image.shape}")
    _check_frames(image, "image")
    size = smart_resize(image.shape[0], image.shape[1], patch_size * merge_size, min_pixels, max_pixels)
    pixels = _resize_normalize(image[None], size, mean, std, resample)
    # The vision tower's patch embedding is a 3-D conv over temporal_patch_size frames: an image is that
    # many copies of itself.
    pixels = pixels.expand(temporal_patch_size, -1, -1, -1)
    return _patchify(pixels, patch_size, temporal_patch_size, merge_size)


def preprocess_video(
    frames: np.ndarray,
    *,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    min_pixels: int = VIDEO_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
    mean: Sequence[float] = OPENAI_CLIP_MEAN,
    std: Sequence[float] = OPENAI_CLIP_STD,
    resample: Resample = "torch",
    cap_pixels_per_frame: bool = False,
    max_video_tokens: int = MAX_VIDEO_TOKENS,
) -> tuple[np.ndarray, np.ndarray]:
    """(T, H, W, 3) uint8 RGB frames (already sampled) -> (pixel_values_videos float32
    [N, 3*temporal_patch_size*P*P], video_grid_thw int64 (1, 3))."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[0] == 0:
        raise ValueError(f"frames must have shape (T, H, W, 3) with T >= 1, got {frames.shape}")
    _check_frames(frames, "video frames")
    num_frames, height, width = frames.shape[:3]
    factor = patch_size * merge_size
    frame_max_pixels = _video_max_pixels(
        num_frames, min_pixels, max_pixels, factor, temporal_patch_size, cap_pixels_per_frame, max_video_tokens
    )
    size = smart_resize(height, width, factor, min_pixels, frame_max_pixels)
    pixels = _resize_normalize(frames, size, mean, std, resample)
    if pad := -num_frames % temporal_patch_size:
        pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)])
    return _patchify(pixels, patch_size, temporal_patch_size, merge_size)
