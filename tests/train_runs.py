"""A tiny end-to-end training run for tests that compare runs (``titanrl.rl.dump``), and what a failed run's
assertion shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def train_tiny(tmp_path, cache, name, nproc, *extra):
    """``titanrl.train`` on the tiny CPU config (2 steps, tensors dumped, old log-probs recomputed, video-heavy,
    4 prompts, 2 minibatches, 300 tokens per microbatch) with ``nproc`` ranks (1: no torchrun) and ``extra``
    overrides; returns the run folder (``titanrl.rl.dump.load_dumps`` reads it) and its metric records."""
    root = Path(__file__).resolve().parents[1]
    launch = [sys.executable, "-m", "titanrl.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
        "titanrl.train"]
    common = ["--config", "configs/tiny_cpu.toml", f"--model.cache_dir={cache}", "--job.steps=2",
              "--checkpoint.enable=false", "--metrics.dump_tensors", "--rl.old_logprobs=recompute",
              "--rl.minibatches=2", "--rl.global_batch_size=4", "--data.mixture=video-heavy",
              "--balance.max_tokens_per_microbatch=300", f"--job.dump_folder={tmp_path / name}"]
    proc = subprocess.run(launch + common + list(extra), cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, failure_report(proc)
    lines = (tmp_path / name / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()
    return tmp_path / name / "tiny_cpu", [json.loads(line) for line in lines]


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
