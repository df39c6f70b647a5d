"""Measured heterogeneity on this machine (issue 28): two ranks of unequal speed, speed-aware vs speed-oblivious.

Rank 0 runs alone on core 0; rank 1 shares core 1 with ``--spinners`` busy processes (each pinned with taskset,
so rank 1 gets about 1 / (1 + spinners) of its core: a slower device). Two ranks x one thread each, so wall-clock
figures mean something here. Steps:

1. ``python -m titanrl.profile`` under the same pinning: each rank's matmul throughput -> relative speeds.
2. The tiny GRPO job, colocated, speed-oblivious (``balance.rank_speeds`` empty) and speed-aware (the profile's
   speeds), with ``metrics.busy_clock = runnable`` (busy = CPU time + time waiting for the core), medians over the
   steps after the first: per-stage ``balance/busy_ratio`` and the step's wall time.
3. Every placement two ranks allow, each measured: colocated (speed-aware), and disaggregated with the rollout on
   the fast rank or on the slow one (the slow rank first: the pinning swapped). ``python -m titanrl.schedule`` on
   the profile picks one; the report says where the pick lands among the measured.

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


def train(work: Path, name: str, pins: tuple[int, int], steps: int, extra: list[str], profile: Path) -> dict:
    out = work / name
    flags = ["--config", "configs/tiny_cpu.toml", f"--job.steps={steps}", "--checkpoint.enable=false",
             f"--job.dump_folder={out}", "--metrics.busy_clock=runnable", "--metrics.progress=none", *extra]
    torchrun(work, pins, ["titanrl.train", *flags])
    recs = [json.loads(line) for line in (out / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()][1:]
    med = lambda key: statistics.median(r[key] for r in recs if key in r) if any(key in r for r in recs) else None
    return {"wall_s": med("step/wall_s"), "busy_ratio": {s: med(f"balance/busy_ratio/{s}") for s in STAGES},
            "share": [med(f"balance/planned_share/rank{r}") for r in (0, 1)], "steps": len(recs),
            "measured": {s: med(f"time/{s}") for s in STAGES},
            "predicted": predicted(flags, profile, devices=[0, 1] if pins == (0, 1) else [1, 0])}


def predicted(flags: list[str], profile: Path, devices: list[int]) -> dict[str, float]:
    """The HetRL cost model's stage times (default, unfitted coefficients) for the run ``flags`` configure, on the
    profiled devices (rank r on profile rank ``devices[r]``), by titanrl's node names."""
    from titanrl.config import load_config
    from titanrl.hetero.cluster import cluster_from_profile
    from titanrl.hetero.cost import TITANRL_NODES, predict_stage_times
    from titanrl.hetero.cost import workload_from_config
    from titanrl.schedule import plan_from_config

    cfg = load_config(flags[1], [f for f in flags[2:]])
    times = predict_stage_times(cluster_from_profile(profile), workload_from_config(cfg),
                                plan_from_config(cfg, 2, devices))
    return {TITANRL_NODES.get(k, k): v for k, v in times.items()}


