"""Metrics a person can watch: a compact line per step on stdout, JSONL always, TensorBoard
when enabled. Only rank 0 writes; values are already reduced across ranks by the caller."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def format_step_line(step: int, total: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}/{total}"]
    for key, fmt in (
        ("loss", "loss {:.4f}"),
        ("reward/mean", "reward {:.3f}"),
        ("reward/accuracy", "acc {:.3f}"),
        ("kl", "kl {:.4f}"),
        ("entropy", "ent {:.3f}"),
        ("grad_norm", "gnorm {:.3f}"),
        ("throughput/tokens_per_s", "{:.0f} tok/s"),
    ):
        if key in metrics:
            parts.append(fmt.format(metrics[key]))
    timings = [f"{k.split('/', 1)[1]} {v:.2f}s" for k, v in metrics.items() if k.startswith("time/")]
    if timings:
        parts.append("[" + ", ".join(timings) + "]")
    if metrics.get("data/skipped", 0):
        parts.append(f"skipped {int(metrics['data/skipped'])}")
    return " | ".join(parts)


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        jsonl: bool,
        tensorboard: bool,
        total_steps: int,
        progress: str = "line",
        wandb: bool = False,
        wandb_project: str = "titanrl",
        wandb_mode: str = "offline",
        run_name: str = "",
        config: dict | None = None,
    ) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.progress = progress
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        if wandb:
            import wandb as wandb_lib

            self._wandb = wandb_lib.init(
                project=wandb_project, name=run_name, mode=wandb_mode, dir=str(run_dir), config=config or {}
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.progress != "none":
            line = format_step_line(step, self.total_steps, metrics)
            if self.progress == "bar":
                done = int(20 * step / max(self.total_steps, 1))
                line = f"[{'#' * done}{'.' * (20 - done)}] " + line
            print(line, file=sys.stdout, flush=True)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
