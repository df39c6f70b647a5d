"""The FlexRL ablation on this machine: whole RL steps, stage by stage, per configuration, one run.

    python scripts/bench_e2e.py                 # -> benchmarks/e2e.{json,md,png}
    python scripts/bench_e2e.py --quick         # tiny model, one step of ``all`` (the CI smoke test)
    python scripts/bench_e2e.py --report-only   # rewrite the .md / .png from the .json
    python scripts/bench_e2e.py --mixtures video-heavy --configs verl-like all --ranks 2 --busy-clock runnable \
        --out benchmarks/e2e_runnable          # the limit with the time the ranks waited for a core
    python scripts/bench_e2e.py --signal --scale tiny --mixtures video-heavy --configs verl-like verl+bucketing all \
        --ranks 2 --out benchmarks/e2e_signal  # steps that learn (non-zero advantages, peak learning rate)

Every row is a real ``titanrl.train`` run (``torchrun``; real decode, vLLM-CPU rollouts, reward,
old/ref log-probs, the update and the weight push; no sleeps) of the ``small`` model
(``configs/small_cpu.toml``) on one synthetic mixture with paper-scale media (``--scale paper``:
360p-480p clips of up to minutes, decoded at 2 fps up to ``--max-frames`` frames; the same files
``scripts/bench_data.py`` uses). Configurations, the baselines at their documented best:

- ``verl-like``: rank 0 decodes every sample and ships its frames to the ranks, which build their pixels
  (``data.loader = centralized``, verl's ``data.return_multi_modal_inputs=false``; ``data.prefetch_batches`` steps
  ahead, the depth ShadowLoader gets), no sequence parallelism, every trajectory
  whole, and verl's default batch balancing (``trainer.balance_batch``: Karmarkar-Karp on token counts, equal
  counts per rank): ``balance.strategy = lb_micro`` with ``balance.cost_model = tokens``;
- ``verl+bucketing``: the FlexRL paper's own baseline (veRL with sequences bucketed by length:
  ``balance.strategy = bucketing``, equal counts per rank by Karmarkar-Karp on verl's workload estimate);

then each feature alone on top of ``verl-like`` (the rest as there), and all together:

- ``+ShadowLoader``: worker-side decode, each rank materializes its own samples ahead, slice-aware loading;
- ``+FlexUlysses``: per-trajectory Ulysses degrees (``parallelism.ulysses = flex``, FLOPs cost model);
- ``+vision``: vision-tower balancing (``lb_micro``: one embedding route per wave);
- ``+ODC``: ``lb_mini`` (Karmarkar-Karp per minibatch on FLOPs, one synchronisation per minibatch, one vision
  pass per minibatch);
- ``+shared prefix``: each prompt computed once with its responses (``rl.shared_prefix``);
- ``all``: ShadowLoader + FlexUlysses + vision balancing + ``lb_mini`` + shared prefix.

Only ``all`` packs a prompt once per group (``rl.shared_prefix``); the other rows compute every
trajectory whole, as verl does. Per step (median over steps 2..; step 1 includes start-up): the wall
seconds of each stage (``time/*``: the slowest rank's), the step's wall time, tokens/s, and the limit:
the sum over ranks of busy seconds (process CPU time: waiting for data or for another rank burns
none) divided by the number of ranks (``step/limit_s``) - the step time with zero exposed data wait
and zero idle at synchronisation points.

Launches: 2 ranks with one thread each (wall-clock figures), and 4 ranks on the same 2 cores (wall
time means little there; the per-rank busy time does: the busiest rank's sum over stages against the
mean).
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
from bench_common import provenance  # noqa: E402
from bench_data import bench_dataset  # noqa: E402
from bench_flex_ulysses import ratio  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("data", "rollout", "reward", "old_logprob", "ref_logprob", "update", "weight_sync")
MIXTURES = ("video-heavy", "only-video", "image-heavy")
SHADOW = ["--data.loader=shadow", "--data.slice_loading=true"]
CENTRAL = ["--data.loader=centralized", "--data.slice_loading=false"]
PLAIN = ["--parallelism.ulysses=none", "--parallelism.vision_balance=false", "--rl.shared_prefix=false"]
VERL = [*CENTRAL, "--balance.strategy=lb_micro", "--balance.cost_model=tokens", *PLAIN]
CONFIGS: dict[str, list[str]] = {
    "verl-like": VERL,
    "verl+bucketing": [*CENTRAL, "--balance.strategy=bucketing", *PLAIN],
    "+ShadowLoader": [*VERL, *SHADOW],
    "+FlexUlysses": [*VERL, "--balance.cost_model=flops", "--parallelism.ulysses=flex"],
    "+vision": [*VERL, "--parallelism.vision_balance=true"],
    "+ODC": [*VERL, "--balance.strategy=lb_mini", "--balance.cost_model=flops"],
    "+shared prefix": [*VERL, "--rl.shared_prefix=true"],
    "all": [*SHADOW, "--balance.strategy=lb_mini", "--balance.cost_model=flops", "--parallelism.ulysses=flex",
            "--parallelism.vision_balance=true", "--rl.shared_prefix=true"],
}
BASELINE = "verl-like"
PAPER_BASELINE = "verl+bucketing"  # the FlexRL paper's baseline
CLOCKS = {"cpu": "process CPU time", "runnable": "process CPU time plus the time its threads waited for a core, "
          "Linux schedstat: `metrics.busy_clock = runnable`"}
TARGET_SPEEDUP, TARGET_LIMIT = 2.5, 1.10  # issue 29, video-heavy: all >= 2.5x verl-like, within 10% of its limit
SAME = ("loss", "kl", "entropy", "reward/mean", "grad_norm")
# --signal: a reward the random policy scores on (tests/signal_reward.py: it varies within every group, so the
# advantages and the policy gradient are non-zero) at the peak learning rate from the first step
SIGNAL = [f"--rl.reward={ROOT / 'tests' / 'signal_reward.py'}:reward", "--lr_scheduler.warmup_steps=0",
          "--lr_scheduler.decay_type=constant"]


def workload(args: argparse.Namespace) -> list[str]:
    """The settings every configuration shares (the ``small`` config plus these)."""
    config = "configs/tiny_cpu.toml" if args.model == "tiny" else "configs/small_cpu.toml"
    return ["--config", config, f"--job.steps={args.steps}", "--checkpoint.enable=false",
            "--metrics.progress=none", "--rollout.engine=vllm", "--rollout.probe_every=0",
            f"--rl.global_batch_size={args.prompts}", f"--rollout.n={args.responses}",
            f"--rollout.max_new_tokens={args.max_new_tokens}", f"--data.max_frames={args.max_frames}",
            f"--data.max_prompt_tokens={args.max_prompt_tokens}",
            f"--model.max_seq_len={args.max_prompt_tokens + args.max_new_tokens}",
            f"--balance.max_tokens_per_microbatch={args.max_tokens}", "--data.prefetch_batches=2",
            f"--data.max_pixels={args.max_pixels}", f"--metrics.busy_clock={args.busy_clock}",
            *(SIGNAL if args.signal else [])]


def data_flags(args: argparse.Namespace, mixture: str) -> list[str]:
    """Tiny-scale media are synthesized by the trainer itself; paper-scale ones once into ``--cache``."""
    num_samples = max(64, args.prompts * (max(args.steps, args.busy_steps) + 4))
    if args.scale == "tiny":
        return [f"--data.mixture={mixture}", f"--data.num_samples={num_samples}"]
    manifest = bench_dataset(Path(args.cache).expanduser(), mixture, num_samples, args.scale)
    return [f"--data.mixture={mixture}", f"--data.manifest={manifest}"]


def run_one(ranks: int, mixture: str, config: str, common: list[str], data: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        # later flags win: the configuration's own prefetch depth overrides the shared one
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "-m", "titanrl.train", *common, *data, f"--parallelism.p_max={ranks}",
               *CONFIGS[config],
               f"--job.dump_folder={tmp}", "--job.name=run"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            text = proc.stdout + proc.stderr
            named = [line for line in text.splitlines() if "error" in line.lower() and "elastic" not in line]
            sys.stderr.write(text[-3000:] + "\n" + "\n".join(named[:10]) + "\n")
            raise SystemExit(f"run failed ({config}, {mixture}, {ranks} ranks): {' '.join(cmd)}")
        lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for r in records:
        r["tokens"] = r["throughput/tokens_per_s"] * sum(r[f"time/{s}"] for s in STAGES if f"time/{s}" in r)
    steady = records[1:] or records
    keys = sorted({k for r in steady for k in r if k.startswith(("time/", "busy/", "step/"))} | {"tokens"})
    shown = [a for a in cmd[3:] if not a.startswith("--job.dump_folder") and a != "--job.name=run"]
    return {
        "command": "OMP_NUM_THREADS=1 torchrun " + " ".join(shown),
        "run_wall_s": wall,
        "median": {k: statistics.median(r.get(k, 0.0) for r in steady) for k in keys},
        "per_step": [{k: r.get(k) for k in SAME} for r in records],
    }


# ------------------------------------------------------------------ report


def _loss_gap(runs: dict, step: int) -> float:
    """Largest |difference| of SAME at ``step`` (0-based) between any configuration and the baseline."""
    if BASELINE not in runs:
        return float("nan")
    base = runs[BASELINE]["per_step"]
    return max((abs(base[step][k] - run["per_step"][step][k]) for run in runs.values()
                if len(run["per_step"]) > step for k in SAME if base[step].get(k) is not None), default=0.0)


def stage_cells(m: dict) -> str:
    """A row's cells of each stage's median wall seconds (``time/<stage>``)."""
    return " | ".join(f"{m.get(f'time/{s}', 0.0):.2f}" for s in STAGES)


def wall_table(results: dict, ranks: str) -> list[str]:
    head = " | ".join(s.replace("_logprob", " lp") for s in STAGES)
    lines = [f"| mixture | configuration | {head} | step (s) | limit (s) | step / limit | tokens/s | speed-up vs "
             f"{BASELINE} | vs {PAPER_BASELINE} |",
             "|---|---|" + "---|" * len(STAGES) + "---|---|---|---|---|---|"]
    for mixture, runs in results[ranks].items():
        base = runs.get(BASELINE, {}).get("median", {}).get("step/wall_s", 0.0)
        fair = runs.get(PAPER_BASELINE, {}).get("median", {}).get("step/wall_s", 0.0)
        for config, run in runs.items():
            m = run["median"]
            lines.append(f"| {mixture} | {config} | {stage_cells(m)} | {m['step/wall_s']:.2f} | {m['step/limit_s']:.2f} | "
                         f"{ratio(m['step/wall_s'], m['step/limit_s'])} | {m['tokens'] / m['step/wall_s']:.0f} | "
                         f"{ratio(base, m['step/wall_s']) if base else '-'} | {ratio(fair, m['step/wall_s']) if fair else '-'} |")
    return lines


def busy_table(results: dict, ranks: str) -> list[str]:
    lines = ["| mixture | configuration | busy per rank, mean (s) | busiest rank per stage, summed (s) | "
             "critical / mean | data wait, slowest rank (s) |", "|---|---|---|---|---|---|"]
    for mixture, runs in results[ranks].items():
        for config, run in runs.items():
            m = run["median"]
            lines.append(f"| {mixture} | {config} | {m['step/limit_s']:.2f} | {m['step/busy_critical_s']:.2f} | "
                         f"{ratio(m['step/busy_critical_s'], m['step/limit_s'])} | {m.get('time/data', 0.0):.2f} |")
    return lines


def targets(results: dict) -> list[str]:
    runs = results.get("2", {}).get("video-heavy")
    if not runs or "all" not in runs or BASELINE not in runs:
        return [f"- (not measured: this run has no `all` and `{BASELINE}` pair on video-heavy with 2 ranks)"]
    m_all, m_base = runs["all"]["median"], runs[BASELINE]["median"]
    speedup = m_base["step/wall_s"] / m_all["step/wall_s"]
    gap = m_all["step/wall_s"] / m_all["step/limit_s"]
    return [f"- all together >= {TARGET_SPEEDUP:g}x {BASELINE}: **{speedup:.2f}x** "
            f"({'met' if speedup >= TARGET_SPEEDUP else 'not met'})",
            f"- all together within {100 * (TARGET_LIMIT - 1):.0f}% of its limit: step / limit **{gap:.2f}** "
            f"({'met' if gap <= TARGET_LIMIT else 'not met'})"]


def report(data: dict, name: str = "e2e") -> str:
    w = data["workload"]
    lines = [
        "# End-to-end: the FlexRL ablation in whole RL steps",
        "",
        f"Generated by `python scripts/bench_e2e.py` from `benchmarks/{name}.json` on {data['machine']} "
        f"({data['date']}, commit {data.get('commit', 'not recorded')}); do not edit. Model `{w['model']}` (random init, fp32, FSDP2 on gloo, vLLM-CPU "
        f"rollouts in each rank's process), {w['prompts']} prompts x {w['responses']} responses per step, "
        f"{w['max_new_tokens']} new tokens, `{w['scale']}`-scale synthetic media resized to at most "
        f"{w['max_pixels']} pixels, videos at 2 fps up to {w['max_frames']} frames, prompts up to {w['max_prompt_tokens']} tokens, {w['max_tokens']} tokens per rank "
        f"per microbatch, {w['steps']} steps per 2-rank run and {w['busy_steps']} per 4-rank run, medians over "
        "steps 2.. . Stage columns are wall seconds (the slowest rank's); *limit* is the mean over "
        f"ranks of busy seconds ({CLOCKS[w.get('busy_clock', 'cpu')]}) summed over stages: the step with no exposed "
        "data wait and no idle at synchronisation points. Configurations: see the script's docstring.",
        "",
        f"Where the time goes (stacked stages per configuration, limit marked): `{name}.png`.",
        "",
    ]
    if "2" in data["results"]:
        lines += ["## 2 ranks x 1 thread (wall-clock)", "", *wall_table(data["results"], "2"), ""]
        lines += ["Targets (video-heavy, from issue 29):", "", *targets(data["results"]), ""]
        if w.get("signal"):
            lines += ["Learning signal: `--signal` (the tests' signal reward, which the random policy scores on, "
                      "and the peak learning rate from step 1). What is compared is not zero: " +
                      "; ".join(f"{mix}: {BASELINE}'s step 1 " + ", ".join(
                          f"{k} {runs[BASELINE]['per_step'][0].get(k, float('nan')):.3g}" for k in SAME)
                          for mix, runs in data["results"]["2"].items() if BASELINE in runs) + ".", ""]
        lines += ["Same computation: the largest difference of loss / KL / entropy / reward / gradient norm between "
                  f"any configuration and {BASELINE} at step 1 (same weights, same responses): " +
                  ", ".join(f"{mix} {_loss_gap(runs, 0):.1e}" for mix, runs in data["results"]["2"].items()) +
                  "; at the last step: " +
                  ", ".join(f"{mix} {_loss_gap(runs, -1):.1e}" for mix, runs in data["results"]["2"].items()) +
                  " (the configurations sum gradients in different orders, so after the first update the weights "
                  "differ in the last bits and a sampled token can flip: the rollouts, not the stages, diverge).", ""]
    if "4" in data["results"]:
        lines += ["## 4 ranks on 2 cores (per-rank busy time; wall-clock is time-shared and not shown)", "",
                  *busy_table(data["results"], "4"), ""]
    two = data["results"].get("2", {})
    shares = [f"{mix} {100 * runs[BASELINE]['median'].get('time/data', 0.0) / runs[BASELINE]['median']['step/wall_s']:.1f}%"
              for mix, runs in two.items() if BASELINE in runs]
    if shares:
        lines += [f"Exposed data wait of {BASELINE} (rank 0 decodes and ships every sample on the critical path), "
                  "share of its step: " + ", ".join(shares) + ". On this CPU the model's compute dwarfs decoding, "
                  "so what ShadowLoader removes is small here (FlexRL measured 57% on GPUs, where compute is "
                  "~1000x faster and decoding is not).", ""]
    missing = [f"2 ranks: {m}" + (f" ({', '.join(c for c in CONFIGS if c not in two[m])})" if m in two else "")
               for m in MIXTURES if m not in two or set(CONFIGS) - set(two[m])] + (
        [] if "4" in data["results"] else ["4 ranks: every mixture"])
    if missing:
        lines += ["Not measured in this run (time): " + "; ".join(missing) + ". `python scripts/bench_e2e.py "
                  "--mixtures ... --ranks ...` runs them; the committed report is this run's.", ""]
    lines += [
        "What this measures and what it does not:",
        "- One machine with 2 cores runs the ranks, their vLLM engines, Ray's media preprocessors and (for "
        "verl-like) rank 0's decode threads: decoding competes with compute for the same cores. On a GPU node "
        "decoding runs on CPU cores the GPUs do not need; here it shows up in every stage's wall time.",
        ("- The limit counts only the ranks' own CPU time: the preprocessors' decode (ShadowLoader) is outside it, "
         "rank 0's decode threads (verl-like) inside it." if w.get("busy_clock", "cpu") == "cpu" else
         "- The limit counts the ranks' CPU time and the time they waited for a core: a rank that waits while the "
         "preprocessors' decode (ShadowLoader) or another rank's threads hold its core is charged that wait, so "
         "what the step spends above this limit is waiting at synchronisation points (imbalance, collectives), "
         "not core sharing; with `--busy-clock cpu` (the default) the same wait counts as exposed."),
        "- Rollout is vLLM-CPU in every row (titanrl does not change it); the rows differ in loading and in how "
        "the training stages place work.",
        "",
        "Reproduce one row (2 ranks; `--nproc-per-node 4` for the 4-rank table):",
        "",
    ]
    for mixture, runs in list(two.items())[:1]:
        lines += [f"    {run['command']}" for run in runs.values()]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"].get("2") or next(iter(data["results"].values()))
    mixtures = list(results)
    fig, axes = plt.subplots(1, len(mixtures), figsize=(5.2 * len(mixtures), 4.6), squeeze=False)
    colours = plt.get_cmap("tab10").colors
    for ax, mixture in zip(axes[0], mixtures):
        runs = results[mixture]
        names = list(runs)
        bottoms = [0.0] * len(names)
        for i, stage in enumerate(STAGES):
            values = [runs[n]["median"].get(f"time/{stage}", 0.0) for n in names]
            ax.bar(range(len(names)), values, bottom=bottoms, color=colours[i % 10], label=stage)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        limits = [runs[n]["median"]["step/limit_s"] for n in names]
        ax.scatter(range(len(names)), limits, marker="_", s=600, color="black", zorder=3, label="limit")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(mixture)
        ax.set_ylabel("seconds per step (wall)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Whole RL steps per stage, {data['workload']['model']} model, 2 ranks x 1 thread (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(data: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    out.with_suffix(".md").write_text(report(data, out.name))
    plot(data, out.with_suffix(".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "small"), default="small")
    parser.add_argument("--steps", type=int, default=3, help="RL steps per 2-rank run")
    parser.add_argument("--busy-steps", type=int, default=2, help="RL steps per 4-rank run")
    parser.add_argument("--scale", choices=("tiny", "paper"), default="paper", help="synthetic media scale")
    parser.add_argument("--cache", default="~/.cache/titanrl/bench_data", help="paper-scale datasets (shared "
                        "with bench_data.py)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (rl.global_batch_size)")
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-frames", type=int, default=16)
    parser.add_argument("--max-pixels", type=int, default=50176, help="largest image / frame area (224 x 224)")
    parser.add_argument("--max-prompt-tokens", type=int, default=3072)
    parser.add_argument("--max-tokens", type=int, default=4096, help="balance.max_tokens_per_microbatch")
    parser.add_argument("--mixtures", nargs="*", default=list(MIXTURES))
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--ranks", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--busy-mixtures", nargs="*", default=["video-heavy"], help="mixtures of the 4-rank launch")
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 step of `all` on video-heavy (smoke)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--merge", action="store_true", help="keep the rows of the existing .json that this run "
                        "does not re-measure (the workload must be the same)")
    parser.add_argument("--busy-clock", choices=tuple(CLOCKS), default="cpu", help="metrics.busy_clock of every "
                        "run (the limit's busy seconds): cpu = process CPU time; runnable = also the time waiting for "
                        "a core (the preprocessors' decode shares the 2 cores here)")
    parser.add_argument("--signal", action="store_true", help="time steps that learn: a reward the random policy "
                        "scores on, the peak learning rate from step 1 (SIGNAL)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "e2e"))
    args = parser.parse_args()
    out = Path(args.out)
    if args.report_only:
        write(json.loads(out.with_suffix(".json").read_text()), out)
        return
    if args.quick:
        args.model, args.steps, args.prompts, args.responses, args.scale = "tiny", 1, 4, 2, "tiny"
        args.max_new_tokens, args.max_frames, args.max_prompt_tokens, args.max_tokens = 8, 8, 1024, 2048
        args.mixtures, args.configs, args.ranks = ["video-heavy"], ["all"], [2]
    results: dict[str, dict] = {}
    data = {**provenance(),
            "workload": {k: getattr(args, k) for k in ("model", "scale", "steps", "busy_steps", "prompts", "responses",
                                                       "max_new_tokens", "max_frames", "max_pixels",
                                                       "max_prompt_tokens", "max_tokens", "busy_clock", "signal")},
            "results": results}
    if args.merge:
        previous = json.loads(out.with_suffix(".json").read_text())
        if {"busy_clock": "cpu", "signal": False, **previous["workload"]} != data["workload"] or previous.get("commit") != data["commit"]:
            raise SystemExit(f"--merge: {out.with_suffix('.json')} measured another workload or commit "
                             f"({previous['workload']}, {previous.get('commit')}); run without --merge")
        results.update(previous["results"])
    for ranks in args.ranks:
        mixtures = args.mixtures if ranks == 2 else [m for m in args.mixtures if m in args.busy_mixtures]
        steps = args.steps if ranks == 2 else args.busy_steps
        common = workload(argparse.Namespace(**{**vars(args), "steps": steps}))
        for mixture in mixtures:
            flags = data_flags(args, mixture)
            for config in args.configs:
                run = run_one(ranks, mixture, config, common, flags)
                results.setdefault(str(ranks), {}).setdefault(mixture, {})[config] = run
                m = run["median"]
                print(f"{ranks} ranks {mixture:12s} {config:20s} step {m['step/wall_s']:7.2f} s  "
                      f"limit {m['step/limit_s']:7.2f} s  ({run['run_wall_s']:.0f} s run)", flush=True)
                write(data, out)
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
