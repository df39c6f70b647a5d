"""3D rotary positions against vLLM's own implementation (what rollouts are scored with)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from hf_reference import IMAGE_ID, VIDEO_ID, make_sample
from titanrl.models.qwen2_5_vl.positions import VisionGrid, mrope_position_ids, vision_window_index


def vllm_positions(sample, tokens_per_second: float) -> np.ndarray:
    """Call vLLM's Qwen2.5-VL ``get_mrope_input_positions`` on a stand-in ``self``."""
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as VllmQwen

    ids = sample.token_ids
    features, cursor = [], 0
    for g in sample.grids:
        pad = VIDEO_ID if g.is_video else IMAGE_ID
        offset = int(np.flatnonzero(ids[cursor:] == pad)[0]) + cursor
        key = "video_grid_thw" if g.is_video else "image_grid_thw"
        data = {key: SimpleNamespace(data=torch.tensor([g.t, g.h, g.w]))}
        if g.is_video:
            data["second_per_grid_ts"] = SimpleNamespace(data=torch.tensor(g.second_per_grid))
        features.append(
            SimpleNamespace(
                modality="video" if g.is_video else "image", data=data, mm_position=SimpleNamespace(offset=offset)
            )
        )
        cursor = offset + g.num_tokens(2)
    fake = SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2, tokens_per_second=tokens_per_second))
    )
    fake.iter_mm_grid_thw = lambda feats: VllmQwen.iter_mm_grid_thw(fake, feats)
    positions, _ = VllmQwen.get_mrope_input_positions(fake, ids.tolist(), features)
    return positions.numpy()


def ours(sample, tps):
    return mrope_position_ids(
        sample.token_ids, sample.grids, image_token_id=IMAGE_ID, video_token_id=VIDEO_ID,
        spatial_merge_size=2, tokens_per_second=tps,
    )


grid_item = st.tuples(
    st.sampled_from(["image", "video"]),
    st.tuples(st.integers(1, 6), st.sampled_from([2, 4, 6, 8]), st.sampled_from([2, 4, 10])),
)


@settings(max_examples=40, deadline=None)
@given(
    items=st.lists(grid_item, max_size=3),
    spg=st.sampled_from([0.25, 0.5, 1.0, 1.5]),
    tps=st.sampled_from([1, 2, 4]),
    text_len=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_positions_equal_vllm(items, spg, tps, text_len, seed):
    items = [(k, (1 if k == "image" else t, h, w)) for k, (t, h, w) in items]
    sample = make_sample(np.random.default_rng(seed), items, second_per_grid=spg, text_len=text_len)
    assume(len(sample.token_ids) > 0)
    np.testing.assert_array_equal(ours(sample, tps), vllm_positions(sample, tps))


def test_text_after_long_video_continues_after_its_last_frame():
    # 8 temporal patches, 2 tokens/s * 1 s per patch -> t positions 0..14 dominate h, w.
    sample = make_sample(np.random.default_rng(0), [("video", (8, 4, 4))], text_len=2)
    pos = ours(sample, 2)
    video_end = int(np.flatnonzero(sample.token_ids == VIDEO_ID)[-1])
    assert pos[:, video_end + 1].tolist() == [pos[:, : video_end + 1].max() + 1] * 3


def test_mismatched_grids_are_reported():
    sample = make_sample(np.random.default_rng(0), [("image", (1, 4, 4))])
    with pytest.raises(ValueError, match="placeholder"):
        mrope_position_ids(sample.token_ids, [VisionGrid(1, 8, 8)], image_token_id=IMAGE_ID,
                           video_token_id=VIDEO_ID, spatial_merge_size=2, tokens_per_second=2)
    with pytest.raises(ValueError, match="more grids"):
        mrope_position_ids(sample.token_ids, sample.grids * 2, image_token_id=IMAGE_ID,
                           video_token_id=VIDEO_ID, spatial_merge_size=2, tokens_per_second=2)


def test_window_index_matches_transformers():
    from transformers.vision_utils import get_vision_window_index

    grids = [VisionGrid(1, 10, 14), VisionGrid(3, 8, 4, is_video=True), VisionGrid(1, 2, 2)]
    idx, cu = vision_window_index(grids, window_size=112, patch_size=14, merge=2)
    ref_idx, ref_cu = get_vision_window_index(
        torch.tensor([[g.t, g.h, g.w] for g in grids]), spatial_merge_size=2, window_size=112, patch_size=14
    )
    assert torch.equal(idx, ref_idx) and cu.tolist() == ref_cu.tolist()
