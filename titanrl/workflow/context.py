"""What a node function receives besides its batch: ``NodeContext``, a typed view of the rank's set-up holding only
what the built-in nodes use, and ``RunState``, what they carry from one step to the next.

The trainer builds both once (``titanrl.trainer.Trainer``); nodes never see the trainer. A user's node gets the same
context (``docs/workflow.md``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from titanrl.config import JobConfig
    from titanrl.data.prompt import PromptEncoder
    from titanrl.distributed import DistInfo
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs
    from titanrl.rl.weight_sync import WeightPusher
    from titanrl.workflow.placement import Placement


@dataclass
class RunState:
    """A rank's state across steps (the trainer checkpoints it with the rest of the run)."""

    step: int = 0  # steps done
    partial_rollouts: dict[int, list] = field(default_factory=dict)  # unfinished groups of this rollout rank
    probe_violations: int = 0  # consecutive probes over rollout.probe_tolerance
    stage_key: Any = None  # which step's trajectories the stage runner's plan was made for


@dataclass
class NodeContext:
    """The run's parts a node may use. Models, optimizers and the stage runner are None on a rank that holds no
    model (a rollout rank of a disaggregated placement); the engine, rewards and loader's prompts are a generating
    rank's."""

    cfg: "JobConfig"
    info: "DistInfo"
    placement: "Placement"
    state: RunState
    args: "Qwen2_5_VLArgs"
    param_dtype: "torch.dtype"
    generates: bool
    # data and rollout
    loader: Any
    encoder: "PromptEncoder"
    engine: Any
    rewards: Any
    skips: Any
    pusher: "WeightPusher | None"
    # models and their updates
    model: Any = None
    ref_model: Any = None
    critic: Any = None
    stages: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    critic_optimizer: Any = None
    critic_lr_scheduler: Any = None
    policy_loss: Callable | None = None
    behaviour_weighted: bool = False  # titanrl.rl.grpo.behaviour_weighted
    turns: Any = None  # multi-turn rollouts (rollout.max_turns > 1): titanrl.rl.turns.TurnSetup

    @property
    def step(self) -> int:
        """Steps done before the one running."""
        return self.state.step
