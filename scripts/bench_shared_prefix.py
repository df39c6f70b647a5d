"""Shared-prefix packing (``rl.shared_prefix``) off vs on, in the same run: tokens computed, stage time, memory.

    python scripts/bench_shared_prefix.py            # -> benchmarks/shared_prefix.{json,md}
    python scripts/bench_shared_prefix.py --quick    # fewer steps and prompts, for a smoke run

Two parts, each running the unshared baseline and shared prefixes back to back on the same input:

- ``tiny default``: the README's main job (``configs/tiny_cpu.toml`` as it stands: ``rl.global_batch_size``
  prompts x ``rollout.n`` responses per step) through
  ``titanrl.train``, one process, real rollouts, rewards and updates; per-stage seconds
  are the median over the steady steps (step 3 on), peak RSS is the whole process's (vLLM included).
- ``stages``: the ``small`` model (random init, fp32, one process, 2 threads) through the trainer's own
  ``StageRunner``: old-log-prob pass + update (forward + backward, no optimizer step) of one RL step, on prompts
  of the image-heavy mixture and on the longest prompts of the video-heavy mixture (videos at 2 fps, up to 128
  frames), 8 responses of 64-192 tokens each. Each configuration runs in a fresh process; ``peak extra RSS`` is
  its maximum resident memory above what it held after building the model and the batch.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import provenance, provenance_text  # noqa: E402
from bench_flex_ulysses import loss_fn, ratio, small_model_dir  # noqa: E402
from bench_vision import build_batch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8192
STAGE_BATCHES = {
    "image-heavy": dict(mixture="image-heavy", prompts=8, longest=False, max_frames=128),
    "video-heavy (longest videos)": dict(mixture="video-heavy", prompts=2, longest=True, max_frames=128),
}
STAGE_KEYS = ("time/old_logprob", "time/ref_logprob", "time/update")


# ---------------------------------------------------------------- part 1: the tiny default, whole RL steps


def run_trainer(shared: bool, steps: int, tmp: Path) -> dict:
    out = tmp / f"shared_{shared}"
    cmd = [sys.executable, "-m", "titanrl.train", "--config", "configs/tiny_cpu.toml", f"--job.steps={steps}",
           "--checkpoint.enable=false", "--rollout.probe_every=0", f"--job.dump_folder={out}",
           f"--rl.shared_prefix={'true' if shared else 'false'}"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        sys.stderr.write(log[-6000:])
        raise SystemExit(f"titanrl.train with rl.shared_prefix={shared} failed")
    records = [json.loads(line) for line in (out / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["step"] >= 3] or records

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in steady)

    row = {k: med(k) for k in (*STAGE_KEYS, "train/tokens_computed", "train/tokens_represented")}
    row["step_s"] = statistics.median(sum(v for k, v in r.items() if k.startswith("time/")) for r in steady)
    row["stages_s"] = sum(row[k] for k in STAGE_KEYS)
    row["reward_last"] = records[-1]["reward/mean"]
    row["peak_rss_mb"] = usage.ru_maxrss / 1024  # Linux: KiB
    row["wall_s"] = time.time() - t0
    row["steps"] = len(records)
    return row


# ---------------------------------------------------------------- part 2: the training stages, small model


def stage_worker(opts) -> None:
    import resource

    import torch

    from titanrl.models.qwen2_5_vl import Qwen2_5_VLModel
    from titanrl.rl.stages import StageRunner, build_cost_model

    torch.set_num_threads(opts.threads)
    spec = STAGE_BATCHES[opts.batch]
    args, trajs = build_batch(Path(opts.model_dir), spec["mixture"], spec["prompts"] if not opts.quick else 1,
                              opts.responses, opts.seed, max_frames=spec["max_frames"], response_range=(64, 192),
                              longest=spec["longest"])
    torch.manual_seed(0)
    model = Qwen2_5_VLModel(args)
    model.init_weights()
    cost_model = build_cost_model(args, "flops")

    def run(ts):
        runner = StageRunner(args=args, rank=0, world=1, device=torch.device("cpu"), dtype=torch.float32,
                             method="none", strategy="lb_micro", max_tokens=MAX_TOKENS, cost_model=cost_model,
                             shared_prefix=opts.shared)
        runner.begin_step(ts)
        t0 = time.perf_counter()
        runner.logprobs(model, "old_logprobs", temperature=1.0)
        t1 = time.perf_counter()
        runner.train_minibatch(model, runner.all_ids(), ("old_logprobs",), loss_fn, temperature=1.0)
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1, runner.metrics()

    run(trajs[:1])  # warm-up
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    logprob_s, update_s, metrics = run(trajs)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lengths = sorted({t.prompt.record.id: len(t.prompt.prompt_ids) for t in trajs}.values(), reverse=True)
    Path(opts.out).write_text(json.dumps({
        "logprob_s": logprob_s, "update_s": update_s, "stages_s": logprob_s + update_s,
        "tokens_computed": metrics["train/tokens_computed"], "tokens_represented": metrics["train/tokens_represented"],
        "peak_extra_rss_mb": max(peak - base, 0) / 1024, "prompts": len(lengths), "prompt_lengths": lengths,
        "responses": opts.responses, "trajectories": len(trajs),
    }))


def run_stages(batch: str, shared: bool, opts, tmp: Path) -> dict:
    out = tmp / f"{batch.split()[0]}_{shared}.json"
    cmd = [sys.executable, __file__, "--worker", "--batch", batch, "--out", str(out), "--model-dir",
           str(opts.model_dir), "--responses", str(opts.responses), "--seed", str(opts.seed), "--threads",
           str(opts.threads)] + (["--shared"] if shared else []) + (["--quick"] if opts.quick else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"stage worker {batch} shared={shared} failed")
    return json.loads(out.read_text())


# ---------------------------------------------------------------- report


def report(res: dict) -> str:
    lines = ["# Shared-prefix packing: a prompt computed once per GRPO group", "",
             "Generated by `scripts/bench_shared_prefix.py` from `benchmarks/shared_prefix.json` (do not edit).",
             "`rl.shared_prefix = false` (every trajectory packed whole, its prompt repeated per response) against",
             "`true` (each prompt once, followed by the responses sharing it; log-probs, loss and gradients equal, see",
             "tests/test_shared_prefix.py), measured in the same run on the same inputs. CPU (this 2-core machine).", ""]
    t = res.get("tiny")
    if t:
        lines += tiny_section(t["off"], t["on"])
    if res.get("stages"):
        lines += stages_section(res)
    lines += ["", f"Reproduce: `{res['command']}` ({res['seconds']:.0f} s, "
                  f"{provenance_text(res)}).", ""]
    return "\n".join(lines)


def tiny_section(off: dict, on: dict) -> list[str]:
    lines = []
    lines += ["## Tiny default, whole RL steps (`configs/tiny_cpu.toml`, one process)", "",
              f"Median over steps 3-{on['steps']} (wall-clock).", "",
              "| rl.shared_prefix | tokens computed / represented | old log-prob s | ref log-prob s | update s | "
              "log-prob + update s | step s | peak RSS MB | reward at last step |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, r in (("false", off), ("true", on)):
        lines.append(f"| {name} | {r['train/tokens_computed']:.0f} / {r['train/tokens_represented']:.0f} | "
                     f"{r['time/old_logprob']:.2f} | {r['time/ref_logprob']:.2f} | {r['time/update']:.2f} | "
                     f"{r['stages_s']:.2f} | {r['step_s']:.2f} | {r['peak_rss_mb']:.0f} | {r['reward_last']:.3f} |")
    lines += ["", f"Tokens computed: {ratio(off['train/tokens_computed'], on['train/tokens_computed'])} fewer; "
              f"log-prob + update stages: {ratio(off['stages_s'], on['stages_s'])} faster; whole step: "
              f"{ratio(off['step_s'], on['step_s'])} faster.", ""]
    return lines


def stages_section(res: dict) -> list[str]:
    lines = ["## Training stages, `small` model (old-log-prob pass + update, one process, "
              f"{res['threads']} threads)", "",
              "| batch | rl.shared_prefix | tokens computed / represented | log-prob s | update s | stages s | "
              "vs off | peak extra RSS MB |",
              "|---|---|---|---|---|---|---|---|"]
    for batch, rows in res["stages"].items():
        off = rows["off"]
        desc = (f"{batch}: {off['prompts']} prompts ({', '.join(str(x) for x in off['prompt_lengths'])} tokens) "
                f"x {off['responses']}")
        for name, key in (("false", "off"), ("true", "on")):
            r = rows[key]
            lines.append(f"| {desc if key == 'off' else ''} | {name} | {r['tokens_computed']:.0f} / "
                         f"{r['tokens_represented']:.0f} | {r['logprob_s']:.1f} | {r['update_s']:.1f} | "
                         f"{r['stages_s']:.1f} | {ratio(off['stages_s'], r['stages_s'])} | "
                         f"{r['peak_extra_rss_mb']:.0f} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--batch", default="")
    p.add_argument("--out", default="")
    p.add_argument("--model-dir", default="")
    p.add_argument("--shared", action="store_true")
    p.add_argument("--responses", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--parts", default="tiny,stages")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--report-only", action="store_true", help="rewrite the .md from the committed .json")
    opts = p.parse_args()
    if opts.worker:
        stage_worker(opts)
        return
    out = ROOT / "benchmarks"
    if opts.report_only:
        (out / "shared_prefix.md").write_text(report(json.loads((out / "shared_prefix.json").read_text())))
        return
    if opts.quick:
        opts.steps = 4
    opts.model_dir = small_model_dir()
    t0 = time.time()
    previous = json.loads((out / "shared_prefix.json").read_text()) if (out / "shared_prefix.json").is_file() else {}
    res = {"threads": opts.threads, "tiny": previous.get("tiny"), "stages": previous.get("stages", {})}
    parts = opts.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if "tiny" in parts:
            res["tiny"] = {"off": run_trainer(False, opts.steps, Path(tmp)), "on": run_trainer(True, opts.steps, Path(tmp))}
            print("tiny default done", flush=True)
        if "stages" in parts:
            for batch in STAGE_BATCHES:
                res["stages"][batch] = {"off": run_stages(batch, False, opts, Path(tmp)),
                                        "on": run_stages(batch, True, opts, Path(tmp))}
                print(f"{batch} done", flush=True)
    res["seconds"] = time.time() - t0
    res["command"] = " ".join(["python", "scripts/bench_shared_prefix.py", *sys.argv[1:]])
    res.update(provenance())
    text = report(res)
    if not opts.quick:
        (out / "shared_prefix.json").write_text(json.dumps(res, indent=1))
        (out / "shared_prefix.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
