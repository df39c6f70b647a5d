"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen2.5-VL checkpoint directory (seed 0), built once per test session.

    Shared by every test in the session: treat it as read-only, and copy it (shutil.copytree)
    before writing into it."""
    from titanrl.models.make_tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt") / "qwen2_5_vl_tiny", size="tiny", seed=0)
