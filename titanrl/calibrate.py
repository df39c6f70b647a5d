"""Fit the scheduler's cost model to measured runs and store it in the profile (HetRL's calibration, issue 47).

    torchrun --nproc-per-node N -m titanrl.profile --out profile.json --config C.toml
    torchrun --nproc-per-node N -m titanrl.train --config C.toml --job.steps=6 --job.dump_folder=cal/a ...
    ...                                                    # a few short runs that differ in batch, lengths, placement
    python -m titanrl.calibrate --profile profile.json cal/a/<job.name> cal/b/<job.name>[@1,0] ...

Each run folder holds the trainer's ``config.toml`` (the resolved config) and ``metrics.jsonl``. For every run the
cost model (:class:`titanrl.hetero.cost.HetCostModel`, on the profile's devices, the plan the config runs:
:func:`titanrl.schedule.plan_from_config`) gives each stage's features, and the run's medians over its steps after
the first give the measured seconds: ``time/<node>`` per stage (the slowest rank's; a synchronous disaggregated
run's ``weight_sync`` less the training stages its rollout ranks wait for inside it) and ``step/wall_s`` for the
step. :func:`titanrl.hetero.cost.fit` solves them (non-negative least squares, each row weighted by 1 / its
seconds) for the efficiencies of the profile's device types, the link factors and the fixed costs
(``OVERHEAD_TERMS``). A term that stays under 1% of every measured stage (the link factors: 10%, e.g. one host's
fast links) cannot be told from noise and keeps its default. The result goes into the profile as ``calibration``;
``python -m titanrl.schedule --profile`` prices with it. ``@d0,d1,...`` names the profiled device each rank ran on
(default: rank r on device r, a launch like the profile's); the run's world size is the number of devices.

Prints, per run and stage, predicted (fitted) vs measured seconds. A fit is only as good as the runs are varied:
a term no run moves (every run the same batch, say) is fitted as a constant of the others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

STEP = "step"


@dataclass(frozen=True)
class MeasuredRun:
    """One run folder's config and measured medians (``stages`` by the cost model's stage names, ``step_s``)."""

    path: Path
    cfg: Any
    devices: tuple[int, ...]
    stages: dict[str, float]
    step_s: float
    steps: int
    workload: Any = None  # the cost model's Workload and Plan of the run (read once)
    plan: Any = None


def read_run(spec: str, world: int, *, skip: int = 1) -> MeasuredRun:
    """The run named by ``spec`` (``DIR`` or ``DIR@d0,d1,...``) on a profile of ``world`` devices."""
    from titanrl.config import ConfigError, load_config
    from titanrl.hetero.cost import TITANRL_NODES

    folder, _, devs = spec.partition("@")
    path = Path(folder).expanduser()
    try:
        devices = tuple(int(d) for d in devs.split(",")) if devs else tuple(range(world))
    except ValueError:
        raise ValueError(f"{spec}: '@' must be followed by device ids, e.g. {folder}@1,0") from None
    if len(set(devices)) != len(devices) or not all(0 <= d < world for d in devices):
        raise ValueError(f"{spec}: devices must be distinct ids of the profile's 0..{world - 1}")
    for name in ("config.toml", "metrics.jsonl"):
        if not (path / name).is_file():
            raise ValueError(f"{spec}: no {name} in {path} (a run folder: <job.dump_folder>/<job.name>)")
    try:
        cfg = load_config(path / "config.toml", validate=False)
    except ConfigError as err:
        raise ValueError(f"{path / 'config.toml'}: {err}") from None
    records = []
    for i, line in enumerate((path / "metrics.jsonl").read_text().splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path / 'metrics.jsonl'} line {i + 1} is not JSON") from None
        if "step/wall_s" in rec:  # a training step (not step 0's evaluation)
            records.append(rec)
    records = records[skip:]
    if not records:
        raise ValueError(f"{path / 'metrics.jsonl'}: no training step after the first {skip} (run more steps)")

    def median(key: str) -> float | None:
        values = [r[key] for r in records if key in r]
        return statistics.median(values) if values else None

    stages = {}
    for stage, node in TITANRL_NODES.items():
        value = median(f"time/{node}")
        if value is not None:
            stages[stage] = float(value)
    if cfg.workflow.placement == "disaggregated" and cfg.workflow.mode == "sync" and "weight_sync" in stages:
        # a synchronous disaggregated step's rollout ranks enter weight_sync when their rollout ends and wait there
        # for the training ranks' stages: time/weight_sync (the slowest rank's) holds that wait; the push is the rest
        wait = sum(v for s, v in stages.items() if s not in ("rollout", "weight_sync"))
        stages["weight_sync"] = max(stages["weight_sync"] - wait, 0.0)
    from titanrl.hetero.cost import workload_from_config
    from titanrl.schedule import plan_from_config

    return MeasuredRun(path, cfg, devices, stages, float(median("step/wall_s")), len(records),
                       workload_from_config(cfg), plan_from_config(cfg, len(devices), devices))


def _estimate(run: MeasuredRun, cluster, coefficients):
    from titanrl.hetero.cost import HetCostModel

    return HetCostModel(cluster, run.workload, coefficients).evaluate(run.plan)


def rows(run: MeasuredRun, cluster, coefficients=None) -> list[tuple[str, dict[str, float], float]]:
    """(stage, features, measured seconds) of every stage the model prices and the run measured, and the step."""
    est = _estimate(run, cluster, coefficients)
    if not est.feasible:
        raise ValueError(f"{run.path}: the cost model says this run does not fit ({est.why_infeasible})")
    out = [(stage, est.features[stage], seconds) for stage, seconds in run.stages.items()
           if est.features.get(stage) and seconds > 0]
    out.append((STEP, est.step_features, run.step_s))
    return out


def predictions(run: MeasuredRun, cluster, coefficients) -> dict[str, float]:
    """The cost model's seconds (with ``coefficients``) of every stage ``run`` measured, and of the step."""
    est = _estimate(run, cluster, coefficients)
    return {**{s: est.stages[s] for s in run.stages}, STEP: est.step_s}


