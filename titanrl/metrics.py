"""Metrics a person can watch: a compact line per step on stdout, JSONL always, TensorBoard
when enabled. Only rank 0 writes; values are already reduced across ranks by the caller."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Sequence

from titanrl.console import say


def source_key(name: str) -> str:
    """A data source's name as it appears in metric keys (``source/<name>/...``, ``eval/source/<name>/...``): every
    character outside letters, digits, ``_``, ``.`` and ``-`` becomes ``_`` (TensorBoard's and W&B's tag rules)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def format_step_line(step: int, total: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}/{total}"]
    for key, fmt in (
        ("loss", "loss {:.4f}"),
        ("reward/mean", "reward {:.3f}"),
        ("reward/accuracy", "acc {:.3f}"),
        ("kl", "kl {:.4f}"),
        ("entropy", "ent {:.3f}"),
        ("grad_norm", "gnorm {:.3f}"),
        ("rl/behaviour_weight_mean", "iw {:.3f}"),  # the truncated importance weight's mean (rl.behaviour_weight)
        ("train/masked_truncated", "masked {:.0f}"),  # cut responses out of the update (rl.mask_truncated)
        ("rollout/unfinished_groups", "carried {:.0f}"),  # groups left for the next step (rollout.tokens_per_update)
        ("throughput/tokens_per_s", "{:.0f} tok/s"),
    ):
        if key in metrics:
            parts.append(fmt.format(metrics[key]))
    timings = [f"{k.split('/', 1)[1]} {v:.2f}s" for k, v in metrics.items() if k.startswith("time/")]
    if timings:
        parts.append("[" + ", ".join(timings) + "]")
    if metrics.get("data/skipped", 0):
        parts.append(f"skipped {int(metrics['data/skipped'])}")
    if metrics.get("reward/errors", 0):
        parts.append(f"reward errors {int(metrics['reward/errors'])}")
    if metrics.get("rollout/env_errors", 0):
        parts.append(f"env errors {int(metrics['rollout/env_errors'])}")
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _best(history: Sequence[dict[str, float]], steps: Sequence[int], key: str) -> str | None:
    values = [(h[key], s) for h, s in zip(history, steps) if key in h]
    if not values:
        return None
    tail = [v for v, _ in values[-10:]]
    best, at = max(values)
    return (f"final {values[-1][0]:.3f} (mean of the last {len(tail)}: {sum(tail) / len(tail):.3f}), "
            f"best {best:.3f} at step {at}")


def _eval_line(evals: Sequence[tuple[int, dict[str, float]]]) -> str | None:
    """The summary's evaluation line: the last evaluation's accuracy (else reward) and the best one."""
    key = "eval/accuracy" if any("eval/accuracy" in m for _, m in evals) else "eval/reward"
    values = [(m[key], s) for s, m in evals if key in m]
    if not values:
        return None
    best, at = max(values, key=lambda v: (v[0], -v[1]))
    label = "eval acc" if key == "eval/accuracy" else "eval rew"
    return (f"  {label:<10} final {values[-1][0]:.3f} at step {values[-1][1]}, best "
            f"{best:.3f} at step {at} ({len(values)} evaluations)")


def format_summary(history: Sequence[dict[str, float]], first_step: int, wall_s: float,
                   places: dict[str, str], notes: Sequence[str] = (),
                   evals: Sequence[tuple[int, dict[str, float]]] = ()) -> str:
    """The end-of-run report: what was reached, where the time went, where the outputs are.

    ``history`` holds every step this process ran (``first_step`` is the first one's number),
    ``wall_s`` the run's wall-clock time from start-up, ``places`` label -> path of its outputs,
    ``evals`` this process's evaluations (step, metrics)."""
    lines = []
    if not history:
        lines.append(f"[titanrl] done: no step to run (already at step {first_step - 1}); {_duration(wall_s)}")
    else:
        steps = list(range(first_step, first_step + len(history)))
        step_s = [sum(v for k, v in h.items() if k.startswith("time/")) for h in history]
        lines.append(f"[titanrl] done: steps {steps[0]}-{steps[-1]}, {sum(step_s) / len(step_s):.2f} s per step; "
                     f"{_duration(wall_s)} in all (start-up and saving included)")
        for label, key in (("reward", "reward/mean"), ("accuracy", "reward/accuracy")):
            text = _best(history, steps, key)
            if text:
                lines.append(f"  {label:<10} {text}")
        if evals and _eval_line(evals):
            lines.append(_eval_line(evals))
        stages: dict[str, float] = {}
        for h in history:
            for k, v in h.items():
                if k.startswith("time/"):
                    stages[k.split("/", 1)[1]] = stages.get(k.split("/", 1)[1], 0.0) + v
        total = sum(stages.values()) or 1.0
        lines.append("  time       " + ", ".join(f"{name} {_duration(v)} ({100 * v / total:.0f}%)"
                                               for name, v in stages.items()))
        rates = [h["throughput/tokens_per_s"] for h in history if "throughput/tokens_per_s" in h]
        if rates:
            lines.append(f"  tokens/s   {sum(rates) / len(rates):.0f} mean over steps (prompt + response tokens "
                         "per second of step time)")
        skipped = history[-1].get("data/skipped", 0)
        if skipped:
            lines.append(f"  skipped    {int(skipped)} sample(s) (data.on_bad_sample = skip; named in the logs)")
    lines.extend(notes)
    for label, where in places.items():
        lines.append(f"  {label:<10} {where}")
    return "\n".join(lines)


def _import_optional(module: str, key: str, extra: str) -> Any:
    """Import an optional dependency that config key ``key`` turns on; when it is missing, say which
    extra of titanrl installs it (``pip install 'titanrl[<extra>]'``) instead of a bare ImportError."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{key}=true needs the {module!r} package, which is not installed: "
            f"pip install 'titanrl[{extra}]' (or set {key}=false)"
        ) from e


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
            wandb_lib = _import_optional("wandb", "metrics.wandb", "wandb")

            self._wandb = wandb_lib.init(
                project=wandb_project, name=run_name, mode=wandb_mode, dir=str(run_dir), config=config or {}
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            _import_optional("tensorboard", "metrics.tensorboard", "tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any], line: bool = True) -> None:
        """The step's record (JSONL, TensorBoard, W&B) and, with ``line``, its console line."""
        if not self.enabled:
            return
        if self.progress != "none" and line:
            line = format_step_line(step, self.total_steps, metrics)
            if self.progress == "bar":
                done = int(20 * step / max(self.total_steps, 1))
                line = f"[{'#' * done}{'.' * (20 - done)}] " + line
            say(line)
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
