"""Qwen2.5-VL in torchtitan style: args, model, positions, HF state-dict adapter."""

from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs, TextArgs, VisionArgs
from titanrl.models.qwen2_5_vl.model import Qwen2_5_VLModel
from titanrl.models.qwen2_5_vl.positions import VisionGrid, mrope_position_ids
from titanrl.models.qwen2_5_vl.state_dict_adapter import (
    Qwen2_5_VLStateDictAdapter,
    load_hf_weights,
    save_hf_checkpoint,
)

__all__ = [
    "Qwen2_5_VLArgs",
    "Qwen2_5_VLModel",
    "Qwen2_5_VLStateDictAdapter",
    "TextArgs",
    "VisionArgs",
    "VisionGrid",
    "load_hf_weights",
    "mrope_position_ids",
    "save_hf_checkpoint",
]
