"""FlexUlysses in the training stages: old-log-prob + update of one RL step's trajectories, per method.

    python scripts/bench_flex_ulysses.py            # -> benchmarks/flex_ulysses.{json,md}
    python scripts/bench_flex_ulysses.py --quick    # a smaller batch, for a smoke run

Real compute of the ``small`` model (random init, FSDP2 on gloo) through the trainer's own
``StageRunner`` (stage plans, trajectory exchange, Ulysses attention), on the skewed batch FlexRL is
about: the longest prompt(s) of the only-video mixture (256 frames at 2 fps; the ``small`` processor
makes one ~7K tokens) among short image prompts of the video-heavy mixture (~200 tokens), each
prompt with ``--responses`` responses of random length. (Whole mixture draws at this scale are
20-40 TFLOP per method, too slow for this 2-core machine.) Methods, all in one run on the same
trajectories and weights:

- ``none``: ``balance.strategy = native``: trajectories stay on the rank that generated them (prompts
  split across ranks by Karmarkar-Karp on cost, as the trainer does), microbatches cut locally;
- ``bucketing``: verl's way, whole sequences dealt to ranks in equal counts by Karmarkar-Karp on
  verl's workload ``24576 s + s^2``;
- ``fixed2`` / ``fixed4``: Ulysses with one degree for every sequence;
- ``flex``: FlexUlysses (per-sequence degree from the cost model, nested groups).

Two launches: 2 ranks with one thread each (wall-clock: stage seconds and ratios), and 4 ranks
(4 processes share 2 cores, so wall-clock means nothing; per-rank busy time is each process's CPU
time in the model's forward/backward, whose max/mean is the measured balance). No optimizer step:
every method sees the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import provenance, provenance_text  # noqa: E402

MAX_TOKENS = 8192  # per-rank budget of a wave (balance.max_tokens_per_microbatch)


def small_model_dir() -> Path:
    """The ``small`` random checkpoint in the cache (the trainer's naming), built on first use."""
    cache = Path(os.environ.get("TITANRL_CACHE", "~/.cache/titanrl")).expanduser()
    model_dir = cache / "models" / "qwen2_5_vl_small_seed0"
    if not (model_dir / "config.json").is_file():
        from titanrl.models.make_tiny import make_tiny_checkpoint

        make_tiny_checkpoint(model_dir, "small")
    return model_dir


def make_trajectories(args, media: list, rng, responses: int, response_range: tuple[int, int]) -> list:
    """One prompt per (media meta, sample spec) of ``media``: random text around the expanded vision
    placeholders, random pixels; ``responses`` random responses each, lengths in ``response_range``."""
    import numpy as np

    from titanrl.data.manifest import SampleRecord
    from titanrl.data.preprocess import PreparedSample
    from titanrl.rl.batch import Trajectory

    trajs = []
    for g, (m, sp) in enumerate(media):
        token = args.video_token_id if m.grid.is_video else args.image_token_id
        ids = np.concatenate([rng.integers(0, 1000, 24), [args.vision_start_token_id], np.full(m.tokens, token),
                              [args.vision_end_token_id], rng.integers(0, 1000, 40)]).astype(np.int64)
        pixels = rng.standard_normal((m.grid.num_patches, args.vision.patch_dim), dtype=np.float32)
        record = SampleRecord(id=sp.id, source=sp.source, prompt="", media=[], answer="")
        prompt = PreparedSample(record, ids, [m.grid], pixels, [])
        for _ in range(responses):
            r = int(rng.integers(*response_range))
            t = Trajectory(prompt=prompt, group=g, response_ids=rng.integers(0, 1000, r).astype(np.int64),
                           rollout_logprobs=np.zeros(r, np.float32))
            t.advantage = float(rng.normal())
            trajs.append(t)
    return trajs


def home_ranks(trajs: list, cost_model, world: int) -> dict[int, int]:
    """Prompt group -> rank, as the trainer's rollout split does: Karmarkar-Karp on cost."""
    from titanrl.parallel.balance import karmarkar_karp

    groups_of = sorted({t.group for t in trajs})
    prompt_cost = [sum(float(cost_model.compute(t.num_tokens)) for t in trajs if t.group == g) for g in groups_of]
    home = {}
    for r, part in enumerate(karmarkar_karp(prompt_cost, world, equal_size=False)):
        for i in part:
            home[groups_of[i]] = r
    return home


def loss_fn(out, inp, global_tokens, global_seqs):
    """The PPO-clip loss of the stage benchmarks (old log-probs travel as a field)."""
    from titanrl.rl.grpo import ppo_clip_loss

    return ppo_clip_loss(out.logprobs, inp.fields["old_logprobs"], inp.advantages, inp.seq_index, inp.seq_lengths,
                         clip_low=0.2, clip_high=0.2, mode="token-mean", global_tokens=global_tokens,
                         global_seqs=global_seqs, entropy=out.entropy, entropy_coef=0.001)


def build_batch(model_dir: Path, long_videos: int, short_prompts: int, responses: int, seed: int):
    """Global trajectories (identical on every rank): the ``long_videos`` longest prompts of the
    only-video mixture and ``short_prompts`` image prompts of the video-heavy mixture, at paper
    scale, with random pixels; ``responses`` responses of 64-512 tokens each."""
    import numpy as np

    from titanrl.data.preprocess import MediaSettings
    from titanrl.data.shadow.metadata import HeaderInfo, media_meta_from_header
    from titanrl.data.synth import sample_specs
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs

    args = Qwen2_5_VLArgs.from_pretrained(model_dir)
    settings = MediaSettings.from_checkpoint(model_dir, fps=2.0, max_frames=256)
    rng = np.random.default_rng(seed)

    def meta(sp):
        header = HeaderInfo(kind=sp.kind, width=sp.width, height=sp.height, num_frames=sp.num_frames, fps=sp.fps,
                            duration=sp.num_frames / sp.fps if sp.fps else 0.0, codec="h264")
        return media_meta_from_header(sp.media_path, header, 0, settings)

    videos = sorted(((meta(sp), sp) for sp in sample_specs("only-video", 16, seed=seed, scale="paper")),
                    key=lambda x: -x[0].tokens)[:long_videos]
    images = [(meta(sp), sp) for sp in sample_specs("video-heavy", 64, seed=seed, scale="paper")
              if sp.kind == "image"][:short_prompts]
    trajs = make_trajectories(args, videos + images, rng, responses, (64, 512))
    return args, trajs


def worker(opts) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from titanrl.distributed import all_gather_objects, build_ulysses_groups
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLModel
    from titanrl.parallel.parallelize import parallelize_qwen2_5_vl
    from titanrl.rl.stages import StageRunner, build_cost_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    args, trajs = build_batch(Path(opts.model_dir), opts.long_videos, opts.short_prompts, opts.responses, opts.seed)
    cost_model = build_cost_model(args, "flops")
    home = home_ranks(trajs, cost_model, world)  # as the trainer's rollout split
    mine = [t for t in trajs if home[t.group] == rank]

    torch.manual_seed(0)
    model = Qwen2_5_VLModel(args)
    model.init_weights()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    model = parallelize_qwen2_5_vl(model, dp_mesh=mesh, ulysses=True, activation_checkpoint=opts.ac)
    degrees = [p for p in (2, 4) if p <= world]
    groups = build_ulysses_groups(rank, world, degrees, device)

    methods = [("none", {}), ("bucketing", {}), ("fixed2", dict(degree=2))]
    if world >= 4:
        methods.append(("fixed4", dict(degree=4)))
    methods.append(("flex", dict(p_max=min(4, world))))
    results = {}
    for name, extra in [("warmup", {})] + methods * opts.repeats:
        method = "none" if name == "warmup" else name.rstrip("24")
        runner = StageRunner(args=args, rank=rank, world=world, device=device, dtype=torch.float32, method=method,
                             max_tokens=MAX_TOKENS, cost_model=cost_model, groups=groups, **extra)
        batch = mine[:1] if name == "warmup" else mine
        runner.begin_step(batch)
        dist.barrier()
        t0 = time.perf_counter()
        runner.logprobs(model, "old_logprobs", temperature=1.0)
        dist.barrier()
        t1 = time.perf_counter()
        logprob_busy = runner.stats.busy_seconds.seconds()
        runner.train_minibatch(model, runner.all_ids(), ("old_logprobs",), loss_fn, temperature=1.0)
        dist.barrier()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        metrics = runner.metrics()
        busy = all_gather_objects((logprob_busy, runner.stats.busy_seconds.seconds()))
        if name == "warmup":
            continue
        _, plan = runner.plan(runner.all_ids())
        row = {
            "old_logprob_s": t1 - t0, "update_s": t2 - t1, "stage_s": t2 - t0,
            "busy_s": [b[1] for b in busy], "busy_logprob_s": [b[0] for b in busy],
            "tokens_per_rank_planned": [sum(w.tokens[r] for w in plan.waves) for r in range(world)],
            **metrics,
        }
        prev = results.get(name)
        if prev is None or row["stage_s"] < prev["stage_s"]:  # the best of the repeats
            results[name] = row
    if rank == 0:
        lengths = sorted((t.num_tokens for t in trajs), reverse=True)
        Path(opts.out).write_text(json.dumps({
            "world": world, "activation_checkpoint": opts.ac, "long_videos": opts.long_videos,
            "short_prompts": opts.short_prompts,
            "responses": opts.responses,
            "lengths": lengths, "total_tokens": int(np.sum(lengths)), "max_tokens_per_microbatch": MAX_TOKENS,
            "methods": results,
        }, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def ac_for(world: int, ac: str) -> str:
    """``--ac auto``: none on 2 ranks; full on more, where 4 processes holding a ~7K-token video's fp32 activations
    without checkpointing (~11 GB each) overflow this machine's 24 GB."""
    return ac if ac != "auto" else ("none" if world <= 2 else "full")


def launch(world: int, opts, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           __file__, "--worker", "--out", str(out), "--model-dir", str(opts.model_dir), "--long-videos",
           str(opts.long_videos), "--short-prompts", str(opts.short_prompts), "--responses", str(opts.responses),
           "--seed", str(opts.seed), "--repeats", str(opts.repeats), "--ac", ac_for(world, opts.ac)]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"worker launch with {world} ranks failed")
    res = json.loads(out.read_text())
    res["launch_seconds"] = time.time() - t0
    res["command"] = " ".join(["python", "scripts/bench_flex_ulysses.py", *opts.argv])
    res.update(provenance())
    return res


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def report(runs: list[dict]) -> str:
    lines = ["# FlexUlysses in the training stages", "",
             "Generated by `scripts/bench_flex_ulysses.py` from `benchmarks/flex_ulysses.json` (do not edit).",
             "Old-log-prob + update (forward + backward, no optimizer step) of one RL step's trajectories, the",
             "`small` model (8 layers, 512 wide, 8 query / 2 KV heads; random init), fp32, FSDP2 on gloo, CPU,",
             f"per-rank budget {MAX_TOKENS} tokens per wave, `balance.strategy` lb_micro for the Ulysses methods",
             "(every rank runs every wave). Every method runs through the trainer's `StageRunner` on the same",
             "trajectories and weights; numbers are the best of the repeats.", ""]
    for run in runs:
        world = run["world"]
        m = run["methods"]
        wall = world == 2
        # 2 ranks, one thread each: wall-clock of the stage. 4 processes on 2 cores share the cores, so the
        # stage's wall-clock means nothing: compare the critical path, the busiest rank's CPU time.
        time_of = (lambda r: r["stage_s"]) if wall else (lambda r: max(r["busy_s"]))
        fixed = {k: v for k, v in m.items() if k.startswith("fixed")}
        best_fixed = min(fixed, key=lambda k: time_of(fixed[k]))
        kind = "one thread each: wall-clock" if wall else "4 processes on 2 cores: per-rank CPU time"
        ac = run.get("activation_checkpoint", "none")
        measure = "stage s (wall)" if wall else "busiest rank's busy s"
        lines += [f"## {world} ranks ({kind}; activation checkpointing: {ac})", "",
                  f"{run['long_videos']} long video prompt(s) + {run['short_prompts']} image prompts, x "
                  f"{run['responses']} responses = {len(run['lengths'])} trajectories, {run['total_tokens']} tokens; "
                  f"longest: {', '.join(str(x) for x in run['lengths'][:6])}.", "",
                  f"| method | {measure} | vs none | vs bucketing | old log-prob s | update s | waves | degree max | "
                  "sharded | balance planned | balance measured | busy s per rank | a2a MB | exchange MB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in m.items():
            lines.append(
                f"| {name} | {time_of(r):.1f} | {ratio(time_of(m['none']), time_of(r))} | "
                f"{ratio(time_of(m['bucketing']), time_of(r))} | {r['old_logprob_s']:.1f} | {r['update_s']:.1f} | "
                f"{r['parallel/waves']:.0f} | {r['parallel/degree_max']:.0f} | {r['parallel/sharded_sequences']:.0f} | "
                f"{r['parallel/balance_planned']:.2f} | {r['parallel/balance_measured']:.2f} | "
                f"{' / '.join(f'{b:.1f}' for b in r['busy_s'])} | {r['parallel/a2a_bytes'] / 1e6:.1f} | "
                f"{r['parallel/exchange_bytes'] / 1e6:.1f} |")
        f, b = m["flex"], m["bucketing"]
        lines += ["", f"Flex against bucketing: {ratio(time_of(b), time_of(f))} (target >= 1.5x); against the best "
                      f"fixed degree ({best_fixed}): {ratio(time_of(fixed[best_fixed]), time_of(f))} (target > 1); "
                      f"measured balance flex {f['parallel/balance_measured']:.2f} (target <= 1.10), bucketing "
                      f"{b['parallel/balance_measured']:.2f}.",
                  f"Reproduce: `{run['command']}` ({run['launch_seconds']:.0f} s for this launch, "
                  f"{provenance_text(run)}).", ""]
    lines += ["Stage seconds are wall-clock between barriers on every rank (planning, exchange, forward, backward,",
              "log-prob return); `busy` is each rank's CPU time inside the model's forward/backward (a rank",
              "blocked in a collective burns none); `balance measured` = max / mean of busy; `balance planned` =",
              "the plan's sum over waves of the most loaded rank's cost over the mean (cost model: this model's",
              "FLOPs). `a2a MB`: attention all-to-alls summed over ranks, forward and backward; `exchange MB`:",
              "token ranges + pixel frame runs moved to the ranks that compute them, and log-probs back.",
              "4 ranks run with activation checkpointing: without it the rank holding a ~7K-token video needs",
              "~11 GB of fp32 activations and 4 such processes overflow this machine's 24 GB.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--model-dir", default="")
    p.add_argument("--long-videos", type=int, default=1)
    p.add_argument("--short-prompts", type=int, default=5)
    p.add_argument("--responses", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--ac", default="auto", choices=["auto", "none", "full"],
                   help="activation checkpointing, every method (auto: none on 2 ranks, full on more: see ac_for)")
    p.add_argument("--report-only", action="store_true", help="rewrite the .md from the committed .json")
    opts = p.parse_args()
    if opts.worker:
        worker(opts)
        return
    opts.argv = sys.argv[1:]
    out = ROOT / "benchmarks"
    if opts.report_only:
        runs = json.loads((out / "flex_ulysses.json").read_text())
        (out / "flex_ulysses.md").write_text(report(runs))
        print(report(runs))
        return
    opts.model_dir = small_model_dir()
    if opts.quick:
        opts.short_prompts, opts.responses = 2, 1
    # launches of other world sizes from earlier runs stay (each row keeps the command that made it)
    previous = json.loads((out / "flex_ulysses.json").read_text()) if (out / "flex_ulysses.json").is_file() else []
    worlds = [int(w) for w in opts.worlds.split(",")]
    runs = [] if opts.quick else list(previous)  # a world's earlier run stays until this invocation replaces it
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            done = launch(world, opts, Path(tmp) / f"w{world}.json")
            runs = sorted([r for r in runs if r["world"] != world] + [done], key=lambda r: r["world"])
            print(f"{world} ranks done in {done['launch_seconds']:.0f} s", flush=True)
            if not opts.quick:  # saved per launch: a later failure keeps what was measured
                (out / "flex_ulysses.json").write_text(json.dumps(runs, indent=1))
    if not opts.quick:
        (out / "flex_ulysses.md").write_text(report(runs))
    print(report(runs))


if __name__ == "__main__":
    main()
