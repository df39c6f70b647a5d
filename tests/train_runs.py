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


def run_tiny(out: Path, cache: Path, nproc: int, *overrides: str, timeout: float = 1200) -> Path:
    """``titanrl.train`` on ``configs/tiny_cpu.toml`` with ``overrides``, its run folder under ``out``; returns the
    run folder (a failed run fails the test with :func:`failure_report`)."""
    argv = launch(nproc) + ["--config", "configs/tiny_cpu.toml", f"--model.cache_dir={cache}",
                            f"--job.dump_folder={out}", *overrides]
    proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, failure_report(proc)
    return Path(out) / "tiny_cpu"


def shared_run(cache: Path, nproc: int, *overrides: str) -> Path:
    """A reference run several tests compare against (:func:`run_tiny`): made once per session under ``cache`` and
    reused by every test that asks for the same one. Returns its run folder."""
    key = (str(cache), nproc, overrides)
    if key not in _SHARED:
        _SHARED[key] = run_tiny(Path(cache) / "shared_runs" / f"run{len(_SHARED)}", cache, nproc, *overrides)
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
        run_dir = run_tiny(tmp_path / name, cache, nproc, *common, *extra)
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
