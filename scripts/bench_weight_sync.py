"""The weight push (trainer -> rollout engines): in memory against the file path it replaced, and its share of the step.

    python scripts/bench_weight_sync.py            # -> benchmarks/weight_sync.{json,md}

1. **The push alone**, `tiny` and `small` (random init), FSDP2 over 2 gloo ranks, each rank with its in-process vLLM
   engine (the colocated trainer's layout), model dtype float32 (the CPU default) and bfloat16:
   - ``files`` (titanrl's path before, reproduced here as it was): every parameter unsharded on its own
     (``DTensor.full_tensor``), local rank 0 writes HF safetensors shards into /dev/shm, a barrier, every engine
     re-reads them (``VLLMEngine.load_weights``);
   - ``memory`` (``titanrl.rl.weight_sync.WeightPusher``): shards cast and all-gathered in buckets, each full tensor
     handed to the rank's own engine by reference.
   Each way in a fresh launch (a process keeps memory it freed): seconds per push (median of 6 after one warm-up),
   peak resident memory a rank adds (sampled every 20 ms), and the bytes left in /dev/shm at the push's peak.
2. **Share of the step**: the README's main job (tiny default, 2 ranks x 1 thread) for 12 steps, this commit against
   the commit named by ``--baseline`` (checked out in a temporary git worktree), in one run: median step wall
   seconds, the weight-sync stage (which also holds the probe of ``rollout.probe_every``) and the push alone.
3. **7B projection** (arithmetic, not measured): bytes each way moves per push on an 8-GPU node and the seconds at
   stated link speeds.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_common import provenance, provenance_text  # noqa: E402

WAYS = ("files", "memory")
PUSHES = 6
# Qwen2.5-VL-7B-Instruct: 8.29B parameters, bf16 in the engines.
_7B = {"params": 8_292_166_656, "ranks": 8, "bytes": 2}
# link speeds of the projection (GB/s, per direction): an all-gather's bus bandwidth over NVLink (H100 NVSwitch,
# NCCL's measured order), PCIe Gen4 x16 device<->host, and a host memcpy into tmpfs / out of it
_LINKS = {"nvlink_allgather": 150.0, "pcie": 22.0, "tmpfs_write": 4.0, "tmpfs_read": 8.0}


def worker(opts) -> None:
    import shutil

    import torch
    import torch.distributed as dist

    from bench_common import PeakRSS
    from titanrl.config import JobConfig
    from titanrl.distributed import build_dp_mesh, init_distributed
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs
    from titanrl.models.qwen2_5_vl.state_dict_adapter import HFShardWriter, clean_name
    from titanrl.parallel.parallelize import build_parallel_model
    from titanrl.rl.weight_sync import WeightPusher
    from titanrl.rollout import build_rollout_engine
    from titanrl.rollout.launch import engine_launch

    torch.set_num_threads(1)
    info = init_distributed(600)
    model_dir = Path(opts.model_dir)
    args = Qwen2_5_VLArgs.from_pretrained(model_dir)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[opts.dtype]
    model = build_parallel_model(args, model_dir, device=info.device, dp_mesh=build_dp_mesh(info), param_dtype=dtype)
    cfg = JobConfig()
    cfg.model.dtype = opts.dtype
    cfg.rollout.kv_cache_bytes = 64 << 20
    launch = engine_launch(info.rank, info.local_rank, info.world_size, 1, "cpu", process_group=True)
    engine = build_rollout_engine(cfg, model_dir, info.rank, launch=launch)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    target = shm / f"titanrl-bench-sync-{os.getppid()}"
    shm_peak = 0

    def files_way() -> None:  # the push before this commit
        nonlocal shm_peak
        writer = HFShardWriter(target, args, dtype=dtype, shard_bytes=256 << 20) if info.local_rank == 0 else None
        for name, value in model.state_dict().items():
            value = value.detach().to(dtype) if value.is_floating_point() else value.detach()
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            if writer is not None:
                writer.add(clean_name(name), full.cpu())
        if writer is not None:
            writer.close(model_dir)
        dist.barrier()
        shm_peak = max(shm_peak, sum(p.stat().st_size for p in target.glob("*")))
        engine.load_weights(target)
        dist.barrier()

    pusher = WeightPusher(args, info, dtype)

    def memory_way() -> None:
        pusher.push(model, engine)
        dist.barrier()

    way = {"files": files_way, "memory": memory_way}[opts.way]
    way()  # warm-up
    rss = PeakRSS()
    seconds = []
    for _ in range(PUSHES):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0001)  # new weights each push
        t0 = time.perf_counter()
        way()
        seconds.append(time.perf_counter() - t0)
    added = rss.stop()
    if info.rank == 0:
        shutil.rmtree(target, ignore_errors=True)
    every = [None] * info.world_size
    dist.all_gather_object(every, added)
    if info.rank == 0:
        Path(opts.out).write_text(json.dumps({
            "model": opts.size, "dtype": opts.dtype, "world": info.world_size, "way": opts.way,
            "params": sum(int(p.numel()) for p in model.parameters()),
            "push_s_median": statistics.median(seconds), "push_s": seconds, "peak_added_bytes": every,
            "shm_bytes": shm_peak}))
    engine.close()
    dist.destroy_process_group()


def push_rows(sizes: list[str], dtypes: list[str]) -> list[dict]:
    from titanrl.models.make_tiny import make_tiny_checkpoint

    rows = []
    for size in sizes:
        model_dir = Path(os.path.expanduser(f"~/.cache/titanrl/models/qwen2_5_vl_{size}_seed0"))
        if not (model_dir / "config.json").is_file():
            make_tiny_checkpoint(model_dir, size=size, seed=0)
        for dtype in dtypes:
            for way in WAYS:
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "r.json"
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           __file__, "--worker", "--out", str(out), "--model-dir", str(model_dir), "--size", size,
                           "--dtype", dtype, "--way", way]
                    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    rows.append(json.loads(out.read_text()))
                print(f"{size} {dtype} {way}: {rows[-1]['push_s_median']:.3f} s", flush=True)
    return rows


def step_rows(baseline: str, steps: int) -> list[dict]:
    """The main job with this checkout's code and with the baseline commit's, one after the other."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), baseline], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for label, code in (("baseline " + baseline[:7], old), ("this commit", ROOT)):
                out = Path(tmp) / label.replace(" ", "_")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "-m", "titanrl.train", "--config", str(code / "configs/tiny_cpu.toml"),
                       f"--job.steps={steps}", f"--job.dump_folder={out}", "--checkpoint.enable=false",
                       "--metrics.progress=line"]
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code)}
                subprocess.run(cmd, check=True, env=env, cwd=str(code), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                metrics = [json.loads(line) for line in (out / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()]
                timed = metrics[1:]  # step 1 holds the engines' first-call warm-up
                med = lambda key: statistics.median(m.get(key, 0.0) for m in timed)  # noqa: E731
                push = [m.get("sync/gather_s", m.get("sync/export_s", 0.0)) + m.get("sync/load_s", 0.0)
                        for m in timed]
                rows.append({"code": label, "steps": len(timed), "step_s": med("step/wall_s"),
                             "weight_sync_stage_s": med("time/weight_sync"), "push_s": statistics.median(push),
                             "push_share": statistics.median(p / m["step/wall_s"] for p, m in zip(push, timed)),
                             "reward": timed[-1].get("reward/mean")})
                print(f"{label}: step {rows[-1]['step_s']:.3f} s, push {rows[-1]['push_s']:.3f} s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    return rows


def projection() -> dict:
    """Per push of Qwen2.5-VL-7B on an 8-GPU node, colocated (every GPU an engine)."""
    model = _7B["params"] * _7B["bytes"]
    ranks = _7B["ranks"]
    gib = 2**30
    gather = model * (ranks - 1) / ranks  # each rank receives the other ranks' shards
    memory_s = gather / (_LINKS["nvlink_allgather"] * 1e9)
    # files: the same gather, the writer's device->host copy and tmpfs write, every engine's tmpfs read and
    # host->device copy (8 engines reading in parallel, one PCIe link each)
    files_s = memory_s + model / (_LINKS["pcie"] * 1e9) + model / (_LINKS["tmpfs_write"] * 1e9) + \
        model / (_LINKS["tmpfs_read"] * 1e9) + model / (_LINKS["pcie"] * 1e9)
    return {"model_gib": model / gib, "gathered_per_rank_gib": gather / gib,
            "files_host_bytes_gib": model * (1 + ranks) / gib, "files_shm_gib": 2 * model / gib,
            "memory_s": memory_s, "files_s": files_s}


def report(result: dict, command: str) -> str:
    mb = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    lines = [
        "# Weight push: in memory vs files",
        "",
        "Generated by `scripts/bench_weight_sync.py` from `benchmarks/weight_sync.json` (do not edit); "
        f"{provenance_text(result)}. CPU only (not yet run on a GPU).",
        "",
        "## The push alone (2 gloo ranks x 1 thread, each with its in-process vLLM engine)",
        "",
        "| model | dtype | way | push s (median of 6) | files / memory | peak added MB per rank | /dev/shm MB |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r["model"], r["dtype"], r["way"]): r for r in result["push"]}
    for r in result["push"]:
        ratio = r["push_s_median"] / by[(r["model"], r["dtype"], "memory")]["push_s_median"] if r["way"] == "files" \
            else None
        lines.append(f"| {r['model']} ({r['params'] / 1e6:.1f}M) | {r['dtype']} | {r['way']} | {r['push_s_median']:.3f} | "
                     f"{'%.2fx' % ratio if ratio else '-'} | {' / '.join(mb(b) for b in r['peak_added_bytes'])} | "
                     f"{mb(r['shm_bytes'])} |")
    lines += [
        "",
        "`files` = the path before this change (every parameter unsharded on its own, local rank 0 writes HF "
        "safetensors into /dev/shm, a barrier, every engine re-reads them); `memory` = `WeightPusher` (bucketed "
        "all-gather of the FSDP2 shards, each full tensor into the rank's engine by reference). Both end in vLLM's "
        "layer-wise reload, which on this CPU build re-creates the oneDNN GEMM handles of every linear layer: most "
        "of the tiny model's push is that reload, which no transport changes. Where we lose: `memory` holds a bucket "
        "(up to 128 MB) of gathered bytes while its tensors are handed over, so on `small` its peak is ~100 MB "
        "above the file path's, which streamed one parameter at a time; the files themselves (host memory on "
        "tmpfs) are gone.",
        "",
        f"## Share of the step: the main job (tiny default, 2 ranks), {result['steps'][0]['steps']} steps after the "
        "first",
        "",
        "| code | step s (median) | weight_sync stage s (push + probe) | push s | push / step |",
        "|---|---|---|---|---|",
    ]
    for r in result["steps"]:
        lines.append(f"| {r['code']} | {r['step_s']:.3f} | {r['weight_sync_stage_s']:.3f} | {r['push_s']:.3f} | "
                     f"{100 * r['push_share']:.1f}% |")
    proj = result["projection"]
    lines += [
        "",
        "The push is `sync/gather_s + sync/load_s` (before: `sync/export_s + sync/load_s`); the stage also runs the "
        "probe (`rollout.probe_every = 1`: a forward of the trainer's model and the engine's scoring of one response "
        "per rank).",
        "",
        "## Projection: Qwen2.5-VL-7B, bf16, 8 GPUs of one node, colocated (arithmetic, not measured)",
        "",
        f"Model {proj['model_gib']:.1f} GiB. `memory`: each rank receives {proj['gathered_per_rank_gib']:.1f} GiB of "
        f"all-gathers over NVLink (~{_LINKS['nvlink_allgather']:.0f} GB/s bus bandwidth) and hands the tensors to its "
        f"engine on the device: ~{proj['memory_s']:.2f} s, nothing through host memory. `files`: the same gathers, "
        f"then {proj['model_gib']:.1f} GiB device->host (PCIe ~{_LINKS['pcie']:.0f} GB/s), written into tmpfs "
        f"(~{_LINKS['tmpfs_write']:.0f} GB/s), re-read by every engine (~{_LINKS['tmpfs_read']:.0f} GB/s) and copied "
        f"host->device: ~{proj['files_s']:.1f} s, with {proj['files_shm_gib']:.0f} GiB of /dev/shm (two alternating "
        "folders; a container's default 64 MB /dev/shm fails).",
        "",
        f"Reproduce: `{command}`.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--model-dir", default="")
    p.add_argument("--size", default="tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--way", default="memory")
    p.add_argument("--baseline", default="0b313ec", help="the commit whose step the share compares with")
    p.add_argument("--steps", type=int, default=13)
    p.add_argument("--report-only", action="store_true")
    opts = p.parse_args()
    if opts.worker:
        worker(opts)
        return
    bench = ROOT / "benchmarks"
    command = "python scripts/bench_weight_sync.py"
    if not opts.report_only:
        baseline = subprocess.run(["git", "-C", str(ROOT), "rev-parse", opts.baseline], check=True,
                                  capture_output=True, text=True).stdout.strip()
        result = {**provenance(), "baseline": baseline,
                  "push": push_rows(["tiny", "small"], ["float32", "bfloat16"]),
                  "steps": step_rows(baseline, opts.steps), "projection": projection()}
        (bench / "weight_sync.json").write_text(json.dumps(result, indent=1))
    result = json.loads((bench / "weight_sync.json").read_text())
    (bench / "weight_sync.md").write_text(report(result, command))
    print((bench / "weight_sync.md").read_text())


if __name__ == "__main__":
    main()
