"""titanrl.data.vision against transformers' Qwen2-VL processors (the reference the model was trained with).

Measured on this machine: max |ours - transformers| = 0.0 for every case below, on both resize paths
(torch vs Qwen2VLImageProcessor / Qwen2VLVideoProcessor; pil vs Qwen2VLImageProcessorPil), so the
comparisons are exact equality.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from titanrl.data import vision

pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_qwen2_vl import (  # noqa: E402
    Qwen2VLImageProcessor,
    smart_resize as hf_smart_resize,
)
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor  # noqa: E402

TINY = vision.TINY_PIXEL_LIMITS

# (height, width, min_pixels, max_pixels): multiples of 28, non-multiples, an upscale forced by
# min_pixels, downscales forced by max_pixels, and an extreme aspect ratio.
IMAGE_CASES = [
    (56, 56, TINY.image_min_pixels, TINY.image_max_pixels),
    (224, 224, TINY.image_min_pixels, TINY.image_max_pixels),
    (90, 131, TINY.image_min_pixels, TINY.image_max_pixels),
    (33, 47, TINY.image_min_pixels, TINY.image_max_pixels),  # below min_pixels: upscaled
    (300, 200, TINY.image_min_pixels, TINY.image_max_pixels),  # above max_pixels: downscaled
    (28, 600, TINY.image_min_pixels, TINY.image_max_pixels),  # aspect ~21
    (500, 377, vision.IMAGE_MIN_PIXELS, vision.IMAGE_MAX_PIXELS),  # transformers defaults
    (61, 89, 128 * 28 * 28, 28 * 28 * 768),  # large min_pixels: a big upscale
]
# (num_frames, height, width, min_pixels, max_pixels)
VIDEO_CASES = [
    (4, 56, 56, TINY.video_min_pixels, TINY.video_max_pixels),
    (5, 90, 100, TINY.video_min_pixels, TINY.video_max_pixels),  # odd frame count: last frame padded
    (8, 112, 84, TINY.video_min_pixels, TINY.video_max_pixels),
    (3, 60, 200, TINY.video_min_pixels, TINY.video_max_pixels),  # above max_pixels
    (2, 30, 40, TINY.video_min_pixels, TINY.video_max_pixels),  # below min_pixels
    (6, 70, 98, vision.VIDEO_MIN_PIXELS, vision.VIDEO_MAX_PIXELS),  # transformers defaults: upscaled
]


def _structured_image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Noise plus smooth gradients and a hard-edged block: exercises the resampling filters everywhere."""
    noise = rng.integers(0, 256, size=(height, width, 3))
    ramp = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    image = (0.5 * noise + 0.5 * ramp).astype(np.uint8)
    image[height // 4 : height // 2, width // 4 : width // 2] = (220, 40, 40)
    return image


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@settings(max_examples=300, deadline=None)
@given(
    height=st.integers(1, 4000),
    width=st.integers(1, 4000),
    min_pixels=st.sampled_from([28 * 28, 56 * 56, 128 * 28 * 28]),
    max_pixels=st.sampled_from([112 * 112, 224 * 224, 28 * 28 * 768, 28 * 28 * 1280]),
)
def test_smart_resize_matches_transformers(height: int, width: int, min_pixels: int, max_pixels: int) -> None:
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(ValueError):
            vision.smart_resize(height, width, 28, min_pixels, max_pixels)
        return
    assert vision.smart_resize(height, width, 28, min_pixels, max_pixels) == hf_smart_resize(
        height, width, 28, min_pixels, max_pixels
    )


@pytest.mark.parametrize("height,width,min_pixels,max_pixels", IMAGE_CASES)
def test_image_torch_path_equals_qwen2vl_image_processor(
    rng: np.random.Generator, height: int, width: int, min_pixels: int, max_pixels: int
) -> None:
    image = _structured_image(rng, height, width)
    reference = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels)(
        images=[image], return_tensors="np"
    )
    pixel_values, grid_thw = vision.preprocess_image(image, min_pixels=min_pixels, max_pixels=max_pixels)
    np.testing.assert_array_equal(grid_thw, reference["image_grid_thw"])
    assert pixel_values.dtype == np.float32 and pixel_values.shape == reference["pixel_values"].shape
    assert np.abs(pixel_values - reference["pixel_values"]).max() == 0.0


@pytest.mark.parametrize("height,width,min_pixels,max_pixels", IMAGE_CASES)
def test_image_pil_path_equals_qwen2vl_image_processor_pil(
    rng: np.random.Generator, height: int, width: int, min_pixels: int, max_pixels: int
) -> None:
    image = _structured_image(rng, height, width)
    reference = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)(
        images=[image], return_tensors="np"
    )
    pixel_values, grid_thw = vision.preprocess_image(
        image, min_pixels=min_pixels, max_pixels=max_pixels, resample="pil"
    )
    np.testing.assert_array_equal(grid_thw, reference["image_grid_thw"])
    assert np.abs(pixel_values - reference["pixel_values"]).max() == 0.0


