"""Plot reward / accuracy per step from a run's metrics.jsonl.

    python scripts/plot_learning_curve.py outputs/<job>/metrics.jsonl benchmarks/learning_curve.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(metrics_path: str, out_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records: dict[int, dict] = {}
    for line in Path(metrics_path).read_text().splitlines():
        rec = json.loads(line)
        records[rec["step"]] = rec  # a resumed run logs steps again: keep the last
    steps = sorted(records)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [records[s]["reward/mean"] for s in steps], label="reward (0.9 acc + 0.1 format)")
    ax.plot(steps, [records[s]["reward/accuracy"] for s in steps], label="accuracy (exact match)")
    ax.axhline(0.25, color="grey", ls=":", label="chance among the 4 colours")
    ax.axhline(0.8, color="green", ls="--", lw=0.8, label="target 0.8")
    if len(sys.argv) > 3:  # mark where the default config stops
        ax.axvline(int(sys.argv[3]), color="black", ls=":", lw=0.8, label=f"default job.steps = {sys.argv[3]}")
    ax.set_xlabel("RL step")
    ax.set_ylim(0, 1.02)
    ax.set_title("GRPO on the synthetic colour task, tiny Qwen2.5-VL (CPU, vLLM rollouts)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    print(f"wrote {out_png} ({len(steps)} steps)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
