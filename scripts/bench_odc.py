"""ODC-style balancing of the update stage: native vs lb_micro vs lb_mini vs odc (``balance.strategy``), each alone
and (``+flex``) with FlexUlysses (``parallelism.ulysses = flex``, ``p_max`` = the ranks up to 4), and the memory
planner's prediction for the 7B config under each.

    python scripts/bench_odc.py            # -> benchmarks/odc.{json,md}
    python scripts/bench_odc.py --quick    # smaller batches, for a smoke run
    python scripts/bench_odc.py --batches video --worlds 4 --merge   # re-run some tables, keep the others
    python scripts/bench_odc.py --strategies lb_mini+flex --merge    # or some rows
    python scripts/bench_odc.py --report-only                        # rewrite odc.md from odc.json

Every row records the commit, machine and date it measured; ``--merge`` keeps the rows of ``benchmarks/odc.json``
this run does not produce (the report names each table's).

Real compute of the ``small`` model (random init, FSDP2 on gloo) through the trainer's own
``StageRunner``: one update minibatch (forward, backward, gradient clipping, AdamW) of an RL step's
trajectories, whose prompts were split across ranks by Karmarkar-Karp on cost as the trainer's rollout
split does. Two batches: ``aime`` (ODC's AIME-like RL: text prompts of 100-300 tokens, 8 responses each
with long-tailed lengths, median 400, up to 3500 tokens; 8 prompts x 4) and ``video`` (a long video prompt of the
only-video mixture among image prompts of the video-heavy mixture, 2 responses each; activation
checkpointing on, which 4 ranks need to fit this 24 GB machine). Each strategy runs
in its own launch (so each rank's peak memory is its own), every launch on the same batch and weights:
2 ranks with one thread each (wall-clock ratios), and 4 ranks (4 processes share 2 cores: per-rank CPU
time only).
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
sys.path.insert(0, str(ROOT / "scripts"))
from bench_common import HeapSampler, provenance, provenance_text  # noqa: E402
STRATEGIES = ("native", "lb_micro", "lb_mini", "odc", "odc/hybrid", "lb_micro+flex", "lb_mini+flex", "odc+flex")


def aime_batch(model_dir: Path, prompts: int, responses: int, seed: int):
    import numpy as np

    from titanrl.data.manifest import SampleRecord
    from titanrl.data.preprocess import PreparedSample
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs
    from titanrl.rl.batch import Trajectory

    args = Qwen2_5_VLArgs.from_pretrained(model_dir)
    rng = np.random.default_rng(seed)
    trajs = []
    for g in range(prompts):
        ids = rng.integers(0, 1000, int(rng.integers(100, 300))).astype(np.int64)
        prompt = PreparedSample(SampleRecord(id=f"aime-{g}", source="aime", prompt="", media=[], answer=""), ids,
                                [], None, [])
        for _ in range(responses):
            r = int(min(3500, max(16, rng.lognormal(np.log(400), 0.9))))
            t = Trajectory(prompt=prompt, group=g, response_ids=rng.integers(0, 1000, r).astype(np.int64),
                           rollout_logprobs=np.zeros(r, np.float32))
            t.advantage = float(rng.normal())
            trajs.append(t)
    return args, trajs


def worker(opts) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from bench_flex_ulysses import build_batch
    from titanrl.distributed import all_gather_objects, build_ulysses_groups
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLModel
    from titanrl.parallel import odc_comm
    from titanrl.parallel.balance import karmarkar_karp
    from titanrl.parallel.parallelize import parallelize_qwen2_5_vl
    from titanrl.rl.grpo import ppo_clip_loss
    from titanrl.rl.stages import StageRunner, build_cost_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if opts.batch == "aime":
        args, trajs = aime_batch(Path(opts.model_dir), opts.prompts, opts.responses, opts.seed)
    else:
        args, trajs = build_batch(Path(opts.model_dir), 1, opts.prompts, opts.responses, opts.seed)
    cost_model = build_cost_model(args, "flops")
    groups = sorted({t.group for t in trajs})
    prompt_cost = [sum(float(cost_model.compute(t.num_tokens)) for t in trajs if t.group == g) for g in groups]
    home = {groups[i]: r for r, part in enumerate(karmarkar_karp(prompt_cost, world)) for i in part}
    mine = [t for t in trajs if home[t.group] == rank]
    for t in mine:
        t.old_logprobs = torch.full((t.num_response_tokens,), -6.9)

    torch.manual_seed(0)
    model = Qwen2_5_VLModel(args)
    model.init_weights()
    name, _, layout = opts.strategy.partition("/")
    # "/hybrid": odc's hybrid sharding as on 2 machines (2 replicas, each sharded over world / 2 ranks)
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            if layout == "hybrid" else init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)))
    strategy, _, flex = name.partition("+")
    p_max = min(4, world) if flex else 1
    degrees = tuple(p for p in (2, 4) if p <= p_max)
    groups = build_ulysses_groups(rank, world, degrees, device) if flex else {}
    model = parallelize_qwen2_5_vl(model, dp_mesh=mesh, activation_checkpoint=opts.ac, ulysses=bool(flex))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def loss_fn(out, inp, global_tokens, global_seqs):
        return ppo_clip_loss(out.logprobs, inp.fields["old_logprobs"], inp.advantages, inp.seq_index,
                             inp.seq_lengths, clip_low=0.2, clip_high=0.2, mode="token-mean",
                             global_tokens=global_tokens, global_seqs=global_seqs)

    runner = StageRunner(args=args, rank=rank, world=world, device=device, dtype=torch.float32,
                         method="flex" if flex else "none", strategy=strategy, max_tokens=opts.max_tokens,
                         cost_model=cost_model, p_max=p_max, groups=groups)
    for batch in (mine[:1], mine):  # a warm-up minibatch of one trajectory per rank, then the measured one
        runner.begin_step(batch)
        memory = HeapSampler()
        memory.peak_live = memory.report()["peak_heap_live_bytes"]
        start = memory.peak_live
        dist.barrier()
        t0 = time.perf_counter()
        runner.train_minibatch(model, runner.all_ids(), ("old_logprobs",), loss_fn, temperature=1.0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        dist.barrier()
        seconds = time.perf_counter() - t0
        memory.stop()
        # live heap (where torch's CPU tensors are) above the start; odc's shared memory (its accumulation buffer,
        # where FSDP would keep gradients, and copies it publishes) is not heap: added, the rank's own only
        comm = odc_comm.attached(model)
        added = memory.report()["peak_heap_live_bytes"] - start + (comm.shared_bytes if comm is not None else 0)
        metrics = runner.metrics()
    _, plan = runner.plan(runner.all_ids())
    every = all_gather_objects((runner.stats.update_busy_seconds.seconds(), added))
    if rank == 0:
        lengths = sorted((t.num_tokens for t in trajs), reverse=True)
        Path(opts.out).write_text(json.dumps({
            "strategy": opts.strategy, "world": world, "batch": opts.batch, "activation_checkpoint": opts.ac,
            "update_s": seconds,
            "busy_s": [e[0] for e in every], "peak_added_bytes": [e[1] for e in every],
            "microbatches": plan.microbatch_counts(), "lengths": lengths, "total_tokens": int(np.sum(lengths)),
            "max_tokens": opts.max_tokens, **metrics,
        }, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, strategy: str, batch: str, opts, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), __file__,
           "--worker", "--out", str(out), "--model-dir", str(opts.model_dir), "--strategy", strategy,
           "--batch", batch, "--prompts", str(opts.prompts_of[batch]), "--responses", str(opts.responses_of[batch]),
           "--max-tokens", str(opts.max_tokens), "--seed", str(opts.seed), "--ac", opts.ac_of[batch]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"{strategy} on {world} ranks ({batch}) failed")
    return {**json.loads(out.read_text()), **opts.provenance}


def merged(kept: list[dict], rows: list[dict]) -> list[dict]:
    """``kept`` rows whose (batch, world, strategy) ``rows`` does not measure, then ``rows``, in report order."""
    key = lambda r: (r["batch"], r["world"], r["strategy"])  # noqa: E731
    new = {key(r) for r in rows}
    out = [r for r in kept if key(r) not in new] + rows
    batches = list(dict.fromkeys(r["batch"] for r in kept + rows))
    return sorted(out, key=lambda r: (batches.index(r["batch"]), r["world"], STRATEGIES.index(r["strategy"])))


def report(rows: list[dict]) -> str:
    lines = ["# ODC-style balancing of the update stage", "",
             "Generated by `scripts/bench_odc.py` from `benchmarks/odc.json` (do not edit). One update minibatch",
             "(forward, backward, clipping, AdamW) of the `small` model (random init, fp32, FSDP2 on gloo, CPU)",
             "through the trainer's `StageRunner`, per `balance.strategy`; prompts split across ranks by",
             "Karmarkar-Karp on cost (the trainer's rollout split). Each strategy in its own launch.", "",
             "Reproduce every table: `python scripts/bench_odc.py`; each table names the command that re-runs it",
             "alone.", ""]
    for batch in dict.fromkeys(r["batch"] for r in rows):
        for world in sorted({r["world"] for r in rows if r["batch"] == batch}):
            sub = {r["strategy"]: r for r in rows if r["batch"] == batch and r["world"] == world}
            first = next(iter(sub.values()))
            kind = "one thread each: wall-clock" if world == 2 else "4 processes on 2 cores: CPU time only"
            measured = " / ".join(dict.fromkeys(provenance_text(r) for r in sub.values()))
            lines += [f"## {batch}, {world} ranks ({kind}; activation checkpointing: "
                      f"{first.get('activation_checkpoint', 'none')})", "",
                      f"Measured: {measured}; reproduce: `python scripts/bench_odc.py --batches {batch} --worlds {world} "
                      "--merge`.", "",
                      f"{len(first['lengths'])} trajectories, {first['total_tokens']} tokens (longest "
                      f"{', '.join(str(x) for x in first['lengths'][:4])}), budget {first['max_tokens']} tokens "
                      "per rank per microbatch.", "",
                      "| strategy | update s | vs native | bubble measured | bubble planned | microbatches per rank | "
                      "syncs / minibatch | busy s per rank | peak added MB per rank |",
                      "|---|---|---|---|---|---|---|---|---|"]
            base = sub.get("native")
            for name in STRATEGIES:
                if name not in sub:
                    continue
                r = sub[name]
                same_run = base is not None and base.get("commit") == r.get("commit")
                speed = f"{base['update_s'] / r['update_s']:.2f}x" if world == 2 and same_run else "-"
                lines.append(
                    f"| {name} | {r['update_s']:.1f} | {speed} | {100 * r['balance/bubble_measured']:.1f}% | "
                    f"{100 * r['balance/bubble_planned']:.1f}% | {' / '.join(str(m) for m in r['microbatches'])} | "
                    f"{r['balance/syncs_per_minibatch']:.0f} | {' / '.join(f'{b:.1f}' for b in r['busy_s'])} | "
                    f"{' / '.join(f'{b / 2**20:.0f}' for b in r['peak_added_bytes'])} |")
            lines.append("")
    lines += ["`bubble measured` = 1 - sum mean / sum max of the ranks' busy time (CPU time inside forward and",
              "backward) per synchronisation unit: every microbatch for native / lb_micro (ranks wait at every",
              "layer), the minibatch for lb_mini and odc; `+flex`: FlexUlysses places the trajectories (a long one sharded",
              "over a Ulysses group); `bubble planned` = the same from the plan's costs (this model's",
              "FLOPs). `microbatches`",
              "include the zero-weight dummies native pads with. `peak added MB`: the rank's live heap (glibc's",
              "`mallinfo2`, where torch's CPU tensors are; sampled every 10 ms) during the minibatch and its optimizer",
              "step above its start, plus, for odc, the shared memory it adds (its accumulation buffer; its parameter",
              "shards move into shared memory, which is not counted: they were there before). lb_mini holds full",
              "parameters and unsharded gradients for the minibatch (the small model: ~140 MB each); odc gathers a",
              "unit from the owners' shared memory when it runs, as FSDP does, and synchronises once per minibatch.",
              "`odc/hybrid`: odc's hybrid sharding as on two machines (2 replicas, each sharded over half the ranks,",
              "gradients all-reduced across the replicas once per minibatch); its parameter and optimizer shards are",
              "twice odc's (not in `peak added`, which counts the gradient buffer).",
              "Wall-clock ratios only for 2 ranks.", ""]
    lines += ["## The 7B config's predicted peak per GPU (8 x 80 GB, `python -m titanrl.memory`)", "",
              "| strategy | predicted peak GiB | fits 80 GB |", "|---|---|---|"]
    lines += [f"| {s} | {gib:.2f} | {'yes' if fits else 'no'} |" for s, gib, fits in planner_rows()]
    lines += ["", "The planner's terms: `docs/memory.md`. odc is refused on CUDA (its symmetric-memory path is not",
              "built): the 7B row is a prediction, not yet run on a GPU.", ""]
    return "\n".join(lines)


def planner_rows() -> list[tuple[str, float, bool]]:
    """(strategy, predicted GiB, fits) for configs/qwen2_5_vl_7b.toml on 8 ranks of 80 GB (the planner's table
    shape for Qwen2.5-VL-7B)."""
    from titanrl import memory
    from titanrl.config import load_config
    from titanrl.config.errors import ConfigError

    rows = []
    # (row, strategy, ranks, shard degree): odc on 2 machines of 8 shards within each (hybrid sharding)
    for label, strategy, world, shard in (("lb_micro", "lb_micro", 8, None), ("odc", "odc", 8, None),
                                          ("odc, 2 machines of 8 (hybrid sharding)", "odc", 16, 8),
                                          ("lb_mini", "lb_mini", 8, None)):
        cfg = load_config(ROOT / "configs" / "qwen2_5_vl_7b.toml",
                          ["--model.path=/models/Qwen2.5-VL-7B-Instruct", f"--balance.strategy={strategy}"])
        args, _ = memory.resolve_shape(cfg)
        plan = memory.predict(cfg, args, world, device="cuda", shard=shard)
        try:
            memory.check_fits(plan, 80 * 10**9, cfg)
            fits = True
        except ConfigError:
            fits = False
        rows.append((label, plan.total / 2**30, fits))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--model-dir", default="")
    p.add_argument("--strategy", default="native")
    p.add_argument("--batch", default="aime")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--responses", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--batches", default="aime,video")
    p.add_argument("--ac", default="none", choices=["none", "full"])
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--merge", action="store_true", help="keep the rows of benchmarks/odc.json this run does not make")
    p.add_argument("--report-only", action="store_true", help="rewrite the .md from the committed .json")
    opts = p.parse_args()
    opts.provenance = provenance()
    if opts.worker:
        worker(opts)
        return
    if opts.report_only:
        text = report(json.loads((ROOT / "benchmarks" / "odc.json").read_text()))
        (ROOT / "benchmarks" / "odc.md").write_text(text)
        print(text)
        return
    from bench_flex_ulysses import small_model_dir

    opts.model_dir = small_model_dir()
    opts.prompts_of = {"aime": 2 if opts.quick else 8, "video": 1 if opts.quick else 5}
    opts.responses_of = {"aime": 2 if opts.quick else 4, "video": 1 if opts.quick else 2}
    # a ~7K-token video trajectory needs ~11 GB of fp32 activations: with 4 ranks on this 24 GB machine
    # only activation checkpointing fits (used for every strategy of that batch)
    opts.ac_of = {"aime": "none", "video": "full"}
    rows = []
    kept = json.loads((ROOT / "benchmarks" / "odc.json").read_text()) if opts.merge else []
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for batch in opts.batches.split(","):
            for world in (int(w) for w in opts.worlds.split(",")):
                for strategy in opts.strategies.split(","):
                    if strategy not in STRATEGIES:
                        raise SystemExit(f"--strategies: {strategy!r} is not one of {', '.join(STRATEGIES)}")
                    t0 = time.time()
                    rows.append(launch(world, strategy, batch, opts, Path(tmp) / "r.json"))
                    print(f"{batch} {world} ranks {strategy}: {rows[-1]['update_s']:.1f} s "
                          f"(launch {time.time() - t0:.0f} s)", flush=True)
                    if not opts.quick:
                        (ROOT / "benchmarks" / "odc.json").write_text(json.dumps(merged(kept, rows), indent=1))
    rows = merged(kept, rows)
    text = report(rows)
    if not opts.quick:
        (ROOT / "benchmarks" / "odc.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
