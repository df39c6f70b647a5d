"""Model arguments for Qwen2.5-VL, read from an HF ``config.json``.

Plain dataclasses (no transformers import) so planners and the config layer can
reason about model shapes without loading anything heavy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class VisionArgs:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    out_hidden_size: int = 3584
    tokens_per_second: float = 2.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    hidden_act: str = "silu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: C * T * P * P (the processor's pixel_values row)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2


@dataclass(frozen=True)
class TextArgs:
    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 128000

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class Qwen2_5_VLArgs:
    text: TextArgs = field(default_factory=TextArgs)
    vision: VisionArgs = field(default_factory=VisionArgs)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    eos_token_id: int = 151645
    pad_token_id: int | None = None
    # Kept verbatim so an export writes back the config it was loaded from.
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "Qwen2_5_VLArgs":
        """Accepts both layouts of config.json: transformers 4.x (text keys at the top level)
        and 5.x (a nested ``text_config``), and both rope spellings (rope_scaling / rope_parameters)."""
        if cfg.get("model_type") not in (None, "qwen2_5_vl"):
            raise ValueError(f"expected a qwen2_5_vl config, got model_type={cfg.get('model_type')!r}")
        text_cfg = {**cfg, **(cfg.get("text_config") or {})}
        vis = cfg.get("vision_config") or {}
        rope = text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", text_cfg.get("rope_theta", 1000000.0))
        mrope = tuple(rope.get("mrope_section", (16, 24, 24)))
        vis_rope = vis.get("rope_parameters") or {}
        text = TextArgs(
            vocab_size=text_cfg["vocab_size"],
            hidden_size=text_cfg["hidden_size"],
            intermediate_size=text_cfg["intermediate_size"],
            num_hidden_layers=text_cfg["num_hidden_layers"],
            num_attention_heads=text_cfg["num_attention_heads"],
            num_key_value_heads=text_cfg.get("num_key_value_heads", text_cfg["num_attention_heads"]),
            rms_norm_eps=text_cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            mrope_section=mrope,  # type: ignore[arg-type]
            hidden_act=text_cfg.get("hidden_act", "silu"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False))),
            max_position_embeddings=text_cfg.get("max_position_embeddings", 128000),
        )
        if 2 * sum(text.mrope_section) != text.head_dim:
            raise ValueError(
                f"mrope_section {text.mrope_section} must sum to head_dim/2 = {text.head_dim // 2}"
            )
        vision = VisionArgs(
            depth=vis.get("depth", 32),
            hidden_size=vis.get("hidden_size", 1280),
            intermediate_size=vis.get("intermediate_size", 3420),
            num_heads=vis.get("num_heads", 16),
            in_channels=vis.get("in_channels", vis.get("in_chans", 3)),
            patch_size=vis.get("patch_size", 14),
            temporal_patch_size=vis.get("temporal_patch_size", 2),
            spatial_merge_size=vis.get("spatial_merge_size", 2),
            window_size=vis.get("window_size", 112),
            fullatt_block_indexes=tuple(vis.get("fullatt_block_indexes", (7, 15, 23, 31))),
            out_hidden_size=vis.get("out_hidden_size", text.hidden_size),
            tokens_per_second=float(vis.get("tokens_per_second", 2)),
            rope_theta=float(vis_rope.get("rope_theta", 10000.0)),
            hidden_act=vis.get("hidden_act", "silu"),
        )
        eos = cfg.get("eos_token_id", text_cfg.get("eos_token_id", 151645))
        if isinstance(eos, list):
            eos = eos[0]
        return cls(
            text=text,
            vision=vision,
            image_token_id=cfg.get("image_token_id", 151655),
            video_token_id=cfg.get("video_token_id", 151656),
            vision_start_token_id=cfg.get("vision_start_token_id", 151652),
            vision_end_token_id=cfg.get("vision_end_token_id", 151653),
            eos_token_id=eos,
            pad_token_id=cfg.get("pad_token_id", text_cfg.get("pad_token_id")),
            hf_config=cfg,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Qwen2_5_VLArgs":
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        return cls.from_hf_config(json.loads(config_path.read_text()))
