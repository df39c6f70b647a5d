"""Environments for multi-turn rollouts (``rl.env``, ``rollout.max_turns > 1``).

An environment is a class loaded like a reward (``"path/to/file.py:ClassName"`` or ``"module:ClassName"``),
constructed once per trajectory as ``ClassName(record)`` (the sample's :class:`~titanrl.data.manifest.SampleRecord`:
prompt, answer, source, and its media with absolute paths). After each turn the rollout calls
``step(response) -> dict`` with that turn's response text:

- ``"observation"``: str or None - text appended to the conversation as the next user message;
- ``"images"``: a list of ``H x W x 3`` uint8 numpy arrays (may be empty) - shown in that message, before its text;
- ``"done"``: bool - the episode ends with this response (its text is the answer ``rl.reward`` scores);
- ``"reward"`` (optional): float - the trajectory's reward, in place of ``rl.reward``'s score.

A ``step`` that raises or returns something else ends its trajectory with reward 0, counted in
``rollout/env_errors`` (with ``rl.on_reward_error = "error"`` the run stops naming the sample).
``titanrl.envs.zoom:ZoomEnv`` is the built-in example (docs/multiturn.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from titanrl.data.manifest import SampleRecord


class EnvError(ValueError):
    """An environment's ``step`` raised or returned something malformed; the message says which and why."""


@dataclass
class EnvStep:
    observation: str | None
    images: list[np.ndarray] = field(default_factory=list)
    done: bool = False
    reward: float | None = None


def check_step(value: Any, *, max_images: int) -> EnvStep:
    """``value`` (what ``step`` returned) as an :class:`EnvStep`, or EnvError saying what is wrong with it."""
    if not isinstance(value, dict):
        raise EnvError(f"step returned {type(value).__name__}, not a dict with 'observation', 'images', 'done'")
    unknown = set(value) - {"observation", "images", "done", "reward"}
    if unknown:
        raise EnvError(f"step returned unknown keys {sorted(unknown)} (allowed: observation, images, done, reward)")
    if "done" not in value or not isinstance(value["done"], (bool, np.bool_)):
        raise EnvError(f"step's 'done' must be a bool, got {value.get('done')!r}")
    observation = value.get("observation")
    if observation is not None and not isinstance(observation, str):
        raise EnvError(f"step's 'observation' must be a str or None, got {type(observation).__name__}")
    images = value.get("images") or []
    if not isinstance(images, (list, tuple)):
        raise EnvError(f"step's 'images' must be a list of arrays, got {type(images).__name__}")
    if len(images) > max_images:
        raise EnvError(f"step returned {len(images)} images; rollout.max_turn_images allows {max_images}")
    checked = []
    for i, image in enumerate(images):
        a = np.asarray(image)
        if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3 or min(a.shape[:2]) < 1:
            raise EnvError(f"step's image {i} must be an H x W x 3 uint8 array, got {a.dtype} {a.shape}")
        checked.append(a if a.flags.writeable and a.flags.c_contiguous else np.array(a))  # ours to keep and read
    reward = value.get("reward")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float, np.floating, np.integer)) \
                or not math.isfinite(float(reward)):
            raise EnvError(f"step's 'reward' must be a finite number, got {reward!r}")
        reward = float(reward)
    return EnvStep(observation, checked, bool(value["done"]), reward)


def load_env(spec: str) -> Callable[[SampleRecord], Any]:
    """The class ``spec`` names (ConfigError naming the file, module or name that is missing)."""
    from titanrl.workflow.functions import load_function

    return load_function(spec, "rl.env")


def env_record(record: SampleRecord, manifest_dir: str | Path | None) -> SampleRecord:
    """The record an environment is given: its media paths made absolute (against the manifest's folder)."""
    if manifest_dir is None:
        return record
    media = [replace(m, path=str((Path(manifest_dir) / m.path).resolve())) for m in record.media]
    return replace(record, media=media)


__all__ = ["EnvError", "EnvStep", "check_step", "env_record", "load_env"]
