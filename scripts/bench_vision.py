"""Vision-tower balancing in the training stages: ``parallelism.vision_balance`` off vs on, one run.

    python scripts/bench_vision.py            # -> benchmarks/vision.{json,md}
    python scripts/bench_vision.py --quick    # fewer prompts, for a smoke run

Real compute of the ``small`` model (random init, FSDP2 on gloo, fp32) through the trainer's own
``StageRunner``: old-log-prob + update (forward + backward, no optimizer step) of one RL step's
trajectories, on two batches drawn from the synthetic mixtures at paper scale (2 fps):

- ``only-video``: video prompts capped at 64 frames (~1.6-1.9K tokens each);
- ``video-heavy``: the mixture's first prompts, videos capped at 256 frames (up to ~7K tokens)
  among short image prompts.

Per batch, in one launch on the same trajectories and weights: stage placement ``none`` (whole
trajectories, Karmarkar-Karp over ranks: ``balance.strategy = lb_micro``) and ``flex``
(FlexUlysses), each with vision balancing off and on. 2 ranks with one thread each (wall-clock),
and optionally 4 ranks (4 processes share 2 cores: only per-rank CPU time means something).

Reported: stage seconds, each rank's vision-tower forward time (busy clock: CPU time) and its max /
mean (``vision/balance_measured``), the planned vision balance, the vision bytes that crossed ranks
(pixels to encoders, embeddings to token holders and their gradients back), and the LM balance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import provenance, provenance_text  # noqa: E402
from bench_flex_ulysses import home_ranks, loss_fn, make_trajectories, ratio, small_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8192
BATCHES = {"only-video": dict(max_frames=64), "video-heavy": dict(max_frames=256)}


def build_batch(model_dir: Path, mixture: str, prompts: int, responses: int, seed: int, *,
                max_frames: int | None = None, response_range: tuple[int, int] = (64, 256), longest: bool = False):
    """``prompts`` prompts of the mixture at paper scale (2 fps, videos capped at ``max_frames``: by default
    this benchmark's cap for the mixture), the first ones or (``longest``) the longest of 4x as many,
    with ``responses`` responses each, lengths in ``response_range``."""
    import numpy as np

    from titanrl.data.preprocess import MediaSettings
    from titanrl.data.shadow.metadata import HeaderInfo, media_meta_from_header
    from titanrl.data.synth import sample_specs
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs

    args = Qwen2_5_VLArgs.from_pretrained(model_dir)
    cap = max_frames if max_frames is not None else BATCHES[mixture]["max_frames"]
    settings = MediaSettings.from_checkpoint(model_dir, fps=2.0, max_frames=cap)
    rng = np.random.default_rng(seed)
    media = []
    for sp in sample_specs(mixture, prompts * (4 if longest else 1), seed=seed, scale="paper"):
        header = HeaderInfo(kind=sp.kind, width=sp.width, height=sp.height, num_frames=sp.num_frames, fps=sp.fps,
                            duration=sp.num_frames / sp.fps if sp.fps else 0.0, codec="h264")
        media.append((media_meta_from_header(sp.media_path, header, 0, settings), sp))
    if longest:
        media = sorted(media, key=lambda x: -x[0].tokens)[:prompts]
    trajs = make_trajectories(args, media, rng, responses, response_range)
    return args, trajs


def worker(opts) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from titanrl.distributed import all_gather_objects, build_ulysses_groups, new_group
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLModel
    from titanrl.parallel.parallelize import parallelize_qwen2_5_vl
    from titanrl.parallel.vision_plan import VisionBalancing
    from titanrl.rl.stages import StageRunner, build_cost_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    vision_group = new_group(range(world))
    degrees = [p for p in (2, 4) if p <= world]
    groups = build_ulysses_groups(rank, world, degrees, device)
    model = None
    out = {"world": world, "batches": {}}
    for mixture in opts.mixtures.split(","):
        args, trajs = build_batch(Path(opts.model_dir), mixture, opts.prompts, opts.responses, opts.seed)
        cost_model = build_cost_model(args, "flops")
        if model is None:
            torch.manual_seed(0)
            model = Qwen2_5_VLModel(args)
            model.init_weights()
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
            model = parallelize_qwen2_5_vl(model, dp_mesh=mesh, ulysses=True, activation_checkpoint=opts.ac)
        home = home_ranks(trajs, cost_model, world)
        mine = [t for t in trajs if home[t.group] == rank]

        configs = [("none", False), ("none", True), ("flex", False), ("flex", True)]
        results = {}
        runs = [(True, "none", True)] + [(False, m, b) for m, b in configs * opts.repeats]  # first: warm-up
        for warmup, method, balance in runs:
            name = f"{method} vision={'on' if balance else 'off'}"
            vision = VisionBalancing(enabled=balance, cost_model=cost_model, group=vision_group)
            runner = StageRunner(args=args, rank=rank, world=world, device=device, dtype=torch.float32,
                                 method=method, strategy="lb_micro", max_tokens=MAX_TOKENS, cost_model=cost_model,
                                 groups=groups, p_max=min(4, world), vision=vision)
            runner.begin_step(mine[:1] if warmup else mine)
            dist.barrier()
            t0 = time.perf_counter()
            runner.logprobs(model, "old_logprobs", temperature=1.0)
            dist.barrier()
            t1 = time.perf_counter()
            runner.train_minibatch(model, runner.all_ids(), ("old_logprobs",), loss_fn, temperature=1.0)
            dist.barrier()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            metrics = runner.metrics()
            busy = all_gather_objects((runner.stats.busy_seconds.seconds(), runner.stats.vision_seconds.seconds()))
            if warmup:
                continue
            row = {"stage_s": t2 - t0, "old_logprob_s": t1 - t0, "update_s": t2 - t1,
                   "busy_s": [b[0] for b in busy], "vision_s": [b[1] for b in busy], **metrics}
            prev = results.get(name)
            if prev is None or row["stage_s"] < prev["stage_s"]:
                results[name] = row
        lengths = sorted((t.num_tokens for t in trajs), reverse=True)
        out["batches"][mixture] = {
            "prompts": opts.prompts, "responses": opts.responses, "max_frames": BATCHES[mixture]["max_frames"],
            "lengths": lengths, "total_tokens": int(np.sum(lengths)),
            "frames": [int(t.prompt.grids[0].t * 2) for t in trajs[::opts.responses] if t.prompt.grids[0].is_video],
            "configs": results,
        }
    if rank == 0:
        Path(opts.out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, opts, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), __file__,
           "--worker", "--out", str(out), "--model-dir", str(opts.model_dir), "--prompts", str(opts.prompts),
           "--responses", str(opts.responses), "--seed", str(opts.seed), "--repeats", str(opts.repeats),
           "--mixtures", opts.mixtures, "--ac", opts.ac]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"worker launch with {world} ranks failed")
    res = json.loads(out.read_text())
    res["launch_seconds"] = time.time() - t0
    res["command"] = " ".join(["python", "scripts/bench_vision.py", *opts.argv])
    res["activation_checkpoint"] = opts.ac
    res.update(provenance())
    return res


def report(runs: list[dict]) -> str:
    lines = ["# Vision-tower balancing in the training stages", "",
             "Generated by `scripts/bench_vision.py` from `benchmarks/vision.json` (do not edit).",
             "Old-log-prob + update (forward + backward, no optimizer step) of one RL step, the `small` model",
             "(vision tower: 8 blocks, 256 wide; decoder: 8 layers, 512 wide; random init), fp32, FSDP2 on gloo,",
             f"CPU, per-rank budget {MAX_TOKENS} tokens per wave, `balance.strategy = lb_micro` (every rank runs",
             "every wave, balanced per wave; under `lb_mini` vision balancing is one pass per minibatch, measured in",
             "whole RL steps by `scripts/bench_e2e.py`). Same trajectories and weights for every row; best of the",
             "repeats. `vision s per rank`: each rank's vision-tower forward time (CPU time), whose max / mean is",
             "`vision balance measured`; `planned`: per wave the busiest rank's vision cost over the mean (cost",
             "model: this model's FLOPs). `vision MB`: pixels sent to other ranks' encoders, embeddings to other",
             "ranks' tokens and their gradients back, summed over ranks.", ""]
    for run in runs:
        world = run["world"]
        wall = world == 2
        kind = "one thread each: wall-clock" if wall else "4 processes on 2 cores: per-rank CPU time"
        time_of = (lambda r: r["stage_s"]) if wall else (lambda r: max(r["busy_s"]))
        measure = "stage s (wall)" if wall else "busiest rank's busy s"
        lines += [f"## {world} ranks ({kind}; activation checkpointing: {run['activation_checkpoint']})", ""]
        for mixture, b in run["batches"].items():
            c = b["configs"]
            frames = b["frames"]
            lines += [f"### {mixture}: {b['prompts']} prompts x {b['responses']} responses, videos at 2 fps capped at "
                      f"{b['max_frames']} frames ({min(frames) if frames else 0}-{max(frames) if frames else 0} "
                      f"frames), {b['total_tokens']} tokens; longest: {', '.join(str(x) for x in b['lengths'][:6])}",
                      "",
                      f"| placement | vision balance | {measure} | vs off | vision s per rank | vision balance measured "
                      "| vision balance planned | vision MB | LM balance measured | exchange MB |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            for name, r in c.items():
                method, flag = name.split(" vision=")
                off = c[f"{method} vision=off"]
                lines.append(
                    f"| {method} | {flag} | {time_of(r):.1f} | {ratio(time_of(off), time_of(r))} | "
                    f"{' / '.join(f'{v:.1f}' for v in r['vision_s'])} | {r['vision/balance_measured']:.2f} | "
                    f"{r['vision/balance_planned']:.2f} | {r['vision/bytes_moved'] / 1e6:.1f} | "
                    f"{r['parallel/balance_measured']:.2f} | {r['parallel/exchange_bytes'] / 1e6:.1f} |")
            lines.append("")
        lines += [f"Reproduce: `{run['command']}` ({run['launch_seconds']:.0f} s for this launch, "
                  f"{provenance_text(run)}).", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--model-dir", default="")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--responses", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--mixtures", default="only-video,video-heavy")
    p.add_argument("--worlds", default="2")
    p.add_argument("--ac", default="none", choices=["none", "full"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--report-only", action="store_true", help="rewrite the .md from the committed .json")
    opts = p.parse_args()
    if opts.worker:
        worker(opts)
        return
    opts.argv = sys.argv[1:]
    out = ROOT / "benchmarks"
    if opts.report_only:
        runs = json.loads((out / "vision.json").read_text())
        (out / "vision.md").write_text(report(runs))
        print(report(runs))
        return
    opts.model_dir = small_model_dir()
    if opts.quick:
        opts.prompts = 3
    previous = json.loads((out / "vision.json").read_text()) if (out / "vision.json").is_file() else []
    worlds = [int(w) for w in opts.worlds.split(",")]
    runs = [] if opts.quick else [r for r in previous if r["world"] not in worlds]
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            done = launch(world, opts, Path(tmp) / f"w{world}.json")
            runs = sorted(runs + [done], key=lambda r: r["world"])
            print(f"{world} ranks done in {done['launch_seconds']:.0f} s", flush=True)
            if not opts.quick:
                (out / "vision.json").write_text(json.dumps(runs, indent=1))
    if not opts.quick:
        (out / "vision.md").write_text(report(runs))
    print(report(runs))


if __name__ == "__main__":
    main()
