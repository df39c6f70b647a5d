"""Environments for the multi-turn tests (``rl.env = "<this file>:ScriptedEnv"``): fixed observations whatever the
policy says, so every run of a test sees the same turns."""

from __future__ import annotations

import zlib

import numpy as np


def picture(sample_id: str, turn: int) -> np.ndarray:
    """A 42 x 70 picture that depends on the sample and the turn only."""
    rng = np.random.default_rng(zlib.crc32(f"{sample_id}:{turn}".encode()))
    return rng.integers(0, 256, (42, 70, 3), dtype=np.uint8)


class ScriptedEnv:
    """Turn 1 -> a text and one picture; turn 2 -> a text only; then done (3 turns with rollout.max_turns >= 3)."""

    def __init__(self, record) -> None:
        self.id = record.id
        self.turn = 0

    def step(self, response: str) -> dict:
        self.turn += 1
        if self.turn == 1:
            return {"observation": "look closer", "images": [picture(self.id, 1)], "done": False}
        if self.turn == 2:
            return {"observation": "now answer", "images": [], "done": False}
        return {"observation": None, "images": [], "done": True}


class RaisingEnv(ScriptedEnv):
    """ScriptedEnv whose second step raises for about half of the samples (by their ids)."""

    def step(self, response: str) -> dict:
        if self.turn == 1 and zlib.crc32(self.id.encode()) % 2 == 0:
            raise RuntimeError(f"scripted failure on {self.id}")
        return super().step(response)


class SlowEnv(ScriptedEnv):
    """ScriptedEnv whose first step never returns in time (it sleeps 30 s)."""

    def step(self, response: str) -> dict:
        import time

        time.sleep(30)
        return super().step(response)
