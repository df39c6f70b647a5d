"""What CPU CI cannot run, on one CUDA GPU: one summary line per check, benchmarks/gpu_check.json with --record.

    python scripts/check_gpu.py [--out OUT_DIR] [--record] [--commit SHA]     # scripts/check_gpu.sh calls this

1. ``attention``: scripts/check_gpu_attention.py (``flash`` bf16 against ``sdpa`` fp32, the Ulysses wrapper at
   degree 1, shared prefixes, speed) -> OUT/attention.json;
2. ``rl_tiny``: 4 GRPO steps of the tiny default in bf16 with ``flash``, the rollout engine generating on the GPU,
   the weight push into it every step and the probe (engine vs trainer log-probs of the same tokens) every step;
3. ``rl_7b_shape_ac_{full,none}``: 3 steps of ``configs/qwen2_5_vl_7b.toml`` (bf16, flash, lb_micro, 8192 tokens
   per microbatch) on a random-init checkpoint at Qwen2.5-VL-7B's full width with 4 of its decoder layers and 4
   of its vision blocks (``make_tiny --size 7b-shape-4l``, 2.15 B parameters), with and without activation
   checkpointing: the memory planner's predicted peak (at the config bound, and at the tokens the run really put
   in a microbatch and the samples it really had: bench_memory.observed_data) against the allocator's measured
   peak, and tokens/s.

4. ``rl_3b_shape``: 3 steps of the same config on a full-depth Qwen2.5-VL-3B-shaped model (36 layers of 2048, the
   32-block vision tower; ``make_tiny --size 3b-shape``, random init) with ``compile.enable`` on: predicted vs
   measured peak, tokens/s and MFU (6 x parameters x tokens/s over the device's dense bf16 peak), the frames
   compiled per step and the in-memory weight push's seconds.

The engine sleeps while the training stages run (``rollout.sleep = "auto"``: on a CUDA device, colocated), so the
probe every step also checks the weight push into a sleeping engine; the engine's memory without it:
``--ac full --suffix _sleep_off --big-overrides=--rollout.sleep=off``.

The rollout engine is vLLM when it imports, else ``hf`` (transformers generate, on the GPU); the loader is
``shadow`` when Ray imports, else ``centralized``: the JSON says which ran. Every run is ``python -m
titanrl.train``, one process (a one-rank FSDP2 mesh: bf16 compute, fp32 master weights).

``--cpu-smoke`` runs the same sequence on a CPU machine (fp32, sdpa, 2 steps, ``small`` in place of the 7B
shape) to check this script itself; its output is not a GPU result and --record refuses it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]
from bench_memory import observed_data, observed_tokens_per_microbatch  # noqa: E402

TINY = "configs/tiny_cpu.toml"
# The probe every step, recorded, never stopping the run: bf16 at full width reads ~0.05 with the right weights (the
# hf engine now takes the trainer's text-after-video positions; before, video prompts read 1.65-2.6); a broken
# weight push reads O(1).
PROBE = ["--rollout.probe_every=1", "--rollout.probe_tolerance=0.05", "--rollout.probe_max_violations=0"]
BIG = "configs/qwen2_5_vl_7b.toml"


def importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def run_logged(name: str, cmd: list[str], out: Path, timeout: float, run_dir: Path | None = None) -> dict:
    """Run ``cmd`` with its output in OUT/<name>.log; rc 124 when it ran past ``timeout``. ``run_dir`` (a
    training run's folder) is emptied first: its metrics.jsonl would otherwise keep an earlier run's steps."""
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    error = first_error(out / f"{name}.log") if rc else None
    result = {"cmd": " ".join(cmd[2:] if cmd[1] == "-m" else cmd[1:]), "rc": rc, "seconds": round(time.time() - t0, 1)}
    return {"error": error, **result} if error else result


def first_error(log: Path) -> str | None:
    """The run's one-line cause (titanrl's ``error on rank`` line, else the last exception line) of a failed run."""
    if not log.exists():
        return None
    lines = log.read_text(errors="replace").splitlines()
    named = [ln for ln in lines if "] error on rank" in ln]
    raised = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception"))]
    return (named or raised or [None])[-1]


def train_argv(config: str, name: str, runs: Path, overrides: list[str]) -> list[str]:
    return ["--config", config, f"--job.name={name}", f"--job.dump_folder={runs}", "--checkpoint.enable=false",
            "--metrics.progress=line", "--metrics.verbose=true", *overrides]


def summarise_run(result: dict, argv: list[str], run_dir: Path) -> dict:
    """Step metrics and the planner's prediction (bound and observed T) of one finished training run."""
    from titanrl import memory
    from titanrl.config import parse_args

    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    result["steps"] = len(rows)
    if not rows:
        return result
    cfg = parse_args(argv)
    shape, _ = memory.resolve_shape(cfg)
    device = "cuda" if cfg.model.attn_backend == "flash" else "cpu"
    bound = memory.predict(cfg, shape, 1, device=device)
    t_obs = observed_tokens_per_microbatch(run_dir, 1)
    data = observed_data(cfg, run_dir)  # the run's samples (the bound assumes the longest, all-media ones)
    at_obs = memory.predict(parse_args([*argv, f"--balance.max_tokens_per_microbatch={t_obs}"]), shape, 1,
                            device=device, data=data)
    measured = max(r["memory/measured_peak_bytes"] for r in rows)
    runtime = bound.term("runtime")
    probe = [r["probe/logprob_max_diff"] for r in rows if "probe/logprob_max_diff" in r]
    later = rows[1:] or rows  # the first step includes warm-up (kernels, allocator growth)
    result.update({
        "params": bound.params,
        "engine_sleeps": cfg.engine_sleeps(device),
        "probe_max_diff": max(probe) if probe else None,
        "probe_steps": len(probe),
        "measured_peak_bytes": measured,
        "predicted_peak_bytes_bound": bound.total,
        "predicted_peak_bytes_logged": rows[-1]["memory/predicted_peak_bytes"],
        "observed_tokens_per_microbatch": t_obs,
        "observed_data": dataclasses.asdict(data),
        "tokens_per_microbatch_bound": cfg.balance.max_tokens_per_microbatch,
        "predicted_peak_bytes_observed_T": at_obs.total,
        "runtime_term_bytes": runtime,
        # the allocator's peak holds no CUDA context / NCCL buffers / cached-but-free blocks: the runtime term's part
        "error_observed_T_without_runtime": (at_obs.total - runtime - measured) / measured,
        "error_observed_T": (at_obs.total - measured) / measured,
        "terms_observed_T": {t.name: t.bytes for t in at_obs.terms},
        "tokens_per_s_after_first_step": sum(r["throughput/tokens_per_s"] for r in later) / len(later),
        "step_wall_s": [round(r["step/wall_s"], 3) for r in rows],
        "stage_s_after_first_step": {k[len("time/"):]: round(sum(r[k] for r in later) / len(later), 3)
                                     for k in rows[-1] if k.startswith("time/")},
        "reward_mean": [round(r["reward/mean"], 4) for r in rows],
    })
    return result


