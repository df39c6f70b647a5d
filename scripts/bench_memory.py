"""Predicted (titanrl.memory) vs measured peak memory per rank, CPU: benchmarks/memory.md + .json.

    nice -n 19 python scripts/bench_memory.py [--models tiny small] [--worlds 1 2] [--steps 2]

For every case (model flavor x ranks x balance.strategy x activation checkpointing) it runs, each as
``python`` (1 rank) or ``torchrun --standalone --nproc-per-node N`` (this file in --child mode, which
calls titanrl's own entry points):

1. ``init``: the Trainer is built (model, reference model, rollout engine, loader, Ray client) and each
   rank's peak RSS is read (``getrusage``). The *runtime* term of that case is this peak minus the
   planner's static terms already resident then (parameters, reference model, engine weights and KV
   cache): the Python/torch/vLLM/Ray-client process, which the planner does not derive from the shape.
   It is a measured constant, reported per case, never fitted to the training run.
2. ``train``: ``titanrl.train`` for ``--steps`` steps with checkpoints off; each rank's peak RSS after.

predicted = planner terms (titanrl.memory.predict) with runtime_bytes = the measured runtime of (1);
the error column compares it with (2), the rank with the largest peak. So the error measures exactly the
terms the training step adds (gradients, AdamW state, lb_mini's gathered parameters and gradients,
activations, the log-prob head), against a baseline that is measured, not guessed.

Both phases also sample the allocator's view (``HeapSampler``: glibc's live heap bytes, the CPU analogue of
CUDA's ``max_memory_allocated``, and the free bytes glibc keeps when RSS peaks); the report compares the planner
with that too, its runtime measured the same way. Predictions are made twice: at the config bound, and at the
run's observed microbatch size and samples (``memory.DataShape`` from the dataset's metadata table and the run's
response lengths).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from bench_common import HeapSampler, git_commit, provenance, provenance_text  # noqa: E402
CONFIGS = {"tiny": "configs/tiny_cpu.toml", "small": "configs/small_cpu.toml"}


def child(out: Path, phase: str, argv: list[str]) -> int:
    """One rank: build the Trainer (init) or run titanrl.train (train); write this rank's peak RSS and
    the allocator's peak (HeapSampler)."""
    from titanrl import memory

    heap = HeapSampler()
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    if phase == "train":
        from titanrl.train import main

        rc = main(argv)
    else:
        from titanrl.config import parse_args_or_exit
        from titanrl.console import route_output
        from titanrl.distributed import init_distributed, shutdown

        cfg = parse_args_or_exit(argv)
        route_output(cfg.run_dir / "logs", rank)
        info = init_distributed(cfg.job.collective_timeout_s)
        try:
            from titanrl.trainer import Trainer

            trainer = Trainer(cfg, info)
            peak = memory.measured_peak_bytes("cpu")
            trainer.close()
        finally:
            shutdown()
        rc = 0
        (out / f"{phase}_rank{rank}.json").write_text(json.dumps({"rank": rank, "peak_rss_bytes": peak,
                                                                 **heap.report()}))
        return rc
    (out / f"{phase}_rank{rank}.json").write_text(
        json.dumps({"rank": rank, "peak_rss_bytes": memory.measured_peak_bytes("cpu"), "rc": rc, **heap.report()}))
    return rc


def launch(out: Path, phase: str, world: int, argv: list[str]) -> tuple[list[dict], float]:
    out.mkdir(parents=True, exist_ok=True)
    me = [str(Path(__file__).resolve()), "--child", str(out), "--phase", phase, "--"]
    if world == 1:
        cmd = [sys.executable, *me, *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *me, *argv]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{phase} world={world} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(world)], wall


def observed_tokens_per_microbatch(run_dir: Path, world: int) -> int:
    """The mean tokens of one rank's update microbatch in the run's busiest step:
    train/tokens_computed / (ranks x mean of balance/microbatches_min and _max)."""
    best = 0.0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        micro = (m["balance/microbatches_min"] + m["balance/microbatches_max"]) / 2
        best = max(best, m["train/tokens_computed"] / (world * micro))
    return max(1, round(best))


