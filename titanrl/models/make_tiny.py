"""Build a small random-init Qwen2.5-VL checkpoint directory, entirely offline.

    python -m titanrl.models.make_tiny OUTDIR [--size tiny|small|7b-shape-4l|3b-shape] [--seed S]

The directory looks like a real Qwen2.5-VL Hugging Face checkpoint, so every consumer (transformers,
vLLM, our own state-dict adapters) can be tested without a hub download:

- ``config.json``: ``Qwen2_5_VLForConditionalGeneration`` with a ``vision_config``; the text fields
  are written both nested (``text_config``, the transformers 5 layout) and flat at the top level
  (the layout of the published Qwen2.5-VL checkpoints), so readers of either layout work.
- ``model.safetensors``: fp32 weights under the canonical on-disk names of the published
  checkpoints: ``visual.*``, ``model.embed_tokens.weight``, ``model.layers.*``, ``model.norm.weight``,
  ``lm_head.weight``.
- a byte-level BPE tokenizer trained here on a small built-in corpus, with the Qwen special tokens,
  a Qwen-style chat template, ``generation_config.json``, and the image and video processor configs.

Both sizes satisfy vLLM-CPU's constraints (see ``check_vllm_cpu_constraints``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from titanrl.models.flavors import (  # noqa: F401 - the shapes this module builds, re-exported
    VLLM_CPU_ATTENTION_HEAD_SIZES, PATCH_SIZE, TEMPORAL_PATCH_SIZE, SPATIAL_MERGE_SIZE, TOKENS_PER_SECOND,
    QWEN_IMAGE_MEAN, QWEN_IMAGE_STD, QWEN_SPECIAL_TOKENS, BPE_VOCAB_SIZE, VOCAB_SIZE, special_token_ids,
    TinyModelSize, TINY, SMALL, SHAPE_7B_4L, SHAPE_3B, SIZES, flat_text_fields,
)

# Heavy imports (torch, transformers, tokenizers) live inside the functions that need them, so
# importing this module (e.g. for ``TINY`` / ``SMALL``) stays cheap.

def check_vllm_cpu_constraints(size: TinyModelSize) -> None:
    """Raise ValueError if vLLM-CPU (or the Qwen2.5-VL architecture) cannot run this size."""
    problems: list[str] = []
    if size.hidden_size % size.num_attention_heads:
        problems.append("hidden_size must be divisible by num_attention_heads")
    if size.num_attention_heads % size.num_key_value_heads:
        problems.append("num_attention_heads must be divisible by num_key_value_heads")
    if size.head_dim not in VLLM_CPU_ATTENTION_HEAD_SIZES:
        problems.append(f"head_dim {size.head_dim} not in vLLM CPU sizes {VLLM_CPU_ATTENTION_HEAD_SIZES}")
    if sum(size.mrope_section) != size.head_dim // 2:
        problems.append(f"mrope_section {size.mrope_section} must sum to head_dim/2 = {size.head_dim // 2}")
    if size.vision_hidden_size % size.vision_num_heads:
        problems.append("vision_hidden_size must be divisible by vision_num_heads")
    # The vision rotary embedding covers half the head (partial_rotary_factor 0.5) and splits that
    # half between the height and width axes, each as cos/sin pairs: head_dim must divide by 4.
    if size.vision_head_dim % 4:
        problems.append(f"vision head_dim {size.vision_head_dim} must be divisible by 4")
    merged_patch = PATCH_SIZE * SPATIAL_MERGE_SIZE
    if size.vision_window_size < merged_patch or size.vision_window_size % merged_patch:
        problems.append(f"vision_window_size must be a positive multiple of {merged_patch}")
    if not size.vision_fullatt_block_indexes or any(
        not 0 <= i < size.vision_depth for i in size.vision_fullatt_block_indexes
    ):
        problems.append("vision_fullatt_block_indexes must be non-empty and within [0, vision_depth)")
    for kind, low, high in (
        ("image", size.image_min_pixels, size.image_max_pixels),
        ("video", size.video_min_pixels, size.video_max_pixels),
    ):
        if not merged_patch**2 <= low <= high:
            problems.append(f"{kind} pixels need {merged_patch}^2 <= min_pixels <= max_pixels")
    if problems:
        raise ValueError(f"size {size.name!r} violates: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

_COLOURS = (
    "red green blue yellow orange purple pink brown black white grey gray cyan magenta violet "
    "gold silver navy teal maroon olive lime beige colour color colours colors dark light bright"
).split()
_SHAPES = (
    "square circle triangle rectangle star hexagon diamond oval line dot cube sphere ball box "
    "shape shapes object objects pixel pixels image images picture video videos frame frames"
).split()
_NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty "
    "ninety hundred thousand first second third fourth fifth last number numbers count many"
).split()
_WORDS = (
    "the a an is are was were be been what which who where when why how many much there here "
    "this that these those it its in on at of to from with without and or not no yes please "
    "answer question word words one only with just say tell me you your i my we our they "
    "left right top bottom middle center above below next between inside outside near far "
    "big small large tiny little long short tall wide thin same different more less most least "
    "moving moves move still fast slow first then after before time second seconds appears "
    "see look show shows contains contain has have do does did can could would should will "
    "describe name find give choose pick select correct wrong true false value total sum "
    "assistant user system helpful harmless honest think reasoning final result because so "
    "background foreground corner edge side scene screen grid row column cell each every all "
    "add plus minus times equals equal greater smaller than number digit letter text read "
    "hello hi thanks thank okay good great sure sorry let step solve problem example"
).split()
_QUESTION_TEMPLATES = (
    "What colour is the {shape}? Answer with one word.",
    "What color is the {shape}? Answer with one word.",
    "How many {shape}s are in the image? Answer with a number.",
    "How many {shape}s are there? Answer with one digit.",
    "Which shape is {colour}? Answer with one word.",
    "Is the {shape} {colour}? Answer yes or no.",
    "What colour is the {shape} in the video? Answer with one word.",
    "Which way is the {colour} {shape} moving? Answer left, right, up or down.",
    "Count the {colour} {shape}s. Answer with a number.",
)
_CHAT_LINES = (
    "You are a helpful assistant.",
    "The answer is {answer}.",
    "The {shape} is {colour}.",
    "There are {digit} {colour} {shape}s.",
    "I see a {colour} {shape} on the {side}.",
    "Let me think step by step. The final answer is {answer}.",
    "<think>The {shape} looks {colour}.</think> {answer}",
    "<answer>{answer}</answer>",
    "{a} + {b} = {c}",
    "{a} plus {b} equals {c}.",
)


def tokenizer_training_corpus() -> Iterator[str]:
    """A deterministic corpus of prompts, answers and chat text, so that the prompts and answers
    the tests use (colours, digits, short questions) become few tokens each."""
    yield " ".join(_COLOURS + _SHAPES + _NUMBER_WORDS + _WORDS)
    for word in _COLOURS + _SHAPES + _NUMBER_WORDS + _WORDS:
        # Both capitalised and lower case, with and without the leading space the pre-tokenizer keeps.
        yield f"{word} {word.capitalize()} {word}. {word}?"
    for colour, shape in itertools.product(_COLOURS[:16], _SHAPES[:14]):
        for template in _QUESTION_TEMPLATES:
            yield template.format(colour=colour, shape=shape)
    sides = ("left", "right", "top", "bottom", "middle")
    for i, (colour, shape) in enumerate(itertools.product(_COLOURS[:12], _SHAPES[:10])):
        digit = i % 10
        answer = colour if i % 2 else str(digit)
        for line in _CHAT_LINES:
            yield line.format(
                answer=answer, shape=shape, colour=colour, digit=digit, side=sides[i % len(sides)],
                a=i % 10, b=(i * 7) % 10, c=i % 10 + (i * 7) % 10,
            )
    for number in range(200):
        yield f"{number} {number}. The answer is {number}."
    # A model's answer starts right after "<|im_start|>assistant\n", i.e. without a leading space:
    # make the bare answer words frequent enough to become single tokens too.
    for _ in range(20):
        yield from _COLOURS[:16] + _SHAPES[:14] + ["yes", "no", "Yes", "No", "left", "right", "up", "down"]


def build_tokenizer() -> Any:
    """Train the byte-level BPE (Qwen2's pre-tokenization) and add the Qwen special tokens.

    Returns a ``tokenizers.Tokenizer`` whose pipeline matches what transformers' Qwen2Tokenizer
    rebuilds from ``tokenizer.json`` (NFC, Qwen2 split regex, byte-level without prefix space)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(tokenizer_training_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(
            f"BPE training produced {tokenizer.get_vocab_size()} tokens, expected {BPE_VOCAB_SIZE}: "
            "the built-in corpus is too small for the requested vocabulary"
        )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    actual_ids = {token: tokenizer.token_to_id(token) for token in QWEN_SPECIAL_TOKENS}
    if actual_ids != special_token_ids():
        raise RuntimeError(f"special tokens got ids {actual_ids}, expected {special_token_ids()}")
    return tokenizer


# A Qwen2.5-VL-style chat template: default system prompt, ChatML turns, and each image / video
# content item rendered as <|vision_start|><|image_pad|><|vision_end|> (resp. <|video_pad|>), which
# the processor then expands to one pad token per merged vision token.
QWEN_VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' or 'image' in item or 'image_url' in item -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'video' or 'video' in item -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in item -%}"
    "{{- item['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def build_processor(size: TinyModelSize) -> Any:
    """The Qwen2_5_VLProcessor (tokenizer + image and video processors + chat template)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2Tokenizer
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    ids = special_token_ids()
    hf_tokenizer = Qwen2Tokenizer(
        tokenizer_object=build_tokenizer(),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=size.max_position_embeddings,
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )
    if len(hf_tokenizer) != VOCAB_SIZE or hf_tokenizer.convert_tokens_to_ids("<|image_pad|>") != ids["<|image_pad|>"]:
        raise RuntimeError("transformers' Qwen2Tokenizer changed the vocabulary or the special token ids")
    shared = dict(
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=SPATIAL_MERGE_SIZE,
        image_mean=list(QWEN_IMAGE_MEAN),
        image_std=list(QWEN_IMAGE_STD),
    )
    image_processor = Qwen2VLImageProcessor(
        min_pixels=size.image_min_pixels, max_pixels=size.image_max_pixels, **shared
    )
    # The capped behaviour (the reference qwen-vl-utils rule, transformers' future default) bounds a
    # whole video's pixels by the context length; choosing it also silences transformers' warning.
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=size.video_min_pixels,
        max_pixels=size.video_max_pixels,
        cap_pixels_per_frame=True,
        max_video_tokens=size.max_position_embeddings,
        **shared,
    )
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=hf_tokenizer,
        video_processor=video_processor,
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )


# ----------------------------------------------------------------------------------------------
# Model config and weights
# ----------------------------------------------------------------------------------------------


def build_config(size: TinyModelSize) -> Any:
    """The transformers ``Qwen2_5_VLConfig`` for ``size`` (fp32, untied embeddings)."""
    from transformers import Qwen2_5_VLConfig

    ids = special_token_ids()
    text_config = dict(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        hidden_act="silu",
        max_position_embeddings=size.max_position_embeddings,
        max_window_layers=size.num_hidden_layers,
        use_sliding_window=False,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": list(size.mrope_section),
        },
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        dtype="float32",
    )
    vision_config = dict(
        depth=size.vision_depth,
        hidden_size=size.vision_hidden_size,
        intermediate_size=size.vision_intermediate_size,
        num_heads=size.vision_num_heads,
        hidden_act="silu",
        in_channels=3,
        patch_size=PATCH_SIZE,
        spatial_merge_size=SPATIAL_MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        tokens_per_second=TOKENS_PER_SECOND,
        window_size=size.vision_window_size,
        fullatt_block_indexes=list(size.vision_fullatt_block_indexes),
        out_hidden_size=size.hidden_size,
        initializer_range=0.02,
        dtype="float32",
    )
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return config


def canonical_checkpoint_name(name: str) -> str:
    """Map a transformers-5 module name to the name published Qwen2.5-VL checkpoints use.

    transformers 5 nests the modules as ``model.visual.*`` and ``model.language_model.*``; the
    published checkpoints (and vLLM's loader, and our adapters) use ``visual.*`` and ``model.*``.
    Names already in the published form pass through unchanged."""
    if name.startswith("model.visual."):
        return name[len("model.") :]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def build_state_dict(config: Any, seed: int) -> dict[str, Any]:
    """Random-init weights (transformers' own init, std = initializer_range) under canonical names."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    # fork_rng: seed the init without disturbing the caller's global RNG state (e.g. under pytest).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    if model.lm_head.weight is model.get_input_embeddings().weight:
        raise RuntimeError("expected an untied lm_head.weight")
    state = {canonical_checkpoint_name(k): v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if len(state) != len(model.state_dict()):
        raise RuntimeError("two module names map to the same checkpoint name")
    return state


def write_generation_config(outdir: Path) -> None:
    """Only token ids; no sampling defaults, because vLLM applies a checkpoint's
    generation_config sampling fields as default SamplingParams and tests should not inherit them."""
    ids = special_token_ids()
    generation_config = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }
    (outdir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")


def write_config(config: Any, size: TinyModelSize, outdir: Path) -> None:
    config_dict = config.to_dict()
    config_dict.pop("transformers_version", None)  # keep the file independent of the installed version
    config_dict.update(flat_text_fields(size))
    (outdir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")


def write_processor_files(processor: Any, size: TinyModelSize, outdir: Path) -> None:
    """Tokenizer files, chat_template.jinja, preprocessor_config.json and
    video_preprocessor_config.json, in the layout of the published checkpoints (which transformers 5
    and vLLM load as well as their newer single processor_config.json)."""
    processor.tokenizer.save_pretrained(str(outdir))  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    for file_name, sub_processor, min_pixels, max_pixels in (
        ("preprocessor_config.json", processor.image_processor, size.image_min_pixels, size.image_max_pixels),
        ("video_preprocessor_config.json", processor.video_processor, size.video_min_pixels, size.video_max_pixels),
    ):
        fields = sub_processor.to_dict()
        # min_pixels / max_pixels are what older readers (and the published configs) use; they
        # equal size's shortest_edge / longest_edge, which transformers 5 reads.
        fields.update(processor_class=type(processor).__name__, min_pixels=min_pixels, max_pixels=max_pixels)
        (outdir / file_name).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


def make_tiny_checkpoint(outdir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a random-init Qwen2.5-VL checkpoint of ``size`` (a key of SIZES) into ``outdir``.

    Deterministic: the same size and seed give byte-identical files."""
    from safetensors.torch import save_file

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SIZES)}")
    model_size = SIZES[size]
    check_vllm_cpu_constraints(model_size)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)

    write_processor_files(build_processor(model_size), model_size, out)
    config = build_config(model_size)
    write_config(config, model_size, out)
    write_generation_config(out)
    save_file(build_state_dict(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_tiny_checkpoint(args.outdir, size=args.size, seed=args.seed)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