def hosts_section(rate: str, steps: int) -> dict:
    """Two namespaced hosts (one rank each) whose links tbf limits to ``rate``: the profile across them, the
    colocated and the disaggregated placement measured, and the scheduler's pick on the profile."""
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
            recs = [json.loads(x) for x in (work / str(k) / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()][1:]
            out["runs"][name] = {"wall_s": statistics.median(r["step/wall_s"] for r in recs),
                                 "predicted": predicted(flags[:2] + flags[2:], prof, devices=[0, 1])}
        sched = subprocess.run([sys.executable, "-m", "titanrl.schedule", "--config", "configs/tiny_cpu.toml",
                                "--profile", str(prof), "--out", str(work / "plan.toml")], cwd=REPO,
                               capture_output=True, text=True, timeout=600)
        out["schedule"] = sched.stdout[-3000:] or sched.stderr[-2000:]
        plan = (work / "plan.toml").read_text() if (work / "plan.toml").exists() else ""
        placement = tomllib.loads(plan)["workflow"]["placement"] if plan else None
        out["pick"] = next((n for n in out["runs"] if placement and n.startswith(placement)), None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spinners", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "hetrl_measured.md"))
    ap.add_argument("--link", default="20mbit", help="tbf rate of the two namespaced hosts' links ('' to skip)")
    args = ap.parse_args()
    data: dict = {**provenance(), "spinners": args.spinners, "steps": args.steps, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp, Spinners(args.spinners, core=1):
        work = Path(tmp)
        time.sleep(1.0)
        torchrun(work, (0, 1), ["titanrl.profile", "--out", str(work / "profile.json"), "--quiet"])
        profile = json.loads((work / "profile.json").read_text())
        tflops = [r["matmul_tflops"] for r in profile["ranks"]]
        speeds = [round(t / max(tflops), 3) for t in tflops]
        data["profile_tflops"], data["speeds"] = tflops, speeds
        runs = data["runs"]
        prof = work / "profile.json"
        runs["colocated, speed-oblivious"] = train(work, "oblivious", (0, 1), args.steps, [], prof)
        runs["colocated, speed-aware"] = train(work, "aware", (0, 1), args.steps,
                                               [f"--balance.rank_speeds=[{speeds[0]},{speeds[1]}]"], prof)
        disagg = ["--workflow.placement=disaggregated", "--workflow.rollout_ranks=1"]
        runs["disaggregated, rollout on the fast rank"] = train(work, "dis_fast", (0, 1), args.steps, disagg, prof)
        runs["disaggregated, rollout on the slow rank"] = train(work, "dis_slow", (1, 0), args.steps, disagg, prof)
        sched = subprocess.run([sys.executable, "-m", "titanrl.schedule", "--config", "configs/tiny_cpu.toml",
                                "--profile", str(work / "profile.json"), "--out", str(work / "plan.toml")],
                               cwd=REPO, capture_output=True, text=True, timeout=600)
        data["schedule"] = {"rc": sched.returncode, "stdout": sched.stdout[-3000:], "stderr": sched.stderr[-2000:],
                            "plan": (work / "plan.toml").read_text() if (work / "plan.toml").exists() else ""}
    if args.link:
        data["hosts"] = hosts_section(args.link, args.steps)
    Path(args.out).with_suffix(".json").write_text(json.dumps(data, indent=1))
    Path(args.out).write_text(report(data))
    print(Path(args.out).read_text())


def report(data: dict) -> str:
    runs = data["runs"]
    lines = [
        "# Heterogeneous ranks on this machine, measured (issue 28)",
        "",
        f"Generated by `scripts/bench_hetrl_measured.py` ({provenance_text(data)}); not hand-edited. Tiny GRPO job "
        f"(configs/tiny_cpu.toml), {data['steps']} steps, medians over steps 2-{data['steps']}. Two ranks x one thread: "
        f"rank 0 alone on core 0, rank 1 on core 1 beside {data['spinners']} spinning processes (a slower device). "
        "Busy time is `metrics.busy_clock = runnable` (CPU time plus the time the rank waited for its core).",
        "",
        f"Profile (`python -m titanrl.profile`, same pinning): matmul {data['profile_tflops'][0]:.3f} vs "
        f"{data['profile_tflops'][1]:.3f} TFLOP/s -> speeds {data['speeds']}.",
        "",
        "| run | step wall s | vs oblivious | " + " | ".join(f"busy ratio {s}" for s in STAGES) + " | planned share rank 1 |",
        "|---|---|---|" + "---|" * len(STAGES) + "---|",
    ]
    base = runs["colocated, speed-oblivious"]["wall_s"]
    for name, r in runs.items():
        ratios = " | ".join("-" if r["busy_ratio"][s] is None else f"{r['busy_ratio'][s]:.2f}" for s in STAGES)
        share = "-" if r["share"][1] is None else f"{r['share'][1]:.2f}"
        lines.append(f"| {name} | {r['wall_s']:.2f} | {base / r['wall_s']:.2f}x | {ratios} | {share} |")
    best = min(runs, key=lambda n: runs[n]["wall_s"])
    pick = picked(data["schedule"]["plan"])
    lines += ["", f"Fastest measured: **{best}** ({runs[best]['wall_s']:.2f} s/step).", "",
              "## The scheduler's pick on this profile", ""]
    if pick in runs:
        gap = runs[pick]["wall_s"] / runs[best]["wall_s"]
        lines += [f"`python -m titanrl.schedule` picked **{pick}**: measured {runs[pick]['wall_s']:.2f} s/step, "
                  f"{gap:.2f}x the best measured ({'within' if gap <= 1.05 else 'NOT within'} 5%).", ""]
    lines += ["```", data["schedule"]["stdout"].strip() or data["schedule"]["stderr"].strip(), "```", "",
              "## Predicted vs measured stage times", "",
              "The HetRL cost model (`titanrl/hetero/cost.py`, default coefficients, not fitted to this machine) on the "
              "profiled devices, against each stage's measured wall time (`time/<stage>`, the slowest rank; medians).",
              "", "| run | " + " | ".join(f"{s} predicted / measured s" for s in STAGES) + " |",
              "|---|" + "---|" * len(STAGES)]
    for name, r in runs.items():
        cells = []
        for s in STAGES:
            p, m = r["predicted"].get(s), r["measured"].get(s)
            cells.append("-" if p is None or m is None else f"{p:.3f} / {m:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if "hosts" in data:
        h = data["hosts"]
        best = min(h["runs"], key=lambda n: h["runs"][n]["wall_s"])
        lines += ["", f"## Two hosts joined by a {h['rate']} link", "",
                  "Two network namespaces joined by veth pairs (`scripts/netns_hosts.py`), one rank each, both links "
                  f"limited with `tc ... tbf` to {h['rate']}; the profiler measured {h['link_gbps']:.3f} Gbit/s "
                  "between them. Ray spans both hosts (ShadowLoader).", "",
                  "| placement | step wall s | predicted step s (cost model, unfitted) |", "|---|---|---|"]
        for name, r in h["runs"].items():
            lines.append(f"| {name} | {r['wall_s']:.2f} | {sum(r['predicted'].values()):.3f} |")
        if h["pick"]:
            gap = h["runs"][h["pick"]]["wall_s"] / h["runs"][best]["wall_s"]
            lines += ["", f"The scheduler picked **{h['pick']}**: {gap:.2f}x the best measured "
                          f"({'within' if gap <= 1.05 else 'NOT within'} 5%)."]
        lines += ["", "```", h["schedule"].strip(), "```"]
    lines += ["", "Where the model is far off, it has no term for what dominates a tiny model on a CPU: per-call "
              "overheads (Python, vLLM's scheduler, FSDP hooks), the reward and data nodes, and the weight push "
              "through a file; `balance.calibrate` refits the training planners' cost model to measured stage "
              "times at run time (`docs/balance.md`), `titanrl.hetero.cost.fit` the scheduler's efficiencies from "
              "rows like these.", ""]
    return "\n".join(lines) + "\n"


def picked(plan_toml: str) -> str | None:
    """Which measured run the scheduler's written config is (None: none of them)."""
    if not plan_toml:
        return None
    cfg = tomllib.loads(plan_toml)
    if cfg["workflow"]["placement"] == "colocated":
        return "colocated, speed-aware" if cfg["balance"].get("rank_speeds") else "colocated, speed-oblivious"
    return ("disaggregated, rollout on the slow rank" if "rank 0: device 1 " in plan_toml
            else "disaggregated, rollout on the fast rank")


if __name__ == "__main__":
    main()