def observed_data(flavor_or_cfg, run_dir: Path):
    """The run's samples (memory.DataShape): the dataset's mean prompt and media tokens per prompt and the run's
    mean response length (metrics: response/length_mean). ``flavor_or_cfg``: "tiny" / "small" (CONFIGS) or the
    run's JobConfig."""
    from titanrl import memory

    prompt, media = (dataset_means(flavor_or_cfg) if isinstance(flavor_or_cfg, str)
                     else config_data_means(flavor_or_cfg))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lengths = [json.loads(line)["response/length_mean"] for line in lines]
    return memory.DataShape(prompt_tokens=prompt, media_tokens=media, response_tokens=sum(lengths) / len(lengths))


@functools.lru_cache(maxsize=None)
def dataset_means(flavor: str) -> tuple[float, float]:
    """config_data_means of the flavor's config (CONFIGS)."""
    from titanrl.config import load_config

    return config_data_means(load_config(REPO / CONFIGS[flavor], []))


def config_data_means(cfg) -> tuple[float, float]:
    """(prompt tokens, media tokens) per prompt, means over the config's dataset (ShadowLoader's metadata table:
    the tokens each image or video becomes after resizing, frame sampling and the 2x2 merge)."""
    from titanrl import assets
    from titanrl.data.prompt import PromptEncoder
    from titanrl.data.shadow.factory import media_settings
    from titanrl.data.shadow.metadata import load_metadata
    from titanrl.distributed import DistInfo

    import torch

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model_dir, manifest = assets.model_dir(cfg, info), assets.manifest_path(cfg, info)
    table = load_metadata(manifest, media_settings(cfg, model_dir), PromptEncoder.from_pretrained(model_dir),
                          max_prompt_tokens=cfg.data.max_prompt_tokens, use_cache=True)
    metas = [m for m in table.metas if m.problem is None]
    return (sum(m.num_tokens for m in metas) / len(metas),
            sum(sum(x.tokens for x in m.media) for m in metas) / len(metas))


def add_observed(row: dict, workdir: Path) -> dict:
    """The planner again with T = the tokens the run really put in a microbatch (the data's lengths,
    which the planner does not know: it assumes full microbatches of the longest samples)."""
    from titanrl import memory
    from titanrl.config import load_config

    t_obs = observed_tokens_per_microbatch(workdir / "runs" / row["case"], row["world"])
    shape, world, runtime = memory.flavor_shape(row["model"]), row["world"], row["runtime_bytes"]
    base = [f"--balance.strategy={row['strategy']}", f"--parallelism.activation_checkpoint={row['activation_checkpoint']}"]
    # the config bound again (a --rewrite recomputes it with the current planner)
    bound = memory.predict(load_config(REPO / CONFIGS[row["model"]], base), shape, world, runtime_bytes=runtime)
    static = static_at_init(bound)
    row["terms"] = {t.name: t.bytes for t in bound.terms}
    row["predicted_bytes"] = bound.total
    row["error"] = (bound.total - row["measured_bytes"]) / row["measured_bytes"]
    row["step_terms_predicted"] = bound.total - static - runtime
    cfg = load_config(REPO / CONFIGS[row["model"]], [*base, f"--balance.max_tokens_per_microbatch={t_obs}"])
    data = observed_data(row["model"], workdir / "runs" / row["case"])
    row["observed_data"] = dataclasses.asdict(data)
    plan = memory.predict(cfg, shape, world, runtime_bytes=runtime, data=data)
    row["observed_tokens_per_microbatch"] = t_obs
    row["predicted_observed_T_bytes"] = plan.total
    row["error_observed_T"] = (plan.total - row["measured_bytes"]) / row["measured_bytes"]
    if "measured_heap_bytes" in row:  # the same plan with the heap's runtime, against the heap's peak
        heap = plan.total - runtime + row["runtime_heap_bytes"]
        row["predicted_heap_observed_T_bytes"] = heap
        row["error_heap_observed_T"] = (heap - row["measured_heap_bytes"]) / row["measured_heap_bytes"]
        heap_bound = bound.total - runtime + row["runtime_heap_bytes"]
        row["error_heap"] = (heap_bound - row["measured_heap_bytes"]) / row["measured_heap_bytes"]
    return row


