"""Paper-shaped batches of sequence lengths for the planner benchmark and tests (no pixels).

**FlexRL mixtures** (:func:`vlm_batch`). Prompts come from ``titanrl.data.synth.sample_specs`` at
``scale="paper"``: Geo3K-like single images of 150-800 px, NExTQA-like clips (lognormal around
40 s) and LongVILA-like clips (lognormal around 3 min, tail to 15 min), mixed 5:2:1
(image-heavy), 1:2:5 (video-heavy) or LongVILA only. Vision tokens follow Qwen2.5-VL's
preprocessing exactly (``titanrl.data.vision``: transformers' default pixel limits, videos
sampled at 2 fps capped at ``max_frames`` = 256 frames, temporal patches of 2 frames, 2x2 merge),
so a Geo3K prompt is a few hundred tokens and a long video tens of thousands (up to ~68k). Text
tokens are approximated by the prompt's word count. GRPO samples ``responses_per_prompt``
responses per prompt (every response repeats its prompt); each response is lognormal (median 256
tokens, sigma 0.8) clipped to [16, 1024], the paper's maximum response length. A sequence is
prompt + response. The paper does not state its GRPO group size; ``responses_per_prompt=1``
gives the hardest batches (one sequence per prompt) and is the benchmark default.

Each sequence also carries its vision units for :func:`~titanrl.parallel.flex_ulysses.vision.plan_vision`:
one image of ``grid_h * grid_w`` patches, or ``grid_t`` temporal slices of ``grid_h * grid_w``
patches each; the vision tokens sit right after the first text token (``<|vision_start|>``).

**ODC-like text batches.** :func:`aime_rl_lengths` stands in for GRPO on AIME prompts with a
DeepSeek-R1-distilled model: prompts ~lognormal(median 120, sigma 0.35) clipped to [40, 400], and
reasoning responses lognormal(median 5000, sigma 0.6) clipped to [300, 8192] (an 8k maximum
response length, as in DeepScaleR-style GRPO recipes; about 20% of responses hit the cap). :func:`longalign_sft_lengths` stands in for
LongAlign SFT: lognormal(median 11000, sigma 0.8) clipped to [1024, 65536] (mean ~15k, max 64k;
ODC appendix E: truncating to 1/8 gives max 8k and mean 2k). Both are deterministic in ``seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FLEXRL_MIXTURES: tuple[str, ...] = ("image-heavy", "video-heavy", "only-video")
RESPONSE_MEDIAN, RESPONSE_SIGMA, RESPONSE_MIN, RESPONSE_MAX = 256.0, 0.8, 16, 1024
MERGE = 4  # patches per LLM token (2x2 merge)
AIME_PROMPT_MAX, AIME_RESPONSE_MAX = 400, 8192
LONGALIGN_MAX = 65536


@dataclass(frozen=True)
class VisionUnits:
    """One sequence's vision inputs: per image / temporal frame slice, its patch count."""

    images: tuple[int, ...]  # patches of each image
    frames: tuple[int, ...]  # patches of each temporal slice (2 frames) of each video, in order
    token_offset: int  # where the first vision token sits in the sequence


@dataclass(frozen=True)
class VLMBatch:
    lengths: np.ndarray  # int64 tokens per sequence
    sources: tuple[str, ...]
    vision: tuple[VisionUnits, ...]
    prompt_lengths: np.ndarray  # int64 prompt tokens of each sequence (its response is the rest)

    @property
    def images_per_sample(self) -> list[int]:
        return [len(v.images) for v in self.vision]

    @property
    def frames_per_sample(self) -> list[int]:
        return [len(v.frames) for v in self.vision]

    @property
    def patches(self) -> list[list[int]]:
        return [list(v.images) + list(v.frames) for v in self.vision]

    @property
    def vision_token_offsets(self) -> list[int]:
        return [v.token_offset for v in self.vision]


def _prompt_units(spec: object, max_frames: int) -> tuple[int, VisionUnits]:
    """(prompt tokens, vision units) of one synth SampleSpec at paper scale."""
    from titanrl.data import synth, vision
    from titanrl.data.media import num_frames_to_sample

    limits = vision.PIXEL_LIMITS_BY_SCALE["paper"]
    text = len(spec.prompt.replace("<image>", " ").replace("<video>", " ").split())
    if spec.kind == "image":
        t, gh, gw = vision.image_grid_thw(
            spec.height, spec.width, min_pixels=limits.image_min_pixels, max_pixels=limits.image_max_pixels
        )
        units = VisionUnits(images=(gh * gw,) * t, frames=(), token_offset=1)
        return text + t * gh * gw // MERGE, units
    sampling = synth.VIDEO_SAMPLING_BY_SCALE["paper"]
    frames = num_frames_to_sample(spec.num_frames, spec.fps, fps=sampling.fps, max_frames=max_frames)
    t, gh, gw = vision.video_grid_thw(
        frames, spec.height, spec.width, min_pixels=limits.video_min_pixels, max_pixels=limits.video_max_pixels
    )
    units = VisionUnits(images=(), frames=(gh * gw,) * t, token_offset=1)
    return text + t * gh * gw // MERGE, units


def vlm_batch(
    mixture: str,
    num_prompts: int,
    *,
    seed: int = 0,
    responses_per_prompt: int = 1,
    max_frames: int = 256,
) -> VLMBatch:
    """A GRPO batch of ``num_prompts * responses_per_prompt`` sequences shaped like FlexRL's data."""
    from titanrl.data import synth

    if mixture not in FLEXRL_MIXTURES:
        raise ValueError(f"unknown mixture {mixture!r}; expected one of {FLEXRL_MIXTURES}")
    specs = synth.sample_specs(mixture, num_prompts, seed=seed, scale="paper")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    lengths: list[int] = []
    prompts: list[int] = []
    sources: list[str] = []
    units: list[VisionUnits] = []
    for spec in specs:
        prompt, vis = _prompt_units(spec, max_frames)
        responses = np.clip(
            np.round(rng.lognormal(math.log(RESPONSE_MEDIAN), RESPONSE_SIGMA, size=responses_per_prompt)),
            RESPONSE_MIN,
            RESPONSE_MAX,
        ).astype(np.int64)
        for r in responses:
            lengths.append(prompt + int(r))
            prompts.append(prompt)
            sources.append(spec.source)
            units.append(vis)
    return VLMBatch(lengths=np.asarray(lengths, dtype=np.int64), sources=tuple(sources), vision=tuple(units),
                    prompt_lengths=np.asarray(prompts, dtype=np.int64))


def aime_rl_lengths(num_sequences: int, *, seed: int = 0) -> np.ndarray:
    """AIME-like GRPO sequence lengths (prompt + long reasoning response, 8k response cap)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xA1E]))
    prompt = np.clip(np.round(rng.lognormal(math.log(120), 0.35, num_sequences)), 40, AIME_PROMPT_MAX)
    response = np.clip(np.round(rng.lognormal(math.log(5000), 0.6, num_sequences)), 300, AIME_RESPONSE_MAX)
    return (prompt + response).astype(np.int64)


def longalign_sft_lengths(num_sequences: int, *, seed: int = 0) -> np.ndarray:
    """LongAlign-like long-tail SFT sample lengths (mean ~15k, max 64k)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x10A6]))
    return np.clip(np.round(rng.lognormal(math.log(11000), 0.8, num_sequences)), 1024, LONGALIGN_MAX).astype(np.int64)
