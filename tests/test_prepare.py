"""Trainer-side prompt + media preparation equals what transformers' Qwen2.5-VL processor
(the code vLLM runs) makes of the same chat text and decoded media."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from titanrl.data.manifest import read_manifest
from titanrl.data.preprocess import MediaSettings, prepare_sample
from titanrl.data.prompt import PromptEncoder, chat_messages
from titanrl.data.synth import generate_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return generate_dataset(tmp_path_factory.mktemp("synth"), "video-heavy", 12, seed=3)


@pytest.fixture(scope="module")
def setup(tiny_ckpt, dataset):
    encoder = PromptEncoder.from_pretrained(tiny_ckpt)
    settings = MediaSettings.from_checkpoint(tiny_ckpt, fps=2.0, max_frames=8)
    return encoder, settings, read_manifest(dataset)


def test_chat_messages_keep_order():
    msgs = chat_messages("a<image>b<video>", system="sys")
    assert msgs[0] == {"role": "system", "content": "sys"}
    assert [c["type"] for c in msgs[1]["content"]] == ["text", "image", "text", "video"]


def test_prepared_samples_equal_the_hf_processor(tiny_ckpt, dataset, setup):
    from transformers import AutoProcessor

    encoder, settings, records = setup
    processor = AutoProcessor.from_pretrained(tiny_ckpt)
    kinds = set()
    for record in records:
        prepared = prepare_sample(record, dataset.parent, encoder, settings)
        text = encoder.render(record.prompt)
        images = [m.frames[0] for m in prepared.media if m.kind == "image"] or None
        videos = [m.frames for m in prepared.media if m.kind == "video"] or None
        ref = processor(text=[text], images=images, videos=videos, return_tensors="np")
        np.testing.assert_array_equal(prepared.prompt_ids, ref["input_ids"][0])
        ref_pixels = ref.get("pixel_values") if images else ref.get("pixel_values_videos")
        np.testing.assert_array_equal(prepared.pixel_values, ref_pixels)
        grid_key = "image_grid_thw" if images else "video_grid_thw"
        assert [[g.t, g.h, g.w] for g in prepared.grids] == ref[grid_key].tolist()
        kinds |= {m.kind for m in prepared.media}
    assert kinds == {"image", "video"}


def test_placeholder_mismatch_is_reported(setup):
    encoder, _, _ = setup
    with pytest.raises(ValueError, match="more media placeholders"):
        encoder.encode("<image><image>hi", [])