def static_at_init(plan) -> int:
    """Planner terms resident once the Trainer is built, before the first step."""
    names = ("parameters", "reference_model", "engine_weights", "engine_kv_cache")
    return sum(t.bytes for t in plan.terms if t.name in names)


def run(args: argparse.Namespace) -> None:
    from titanrl import memory
    from titanrl.config import load_config

    args.measured = provenance()  # the code the children run (and where, when): taken before the first case
    args.planner_commit = args.measured["commit"]
    rows = []
    tmp = Path(args.workdir)
    for flavor in args.models:
        for world in args.worlds:
            for strategy in args.strategies:
                for ac in args.ac:
                    name = f"{flavor}_w{world}_{strategy}_ac{ac}"
                    overrides = [f"--balance.strategy={strategy}", f"--parallelism.activation_checkpoint={ac}",
                                 "--checkpoint.enable=false", f"--job.steps={args.steps}",
                                 f"--job.dump_folder={tmp / 'runs'}", f"--job.name={name}", "--metrics.progress=none"]
                    argv = ["--config", CONFIGS[flavor], *overrides]
                    cfg = load_config(REPO / CONFIGS[flavor], overrides)
                    shape = memory.flavor_shape(flavor)
                    plan0 = memory.predict(cfg, shape, world, runtime_bytes=0)
                    print(f"[bench_memory] {name}: init ...", flush=True)
                    init, init_wall = launch(tmp / name, "init", world, argv)
                    init_peaks = [r["peak_rss_bytes"] for r in init]
                    runtime = max(init_peaks) - static_at_init(plan0)
                    runtime_heap = max(r["peak_heap_live_bytes"] for r in init) - static_at_init(plan0)
                    plan = memory.predict(cfg, shape, world, runtime_bytes=runtime)
                    print(f"[bench_memory] {name}: train ...", flush=True)
                    train, train_wall = launch(tmp / name, "train", world, argv)
                    train_peaks = [r["peak_rss_bytes"] for r in train]
                    measured = max(train_peaks)
                    row = {
                        "case": name, "model": flavor, "world": world, "strategy": strategy, "activation_checkpoint": ac,
                        "params": plan.params, "tokens_per_microbatch": plan.tokens_per_microbatch,
                        "init_peak_rss_bytes": init_peaks, "runtime_bytes": runtime,
                        "terms": {t.name: t.bytes for t in plan.terms},
                        "predicted_bytes": plan.total, "measured_peak_rss_bytes": train_peaks,
                        "measured_bytes": measured,
                        "step_terms_predicted": plan.total - static_at_init(plan0) - runtime,
                        "step_terms_measured": measured - max(init_peaks),
                        "error": (plan.total - measured) / measured,
                        "wall_s": {"init": round(init_wall, 1), "train": round(train_wall, 1)},
                        # the allocator's view (HeapSampler): the runtime term and the peak in live heap bytes
                        "init_peak_heap_live_bytes": [r["peak_heap_live_bytes"] for r in init],
                        "runtime_heap_bytes": runtime_heap,
                        "measured_peak_heap_live_bytes": [r["peak_heap_live_bytes"] for r in train],
                        "measured_heap_bytes": max(r["peak_heap_live_bytes"] for r in train),
                        "heap_free_at_rss_peak_bytes": [r["heap_free_at_rss_peak_bytes"] for r in train],
                    }
                    rows.append(add_observed(row, tmp))
                    print(f"[bench_memory] {name}: predicted {memory.fmt_bytes(plan.total)} measured "
                          f"{memory.fmt_bytes(measured)} ({100 * row['error']:+.1f}%)", flush=True)
                    write(rows, args)


