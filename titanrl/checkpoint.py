"""Checkpoints through torchtitan's DCP ``CheckpointManager``: model, optimizer, LR schedule,
data position and RNG states, in ``<run_dir>/<checkpoint.folder>/step-N``.

The optimizer goes through ``get/set_optimizer_state_dict`` (FQN-keyed, FSDP-aware) rather than
``optimizer.state_dict()`` (keyed by parameter index). RNG states differ per rank, so they are
saved under a per-rank key: DCP deduplicates identical non-tensor keys across ranks.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpointer.dcp import CheckpointManager

from titanrl.config import JobConfig


class OptimizerState(Stateful):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(
            self.model, self.optimizer, state_dict, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )


class ModelState(Stateful):
    """A further model's parameters (the critic), FQN-keyed and FSDP-aware like the policy's."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class SchedulerState(Stateful):
    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict({**state_dict, "lr_lambdas": [None] * len(self.scheduler.lr_lambdas)})


class RNGState(Stateful):
    """Python, NumPy and torch generator states of this rank, under a per-rank key."""

    def __init__(self, rank: int) -> None:
        self.key = f"rank{rank}"

    def state_dict(self) -> dict[str, Any]:
        return {
            self.key: {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
            }
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = state_dict.get(self.key)
        if mine is None:
            return  # resumed on a different world size: keep fresh generators
        random.setstate(mine["python"])
        np.random.set_state(mine["numpy"])
        torch.set_rng_state(mine["torch"])


class CallbackState(Stateful):
    """A Stateful from two functions (the trainer's step counter, the loader position)."""

    def __init__(self, get: Callable[[], dict[str, Any]], put: Callable[[dict[str, Any]], None]) -> None:
        self._get, self._put = get, put

    def state_dict(self) -> dict[str, Any]:
        return self._get()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._put(state_dict)


class _Nothing(Stateful):
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


_NOTHING = _Nothing()


def build_checkpoint_manager(
    cfg: JobConfig,
    *,
    model: torch.nn.Module | None,
    model_view: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    dataloader: Stateful,
    extra_states: dict[str, Stateful],
) -> CheckpointManager:
    c = cfg.checkpoint
    manager_cfg = CheckpointManager.Config(
        enable=c.enable,
        folder=str(cfg.checkpoint_dir),
        interval=c.interval,
        keep_latest_k=c.keep_latest_k,
        async_mode=c.async_mode,
        last_save_model_only=False,
    )
    return CheckpointManager(
        manager_cfg,
        dataloader=dataloader,  # type: ignore[arg-type]
        # a rank without the models (the rollout ranks of a disaggregated placement) saves no model state
        # (``model_view``: what of the model it saves, e.g. LoRA's adapters: titanrl.models.lora.AdapterCheckpoint)
        model_parts=[model_view or model] if model is not None else [],
        optimizers=OptimizerState(model, optimizer) if model is not None else _NOTHING,  # type: ignore[arg-type]
        lr_schedulers=SchedulerState(lr_scheduler) if model is not None else _NOTHING,  # type: ignore[arg-type]
        states=dict(extra_states),
        sd_adapter=None,
        base_folder="",
    )


def remove_incomplete(folder: Path) -> list[Path]:
    """Remove the ``step-N`` folders a save left half-written (a process killed while saving): DCP writes its
    ``.metadata`` last, so a folder without it never held a complete checkpoint (torchtitan's resume skips it; this
    keeps it from being counted among ``checkpoint.keep_latest_k``). Returns what it removed."""
    import shutil

    removed = []
    if folder.is_dir():
        for d in sorted(folder.glob("step-*")):
            if d.is_dir() and d.name.removeprefix("step-").isdigit() and not (d / ".metadata").is_file():
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
    return removed


class CheckpointError(RuntimeError):
    """A DCP load or save that failed, named: which folder, which ranks, the first rank's error."""


@contextmanager
def named_checkpoint_errors(action: str, folder: Path) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` into a ``CheckpointError`` with one line naming the cause. DCP's exception
    derives from ``BaseException``: it passes every ``except Exception`` and would end the rank with a bare
    traceback and no named line. A load that misses keys is the checkpoint of other settings."""
    try:
        yield
    except CheckpointException as err:
        failures = err.failures
        first = failures[min(failures)] if failures else None
        exc = first[0] if isinstance(first, tuple) else first
        cause = f"{type(exc).__name__}: {str(exc).rstrip('.')}" if exc is not None else "unknown error"
        message = f"checkpoint {action} in {folder} failed on rank(s) {sorted(failures)}: {cause}"
        if action == "load" and "Missing key" in cause:
            message += (". The checkpoint holds other parameters or optimizer states than this run builds: it was "
                        "saved with other settings (model.freeze_vision_tower, [lora], rl.algorithm, the model). "
                        "Resume with those, or start afresh (checkpoint.resume = false, or another job.dump_folder)")
        raise CheckpointError(message) from err