def _hf_video(frames: np.ndarray, min_pixels: int, max_pixels: int) -> dict:
    processor = Qwen2VLVideoProcessor(min_pixels=min_pixels, max_pixels=max_pixels)
    return processor(videos=[frames], return_tensors="np", cap_pixels_per_frame=False)


@pytest.mark.parametrize("num_frames,height,width,min_pixels,max_pixels", VIDEO_CASES)
def test_video_equals_qwen2vl_video_processor(
    rng: np.random.Generator, num_frames: int, height: int, width: int, min_pixels: int, max_pixels: int
) -> None:
    frames = np.stack([_structured_image(rng, height, width) for _ in range(num_frames)])
    reference = _hf_video(frames, min_pixels, max_pixels)
    pixel_values, grid_thw = vision.preprocess_video(frames, min_pixels=min_pixels, max_pixels=max_pixels)
    np.testing.assert_array_equal(grid_thw, reference["video_grid_thw"])
    assert pixel_values.shape == reference["pixel_values_videos"].shape
    assert np.abs(pixel_values - reference["pixel_values_videos"]).max() == 0.0
    tokens = vision.vision_tokens_for_video(num_frames, height, width, min_pixels=min_pixels, max_pixels=max_pixels)
    assert tokens == int(np.prod(reference["video_grid_thw"][0])) // 4


def test_video_total_pixel_cap_equals_qwen2vl_video_processor(rng: np.random.Generator) -> None:
    # A small total budget makes qwen-vl-utils' per-frame cap bind: 32 frames share 20 tokens' worth.
    frames = np.stack([_structured_image(rng, 168, 224) for _ in range(32)])
    processor = Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=224 * 224, max_video_tokens=40)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = processor(videos=[frames], return_tensors="np", cap_pixels_per_frame=True)
    kwargs = dict(min_pixels=28 * 28, max_pixels=224 * 224, cap_pixels_per_frame=True, max_video_tokens=40)
    pixel_values, grid_thw = vision.preprocess_video(frames, **kwargs)
    np.testing.assert_array_equal(grid_thw, reference["video_grid_thw"])
    assert np.abs(pixel_values - reference["pixel_values_videos"]).max() == 0.0
    assert vision.video_grid_thw(32, 168, 224, **kwargs) == tuple(int(v) for v in grid_thw[0])
    uncapped = vision.video_grid_thw(32, 168, 224, min_pixels=28 * 28, max_pixels=224 * 224)
    assert np.prod(uncapped) > np.prod(grid_thw[0])  # the cap really bound


@settings(max_examples=200, deadline=None)
@given(height=st.integers(20, 2000), width=st.integers(20, 2000), num_frames=st.integers(1, 300))
def test_token_counts_match_processor_patch_counts(height: int, width: int, num_frames: int) -> None:
    image_processor = Qwen2VLImageProcessor(min_pixels=TINY.image_min_pixels, max_pixels=TINY.image_max_pixels)
    patches = image_processor.get_number_of_image_patches(height, width)
    assert vision.vision_tokens_for_image(
        height, width, min_pixels=TINY.image_min_pixels, max_pixels=TINY.image_max_pixels
    ) == patches // 4
    assert vision.vision_tokens_for_image(height, width) == Qwen2VLImageProcessor().get_number_of_image_patches(
        height, width
    ) // 4
    video_processor = Qwen2VLVideoProcessor()
    video_patches = video_processor.get_num_of_video_patches(num_frames, height, width, videos_kwargs={})
    assert vision.vision_tokens_for_video(num_frames, height, width) == video_patches // 4


def test_patch_layout_by_hand() -> None:
    """Independent of transformers: row r of the output is the patch the merge order puts there."""
    height, width, patch, merge = 56, 84, 14, 2
    image = np.random.default_rng(0).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    mean, std = (0.0, 0.0, 0.0), (1 / 255, 1 / 255, 1 / 255)  # normalisation becomes the identity
    pixel_values, grid_thw = vision.preprocess_image(image, mean=mean, std=std, min_pixels=1, max_pixels=10**6)
    assert grid_thw.tolist() == [[1, 4, 6]]
    rows = pixel_values.reshape(-1, 3, 2, patch, patch)
    row = 0
    for block_row in range(4 // merge):
        for block_col in range(6 // merge):
            for inner_row in range(merge):
                for inner_col in range(merge):
                    y = (block_row * merge + inner_row) * patch
                    x = (block_col * merge + inner_col) * patch
                    expected = image[y : y + patch, x : x + patch].transpose(2, 0, 1).astype(np.float32)
                    np.testing.assert_array_equal(rows[row, :, 0], expected)
                    np.testing.assert_array_equal(rows[row, :, 1], expected)  # the image, twice in time
                    row += 1
    assert row == len(pixel_values)


def test_input_validation() -> None:
    with pytest.raises(ValueError, match="uint8"):
        vision.preprocess_image(np.zeros((56, 56, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="RGB"):
        vision.preprocess_image(np.zeros((56, 56, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="T, H, W, 3"):
        vision.preprocess_video(np.zeros((56, 56, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="resample"):
        vision.preprocess_image(np.zeros((56, 56, 3), dtype=np.uint8), resample="lanczos")  # type: ignore[arg-type]