def findings(rows: list[dict]) -> str:
    """The findings, their figures taken from ``rows`` (the prose says what the figures mean; it was written for
    the run at 4125321: re-read it after a new run)."""
    from titanrl.memory import fmt_bytes

    def pick(model=None, ac=None):
        return [r for r in rows if (model is None or r["model"] == model) and (ac is None or r["activation_checkpoint"] == ac)]

    def span(values, scale=100.0, unit="%"):
        values = [scale * v for v in values]
        return f"{min(values):+.0f}{unit} to {max(values):+.0f}{unit}" if values else "n/a"

    def gib_span(values):
        return f"{fmt_bytes(min(values))} to {fmt_bytes(max(values))}" if values else "n/a"

    heap = [r for r in rows if "error_heap_observed_T" in r]
    small, tiny = pick("small"), pick("tiny")
    within_heap = [r for r in heap if abs(r["error_heap_observed_T"]) <= 0.15]
    within_rss = [r for r in rows if abs(r["error_observed_T"]) <= 0.15]
    shapes = "; ".join(sorted({
        f"{r['model']}: {r['observed_data']['prompt_tokens']:.0f} prompt tokens of which "
        f"{r['observed_data']['media_tokens']:.0f} media, responses of {r['observed_data']['response_tokens']:.0f}"
        for r in heap}))
    t_obs = "; ".join(f"{m} on {w} rank(s): {o} of {t}" for m, w, o, t in sorted(
        {(r["model"], r["world"], r["observed_tokens_per_microbatch"], r["tokens_per_microbatch"]) for r in rows}))
    free = [max(r["heap_free_at_rss_peak_bytes"]) for r in heap]
    free_small = [max(r["heap_free_at_rss_peak_bytes"]) for r in small if r in heap]
    ac_saved = {}
    by = {(r["model"], r["world"], r["strategy"], r["activation_checkpoint"]): r for r in heap}
    for k, r in by.items():
        if k[0] == "small" and k[3] == "none" and k[:3] + ("full",) in by:
            o = by[k[:3] + ("full",)]
            ac_saved[k] = (r["predicted_heap_observed_T_bytes"] - o["predicted_heap_observed_T_bytes"],
                           r["measured_heap_bytes"] - o["measured_heap_bytes"])
    return f"""## Findings

- **The allocator's view (live heap, the quantity CUDA's peak measures): {len(within_heap)} of {len(heap)} cases within
  15%** at the observed T and data: small {span([r["error_heap_observed_T"] for r in small if r in heap])}, tiny
  {span([r["error_heap_observed_T"] for r in tiny if r in heap])}. What tiny misses (the one-rank cases most) is
  the rollout engine's working memory: on one process the live heap grows ~50 MiB in the first generate and keeps
  it (vLLM's buffers; a per-node diagnostic at 4125321, not this script), which no term models.
- **Peak RSS: {len(within_rss)} of {len(rows)} cases within 15%** (small {span([r["error_observed_T"] for r in small])},
  tiny {span([r["error_observed_T"] for r in tiny])}). RSS exceeds the live heap by what glibc keeps after `free`:
  {gib_span(free)} of free chunks when RSS peaked ({gib_span(free_small)} on small, most without checkpointing:
  freed activations and the hf engine's generate memory, in chunks the next allocations do not fit). How much is
  kept depends on the order of allocations, not on the config; no planner term models it, so the planner's figure is
  the live peak, which on CUDA is what `memory/measured_peak_bytes` reads (`torch.cuda.max_memory_allocated`; one
  H100, a 7B-shaped model: +0.5%, `docs/memory.md`). A fixed glibc mmap threshold (`MALLOC_MMAP_THRESHOLD_=262144`)
  returns freed large chunks at once (peak RSS -24% on small, one process, a diagnostic at 4125321) but slows the
  update ~30% (a page fault on every fresh chunk): not done.
- **The config bound is an upper bound** (what `python -m titanrl.memory` and the start-up check use): full
  microbatches of the longest, all-media samples the config allows, and the data term at all-media prompts. These
  runs have short samples ({shapes}) and fewer tokens per microbatch ({t_obs}), so against the live heap the bound
  is {span([r["error_heap"] for r in heap])} over.
- **Per-token activation formula, checked directly** (`tests/test_memory.py`, within 20%): autograd's saved tensors
  (unique storages, parameters left out) of a text-only packed sequence against `T (L A_d + o)`, and the kept part
  with full checkpointing. The vision-block formula is not checked this way yet.
- **Activation checkpointing on small** saves {gib_span([m for _, m in ac_saved.values()])} of live heap measured,
  {gib_span([p for p, _ in ac_saved.values()])} predicted at the observed T and data (table below).
- Not measured: GPUs (the H100 figures are from `scripts/check_gpu.py`, `benchmarks/gpu_check.json`).
"""


