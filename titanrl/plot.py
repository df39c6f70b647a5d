"""Plots of a run: ``python -m titanrl.plot RUN_DIR [--out DIR]``.

Reads ``RUN_DIR/metrics.jsonl`` and writes, into ``RUN_DIR/plots/`` (or ``--out``):

- ``reward.png``  reward and accuracy per step, and the held-out evaluations' accuracy ([eval]);
- ``stages.png``  the time of every stage per step, stacked (where a step's time goes);
- ``balance.png`` planned and measured balance and the update stage's bubble, when the run logged them
  (multi-rank runs: ``parallel/*``, ``balance/*``).

A resumed run logs some steps twice; the last record of a step wins.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(path: Path) -> dict[int, dict[str, float]]:
    records: dict[int, dict[str, float]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise SystemExit(f"{path}:{number}: not a JSON line ({err})") from None
        records[int(record["step"])] = record
    return records


def _series(records: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    steps = [s for s in sorted(records) if key in records[s]]
    return steps, [records[s][key] for s in steps]


def plot_reward(records: dict[int, dict[str, float]], out_png: Path, *, title: str = "", chance: float | None = None,
                target: float | None = None, mark_step: int | None = None) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("reward/mean", "reward"), ("reward/accuracy", "accuracy")):
        steps, values = _series(records, key)
        if steps:
            ax.plot(steps, values, label=label)
    # with several data sources, each one's accuracy (or reward, where the reward does not say what is correct)
    sources = sorted({k for r in records.values() for k in r if k.startswith("source/") and k.endswith("/responses")})
    for key in sources if len(sources) > 1 else []:
        base = key[: -len("/responses")]
        for metric in ("accuracy", "reward"):
            steps, values = _series(records, f"{base}/{metric}")
            if steps:
                ax.plot(steps, values, lw=0.8, ls="--", label=f"{metric} {base.split('/', 1)[1]}")
                break
    # evaluations ([eval]): held-out accuracy (else reward), a marker per evaluation
    for key, label in (("eval/accuracy", "held-out accuracy (eval)"), ("eval/reward", "held-out reward (eval)")):
        steps, values = _series(records, key)
        if steps:
            ax.plot(steps, values, marker="o", color="black", lw=1.2, label=label)
            break
    if chance is not None:
        ax.axhline(chance, color="grey", ls=":", label=f"chance ({chance:g})")
    if target is not None:
        ax.axhline(target, color="green", ls="--", lw=0.8, label=f"target {target:g}")
    if mark_step is not None:
        ax.axvline(mark_step, color="black", ls=":", lw=0.8, label=f"step {mark_step}")
    ax.set_xlabel("RL step")
    ax.set_ylim(0, 1.02)
    ax.set_title(title or "reward and accuracy per step")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def plot_stages(records: dict[int, dict[str, float]], out_png: Path) -> bool:
    import matplotlib.pyplot as plt

    names = [k for k in next(iter(records.values())) if k.startswith("time/")]
    for r in records.values():  # a stage that appears later (e.g. ref log-probs) still gets a colour
        names += [k for k in r if k.startswith("time/") and k not in names]
    if not names:
        return False
    steps = [s for s in sorted(records) if any(k.startswith("time/") for k in records[s])]  # (not step 0's eval)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.stackplot(steps, [[records[s].get(k, 0.0) for s in steps] for k in names],
                 labels=[k.split("/", 1)[1] for k in names])
    ax.set_xlabel("RL step")
    ax.set_ylabel("seconds (slowest rank per stage)")
    ax.set_title("time per step, by stage")
    ax.legend(loc="upper left", fontsize=8, ncol=min(4, len(names)))
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return True


def plot_balance(records: dict[int, dict[str, float]], out_png: Path) -> bool:
    import matplotlib.pyplot as plt

    ratios = [k for k in ("parallel/balance_planned", "parallel/balance_measured") if _series(records, k)[0]]
    bubbles = [k for k in ("balance/bubble_planned", "balance/bubble_measured") if _series(records, k)[0]]
    if not ratios and not bubbles:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key in ratios:
        left.plot(*_series(records, key), label=key.split("/", 1)[1])
    left.axhline(1.0, color="grey", ls=":")
    left.set_title("max / mean of per-rank work (1 = balanced)")
    left.set_xlabel("RL step")
    for key in bubbles:
        right.plot(*_series(records, key), label=key.split("/", 1)[1])
    right.set_title("update-stage bubble (1 - mean / max busy time)")
    right.set_xlabel("RL step")
    right.set_ylim(bottom=0)
    for ax in (left, right):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return True


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Every plot the run's metrics allow; returns the files written."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"{metrics} does not exist (was metrics.jsonl off, or is {run_dir} not a run directory?)")
    records = read_metrics(metrics)
    if not records:
        raise SystemExit(f"{metrics} holds no step yet")
    import matplotlib

    matplotlib.use("Agg")
    out_dir = out_dir or run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    plot_reward(records, out_dir / "reward.png", title=f"{run_dir.name}: reward and accuracy per step")
    written.append(out_dir / "reward.png")
    if plot_stages(records, out_dir / "stages.png"):
        written.append(out_dir / "stages.png")
    if plot_balance(records, out_dir / "balance.png"):
        written.append(out_dir / "balance.png")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titanrl.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="<job.dump_folder>/<job.name>, the folder with metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    args = parser.parse_args(argv)
    for path in plot_run(args.run_dir, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
