"""titanrl's Qwen2.5-VL against transformers' (the reference nobody here wrote), fp32.

The HF model is built by transformers from a tiny config, saved with ``save_pretrained`` and
loaded through our state-dict adapter; logits must agree within 1e-4 for text-only, one image,
several images and a video, with several sequences packed into one stream on our side.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_reference import IMAGE_ID, VIDEO_ID, build_hf_model, make_sample
from titanrl.models.packed import pack_sequences
from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, load_hf_weights, save_hf_checkpoint
from titanrl.models.qwen2_5_vl.inputs import make_sequence_input

TOL = 1e-4


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_tiny")
    build_hf_model(seed=0).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(hf_dir):
    args = Qwen2_5_VLArgs.from_pretrained(hf_dir)
    model = Qwen2_5_VLModel(args)
    load_hf_weights(model, hf_dir)
    return model.eval()


def hf_logits(hf_model, sample, position_ids=None):
    ids = torch.from_numpy(sample.token_ids)[None]
    kwargs = {}
    images = [g for g in sample.grids if not g.is_video]
    videos = [g for g in sample.grids if g.is_video]
    if sample.grids:
        # Split our in-order pixel stream into HF's separate image and video tensors.
        chunks = torch.split(sample.pixel_values, [g.num_patches for g in sample.grids])
        if images:
            kwargs["pixel_values"] = torch.cat([c for c, g in zip(chunks, sample.grids) if not g.is_video])
            kwargs["image_grid_thw"] = torch.tensor([[g.t, g.h, g.w] for g in images])
        if videos:
            kwargs["pixel_values_videos"] = torch.cat([c for c, g in zip(chunks, sample.grids) if g.is_video])
            kwargs["video_grid_thw"] = torch.tensor([[g.t, g.h, g.w] for g in videos])
            kwargs["second_per_grid_ts"] = torch.tensor([g.second_per_grid for g in videos])
        mm = np.zeros_like(sample.token_ids)
        mm[sample.token_ids == IMAGE_ID] = 1
        mm[sample.token_ids == VIDEO_ID] = 2
        kwargs["mm_token_type_ids"] = torch.from_numpy(mm)[None]
    if position_ids is not None:
        kwargs["position_ids"] = torch.from_numpy(position_ids)[:, None, :]
    with torch.no_grad():
        return hf_model(input_ids=ids, **kwargs).logits[0]


def our_logits(model, samples):
    seqs = [make_sequence_input(model.args, s.token_ids, s.grids, s.pixel_values) for s in samples]
    batch = pack_sequences(seqs)
    with torch.no_grad():
        logits = model.logits(model(batch).hidden)
    return torch.split(logits, batch.seq_lengths()), seqs


CASES = {
    "text": [],
    "image": [("image", (1, 8, 12))],
    "images": [("image", (1, 4, 4)), ("image", (1, 10, 6)), ("image", (1, 6, 14))],
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_with_its_own_positions(hf_model, ours, case):
    """Text and images: transformers computes positions itself; ours must agree."""
    rng = np.random.default_rng(1)
    sample = make_sample(rng, CASES[case])
    (logits,), _ = our_logits(ours, [sample])
    ref = hf_logits(hf_model, sample)
    err = (logits - ref).abs().max().item()
    assert err < TOL, f"{case}: max |diff| {err:.2e}"


def test_video_logits_match_with_vllm_rule_positions(hf_model, ours):
    """A long video (temporal extent > spatial): pass our vLLM-rule positions to transformers."""
    rng = np.random.default_rng(2)
    sample = make_sample(rng, [("video", (8, 4, 6)), ("image", (1, 4, 4))], second_per_grid=1.0)
    (logits,), (seq,) = our_logits(ours, [sample])
    ref = hf_logits(hf_model, sample, position_ids=seq.position_ids)
    err = (logits - ref).abs().max().item()
    assert err < TOL, f"video: max |diff| {err:.2e}"


def test_packed_batch_equals_one_by_one(hf_model, ours):
    """Several sequences of all kinds in one packed stream == each run alone through transformers."""
    rng = np.random.default_rng(3)
    samples = [
        make_sample(rng, []),
        make_sample(rng, [("image", (1, 8, 8))]),
        make_sample(rng, [("video", (4, 6, 4))], second_per_grid=0.5),
        make_sample(rng, [("image", (1, 4, 6)), ("image", (1, 6, 4))]),
    ]
    per_seq, seqs = our_logits(ours, samples)
    for i, (s, seq, logits) in enumerate(zip(samples, seqs, per_seq)):
        ref = hf_logits(hf_model, s, position_ids=seq.position_ids)
        err = (logits - ref).abs().max().item()
        assert err < TOL, f"sequence {i}: max |diff| {err:.2e}"


def test_save_and_reload_into_transformers(tmp_path, hf_model, ours, hf_dir):
    """Save from titanrl, reload into transformers: identical logits."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    save_hf_checkpoint(ours.state_dict(), ours.args, tmp_path, assets_from=hf_dir)
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    sample = make_sample(np.random.default_rng(4), [("image", (1, 6, 6))])
    a, b = hf_logits(hf_model, sample), hf_logits(reloaded, sample)
    assert torch.equal(a, b)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "visual.patch_embed.proj.weight" in keys and "model.layers.0.self_attn.q_proj.weight" in keys
    assert "lm_head.weight" in keys and not any(k.startswith("model.language_model") for k in keys)


def test_sharded_save_loads_into_transformers_and_vllm_headers(tmp_path, hf_model, ours, hf_dir):
    """A shard budget smaller than the model gives several files and an index (the layout of the
    streamed weight push and export); transformers reloads it with identical logits, and a second
    save into the same folder as one file leaves no stale shard behind."""
    import json

    from transformers import Qwen2_5_VLForConditionalGeneration

    from titanrl.rollout.weights import read_headers

    save_hf_checkpoint(ours.state_dict(), ours.args, tmp_path, assets_from=hf_dir, shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (tmp_path / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(p.numel() * p.element_size() for p in ours.parameters())
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    sample = make_sample(np.random.default_rng(4), [("image", (1, 6, 6))])
    assert torch.equal(hf_logits(hf_model, sample), hf_logits(reloaded, sample))
    assert set(read_headers(tmp_path)) == set(index["weight_map"])
    save_hf_checkpoint(ours.state_dict(), ours.args, tmp_path, assets_from=hf_dir)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_shared_vision_encoding_equals_separate(ours):
    """The n responses of one prompt share one vision encoding in a pack (vision_key): same
    logits as encoding the media once per sequence, with the vision tower run once."""
    rng = np.random.default_rng(5)
    prompt = make_sample(rng, [("video", (4, 4, 6)), ("image", (1, 6, 4))])
    other = make_sample(rng, [("image", (1, 4, 4))])

    def seqs(shared: bool):
        out = []
        for i, s in enumerate([prompt, other, prompt, prompt]):
            seq = make_sequence_input(ours.args, s.token_ids, s.grids, s.pixel_values)
            if shared:
                seq.vision_key = id(s)
            out.append(seq)
        return out

    separate, shared = pack_sequences(seqs(False)), pack_sequences(seqs(True))
    assert shared.pixel_values.shape[0] < separate.pixel_values.shape[0]
    with torch.no_grad():
        a = ours.logits(ours(separate).hidden)
        b = ours.logits(ours(shared).hidden)
    assert (a - b).abs().max().item() < 1e-5
