"""The committed learning curve of the tiny default (``benchmarks/learning_curve.{png,md}``).

    python scripts/plot_learning_curve.py benchmarks/learning_curve --mark 150 \\
        outputs/seed0/metrics.jsonl outputs/seed1/metrics.jsonl

One line of accuracy per run (seed) on one figure, with the synthetic colour task's chance level, the
0.8 target and the 0.75 floor the default must hold over steps 150-300; ``--mark`` marks where the
default config stops. The Markdown summary beside it gives, per run, the first step whose 10-step mean
accuracy reaches 0.8 and the minimum / mean accuracy over steps 150-300, from the same files (the
first metrics file is also copied to ``<out>.jsonl``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

from titanrl.plot import _series, read_metrics

CHANCE, TARGET, FLOOR, BAND = 0.25, 0.8, 0.75, (150, 300)


def summarize(records: dict[int, dict[str, float]]) -> dict[str, float | int | None]:
    steps, acc = _series(records, "reward/accuracy")
    acc_a = np.asarray(acc)
    mean10 = np.convolve(acc_a, np.ones(10) / 10, mode="valid")
    reached = next((steps[i + 9] for i, v in enumerate(mean10) if v >= TARGET), None)
    band = [a for s, a in zip(steps, acc) if BAND[0] <= s <= BAND[1]]
    _, kl = _series(records, "kl")
    _, uniform = _series(records, "reward/uniform_group_fraction")  # absent in runs older than the metric
    wall_steps, wall = _series(records, "step/wall_s")
    elapsed = dict(zip(wall_steps, np.cumsum(wall).tolist()))
    return {"reached_0.8_after_s": elapsed.get(reached) if reached is not None else None,
            "wall_s": elapsed.get(steps[-1]) if elapsed else None,"uniform_last50": float(np.mean(uniform[-50:])) if uniform else None,
            "steps": steps[-1], "reached_0.8_at": reached, "band_min": min(band) if band else None,
            "band_mean": float(np.mean(band)) if band else None, "final_accuracy": acc[-1],
            "kl_max": max(kl) if kl else None, "kl_final": kl[-1] if kl else None}


def _share(records: dict[int, dict[str, float]]) -> str:
    """The mean of reward/tool_share over a run's last 50 steps ("-" for a run without it: one turn)."""
    _, share = _series(records, "reward/tool_share")
    return f"{np.mean(share[-50:]):.2f}" if share else "-"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output path without suffix (writes .png and .md)")
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl of each run, in seed order")
    parser.add_argument("--mark", type=int, default=None, help="the step where the default config stops")
    parser.add_argument("--labels", nargs="*", default=None, help="a label per run (default: seed 0, 1, ...)")
    parser.add_argument("--settings", default="", help="how the runs were launched, for the summary")
    parser.add_argument("--title", default="GRPO on the synthetic colour task, tiny Qwen2.5-VL (CPU, vLLM rollouts)",
                        help="the plot's title")
    parser.add_argument("--wall", action="store_true",
                        help="a second panel against the runs' summed step wall time (step/wall_s), and its columns")
    parser.add_argument("--heading", default="Learning curves of the tiny task", help="the summary's heading")
    parser.add_argument("--tool", action="store_true",
                        help="multi-turn runs: each run's share of responses that called the environment "
                             "(reward/tool_share) drawn dotted in its colour, and its mean over the last 50 steps")
    parser.add_argument("--table-only", nargs="*", default=[], metavar="LABEL=METRICS",
                        help="runs listed in the summary table but not drawn (variants of the default)")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    labels = args.labels or [f"seed {i}" for i in range(len(args.metrics))]
    runs = [read_metrics(Path(m)) for m in args.metrics]
    if args.wall:
        fig, (ax, wax) = plt.subplots(1, 2, figsize=(14, 4.2))
    else:
        fig, ax = plt.subplots(figsize=(8 if len(runs) <= 4 else 12, 4.2))
    for label, records in zip(labels, runs):
        steps, acc = _series(records, "reward/accuracy")
        if args.wall:
            wall_steps, wall = _series(records, "step/wall_s")
            elapsed = dict(zip(wall_steps, np.cumsum(wall).tolist()))
            wax.plot([elapsed[s] for s in steps], acc, lw=0.9, alpha=0.9, label=label)
        # runs of older code (labelled "before ...") drawn faint, so the current ones stay readable
        old = "before" in label
        line, = ax.plot(steps, acc, lw=0.6 if old else 0.9, alpha=0.35 if old else 0.9, ls="--" if old else "-",
                        label=f"accuracy, {label}")
        if args.tool:
            tool_steps, share = _series(records, "reward/tool_share")
            if share:
                ax.plot(tool_steps, share, lw=0.9, ls=":", color=line.get_color(), label=f"tool share, {label}")
    ax.axhline(CHANCE, color="grey", ls=":", label=f"chance ({CHANCE:g})")
    ax.axhline(TARGET, color="green", ls="--", lw=0.8, label=f"target {TARGET:g}")
    if max(max(r) for r in runs) >= BAND[0]:  # the default's floor, for runs that get there
        ax.plot(BAND, [FLOOR, FLOOR], color="red", ls="--", lw=0.8, label=f"floor {FLOOR:g}, steps {BAND[0]}-{BAND[1]}")
    if args.mark is not None:
        ax.axvline(args.mark, color="black", ls=":", lw=0.8, label=f"default stops (step {args.mark})")
    ax.set_xlabel("RL step")
    ax.set_ylim(0, 1.02)
    ax.set_title(args.title)
    if args.wall:
        wax.axhline(TARGET, color="green", ls="--", lw=0.8)
        wax.set_xlabel("seconds (sum of the steps' wall time)")
        wax.set_ylim(0, 1.02)
        wax.set_title("the same runs against wall-clock time")
        wax.legend(loc="lower right", fontsize=7)
    if len(runs) <= 4:
        ax.legend(loc="lower right", fontsize=7)
    else:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)

    lines = [f"# {args.heading}", "",
             f"Generated by `python scripts/plot_learning_curve.py {out} ...` from the runs' metrics "
             f"(plot: `{out.name}.png`, first run's metrics: `{out.name}.jsonl`).", "",
             *([args.settings, ""] if args.settings else []),
             "| run | steps | 10-step mean accuracy >= 0.8 from step | accuracy min / mean, steps 150-300 "
             "| final accuracy | KL max / final | groups with one reward, last 50 steps |"
             + (" reached 0.8 after (s) | steps' wall time (s) |" if args.wall else "")
             + (" tool share, last 50 steps |" if args.tool else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if args.wall else "") + ("---|" if args.tool else "")]
    table_only = [spec.split("=", 1) for spec in args.table_only]
    if any(len(pair) != 2 for pair in table_only):
        parser.error("--table-only takes LABEL=METRICS pairs")
    for label, records in [*zip(labels, runs), *((lab, read_metrics(Path(m))) for lab, m in table_only)]:
        s = summarize(records)
        band = "-" if s["band_min"] is None else f"{s['band_min']:.3f} / {s['band_mean']:.3f}"
        uniform = "-" if s["uniform_last50"] is None else f"{100 * s['uniform_last50']:.0f}%"
        lines.append(f"| {label} | {s['steps']} | {s['reached_0.8_at'] or 'not reached'} | {band} | "
                     f"{s['final_accuracy']:.3f} | {s['kl_max']:.1f} / {s['kl_final']:.1f} | "
                     f"{uniform} |" + (f" {_s(s['reached_0.8_after_s'])} | {_s(s['wall_s'])} |" if args.wall else "")
                     + (f" {_share(records)} |" if args.tool else ""))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    shutil.copyfile(args.metrics[0], out.with_suffix(".jsonl"))
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.md')} ({len(runs)} runs)")


if __name__ == "__main__":
    main()
