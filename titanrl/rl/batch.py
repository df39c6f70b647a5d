"""Rollouts as training data: one ``Trajectory`` per sampled response, packed into microbatches.

A trajectory is prompt + response; only response tokens are scored (the prompt is context), and of a multi-turn
response only the tokens the policy generated (its observations are context too).
``pack_trajectories`` packs whole trajectories (the reference path, the probe); the training
stages place whole or sliced trajectories through ``titanrl.rl.exchange``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from titanrl.data.preprocess import PreparedSample
from titanrl.models.packed import PackedBatch, pack_sequences
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
from titanrl.models.qwen2_5_vl.model import LogprobTargets
from titanrl.rl.units import generated_spans


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
    # Multi-turn (rollout.max_turns > 1): the response holds every turn, the observations between them included;
    # ``generated`` marks the tokens the policy sampled (the only ones scored, trained and probed; None: all), and
    # the observations' images follow the prompt's media (their placeholders are in the response)
    generated: np.ndarray | None = None  # bool [R]
    turn_media: list = field(default_factory=list)  # DecodedMedia of the observations' images, in order
    turn_grids: list = field(default_factory=list)  # VisionGrid of each
    turn_pixels: np.ndarray | None = None  # float32 [sum of their patches, patch_dim]
    turns: int = 1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt.prompt_ids) + len(self.response_ids)

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.response_ids) if self.generated is None else int(self.generated.sum())

    @property
    def longest_turn(self) -> int:
        """The most tokens the policy generated in one turn (a run of ``generated``; single-turn: the response)."""
        if self.generated is None:
            return len(self.response_ids)
        return max((b - a for a, b in generated_spans(np.asarray(self.generated))), default=0)

    @property
    def grids(self) -> list:
        """Every media item's grid in token order: the prompt's, then the observations'."""
        return list(self.prompt.grids) + list(self.turn_grids)

    @property
    def pixel_values(self) -> np.ndarray | None:
        """Pixel rows of :attr:`grids` (None where the prompt came without its pixels: slice-aware loading fetches
        them; the observations' rows are then read from ``turn_pixels``)."""
        if self.turn_pixels is None:
            return self.prompt.pixel_values
        if self.prompt.pixel_values is None:
            if self.prompt.grids:
                return None  # the prompt's rows are fetched (slice-aware loading); the observations' are sent
            return self.turn_pixels
        return np.concatenate([self.prompt.pixel_values, self.turn_pixels])

    def request(self, encoder) -> "RolloutRequest":
        """The engine request of the trajectory's whole context (the probe scores its response after it)."""
        from titanrl.rollout import RolloutRequest

        base = RolloutRequest.from_prepared(self.prompt, encoder)
        if not self.turn_grids:
            return base
        return replace(base, media=list(self.prompt.media) + list(self.turn_media), grids=self.grids,
                       pixel_values=self.pixel_values)


@dataclass
class TrainingPack:
    batch: PackedBatch
    targets: LogprobTargets
    seq_index: torch.Tensor  # [K] which local trajectory each scored token belongs to
    seq_lengths: torch.Tensor  # [S] scored (generated) response tokens per trajectory


def pack_trajectories(
    trajs: list[Trajectory], args: Qwen2_5_VLArgs, device: torch.device, dtype: torch.dtype,
    *, temperature: float = 1.0, return_entropy: bool = False,
) -> TrainingPack:
    seqs, positions, seq_index = [], [], []
    offset = 0
    for i, t in enumerate(trajs):
        ids = np.concatenate([t.prompt.prompt_ids, t.response_ids])
        pixels = t.pixel_values
        seq = make_sequence_input(args, ids, t.grids, torch.from_numpy(pixels) if pixels is not None else None)
        # the n responses of a prompt share one vision encoding (a multi-turn trajectory's images are its own)
        seq.vision_key = id(t.prompt) if not t.turn_grids else id(t)
        seqs.append(seq)
        first = offset + len(t.prompt.prompt_ids)
        scored = np.arange(len(t.response_ids)) if t.generated is None else np.flatnonzero(t.generated)
        positions.append(first - 1 + scored)
        seq_index.append(np.full(len(scored), i))
        offset += len(ids)
    batch = pack_sequences(seqs, spatial_merge_size=args.vision.spatial_merge_size).to(device, dtype)
    pos = torch.from_numpy(np.concatenate(positions)).to(device)
    return TrainingPack(
        batch=batch,
        targets=LogprobTargets(positions=pos, token_ids=batch.input_ids[pos + 1], temperature=temperature,
                               return_entropy=return_entropy),
        seq_index=torch.from_numpy(np.concatenate(seq_index)).to(device),
        seq_lengths=torch.tensor([t.num_generated_tokens for t in trajs], device=device),
    )


def dummy_pack(args: Qwen2_5_VLArgs, device: torch.device, dtype: torch.dtype) -> TrainingPack:
    """A two-token text sequence scored with zero weight: a rank with fewer microbatches runs it
    so every rank issues the same FSDP collectives."""
    seq = make_sequence_input(args, np.array([0, 0], dtype=np.int64))
    batch = pack_sequences([seq]).to(device, dtype)
    pos = torch.zeros(1, dtype=torch.int64, device=device)
    return TrainingPack(batch, LogprobTargets(pos, batch.input_ids[pos + 1]),
                        torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, device=device))
