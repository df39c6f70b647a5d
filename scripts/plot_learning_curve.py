"""The committed learning curve of the tiny default (``benchmarks/learning_curve.png``).

    python scripts/plot_learning_curve.py outputs/<job>/metrics.jsonl benchmarks/learning_curve.png [STEP]

Same drawing as ``python -m titanrl.plot`` (``titanrl.plot.plot_reward``), with the synthetic colour task's
chance level and the 0.8 target; ``STEP`` marks where the default config stops.
"""

from __future__ import annotations

import sys
from pathlib import Path

from titanrl.plot import plot_reward, read_metrics


def main(metrics_path: str, out_png: str, mark_step: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    records = read_metrics(Path(metrics_path))
    plot_reward(records, Path(out_png), chance=0.25, target=0.8, mark_step=mark_step,
                title="GRPO on the synthetic colour task, tiny Qwen2.5-VL (CPU, vLLM rollouts)")
    print(f"wrote {out_png} ({len(records)} steps)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
