"""Measured heterogeneity on this machine (issues 28, 47): two ranks of unequal speed, every placement measured,
the scheduler's cost model fitted to some runs and tested on the others.

Rank 0 runs alone on core 0; rank 1 shares core 1 with ``--spinners`` busy processes (each pinned with taskset,
so rank 1 gets about 1 / (1 + spinners) of its core: a slower device). Two ranks x one thread each, so wall-clock
figures mean something here. Steps:

1. ``python -m titanrl.profile`` under the same pinning: each rank's matmul throughput -> relative speeds.
2. The tiny GRPO job in the runs of ``RUNS``: the four placements two ranks allow at the default batch (colocated
   speed-oblivious and speed-aware, disaggregated with the rollout on the fast or the slow rank) and four more
   that change the batch, the response length, ``rollout.n`` and the microbatch budget, with
   ``metrics.busy_clock = runnable``; medians over the steps after the first.
3. ``python -m titanrl.calibrate`` fits the cost model to the runs marked "fit" and writes it into the profile;
   every run is predicted with the default and with the fitted coefficients, per stage and per step, the held-out
   runs included (the fit never saw them).
4. ``python -m titanrl.schedule`` on the calibrated profile picks a placement; the report says where the pick lands
   among the measured.
5. Two namespaced hosts behind a ``tc tbf`` link (``--link``): both placements measured, predicted with the default
   coefficients and with the one-host fit (a held-out cluster).

    python scripts/bench_hetrl_measured.py            # writes benchmarks/hetrl_measured.md (+ .json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO, provenance, provenance_text  # noqa: E402

STAGES = ("rollout", "old_logprob", "ref_logprob", "update", "weight_sync")
PIN = """#!/bin/bash
var="PIN_${LOCAL_RANK}"
exec taskset -c "${!var}" "$@"
"""


class Spinners:
    """``n`` busy processes pinned to ``core`` for the duration of a ``with`` block."""

    def __init__(self, n: int, core: int) -> None:
        self.n, self.core, self.procs = n, core, []

    def __enter__(self) -> "Spinners":
        self.procs = [subprocess.Popen(["taskset", "-c", str(self.core), sys.executable, "-c", "while True: pass"])
                      for _ in range(self.n)]
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def torchrun(work: Path, pins: tuple[int, int], module_args: list[str], timeout: float = 900) -> str:
    wrapper = work / "pin.sh"
    wrapper.write_text(PIN)
    wrapper.chmod(0o755)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIN_0": str(pins[0]), "PIN_1": str(pins[1])}
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "--no-python", str(wrapper), sys.executable, "-m",
           *module_args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(module_args[:3])} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def train(work: Path, name: str, pins: tuple[int, int], steps: int, extra: list[str]) -> dict:
    out = work / name
    flags = ["--config", "configs/tiny_cpu.toml", f"--job.steps={steps}", "--checkpoint.enable=false",
             f"--job.dump_folder={out}", "--metrics.busy_clock=runnable", "--metrics.progress=none", *extra]
    torchrun(work, pins, ["titanrl.train", *flags])
    recs = [json.loads(line) for line in (out / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()][1:]
    med = lambda key: statistics.median(r[key] for r in recs if key in r) if any(key in r for r in recs) else None
    devices = [0, 1] if pins == (0, 1) else [1, 0]
    return {"wall_s": med("step/wall_s"), "busy_ratio": {s: med(f"balance/busy_ratio/{s}") for s in STAGES},
            "share": [med(f"balance/planned_share/rank{r}") for r in (0, 1)], "steps": len(recs),
            "measured": {s: med(f"time/{s}") for s in STAGES}, "flags": extra,
            "folder": f"{out / 'tiny_cpu'}@{','.join(map(str, devices))}"}


def predicted(folder: str, profile: Path, calibrated: Path | None = None) -> dict[str, float]:
    """The HetRL cost model's stage and step seconds for the run in ``folder`` (``DIR@devices``) on the profiled
    devices, by titanrl's node names: default coefficients, or the calibration stored in ``calibrated``."""
    from titanrl.calibrate import STEP, predictions, profile_coefficients, read_run
    from titanrl.hetero.cluster import cluster_from_profile
    from titanrl.hetero.cost import TITANRL_NODES

    cluster = cluster_from_profile(profile)
    coefficients = profile_coefficients(json.loads(calibrated.read_text())) if calibrated else None
    run = read_run(folder, len(cluster))
    times = predictions(run, cluster, coefficients)
    return {TITANRL_NODES.get(k, k) if k != STEP else "step": v for k, v in times.items()}


