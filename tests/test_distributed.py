"""FSDP2 (gloo) training steps equal the single-process result.

``tests/dist/fsdp_step.py`` runs two AdamW steps of the tiny model on a fixed global batch of
text, image, multi-image and video sequences, once as one plain process (no FSDP: the
reference) and under torchrun with 2 and 4 ranks, eager and with torch.compile (inductor).
Ranks see different media (some only text), which also proves the collectives stay matched.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import fork_launch
import pytest
import torch

SCRIPT = Path(__file__).parent / "dist" / "fsdp_step.py"
TOL = 1e-5


def run(out: Path, nproc: int | None, *extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc is None:
        cmd = [sys.executable, str(SCRIPT)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--standalone", str(SCRIPT)]
    proc = fork_launch.run(cmd + ["--out", str(out), *extra], env, timeout=300)
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        # Seen once in ~30 runs: a rank aborting in gloo's teardown after the work was done.
        # Run once more so that rare teardown flake does not fail CI; a second failure does.
        proc = fork_launch.run(cmd + ["--out", str(out), *extra], env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ref") / "ref.pt", None)


def assert_same(ref: dict, got: dict) -> None:
    assert set(ref["params"]) == set(got["params"])
    for a, b in zip(ref["losses"], got["losses"]):
        assert abs(a - b) < TOL, (ref["losses"], got["losses"])
    for name in ref["grads"]:
        err = (ref["grads"][name] - got["grads"][name]).abs().max().item()
        assert err < TOL, f"grad {name}: {err:.2e}"
    for name in ref["params"]:
        err = (ref["params"][name] - got["params"][name]).abs().max().item()
        assert err < TOL, f"param {name}: {err:.2e}"
    # the run must actually have trained
    assert ref["losses"][1] < ref["losses"][0]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp_matches_single_process(tmp_path, reference, nproc):
    assert_same(reference, run(tmp_path / "d.pt", nproc))


@pytest.mark.slow
def test_fsdp_with_compile_matches_single_process(tmp_path, reference):
    assert_same(reference, run(tmp_path / "c.pt", 2, "--compile", "inductor"))


@pytest.mark.slow
def test_fsdp_with_activation_checkpointing_matches(tmp_path, reference):
    assert_same(reference, run(tmp_path / "ac.pt", 2, "--ac", "full"))
