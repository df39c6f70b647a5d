"""Tests for titanrl.models.make_tiny: the random-init Qwen2.5-VL checkpoint loads and runs in
transformers and in vLLM (CPU).

The vLLM test uses the session fixture `vllm_probe_results` (tests/vllm_probe.py), which runs the
engine once per session in a child process.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from titanrl.models.make_tiny import (
    BPE_VOCAB_SIZE,
    QWEN_SPECIAL_TOKENS,
    SMALL,
    TINY,
    VOCAB_SIZE,
    build_config,
    check_vllm_cpu_constraints,
    main,
    make_tiny_checkpoint,
    special_token_ids,
)
from vllm_probe import PROBE_MAX_TOKENS, QUESTION, probe_image, probe_prompt, probe_video



@pytest.mark.parametrize("size", [TINY, SMALL], ids=lambda s: s.name)
def test_sizes_satisfy_vllm_cpu_constraints(size: Any) -> None:
    check_vllm_cpu_constraints(size)
    assert sum(size.mrope_section) == size.head_dim // 2


def test_constraint_check_rejects_unsupported_head_dim() -> None:
    bad = dataclasses.replace(TINY, hidden_size=96, num_attention_heads=4)  # head_dim 24
    with pytest.raises(ValueError, match="head_dim 24"):
        check_vllm_cpu_constraints(bad)
    with pytest.raises(ValueError, match="window"):
        check_vllm_cpu_constraints(dataclasses.replace(TINY, vision_window_size=42))


@pytest.mark.parametrize(
    ("size", "low", "high"), [(TINY, 0.5e6, 1.5e6), (SMALL, 20e6, 100e6)], ids=["tiny", "small"]
)
def test_parameter_count_in_range(size: Any, low: float, high: float) -> None:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):  # count without allocating or initialising
        model = Qwen2_5_VLForConditionalGeneration(build_config(size))
    num_params = sum(p.numel() for p in model.parameters())
    assert low <= num_params <= high, num_params


def test_config_json(tiny_ckpt: Path) -> None:
    config = json.loads((tiny_ckpt / "config.json").read_text())
    ids = special_token_ids()
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["model_type"] == "qwen2_5_vl"
    assert config["tie_word_embeddings"] is False
    assert config["image_token_id"] == ids["<|image_pad|>"]
    assert config["video_token_id"] == ids["<|video_pad|>"]
    assert config["vision_start_token_id"] == ids["<|vision_start|>"]
    assert config["vision_end_token_id"] == ids["<|vision_end|>"]
    text = config["text_config"]
    for layout in (text, config):  # nested (transformers 5) and flat (published checkpoints) agree
        assert layout["vocab_size"] == VOCAB_SIZE
        assert layout["hidden_size"] == TINY.hidden_size
        assert layout["num_hidden_layers"] == TINY.num_hidden_layers
        assert layout["eos_token_id"] == ids["<|im_end|>"]
        assert layout["bos_token_id"] == layout["pad_token_id"] == ids["<|endoftext|>"]
    assert text["rope_parameters"]["mrope_section"] == config["rope_scaling"]["mrope_section"] == [4, 6, 6]
    vision = config["vision_config"]
    assert (vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]) == (14, 2, 2)
    assert vision["tokens_per_second"] == 2
    assert vision["out_hidden_size"] == TINY.hidden_size
    assert vision["fullatt_block_indexes"] == [1] and vision["depth"] == 2
    generation = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]


def test_on_disk_names_are_canonical(tiny_ckpt: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_ckpt / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(name).get_dtype() for name in names}
    assert dtypes == {"F32"}
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= names
    assert "visual.patch_embed.proj.weight" in names
    assert "visual.merger.mlp.0.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "visual.blocks.1.attn.qkv.weight" in names
    # Every name is in one of the published families; none in transformers 5's internal nesting.
    families = ("visual.blocks.", "visual.patch_embed.", "visual.merger.", "model.layers.")
    singles = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert all(name.startswith(families) or name in singles for name in names), sorted(names)
    assert not any(name.startswith(("model.language_model.", "model.visual.")) for name in names)


def test_build_is_deterministic_and_cli_works(tiny_ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    assert main([str(tmp_path / "same"), "--size", "tiny", "--seed", "0"]) == 0
    for path in sorted(tiny_ckpt.iterdir()):
        assert (tmp_path / "same" / path.name).read_bytes() == path.read_bytes(), path.name

    other = make_tiny_checkpoint(tmp_path / "other", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (tiny_ckpt / "tokenizer.json").read_bytes()
    weights_seed0 = load_file(str(tiny_ckpt / "model.safetensors"))
    weights_seed1 = load_file(str(other / "model.safetensors"))
    assert not weights_seed0["lm_head.weight"].equal(weights_seed1["lm_head.weight"])


def test_unknown_size_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown size"):
        make_tiny_checkpoint(tmp_path, size="huge")


# ----------------------------------------------------------------------------------------------
# Tokenizer and processor
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def processor(tiny_ckpt: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_ckpt))


def test_processor_types(processor: Any) -> None:
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert type(processor.video_processor).__name__ == "Qwen2VLVideoProcessor"
    assert processor.image_processor.size["longest_edge"] == TINY.image_max_pixels


def test_special_tokens(processor: Any) -> None:
    tokenizer = processor.tokenizer
    assert len(tokenizer) == VOCAB_SIZE
    for token, token_id in special_token_ids().items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token) == [token_id]  # never split into bytes
    assert [special_token_ids()[t] for t in QWEN_SPECIAL_TOKENS] == list(range(BPE_VOCAB_SIZE, VOCAB_SIZE))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_prompts_and_answers_tokenize_compactly(processor: Any) -> None:
    tokenizer = processor.tokenizer
    assert len(tokenizer.encode(QUESTION)) <= 12
    # An answer follows "<|im_start|>assistant\n" (no leading space) or a space inside a sentence.
    for answer in ("red", "green", "blue", "yellow", "square", "yes", "no", *map(str, range(10))):
        assert len(tokenizer.encode(answer)) == 1, answer
        assert tokenizer.decode(tokenizer.encode(answer)) == answer
    for answer in ("red", "green", "blue", "yellow"):
        assert len(tokenizer.encode(" " + answer)) == 1, answer


def test_chat_template(processor: Any) -> None:
    for media in ("text", "image", "video"):
        content: list[dict[str, str]] = [] if media == "text" else [{"type": media}]
        content.append({"type": "text", "text": QUESTION})
        messages = [{"role": "user", "content": content}]
        rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rendered == probe_prompt(media)
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = processor.apply_chat_template(with_system, tokenize=False)
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def count_token(input_ids: Any, token: str) -> int:
    return int((input_ids == special_token_ids()[token]).sum())


def test_processor_expands_image_and_video_pads(processor: Any) -> None:
    inputs = processor(text=[probe_prompt("image")], images=[probe_image()], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert count_token(inputs["input_ids"], "<|image_pad|>") == 16
    assert inputs["pixel_values"].shape == (64, 3 * 2 * 14 * 14)

    # A large image is capped at max_pixels = 28*28*64 pixels, i.e. at most 64 merged tokens.
    big = np.zeros((480, 640, 3), dtype=np.uint8)
    inputs = processor(text=[probe_prompt("image")], images=[big], return_tensors="pt")
    assert 32 <= count_token(inputs["input_ids"], "<|image_pad|>") <= 64

    inputs = processor(text=[probe_prompt("video")], videos=[probe_video()], return_tensors="pt")
    assert inputs["video_grid_thw"].tolist() == [[4, 4, 4]]
    assert count_token(inputs["input_ids"], "<|video_pad|>") == 16


# ----------------------------------------------------------------------------------------------
# transformers model
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt: Path) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tiny_ckpt)).eval()


def test_transformers_loads_every_weight(tiny_ckpt: Path, hf_model: Any) -> None:
    import torch
    from safetensors.torch import load_file

    assert hf_model.dtype == torch.float32
    on_disk = load_file(str(tiny_ckpt / "model.safetensors"))
    # Loaded parameters equal the file's (no tensor silently left at a fresh random init).
    assert hf_model.lm_head.weight.equal(on_disk["lm_head.weight"])
    assert hf_model.model.visual.patch_embed.proj.weight.equal(on_disk["visual.patch_embed.proj.weight"])
    layer0 = hf_model.model.language_model.layers[0]
    assert layer0.mlp.down_proj.weight.equal(on_disk["model.layers.0.mlp.down_proj.weight"])
    assert sum(p.numel() for p in hf_model.parameters()) == sum(t.numel() for t in on_disk.values())
    # initializer_range 0.02
    assert 0.015 < float(on_disk["model.layers.1.self_attn.q_proj.weight"].std()) < 0.025


def test_transformers_forward_and_generate(processor: Any, hf_model: Any) -> None:
    import torch

    inputs = processor(text=[probe_prompt("image")], images=[probe_image()], return_tensors="pt")
    with torch.no_grad():
        logits = hf_model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    assert float(logits[0, -1].std()) > 1e-3  # not constant

    prompt_len = inputs["input_ids"].shape[1]
    generated = hf_model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (1, prompt_len + 4)

    video_inputs = processor(text=[probe_prompt("video")], videos=[probe_video()], return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(hf_model(**video_inputs).logits).all()


# ----------------------------------------------------------------------------------------------
# vLLM (CPU), in a child process
# ----------------------------------------------------------------------------------------------


def transformers_completion_logprobs(
    hf_model: Any, processor: Any, media: str, prompt_ids: list[int], completion_ids: list[int]
) -> list[float]:
    """Log-probs transformers gives the completion tokens after the same prompt (teacher-forced)."""
    import torch

    images = [probe_image()] if media == "image" else None
    inputs = processor(text=[probe_prompt(media)], images=images, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == prompt_ids, "vLLM and transformers tokenized differently"
    extra = len(completion_ids) - 1
    completion = torch.tensor([completion_ids[:-1]], dtype=torch.long)
    inputs["input_ids"] = torch.cat([inputs["input_ids"], completion], dim=1)
    for per_token in ("attention_mask", "mm_token_type_ids"):
        if per_token in inputs:
            fill = 1 if per_token == "attention_mask" else 0
            tail = torch.full((1, extra), fill, dtype=inputs[per_token].dtype)
            inputs[per_token] = torch.cat([inputs[per_token], tail], dim=1)
    with torch.no_grad():
        logits = hf_model(**inputs).logits[0, len(prompt_ids) - 1 :]
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return logprobs.gather(1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


@pytest.mark.slow
def test_vllm_generates_text_image_video_with_logprobs(
    vllm_probe_results: dict, processor: Any, hf_model: Any
) -> None:
    results = {k: v for k, v in vllm_probe_results.items() if k != "timings_s"}

    expected_pads = {"text": ("<|image_pad|>", 0), "image": ("<|image_pad|>", 16), "video": ("<|video_pad|>", 16)}
    for media, result in results.items():
        token_ids, logprobs = result["token_ids"], result["logprobs"]
        assert len(token_ids) == len(logprobs) == PROBE_MAX_TOKENS, media
        assert all(0 <= t < VOCAB_SIZE for t in token_ids), media
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs), media
        pad, count = expected_pads[media]
        assert count_token(np.array(result["prompt_token_ids"]), pad) == count, media

    # vLLM runs the checkpoint as transformers does: same log-probs for the tokens it sampled
    # (fp32; checked up to the first special token, which would confuse the media placeholders).
    # Video is left out: vLLM's video position ids differ from transformers' default ones.
    for media in ("text", "image"):
        result = results[media]
        completion = result["token_ids"]
        first_special = next((i for i, t in enumerate(completion) if t >= BPE_VOCAB_SIZE), len(completion))
        completion = completion[:first_special]
        if not completion:
            continue
        expected = transformers_completion_logprobs(hf_model, processor, media, result["prompt_token_ids"], completion)
        np.testing.assert_allclose(result["logprobs"][: len(completion)], expected, atol=2e-3, err_msg=media)
        max_diff = float(np.max(np.abs(np.array(result["logprobs"][: len(completion)]) - expected)))
        print(f"{media}: {len(completion)} sampled tokens, max |vLLM - transformers| log-prob {max_diff:.2e}")


def test_the_7b_shape_is_qwen2_5_vl_7b_at_full_width_with_4_layers():
    """scripts/check_gpu.py's memory and throughput model: every width of the published 7B (the planner's
    known shape), 4 of its decoder layers and 4 of its vision blocks."""
    from titanrl import memory
    from titanrl.models.make_tiny import SIZES, build_config
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs

    config = build_config(SIZES["7b-shape-4l"]).to_dict()
    ours = Qwen2_5_VLArgs.from_hf_config(config)
    seven_b = memory.known_shape("qwen2_5_vl_7b")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        assert getattr(ours.text, field) == getattr(seven_b.text, field), field
    for field in ("hidden_size", "intermediate_size", "num_heads", "out_hidden_size"):
        assert getattr(ours.vision, field) == getattr(seven_b.vision, field), field
    assert (ours.text.num_hidden_layers, ours.vision.depth) == (4, 4)
    assert 2.0e9 < memory.param_counts(ours).total < 2.3e9


def test_the_3b_shape_is_qwen2_5_vl_3b_at_full_depth():
    """scripts/check_gpu.py's full-depth run: Qwen2.5-VL-3B's decoder (36 layers of 2048, 16 / 2 heads, 11008 MLP,
    151936 rows) and its 32-block vision tower projecting to 2048; lm_head untied."""
    from titanrl import memory
    from titanrl.models.make_tiny import SIZES, build_config
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs

    ours = Qwen2_5_VLArgs.from_hf_config(build_config(SIZES["3b-shape"]).to_dict())
    t, v = ours.text, ours.vision
    assert (t.num_hidden_layers, t.hidden_size, t.intermediate_size, t.num_attention_heads,
            t.num_key_value_heads, t.vocab_size) == (36, 2048, 11008, 16, 2, 151936)
    assert (v.depth, v.hidden_size, v.intermediate_size, v.num_heads, v.out_hidden_size) == (32, 1280, 3420, 16, 2048)
    assert 3.9e9 < memory.param_counts(ours).total < 4.3e9
