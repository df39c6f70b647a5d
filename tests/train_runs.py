"""Tiny end-to-end training runs for tests that compare runs (``titanrl.rl.dump``), the references several tests
share (run once per session), and what a failed run's assertion shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SHARED: dict[tuple, Path] = {}


def launch(nproc: int) -> list[str]:
    """``titanrl.train`` on one process (no torchrun) or under torchrun with ``nproc`` ranks."""
    if nproc == 1:
        return [sys.executable, "-m", "titanrl.train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
            "titanrl.train"]


def shared_run(cache: Path, nproc: int, *overrides: str, timeout: float = 1200) -> Path:
    """A reference run several tests compare against (``configs/tiny_cpu.toml`` with ``overrides`` on ``nproc``
    ranks): made once per session under ``cache`` and reused by every test that asks for the same one. Returns
    its run folder."""
    key = (str(cache), nproc, overrides)
    if key not in _SHARED:
        out = Path(cache) / "shared_runs" / f"run{len(_SHARED)}"
        argv = launch(nproc) + ["--config", "configs/tiny_cpu.toml", f"--model.cache_dir={cache}",
                                f"--job.dump_folder={out}", *overrides]
        proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0, failure_report(proc)
        _SHARED[key] = out / "tiny_cpu"
    return _SHARED[key]


def train_tiny(tmp_path, cache, name, nproc, *extra, shared: bool = False):
    """``titanrl.train`` on the tiny CPU config (2 steps, tensors dumped, old log-probs recomputed, video-heavy,
    4 prompts, 2 minibatches, 300 tokens per microbatch) with ``nproc`` ranks (1: no torchrun) and ``extra``
    overrides; returns the run folder (``titanrl.rl.dump.load_dumps`` reads it) and its metric records.
    ``shared``: a reference other tests use too (:func:`shared_run`), run once per session."""
    common = ["--job.steps=2", "--checkpoint.enable=false", "--metrics.dump_tensors", "--rl.old_logprobs=recompute",
              "--rl.minibatches=2", "--rl.global_batch_size=4", "--data.mixture=video-heavy",
              "--balance.max_tokens_per_microbatch=300"]
    if shared:
        run_dir = shared_run(cache, nproc, *common, *extra)
    else:
        argv = launch(nproc) + ["--config", "configs/tiny_cpu.toml", f"--model.cache_dir={cache}", *common,
                                f"--job.dump_folder={tmp_path / name}", *extra]
        proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=1200)
        assert proc.returncode == 0, failure_report(proc)
        run_dir = tmp_path / name / "tiny_cpu"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return run_dir, [json.loads(line) for line in lines]


def failure_report(proc: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """A failed ``titanrl.train`` run: the ends of its stdout and stderr, then of every rank's log under the
    command's ``--job.dump_folder`` (a rank that hung writes its threads' stacks there when another rank fails:
    ``titanrl.workflow.abort``)."""
    parts = [proc.stdout[-tail:], proc.stderr[-tail:]]
    folders = [a.split("=", 1)[1] for a in proc.args if isinstance(a, str) and a.startswith("--job.dump_folder=")]
    for folder in folders:
        for log in sorted(Path(folder).glob("*/logs/rank*.log")):
            parts.append(f"\n----- {log} (end) -----\n" + log.read_text(errors="replace")[-tail:])
    return "".join(parts)
