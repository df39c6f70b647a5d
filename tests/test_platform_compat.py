"""The CUDA-only torchvision/torchaudio/torchcodec wheels import next to CPU torch, in this
process, in a fresh interpreter and in a *spawned* child (how vLLM starts its engine core)."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.version.cuda is not None, reason="the hook only acts on CPU builds of torch")

IMPORTS = "import torchvision, torchaudio, transformers.models.qwen2_vl.video_processing_qwen2_vl; print('ok')"


def _import_in_child(queue) -> None:
    import torchaudio  # noqa: F401
    import torchvision  # noqa: F401

    queue.put("ok")


def test_imports_in_a_fresh_interpreter():
    proc = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_torchcodec_is_a_clean_import_error():
    code = "import torchcodec.decoders"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "ImportError" in proc.stderr and "no CPU build" in proc.stderr


def test_hook_can_be_turned_off():
    env = {**os.environ, "TITANRL_NO_PLATFORM_COMPAT": "1"}
    proc = subprocess.run([sys.executable, "-c", "import torchvision"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0  # proves the hook is what makes the import work


def test_the_packages_import_in_a_spawned_child():
    """(vLLM itself imports in spawned children in every disaggregated run: its engine core is one, e.g. test_async.)"""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_import_in_child, args=(queue,))
    child.start()
    child.join(timeout=300)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == "ok"


def test_a_missing_start_up_hook_is_named_with_the_fix(monkeypatch):
    """The hook ran in this interpreter (the installed titanrl is this checkout): no problem. Without it (an install
    of another checkout: this one found on the current folder), the trainer and the suite stop with one line naming
    both places and the command, not with vLLM's import naming torchvision."""
    from titanrl import _platform_compat as compat

    assert compat.start_up_problem() is None
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, compat._CompatFinder)])
    problem = compat.start_up_problem()
    here = os.path.dirname(os.path.dirname(os.path.abspath(compat.__file__)))
    assert problem and "did not run" in problem and here in problem and "pip install -e ." in problem, problem
    monkeypatch.setenv("TITANRL_NO_PLATFORM_COMPAT", "1")  # turned off on purpose
    assert compat.start_up_problem() is None