def write(rows: list[dict], args: argparse.Namespace) -> None:
    from titanrl.memory import fmt_bytes

    measured = args.measured
    out = REPO / "benchmarks"
    planner = getattr(args, "planner_commit", measured["commit"])
    (out / "memory.json").write_text(json.dumps({**measured, "planner_commit": planner, "steps": args.steps,
                                                 "device": "cpu", "rows": rows}, indent=1) + "\n")
    lines = [
        "# Memory planner: predicted vs measured peak per rank (CPU)",
        "",
        f"Measured: {provenance_text(measured)}; predictions by the planner at `{planner}`. Written by `scripts/bench_memory.py` (`nice -n 19`, {args.steps} steps, "
        "checkpoints off, 2 shared CPU cores). Measured = the largest peak RSS over the ranks (`getrusage`) of "
        "`titanrl.train`; predicted = `titanrl.memory.predict` with its *runtime* term set to the measured "
        "constant of the same case: peak RSS after building the Trainer minus the planner's terms resident then "
        "(parameters, reference model, engine weights and KV cache). `step+` = what the training steps add over "
        "that init peak, predicted vs measured.",
        "",
        "Two predictions: **config bound** is what `python -m titanrl.memory` and `check_fits` use: full "
        "microbatches of `balance.max_tokens_per_microbatch` tokens made of the longest samples the config allows "
        "(all-media prompts of `data.max_prompt_tokens`, responses of `rollout.max_new_tokens`). **observed T** is "
        "the same planner with T = the mean tokens per update microbatch the run really had (metrics: "
        "`train/tokens_computed` / ranks / microbatches) and the samples the run really had (`memory.DataShape`: "
        "the dataset's mean prompt and media tokens per prompt from ShadowLoader's metadata table, the run's mean "
        "response length), which set the microbatch's mix of vision patches and log-prob targets, the data term "
        "and the hf engine's KV cache.",
        "",
        "| case | N params | runtime (measured) | config bound | observed T | predicted (obs. T) | measured "
        "| error (bound) | error (obs. T) | step+ predicted (bound) | step+ measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['params'] / 1e6:.1f}M | {fmt_bytes(r['runtime_bytes'])} | {fmt_bytes(r['predicted_bytes'])} "
            f"| {r['observed_tokens_per_microbatch']} | {fmt_bytes(r['predicted_observed_T_bytes'])} "
            f"| {fmt_bytes(r['measured_bytes'])} | {100 * r['error']:+.1f}% | {100 * r['error_observed_T']:+.1f}% "
            f"| {fmt_bytes(r['step_terms_predicted'])} | {fmt_bytes(r['step_terms_measured'])} |")
    heap_rows = [r for r in rows if "measured_heap_bytes" in r]
    if heap_rows:
        lines += [
            "", "## The allocator's view: live heap bytes (the analogue of CUDA's `max_memory_allocated`)", "",
            "Peak RSS counts what glibc keeps after `free` (freed chunks it has not returned to the system) and what "
            "is not `malloc` memory at all (shared libraries, Python's object arenas, mapped Ray objects). On CUDA "
            "`memory/measured_peak_bytes` is the caching allocator's peak of *live* bytes, without its cached free "
            "blocks. The CPU analogue, sampled every 10 ms in each rank (`HeapSampler`: glibc's `mallinfo2`, "
            "`uordblks + hblkhd`; a peak shorter than the interval is missed): measured = the largest peak of live "
            "heap bytes over the ranks; predicted = the same planner terms with the runtime measured the same way "
            "(the live heap once the Trainer is built minus the planner's terms resident then). `heap free at RSS "
            "peak` = glibc's free bytes (`fordblks`) when the sampled RSS peaked (largest over the ranks): the part "
            "of peak RSS that no planner term can see.",
            "",
            "| case | runtime (heap) | predicted (bound) | predicted (obs. T) | measured live heap | error (bound) "
            "| error (obs. T) | heap free at RSS peak |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in heap_rows:
            bound = r["predicted_bytes"] - r["runtime_bytes"] + r["runtime_heap_bytes"]
            lines.append(
                f"| {r['case']} | {fmt_bytes(r['runtime_heap_bytes'])} | {fmt_bytes(bound)} "
                f"| {fmt_bytes(r['predicted_heap_observed_T_bytes'])} | {fmt_bytes(r['measured_heap_bytes'])} "
                f"| {100 * r['error_heap']:+.1f}% | {100 * r['error_heap_observed_T']:+.1f}% "
                f"| {fmt_bytes(max(r['heap_free_at_rss_peak_bytes']))} |")
    lines += ["", findings(rows), *deltas(rows), "", "Per-case terms (bytes) are in `benchmarks/memory.json`.", ""]
    (out / "memory.md").write_text("\n".join(lines) + "\n")


def deltas(rows: list[dict]) -> list[str]:
    """What switching one setting changes, predicted (observed T and data) vs measured (live heap and RSS): checks
    the terms' slopes apart from any constant offset."""
    from titanrl.memory import fmt_bytes

    by = {(r["model"], r["world"], r["strategy"], r["activation_checkpoint"]): r
          for r in rows if "measured_heap_bytes" in r}
    lines = ["## One setting changed: predicted vs measured difference of the peak", "",
             "| model | ranks | change | predicted (obs.) | measured live heap | measured RSS |",
             "|---|---|---|---|---|---|"]
    for (model, world, strategy, ac), r in by.items():
        pairs = []
        if ac == "none" and (model, world, strategy, "full") in by:
            pairs.append((f"{strategy}: activation_checkpoint none -> full", by[(model, world, strategy, "full")]))
        if strategy == "lb_mini" and world > 1 and (model, world, "lb_micro", ac) in by:
            pairs.append((f"ac={ac}: lb_mini -> lb_micro", by[(model, world, "lb_micro", ac)]))
        for label, other in pairs:
            lines.append(
                f"| {model} | {world} | {label} "
                f"| {fmt_bytes(other['predicted_heap_observed_T_bytes'] - r['predicted_heap_observed_T_bytes'])} "
                f"| {fmt_bytes(other['measured_heap_bytes'] - r['measured_heap_bytes'])} "
                f"| {fmt_bytes(other['measured_bytes'] - r['measured_bytes'])} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=("init", "train"), help=argparse.SUPPRESS)
    p.add_argument("--models", nargs="+", default=["tiny", "small"], choices=sorted(CONFIGS))
    p.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--strategies", nargs="+", default=["lb_mini", "lb_micro"])
    p.add_argument("--ac", nargs="+", default=["none", "full"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--workdir", default="/tmp/titanrl_bench_memory")
    p.add_argument("--rewrite", action="store_true", help="rewrite memory.md from memory.json, run nothing")
    args, rest = p.parse_known_args()
    if args.rewrite:
        data = json.loads((REPO / "benchmarks" / "memory.json").read_text())
        args.measured = {k: data[k] for k in ("commit", "machine", "date") if k in data}
        args.steps = data["steps"]
        args.planner_commit = git_commit()  # predictions recomputed from the stored measurements
        write([add_observed(r, Path(args.workdir)) for r in data["rows"]], args)
        return
    if args.child is not None:
        if rest and rest[0] == "--":
            rest = rest[1:]
        sys.exit(child(args.child, args.phase, rest))
    run(args)


if __name__ == "__main__":
    main()
