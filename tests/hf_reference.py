"""Reference-side helpers for tests: a tiny random Qwen2.5-VL built by transformers itself,
and inputs laid out the way transformers' and vLLM's processors lay them out."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from titanrl.models.qwen2_5_vl.positions import VisionGrid

IMAGE_ID, VIDEO_ID, VSTART_ID, VEND_ID = 290, 291, 292, 293
VOCAB = 300


def tiny_hf_config(*, tokens_per_second: int = 2, tie: bool = False):
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            tie_word_embeddings=tie,
        ),
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            window_size=56,
            fullatt_block_indexes=[1],
            tokens_per_second=tokens_per_second,
        ),
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        vision_start_token_id=VSTART_ID,
        vision_end_token_id=VEND_ID,
        tie_word_embeddings=tie,
    )


def build_hf_model(seed: int = 0, **kw):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    cfg = tiny_hf_config(**kw)
    model = Qwen2_5_VLForConditionalGeneration(cfg).float().eval()
    # Random biases/norm weights too, so a wrong mapping of any tensor shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@dataclass
class ReferenceSample:
    """One sequence: token ids with expanded placeholders and the vision inputs in order."""

    token_ids: np.ndarray
    grids: list[VisionGrid]
    pixel_values: torch.Tensor | None


def make_sample(rng: np.random.Generator, items: list[tuple[str, tuple[int, int, int]]], second_per_grid: float = 1.0,
                text_len: int = 5) -> ReferenceSample:
    """items: [("image"|"video", (t, h, w)), ...] in patch units; text between and around them."""
    ids: list[int] = list(rng.integers(0, 280, text_len))
    grids, pixels = [], []
    for kind, (t, h, w) in items:
        is_video = kind == "video"
        grid = VisionGrid(t, h, w, is_video=is_video, second_per_grid=second_per_grid if is_video else 1.0)
        ids += [VSTART_ID] + [VIDEO_ID if is_video else IMAGE_ID] * grid.num_tokens(2) + [VEND_ID]
        ids += list(rng.integers(0, 280, text_len))
        grids.append(grid)
        pixels.append(torch.from_numpy(rng.standard_normal((grid.num_patches, 3 * 2 * 14 * 14)).astype(np.float32)))
    return ReferenceSample(np.asarray(ids, dtype=np.int64), grids, torch.cat(pixels) if pixels else None)
