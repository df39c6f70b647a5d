"""Asynchronous vs synchronous RL steps: colocated sync, disaggregated sync, disaggregated async.

    python scripts/bench_async.py                # -> benchmarks/async.{json,md}
    python scripts/bench_async.py --report-only  # rewrite the .md from the .json

Every row is a real ``titanrl.train`` run under ``torchrun`` with 2 ranks x 1 thread (wall-clock: each rank has a
core) of the workloads of ``bench_placement`` (the tiny default, 32 prompts x 8 responses; the ``small`` model with
``bench_e2e``'s video-heavy batch, 4 x 4, 32 new tokens), probe off as there:

- ``colocated sync``: both ranks generate, then train (the default);
- ``disaggregated sync``: rank 0 generates and scores, rank 1 trains; each waits for the other
  (``benchmarks/placement.md``);
- ``disaggregated async``: the same ranks with ``workflow.mode = async``, ``workflow.max_staleness = 1``: rank 0
  generates the batch of step t + 1 while rank 1 trains step t.

Per variant, medians over steps 3.. (the first async step also fills the pipeline): the step's wall time, each
rank's busy seconds and idle share (1 - busy / step), the stage times, and the staleness of the trained batch.
A rollout rank's busy time counts the wall time of its calls into its vLLM engine (whose core runs in a child
process); a training rank's is its process CPU time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import provenance  # noqa: E402
from bench_flex_ulysses import ratio  # noqa: E402
from bench_placement import common_flags, run_one  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPLIT = ["--workflow.placement=disaggregated", "--workflow.rollout_ranks=1"]
VARIANTS = {
    "colocated sync": [],
    "disaggregated sync": SPLIT,
    "disaggregated async": [*SPLIT, "--workflow.mode=async", "--workflow.max_staleness=1"],
}
STAGES = ("data", "rollout", "reward", "redistribute", "old_logprob", "ref_logprob", "update", "weight_sync")


def busy(m: dict, variant: str) -> tuple[float, float]:
    """Busy seconds per step of the rollout rank and the training rank (colocated: every rank does both)."""
    if variant.startswith("colocated"):
        return m["step/limit_s"], m["step/limit_s"]
    return m["busy/rollout_ranks_s"], m["busy/train_ranks_s"]


def shares(m: dict) -> tuple[float, float]:
    """Of the colocated step: the generation's share and the training's (the condition of the target)."""
    step = m["step/wall_s"]
    train = sum(m.get(f"time/{s}", 0.0) for s in ("old_logprob", "ref_logprob", "update"))
    return m.get("time/rollout", 0.0) / step, train / step


def table(results: dict) -> list[str]:
    head = " | ".join(s.replace("_logprob", " lp") for s in STAGES)
    lines = [f"| workload | variant | {head} | step (s) | vs disaggregated sync | vs colocated | busy: rollout rank "
             "(s) | busy: training rank (s) | idle: rollout rank | idle: training rank | staleness |",
             "|---|---|" + "---|" * len(STAGES) + "---|---|---|---|---|---|---|---|"]
    for model, runs in results.items():
        sync = runs["disaggregated sync"]["median"]["step/wall_s"]
        colo = runs["colocated sync"]["median"]["step/wall_s"]
        for variant, run in runs.items():
            m = run["median"]
            step = m["step/wall_s"]
            b_r, b_t = busy(m, variant)
            stages = " | ".join(f"{m.get(f'time/{s}', 0.0):.2f}" for s in STAGES)
            lines.append(f"| {model} | {variant} | {stages} | {step:.2f} | {ratio(sync, step)} | {ratio(colo, step)} | "
                         f"{b_r:.2f} | {b_t:.2f} | {max(0.0, 1 - b_r / step):.0%} | {max(0.0, 1 - b_t / step):.0%} | "
                         f"{m.get('async/staleness_mean', 0.0):.0f} |")
    return lines


def findings(results: dict) -> list[str]:
    out = []
    for model, runs in results.items():
        c, s, a = (runs[v]["median"] for v in VARIANTS)
        gen, train = shares(c)
        vs_sync, vs_colo = s["step/wall_s"] / a["step/wall_s"], c["step/wall_s"] / a["step/wall_s"]
        both = gen >= 1 / 3 and train >= 1 / 3
        verdict = ("meets" if vs_sync >= 1.6 else "misses") + " the 1.6x target over disaggregated sync"
        colo = ("faster than" if vs_colo > 1 else "slower than") + " colocated"
        cond = (f"generation {gen:.0%} and training {train:.0%} of the colocated step, so the target asks it to beat "
                "colocated" if both else f"generation {gen:.0%} and training {train:.0%} of the colocated step: one "
                "side under a third, so colocated is not a target here")
        b_r, b_t = busy(a, "disaggregated async")
        side = "rollout" if b_r >= b_t else "training"
        out.append(f"- {model}: async {vs_sync:.2f}x the synchronous disaggregated step rate ({verdict}) and "
                   f"{vs_colo:.2f}x the colocated one ({colo}); {cond}. Async busy: rollout rank {b_r:.2f} s, "
                   f"training rank {b_t:.2f} s of a {a['step/wall_s']:.2f} s step: the {side} rank is busy "
                   f"{max(b_r, b_t) / a['step/wall_s']:.0%} of it and bounds it (a rollout rank's busy time counts "
                   "the wall time of its engine calls, during which the rank's own process also runs, so it can "
                   "exceed the step).")
    return out


def report(data: dict) -> str:
    lines = [
        "# Asynchronous RL: async vs synchronous disaggregated vs colocated",
        "",
        f"Generated by `python scripts/bench_async.py` from `benchmarks/async.json` on {data['machine']} "
        f"({data['date']}, commit {data['commit']}, {data['steps']} steps per run); do not edit. 2 ranks x 1 "
        "thread, wall-clock. Workloads and variants: see the script's docstring. Stage columns are wall seconds "
        "of the slowest rank (asynchronous, `rollout` is the generation of the next batch, which overlaps the "
        "training stages on the other rank; `redistribute` and `weight_sync` include each side's wait for the "
        "other); medians over steps 3.. .",
        "",
        *table(data["results"]),
        "",
        "## Findings",
        "",
        *findings(data["results"]),
        "",
        "With one rank per side the asynchronous step is bounded below by the busier side: the step shortens from "
        "rollout + training (synchronous disaggregated) towards max(rollout, training). On this machine the "
        "rollout rank's vLLM engine runs in a child process (vLLM's engine core, its worker inside) that shares "
        "the 2 cores with both ranks, so while it generates it takes CPU from the training rank, which a device per "
        "rank would not.",
        "",
        "Commands:",
        "",
    ]
    for model, runs in data["results"].items():
        for variant, run in runs.items():
            lines.append(f"- {model}, {variant}: `{run['command']}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=6, help="RL steps per run (medians over steps 3..)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "async"))
    args = parser.parse_args()
    out = Path(args.out)
    if args.report_only:
        data = json.loads(out.with_suffix(".json").read_text())
    else:
        data = {**provenance(), "steps": args.steps, "results": {}}
        for model in args.models:
            common = common_flags(model, args.steps)
            for variant, extra in VARIANTS.items():
                print(f"[bench_async] {model}, {variant}", flush=True)
                result = run_one(2, variant, common, extra, skip=2)
                data["results"].setdefault(model, {})[variant] = result
                out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    out.with_suffix(".md").write_text(report(data))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