def compared(folder: str, profile: Path) -> dict[str, float]:
    """What the model's stages are compared with, as ``titanrl.calibrate`` reads a run (its medians; a synchronous
    disaggregated run's ``weight_sync`` less the training stages its rollout ranks wait for inside it), by node."""
    from titanrl.calibrate import read_run
    from titanrl.hetero.cost import TITANRL_NODES

    run = read_run(folder, len(json.loads(profile.read_text())["ranks"]))
    return {**{TITANRL_NODES[k]: v for k, v in run.stages.items()}, "step": run.step_s}


def hosts_section(rate: str, steps: int, calibrated: Path) -> dict:
    """Two namespaced hosts (one rank each) whose links tbf limits to ``rate``: the profile across them, the
    colocated and the disaggregated placement measured and predicted (default coefficients, and the calibration fitted
    on one host: a held-out cluster), and the scheduler's pick on the profile."""
    from netns_hosts import Hosts

    out: dict = {"rate": rate, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp, Hosts(2) as hosts:
        work = Path(tmp)
        hosts.start_ray()
        for i in range(2):
            hosts.shape(i, rate, burst="256kbit")

        def launch(module_args: list[str], port: int) -> None:
            procs = []
            for rank, h in enumerate(hosts.hosts):
                argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                        "--node-rank", str(rank), "--master-addr", hosts[0].ip, "--master-port", str(port), "-m",
                        *module_args]
                env = {"GLOO_SOCKET_IFNAME": h.dev, "VLLM_HOST_IP": h.ip, "OMP_NUM_THREADS": "1",
                       "TITANRL_HOST": f"host{rank}"}
                procs.append(h.popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True))
            for p in procs:
                text, _ = p.communicate(timeout=900)
                if p.returncode != 0:
                    raise RuntimeError(f"{module_args[0]} on two hosts failed:\n{text[-3000:]}")

        prof = work / "profile.json"
        launch(["titanrl.profile", "--out", str(prof), "--seconds", "0.3", "--link-mb", "8", "--quiet"], 29751)
        out["link_gbps"] = json.loads(prof.read_text())["links"][0]["gbps"]
        variants = {"colocated (FSDP over the link)": [],
                    "disaggregated (rollout on host 0, training on host 1)":
                        ["--workflow.placement=disaggregated", "--workflow.rollout_ranks=1"]}
        for k, (name, extra) in enumerate(variants.items()):
            flags = ["--config", "configs/tiny_cpu.toml", f"--job.steps={steps}", "--checkpoint.enable=false",
                     f"--job.dump_folder={work / str(k)}", f"--data.ray_address={hosts.ray_address}",
                     "--metrics.progress=none", *extra]
            launch(["titanrl.train", *flags], 29752 + k)
            folder = str(work / str(k) / "tiny_cpu")
            recs = [json.loads(x) for x in (Path(folder) / "metrics.jsonl").read_text().splitlines()][1:]
            out["runs"][name] = {"wall_s": statistics.median(r["step/wall_s"] for r in recs),
                                 "default": predicted(folder, prof)["step"],
                                 "fitted": predicted(folder, prof, calibrated)["step"]}
        sched = subprocess.run([sys.executable, "-m", "titanrl.schedule", "--config", "configs/tiny_cpu.toml",
                                "--profile", str(prof), "--out", str(work / "plan.toml")], cwd=REPO,
                               capture_output=True, text=True, timeout=600)
        out["schedule"] = sched.stdout[-3000:] or sched.stderr[-2000:]
        plan = (work / "plan.toml").read_text() if (work / "plan.toml").exists() else ""
        placement = tomllib.loads(plan)["workflow"]["placement"] if plan else None
        out["pick"] = next((n for n in out["runs"] if placement and n.startswith(placement)), None)
    return out