def line(name: str, r: dict) -> str:
    from titanrl.memory import fmt_bytes

    if r["rc"] != 0:
        return f"{name}: FAILED rc={r['rc']} after {r['seconds']} s (OUT/{name}.log)"
    if "measured_peak_bytes" not in r:
        return f"{name}: ok in {r['seconds']} s"
    probe = f", probe max |engine - trainer| {r['probe_max_diff']:.3g}" if r.get("probe_max_diff") is not None else ""
    return (f"{name}: ok, {r['steps']} steps in {r['seconds']} s, "
            f"{r['tokens_per_s_after_first_step']:.0f} tok/s{probe}; "
            f"peak {fmt_bytes(r['measured_peak_bytes'])} measured, {fmt_bytes(r['predicted_peak_bytes_observed_T'])} "
            f"predicted at T={r['observed_tokens_per_microbatch']} ({100 * r['error_observed_T']:+.1f}%; "
            f"{100 * r['error_observed_T_without_runtime']:+.1f}% without the runtime term), "
            f"{fmt_bytes(r['predicted_peak_bytes_bound'])} at the config bound")


def combine(paths: list[Path]) -> int:
    """benchmarks/gpu_check.json from several calls' reports: the device facts of the first, each check with the
    commit, engine and loader of the call that ran it; the checks a later call ran again under ``superseded``."""
    reports = [json.loads(p.read_text()) for p in paths]
    out = {k: v for k, v in reports[0].items() if k not in ("checks", "commit", "rollout_engine", "loader", "why")}
    out["calls"] = [{k: v for k, v in r.items() if k != "checks"} | {"checks": sorted(r["checks"])} for r in reports]
    out["checks"], out["superseded"] = {}, []  # superseded: a check that a later call ran again
    for path, r in zip(paths, reports):
        for name, check in r["checks"].items():
            if name in out["checks"]:
                out["superseded"].append({"name": name, **out["checks"][name]})
            if check["rc"] and "error" not in check:  # reports written before the error field: read the log
                error = first_error(path.parent / f"{name}.log")
                check = {**check, **({"error": error} if error else {})}
            out["checks"][name] = {"commit": r["commit"], **check}
    (REPO / "benchmarks" / "gpu_check.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, check in out["checks"].items():
        print(f"{line(name, check)} [{check['commit'][:7]}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "check_gpu")
    ap.add_argument("--record", action="store_true", help="also write benchmarks/gpu_check.json")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    ap.add_argument("--cpu-smoke", action="store_true", help="check this script on a CPU machine (not a result)")
    ap.add_argument("--skip", nargs="*", default=[], help="checks to leave out (attention, rl_tiny, rl_7b_shape, "
                    "rl_3b_shape)")
    ap.add_argument("--ac", nargs="+", default=["full", "none"], help="activation_checkpoint of the 7B-shaped runs")
    ap.add_argument("--combine", nargs="+", type=Path, default=None, metavar="GPU_CHECK_JSON",
                    help="write benchmarks/gpu_check.json from the gpu_check.json of several device calls (each "
                         "check with the commit and settings it ran at; a later file's check replaces an earlier's)")
    ap.add_argument("--big-overrides", nargs="*", default=[], help="more overrides for the 7B-shaped runs, each as "
                    "--big-overrides=--section.key=value")
    ap.add_argument("--suffix", default="", help="appended to the 7B-shaped checks' names (runs with other "
                    "--big-overrides, e.g. _image_heavy with --big-overrides=--data.mixture=image-heavy)")
    ap.add_argument("--big-timeout", type=float, default=330.0, help="seconds for each 7B-shaped run")
    args = ap.parse_args(argv)
    if args.combine:
        return combine(args.combine)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("check_gpu: no CUDA device visible to torch (--cpu-smoke checks this script on a CPU)")
        return 1
    if args.record and args.cpu_smoke:
        print("check_gpu: --record writes GPU results only")
        return 1
    commit = args.commit
    if commit is None:
        from bench_common import git_commit

        commit = git_commit()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = Path(os.environ.get("TMPDIR", "/tmp")) / "titanrl-check-gpu"
    engine = "vllm" if importable("vllm") and not args.cpu_smoke else "hf"  # the smoke: what a GPU box without
    loader = "shadow" if importable("ray") and not args.cpu_smoke else "centralized"  # vLLM and Ray runs
    report: dict = {
        "commit": commit,
        "device": torch.cuda.get_device_name() if cuda else "cpu (--cpu-smoke: not a GPU result)",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "rollout_engine": engine,
        "loader": loader,
        "why": ("vLLM does not import on this machine, so rollouts ran on transformers generate on the GPU"
                if engine == "hf" else "vLLM (CUDA) rollouts")
               + ("; Ray does not import, so the centralized loader decoded the media" if loader == "centralized"
                  else ""),
        "checks": {},
    }
    precision = (["--model.dtype=float32", "--model.attn_backend=sdpa"] if args.cpu_smoke
                 else ["--model.dtype=bfloat16", "--model.attn_backend=flash"])
    common = [f"--rollout.engine={engine}", f"--data.loader={loader}", *precision]
    if loader == "centralized":
        common.append("--data.slice_loading=false")
    ok = True

    def record(name: str, result: dict) -> None:
        nonlocal ok
        report["checks"][name] = result
        ok = ok and result["rc"] == 0
        print(line(name, result), flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")

    if "attention" not in args.skip and not args.cpu_smoke:
        r = run_logged("attention", [sys.executable, "scripts/check_gpu_attention.py", "--out",
                                     str(out / "attention.json")], out, 240)
        if (out / "attention.json").exists():
            r["result"] = json.loads((out / "attention.json").read_text())
        record("attention", r)

    if "rl_tiny" not in args.skip:
        tiny = train_argv(TINY, "rl_tiny", runs, [*common, f"--job.steps={2 if args.cpu_smoke else 4}",
                                                    *PROBE])
        r = run_logged("rl_tiny", [sys.executable, "-m", "titanrl.train", *tiny], out, 300, runs / "rl_tiny")
        record("rl_tiny", summarise_run(r, tiny, runs / "rl_tiny"))

    if "rl_7b_shape" not in args.skip:
        size = "small" if args.cpu_smoke else "7b-shape-4l"
        ckpt = runs / f"ckpt-{size}"
        if not (ckpt / "model.safetensors").exists():
            r = run_logged("make_checkpoint", [sys.executable, "-m", "titanrl.models.make_tiny", str(ckpt),
                                               "--size", size], out, 300)
            record("make_checkpoint", r)
        for ac in args.ac:
            name = f"rl_7b_shape_ac_{ac}{args.suffix}"
            big = train_argv(BIG, name, runs, [
                *common, f"--model.path={ckpt}", f"--job.steps={2 if args.cpu_smoke else 3}",
                f"--parallelism.activation_checkpoint={ac}", "--parallelism.ulysses=none",
                "--checkpoint.export_hf=false",
                # a short GRPO step: 8 prompts x 4 responses of at most 64 tokens (transformers generate is slow)
                "--rl.global_batch_size=8", "--rollout.n=4", "--rollout.max_new_tokens=64", "--data.num_samples=32",
                *PROBE,
                *(["--balance.max_tokens_per_microbatch=2048", "--model.max_seq_len=2048",
                   "--data.max_prompt_tokens=1024", "--data.max_frames=8"] if args.cpu_smoke else []),
                *args.big_overrides,
            ])
            r = run_logged(name, [sys.executable, "-m", "titanrl.train", *big], out, args.big_timeout, runs / name)
            record(name, summarise_run(r, big, runs / name))

    if "rl_3b_shape" not in args.skip and not args.cpu_smoke:
        ckpt = runs / "ckpt-3b-shape"
        if not (ckpt / "model.safetensors").exists():
            record("make_checkpoint_3b", run_logged("make_checkpoint_3b", [
                sys.executable, "-m", "titanrl.models.make_tiny", str(ckpt), "--size", "3b-shape"], out, 400))
        name = "rl_3b_shape"
        big = train_argv(BIG, name, runs, [
            *common, f"--model.path={ckpt}", "--job.steps=3", "--parallelism.activation_checkpoint=full",
            "--parallelism.ulysses=none", "--compile.enable=true", "--checkpoint.export_hf=false",
            "--rl.global_batch_size=8", "--rollout.n=4", "--rollout.max_new_tokens=64", "--data.num_samples=32",
            *PROBE, *args.big_overrides])
        run = run_logged(name, [sys.executable, "-m", "titanrl.train", *big], out, max(args.big_timeout, 540),
                         runs / name)
        r = summarise_run(run, big, runs / name)
        if "tokens_per_s_after_first_step" in r:
            peak = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
            dense = next((v for k, v in peak.items() if k in report["device"]), None)
            r["mfu"] = 6 * r["params"] * r["tokens_per_s_after_first_step"] / dense if dense else None
            rows = [json.loads(x) for x in (runs / name / "metrics.jsonl").read_text().splitlines()]
            r["compile_recompiles"] = [x.get("compile/recompiles") for x in rows]
            r["push_s"] = [round(x.get("sync/gather_s", 0.0) + x.get("sync/load_s", 0.0), 3) for x in rows]
        record(name, r)

    if args.record:
        (REPO / "benchmarks" / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"check_gpu: {'all ok' if ok else 'FAILED'}; {out / 'gpu_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
