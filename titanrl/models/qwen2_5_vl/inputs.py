"""Turn one tokenized sequence + its vision inputs into the model's ``SequenceInput``."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from titanrl.models.packed import SequenceInput
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.models.qwen2_5_vl.positions import VisionGrid, mrope_position_ids


def make_sequence_input(
    args: Qwen2_5_VLArgs,
    token_ids: Sequence[int] | np.ndarray,
    grids: Sequence[VisionGrid] = (),
    pixel_values: torch.Tensor | None = None,
) -> SequenceInput:
    ids = np.asarray(token_ids, dtype=np.int64)
    positions = mrope_position_ids(
        ids,
        list(grids),
        image_token_id=args.image_token_id,
        video_token_id=args.video_token_id,
        spatial_merge_size=args.vision.spatial_merge_size,
        tokens_per_second=args.vision.tokens_per_second,
    )
    return SequenceInput(token_ids=ids, position_ids=positions, grids=list(grids), pixel_values=pixel_values)