DISAGG = ["--workflow.placement=disaggregated", "--workflow.rollout_ranks=1"]
# (name, role, pins, flags): "fit" runs are what titanrl.calibrate fits; "held-out" runs only test the fit.
# The four placements at the default batch are the scheduler's candidates (its pick is checked against them).
RUNS = [
    ("colocated, speed-oblivious", "fit", (0, 1), []),
    ("colocated, speed-aware", "held-out", (0, 1), ["--balance.rank_speeds={speeds}"]),
    ("disaggregated, rollout on the fast rank", "fit", (0, 1), DISAGG),
    ("disaggregated, rollout on the slow rank", "held-out", (1, 0), DISAGG),
    ("colocated, speed-aware, 16 prompts, 16 new tokens", "fit", (0, 1),
     ["--balance.rank_speeds={speeds}", "--rl.global_batch_size=16", "--rollout.max_new_tokens=16"]),
    ("colocated, speed-oblivious, n 4, 1024-token microbatches", "fit", (0, 1),
     ["--rollout.n=4", "--balance.max_tokens_per_microbatch=1024"]),
    ("colocated, speed-aware, 24 prompts, 8 new tokens", "held-out", (0, 1),
     ["--balance.rank_speeds={speeds}", "--rl.global_batch_size=24", "--rollout.max_new_tokens=8"]),
    ("disaggregated, rollout on the fast rank, 16 prompts, 8 new tokens", "held-out", (0, 1),
     [*DISAGG, "--rl.global_batch_size=16", "--rollout.max_new_tokens=8"]),
]
PLACEMENTS = [name for name, *_ in RUNS[:4]]
STAGE_TARGET, STEP_TARGET = 1.5, 1.25


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spinners", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "hetrl_measured.md"))
    ap.add_argument("--link", default="20mbit", help="tbf rate of the two namespaced hosts' links ('' to skip)")
    args = ap.parse_args()
    data: dict = {**provenance(), "spinners": args.spinners, "steps": args.steps, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with Spinners(args.spinners, core=1):
            time.sleep(1.0)
            torchrun(work, (0, 1), ["titanrl.profile", "--out", str(work / "profile.json"), "--quiet"])
            profile = json.loads((work / "profile.json").read_text())
            tflops = [r["matmul_tflops"] for r in profile["ranks"]]
            speeds = [round(t / max(tflops), 3) for t in tflops]
            data["profile_tflops"], data["speeds"] = tflops, speeds
            prof = work / "profile.json"
            for k, (name, role, pins, extra) in enumerate(RUNS):
                flags = [f.format(speeds=f"[{speeds[0]},{speeds[1]}]") for f in extra]
                data["runs"][name] = {**train(work, f"run{k}", pins, args.steps, flags), "role": role}
            runs = data["runs"]
            uncalibrated = work / "profile_default.json"
            uncalibrated.write_text(prof.read_text())
            cal = subprocess.run([sys.executable, "-m", "titanrl.calibrate", "--profile", str(prof),
                                  *[r["folder"] for r in runs.values() if r["role"] == "fit"]],
                                 cwd=REPO, capture_output=True, text=True, timeout=600)
            if cal.returncode != 0:
                raise RuntimeError(f"titanrl.calibrate failed:\n{cal.stdout}\n{cal.stderr}")
            data["calibrate"] = cal.stdout
            data["coefficients"] = json.loads(prof.read_text())["calibration"]["coefficients"]
            for r in runs.values():
                r["default"] = predicted(r["folder"], uncalibrated)
                r["fitted"] = predicted(r["folder"], prof, prof)
                r["compared"] = compared(r["folder"], prof)
            sched = subprocess.run([sys.executable, "-m", "titanrl.schedule", "--config", "configs/tiny_cpu.toml",
                                    "--profile", str(prof), "--out", str(work / "plan.toml")],
                                   cwd=REPO, capture_output=True, text=True, timeout=600)
            data["schedule"] = {"rc": sched.returncode, "stdout": sched.stdout[-3000:], "stderr": sched.stderr[-2000:],
                                "plan": (work / "plan.toml").read_text() if (work / "plan.toml").exists() else ""}
        if args.link:
            data["hosts"] = hosts_section(args.link, args.steps, prof)
    Path(args.out).with_suffix(".json").write_text(json.dumps(data, indent=1))
    Path(args.out).write_text(report(data))
    print(Path(args.out).read_text())


def _ratio(p: float | None, m: float | None) -> float | None:
    if p is None or m is None or p <= 0 or m <= 0:
        return None
    return max(p / m, m / p)


def report(data: dict) -> str:
    runs = data["runs"]
    lines = [
        "# Heterogeneous ranks on this machine, measured; the scheduler's cost model fitted and tested on held-out runs",
        "",
        f"Generated by `scripts/bench_hetrl_measured.py` ({provenance_text(data)}); not hand-edited. Tiny GRPO job "
        f"(configs/tiny_cpu.toml), {data['steps']} steps, medians over steps 2-{data['steps']}. Two ranks x one thread: "
        f"rank 0 alone on core 0, rank 1 on core 1 beside {data['spinners']} spinning processes (a slower device). "
        "Busy time is `metrics.busy_clock = runnable` (CPU time plus the time the rank waited for its core).",
        "",
        f"Profile (`python -m titanrl.profile`, same pinning): matmul {data['profile_tflops'][0]:.3f} vs "
        f"{data['profile_tflops'][1]:.3f} TFLOP/s -> speeds {data['speeds']}.",
        "",
        "| run | fit or held out | step wall s | " + " | ".join(f"busy ratio {s}" for s in STAGES)
        + " | planned share rank 1 |",
        "|---|---|---|" + "---|" * len(STAGES) + "---|",
    ]
    for name, r in runs.items():
        ratios = " | ".join("-" if r["busy_ratio"][s] is None else f"{r['busy_ratio'][s]:.2f}" for s in STAGES)
        share = "-" if r["share"][1] is None else f"{r['share'][1]:.2f}"
        lines.append(f"| {name} | {r['role']} | {r['wall_s']:.2f} | {ratios} | {share} |")
    base = runs[PLACEMENTS[0]]["wall_s"]
    best = min(PLACEMENTS, key=lambda n: runs[n]["wall_s"])
    lines += ["", "The four placements at the default batch, against the speed-oblivious one: " + ", ".join(
        f"{n} {base / runs[n]['wall_s']:.2f}x" for n in PLACEMENTS) + ".",
        f"Fastest measured: **{best}** ({runs[best]['wall_s']:.2f} s/step).", "",
        "## The cost model fitted to measured runs (`python -m titanrl.calibrate`)", "",
        "`titanrl.calibrate` fitted the efficiencies, link factors and fixed costs (`OVERHEAD_TERMS` of "
        "`titanrl/hetero/cost.py`) to the runs marked *fit* (each stage's and the step's medians, non-negative least "
        "squares weighted by 1 / seconds) and wrote them into the profile. The runs marked *held-out* were not in "
        f"the fit. Targets: within {STAGE_TARGET}x per stage and {STEP_TARGET}x per step (the larger of "
        "predicted / measured and its inverse). *Measured* is what the fit reads: the medians of `time/<stage>` (the "
        "slowest rank's wall clock, so a stage's time includes waiting for a rank still in the stage before) and "
        "`step/wall_s`; in a synchronous disaggregated run the rollout rank waits inside `weight_sync` for the "
        "training rank's stages, so its `weight_sync` is the measured one less those stages.", "", "```",
        data["calibrate"].strip(), "```", "",
        "| run | role | " + " | ".join(f"{s} default / fitted / measured s" for s in (*STAGES, "step")) + " |",
        "|---|---|" + "---|" * (len(STAGES) + 1)]
    misses: list[str] = []
    worst = {"fit": [1.0, 1.0], "held-out": [1.0, 1.0]}
    for name, r in runs.items():
        cells = []
        for s in (*STAGES, "step"):
            m = r["compared"].get(s)
            d, f = r["default"].get(s), r["fitted"].get(s)
            if m is None or f is None:
                cells.append("-")
                continue
            ratio = _ratio(f, m)
            target = STEP_TARGET if s == "step" else STAGE_TARGET
            mark = "" if ratio is not None and ratio <= target else " **x**"
            if mark:
                misses.append(f"{name}: {s} {'off' if ratio is None else f'{ratio:.2f}x'}")
            if ratio is not None:
                k = 1 if s == "step" else 0
                worst[r["role"]][k] = max(worst[r["role"]][k], ratio)
            cells.append(f"{d:.3f} / {f:.3f} / {m:.3f}{mark}")
        lines.append(f"| {name} | {r['role']} | " + " | ".join(cells) + " |")
    lines += ["", f"Worst ratio, fitted model: fit runs {worst['fit'][0]:.2f}x per stage, {worst['fit'][1]:.2f}x per "
              f"step; held-out runs {worst['held-out'][0]:.2f}x per stage, {worst['held-out'][1]:.2f}x per step.",
              "", ("Outside the targets (**x**): " + "; ".join(misses) + ".") if misses else
              "Every stage and step is within the targets.", "",
              "## The scheduler's pick on this profile (calibrated)", ""]
    pick = picked(data["schedule"]["plan"])
    if pick in runs:
        gap = runs[pick]["wall_s"] / runs[best]["wall_s"]
        lines += [f"`python -m titanrl.schedule` picked **{pick}**: measured {runs[pick]['wall_s']:.2f} s/step, "
                  f"{gap:.2f}x the best measured ({'within' if gap <= 1.05 else 'NOT within'} 5%).", ""]
    lines += ["```", data["schedule"]["stdout"].strip() or data["schedule"]["stderr"].strip(), "```"]
    if "hosts" in data:
        h = data["hosts"]
        best = min(h["runs"], key=lambda n: h["runs"][n]["wall_s"])
        lines += ["", f"## Two hosts joined by a {h['rate']} link (a held-out cluster)", "",
                  "Two network namespaces joined by veth pairs (`scripts/netns_hosts.py`), one rank each, both links "
                  f"limited with `tc ... tbf` to {h['rate']}; the profiler measured {h['link_gbps']:.3f} Gbit/s "
                  "between them. Ray spans both hosts (ShadowLoader). *Fitted* is the calibration above (one host, "
                  "fast local links) applied to this profile.", "",
                  "| placement | step wall s | predicted step s, default | predicted step s, fitted |", "|---|---|---|---|"]
        for name, r in h["runs"].items():
            ratio = _ratio(r["fitted"], r["wall_s"])
            lines.append(f"| {name} | {r['wall_s']:.2f} | {r['default']:.3f} | {r['fitted']:.3f} "
                         f"({'-' if ratio is None else f'{ratio:.2f}x'}) |")
        if h["pick"]:
            gap = h["runs"][h["pick"]]["wall_s"] / h["runs"][best]["wall_s"]
            lines += ["", f"The scheduler (default coefficients: this profile is not calibrated) picked **{h['pick']}**:"
                          f" {gap:.2f}x the best measured ({'within' if gap <= 1.05 else 'NOT within'} 5%)."]
        lines += ["", "```", h["schedule"].strip(), "```"]
    lines += ["", "The default coefficients are round numbers for large GPU models: they have no fixed costs, which "
              "is what dominates a tiny model on a CPU (Python, vLLM's scheduler, FSDP hooks, the reward and data "
              "nodes). The fit adds them. Not measured here: a GPU, or a model large enough that FLOPs dominate.", ""]
    return "\n".join(lines) + "\n"


def picked(plan_toml: str) -> str | None:
    """Which measured placement the scheduler's written config is (None: none of them)."""
    if not plan_toml:
        return None
    cfg = tomllib.loads(plan_toml)
    if cfg["workflow"]["placement"] == "colocated":
        return PLACEMENTS[1] if cfg["balance"].get("rank_speeds") else PLACEMENTS[0]
    return PLACEMENTS[3] if "rank 0: device 1 " in plan_toml else PLACEMENTS[2]


if __name__ == "__main__":
    main()