def calibrate(cluster, runs: Sequence[MeasuredRun], *, base=None, label: str = "", rounds: int = 6):
    """Coefficients fitted to ``runs`` (module doc). Which unit is critical and whether decoding is compute- or
    memory-bound depend on the coefficients, so the features are re-taken with each fit until they stop changing
    (at most ``rounds`` fits); the fit whose predictions are closest to the measurements is kept."""
    from titanrl.hetero.cost import fit

    coefficients, best, seen = base, None, []
    for _ in range(rounds):
        table = [(features, seconds) for run in runs for _, features, seconds in rows(run, cluster, coefficients)]
        if table in seen:
            break
        seen.append(table)
        coefficients = fit(table, base=base, relative=True, negligible=0.01, link_negligible=0.1,
                           fitted=label or f"{len(runs)} measured run(s), {len(table)} rows")
        error = max(max(p / m, m / p) for run in runs
                    for p, m in _pairs(predictions(run, cluster, coefficients), run))
        if best is None or error < best[0]:
            best = (error, coefficients)
    return best[1]


def _pairs(predicted: Mapping[str, float], run: MeasuredRun) -> list[tuple[float, float]]:
    out = [(predicted[s], m) for s, m in run.stages.items() if m > 0 and predicted.get(s, 0) > 0]
    return out + [(predicted[STEP], run.step_s)]


def profile_coefficients(profile: Mapping[str, Any], *, source: str = "profile"):
    """The coefficients a profile's ``calibration`` holds (None: not calibrated)."""
    from titanrl.hetero.cost import Coefficients

    cal = profile.get("calibration")
    if cal is None:
        return None
    if not isinstance(cal, dict) or not isinstance(cal.get("coefficients"), dict):
        raise ValueError(f"{source}: calibration.coefficients must be a table (python -m titanrl.calibrate writes it)")
    return Coefficients.from_dict(cal["coefficients"], source=f"{source}: calibration.coefficients")


def format_comparison(runs: Sequence[MeasuredRun], cluster, coefficients) -> list[str]:
    lines = []
    for run in runs:
        pred = predictions(run, cluster, coefficients)
        cells = [f"{s} {pred[s]:.3g}/{m:.3g}" for s, m in [*run.stages.items(), (STEP, run.step_s)]]
        lines.append(f"  {run.path}: predicted/measured s: " + ", ".join(cells))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m titanrl.calibrate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="the `python -m titanrl.profile` JSON the runs were measured on; "
                                                    "the fit is written into it as `calibration`")
    p.add_argument("runs", nargs="+", help="run folders (<job.dump_folder>/<job.name>), each DIR or DIR@d0,d1,...")
    p.add_argument("--skip", type=int, default=1, help="steps left out at the start of each run (default 1)")
    p.add_argument("--dry-run", action="store_true", help="print the fit, do not write the profile")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from titanrl.hetero.cluster import ClusterError, cluster_from_profile_dict

    path = Path(args.profile).expanduser()
    try:
        profile = json.loads(path.read_text())
        cluster = cluster_from_profile_dict(profile, source=path.name)
        runs = [read_run(spec, len(cluster), skip=args.skip) for spec in args.runs]
        coefficients = calibrate(cluster, runs)
    except FileNotFoundError:
        print(f"error: profile not found: {path}", file=sys.stderr)
        return 2
    except (ClusterError, ValueError, json.JSONDecodeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"fitted to {coefficients.fitted}:")
    for line in format_comparison(runs, cluster, coefficients):
        print(line)
    print("  overheads (s per unit): " + ", ".join(f"{k} {v:.3g}" for k, v in coefficients.overheads))
    print("  efficiencies: " + ", ".join(f"{t}:{dt} {v:.3g}" for t, dt, v in coefficients.by_type)
          + f"; comm {coefficients.comm:.3g}, latency {coefficients.latency:.3g}")
    if args.dry_run:
        return 0
    profile["calibration"] = {"coefficients": coefficients.to_dict(),
                              "runs": [{"path": str(r.path), "devices": list(r.devices), "steps": r.steps}
                                       for r in runs]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile, indent=1))
    tmp.replace(path)
    print(f"wrote calibration into {path} (python -m titanrl.schedule --profile {path} prices with it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
