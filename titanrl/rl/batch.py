"""Rollouts as training data: one ``Trajectory`` per sampled response, packed into microbatches.

A trajectory is prompt + response; only response tokens are scored (the prompt is context).
``pack_trajectories`` packs whole trajectories (the reference path, the probe); the training
stages place whole or sliced trajectories through ``titanrl.rl.exchange``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from titanrl.data.preprocess import PreparedSample
from titanrl.models.packed import PackedBatch, pack_sequences
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
from titanrl.models.qwen2_5_vl.model import LogprobTargets


@dataclass
class Trajectory:
    prompt: PreparedSample
    group: int  # global batch position of the prompt: GRPO's group, the minibatch key
    response_index: int = 0  # which of the prompt's rollout.n samples (with group: the same key on any world size)
    response_ids: np.ndarray = None  # int64 [R], as sampled (may end with the EOS token)
    rollout_logprobs: np.ndarray = None  # float32 [R], from the rollout engine
    finish_reason: str = "stop"
    response_text: str = ""
    reward: float = 0.0
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None  # [R]
    ref_logprobs: torch.Tensor | None = None  # [R]
    extras: dict = field(default_factory=dict)
    version: int = 0  # the policy version (updates pushed to the engine) that generated its first token
    token_versions: np.ndarray | None = None  # int32 [R]: the version of each token (partial rollouts: rising)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt.prompt_ids) + len(self.response_ids)

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)


@dataclass
class TrainingPack:
    batch: PackedBatch
    targets: LogprobTargets
    seq_index: torch.Tensor  # [K] which local trajectory each scored token belongs to
    seq_lengths: torch.Tensor  # [S] response tokens per trajectory


def pack_trajectories(
    trajs: list[Trajectory], args: Qwen2_5_VLArgs, device: torch.device, dtype: torch.dtype,
    *, temperature: float = 1.0, return_entropy: bool = False,
) -> TrainingPack:
    seqs, positions, seq_index = [], [], []
    offset = 0
    for i, t in enumerate(trajs):
        ids = np.concatenate([t.prompt.prompt_ids, t.response_ids])
        pixels = torch.from_numpy(t.prompt.pixel_values) if t.prompt.pixel_values is not None else None
        seq = make_sequence_input(args, ids, t.prompt.grids, pixels)
        seq.vision_key = id(t.prompt)  # the n responses of a prompt share one vision encoding
        seqs.append(seq)
        first = offset + len(t.prompt.prompt_ids)
        positions.append(np.arange(first - 1, first - 1 + len(t.response_ids)))
        seq_index.append(np.full(len(t.response_ids), i))
        offset += len(ids)
    batch = pack_sequences(seqs, spatial_merge_size=args.vision.spatial_merge_size).to(device, dtype)
    pos = torch.from_numpy(np.concatenate(positions)).to(device)
    return TrainingPack(
        batch=batch,
        targets=LogprobTargets(positions=pos, token_ids=batch.input_ids[pos + 1], temperature=temperature,
                               return_entropy=return_entropy),
        seq_index=torch.from_numpy(np.concatenate(seq_index)).to(device),
        seq_lengths=torch.tensor([t.num_response_tokens for t in trajs], device=device),
    )


def dummy_pack(args: Qwen2_5_VLArgs, device: torch.device, dtype: torch.dtype) -> TrainingPack:
    """A two-token text sequence scored with zero weight: a rank with fewer microbatches runs it
    so every rank issues the same FSDP collectives."""
    seq = make_sequence_input(args, np.array([0, 0], dtype=np.int64))
    batch = pack_sequences([seq]).to(device, dtype)
    pos = torch.zeros(1, dtype=torch.int64, device=device)
    return TrainingPack(batch, LogprobTargets(pos, batch.input_ids[pos + 1]),
                        torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, device=device))
