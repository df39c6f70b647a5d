"""The weight push (trainer -> rollout engines): in memory and in place, against the paths it replaced, and its share
of the step.

    python scripts/bench_weight_sync.py            # -> benchmarks/weight_sync.{json,md}

1. **The push alone**, `tiny` and `small` (random init), FSDP2 over 2 gloo ranks, each rank with its in-process vLLM
   engine (the colocated trainer's layout), model dtype float32 (the CPU default) and bfloat16:
   - ``files`` (titanrl's first path, reproduced here as it was): every parameter unsharded on its own
     (``DTensor.full_tensor``), local rank 0 writes HF safetensors shards into /dev/shm, a barrier, every engine
     re-reads them (``VLLMEngine.load_weights``) into vLLM-CPU's packed kernels (layer-wise reload);
   - ``reload`` (the push before this commit): ``titanrl.rl.weight_sync.WeightPusher``'s shards cast and all-gathered
     in buckets, each full tensor handed to the rank's own engine by reference, into vLLM-CPU's packed kernels
     through vLLM's layer-wise reload (the engine built with ``TITANRL_VLLM_KEEP_WEIGHTS=0``);
   - ``memory`` (this commit): the same transport, the engine's linear layers keeping their weights beside their
     packed kernels (``titanrl.rollout.vllm_plugin``), each tensor loaded in place by the model's ``load_weights``,
     then the kernels packed again from the new weights.
   Each way in a fresh launch (a process keeps memory it freed): seconds per push (median of 6 after one warm-up),
   peak resident memory a rank adds (sampled every 20 ms), the bytes left in /dev/shm at the push's peak, and the
   weights the engine holds beside its packed kernels.
2. **Share of the step**: the README's main job (tiny default, 2 ranks x 1 thread) for 12 steps, this commit against
   the commit named by ``--baseline`` (checked out in a temporary git worktree) and against this commit with the
   engine dropping its weights (the reload: the push before it), in one run: median step wall seconds, the rollout
   stage, the weight-sync stage (which also holds the probe of ``rollout.probe_every``), the push alone and the
   engine's load in it. The same on ``small`` (6 steps after the first), this commit both ways.
3. **Equal to the push before it**: the main job (2 ranks) for 3 steps with a learning signal (tests/signal_reward.py,
   the peak learning rate from the first step, old log-probs recomputed), per-token tensors and parameters dumped
   (``metrics.dump_tensors``), once through vLLM's reload and once in place: the largest difference of the engines'
   rollout log-probs, the old and reference log-probs and the parameters after each step, beside the size of the
   step's parameter update. ``--equality`` runs this part alone (the report names the commit of each part).
4. **7B projection** (arithmetic, not measured): bytes each way moves per push on an 8-GPU node and the seconds at
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

WAYS = ("files", "reload", "memory")
# the ways whose engine drops its weights after packing its kernels (vLLM-CPU as it is: titanrl's plugin off)
_PACKED = {"TITANRL_VLLM_KEEP_WEIGHTS": "0"}
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

    assert engine.in_place == (opts.way == "memory"), (opts.way, engine.in_place)
    way = {"files": files_way, "reload": memory_way, "memory": memory_way}[opts.way]
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
    # what the engine holds beside its packed kernels: the linear layers' kept weights (0 where vLLM dropped them)
    kept = engine.llm.apply_model(_kept_weight_bytes)[0]
    if info.rank == 0:
        shutil.rmtree(target, ignore_errors=True)
    every = [None] * info.world_size
    dist.all_gather_object(every, added)
    if info.rank == 0:
        Path(opts.out).write_text(json.dumps({
            "model": opts.size, "dtype": opts.dtype, "world": info.world_size, "way": opts.way,
            "params": sum(int(p.numel()) for p in model.parameters()),
            "push_s_median": statistics.median(seconds), "push_s": seconds, "peak_added_bytes": every,
            "shm_bytes": shm_peak, "kept_bytes": kept}))
    engine.close()
    dist.destroy_process_group()


def _kept_weight_bytes(model) -> int:
    """Bytes of the weights an engine's CPU GEMM layers hold beside their packed kernels."""
    from titanrl.rollout.vllm_plugin import cpu_gemm_layers

    return sum(m.weight.numel() * m.weight.element_size() for m in cpu_gemm_layers(model))


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
                    env = {**os.environ, "OMP_NUM_THREADS": "1", **(_PACKED if way != "memory" else {})}
                    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    rows.append(json.loads(out.read_text()))
                print(f"{size} {dtype} {way}: {rows[-1]['push_s_median']:.3f} s", flush=True)
    return rows


def step_rows(baseline: str, steps: int, small_steps: int) -> list[dict]:
    """The main job with the baseline commit's code, with this commit's and the engine dropping its weights (the
    push before it), and with this commit's; then ``small`` both ways; one after the other."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), baseline], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            runs = (("baseline " + baseline[:7], old, "tiny", _PACKED, steps),
                    ("this commit, weights dropped, reload (the push before it)", ROOT, "tiny", _PACKED, steps),
                    ("this commit", ROOT, "tiny", {}, steps),
                    ("this commit, weights dropped, reload (the push before it)", ROOT, "small", _PACKED, small_steps),
                    ("this commit", ROOT, "small", {}, small_steps))
            for k, (label, code, flavor, extra_env, n) in enumerate(runs):
                out = Path(tmp) / f"run{k}"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       "-m", "titanrl.train", "--config", str(code / "configs/tiny_cpu.toml"),
                       f"--job.steps={n}", f"--job.dump_folder={out}", "--checkpoint.enable=false",
                       "--metrics.progress=line", f"--model.flavor={flavor}"]
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code), **extra_env}
                subprocess.run(cmd, check=True, env=env, cwd=str(code), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                metrics = [json.loads(line) for line in (out / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()]
                timed = metrics[1:]  # step 1 holds the engines' first-call warm-up
                med = lambda key: statistics.median(m.get(key, 0.0) for m in timed)  # noqa: E731
                push = [m.get("sync/gather_s", m.get("sync/export_s", 0.0)) + m.get("sync/load_s", 0.0)
                        for m in timed]
                rows.append({"code": label, "model": flavor, "steps": len(timed), "step_s": med("step/wall_s"),
                             "rollout_s": med("time/rollout"), "weight_sync_stage_s": med("time/weight_sync"),
                             "push_s": statistics.median(push), "load_s": med("sync/load_s"),
                             "push_share": statistics.median(p / m["step/wall_s"] for p, m in zip(push, timed)),
                             "probe_max": max(m.get("probe/logprob_max_diff", 0.0) for m in timed),
                             "reward": timed[-1].get("reward/mean")})
                print(f"{flavor} {label}: step {rows[-1]['step_s']:.3f} s, push {rows[-1]['push_s']:.3f} s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    return rows


EQUALITY_STEPS = 3
SIGNAL = (f"--rl.reward={ROOT / 'tests' / 'signal_reward.py'}:reward", "--lr_scheduler.warmup_steps=0",
          "--lr_scheduler.decay_type=constant", "--rl.old_logprobs=recompute", "--metrics.dump_tensors")


def equality_rows() -> dict:
    """The main job both ways (reload, in place) with a learning signal and its tensors dumped; per step the largest
    differences between the two runs and the size of the step's update (``max |p_step - p_step-1|``)."""
    from titanrl.rl.dump import PER_TOKEN, load_dumps, max_differences

    dumps = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way, extra_env in (("reload", _PACKED), ("memory", {})):
            out = Path(tmp) / way
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "-m", "titanrl.train", "--config", str(ROOT / "configs/tiny_cpu.toml"),
                   f"--job.steps={EQUALITY_STEPS}", f"--job.dump_folder={out}", "--checkpoint.enable=false",
                   "--metrics.progress=line", *SIGNAL]
            env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
            subprocess.run(cmd, check=True, env=env, cwd=str(ROOT), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            dumps[way] = load_dumps(out / "tiny_cpu")
    a, b = dumps["reload"], dumps["memory"]
    rows = []
    for step in sorted(a):
        diff = max_differences(a[step], b[step])
        update = None
        if step - 1 in b:
            prev, now = b[step - 1]["params"]["policy"], b[step]["params"]["policy"]
            update = max(float((now[k] - prev[k]).abs().max()) for k in now)
        trajs = b[step]["trajectories"].values()
        rows.append({"step": step, **{k: diff[k] for k in (*PER_TOKEN, "params/policy") if k in diff},
                     "update_max": update,
                     "nonzero_advantages": sum(abs(t["advantage"]) > 0 for t in trajs), "trajectories": len(trajs)})
        print(f"equality step {step}: {rows[-1]}", flush=True)
    return {**provenance(), "rows": rows}


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
        "# Weight push: in memory and in place vs the paths before",
        "",
        "Generated by `scripts/bench_weight_sync.py` from `benchmarks/weight_sync.json` (do not edit); "
        f"{provenance_text(result)}. CPU only (not yet run on a GPU).",
        "",
        "## The push alone (2 gloo ranks x 1 thread, each with its in-process vLLM engine)",
        "",
        "| model | dtype | way | push s (median of 6) | x memory | peak added MB per rank | /dev/shm MB | "
        "engine's kept weights MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["model"], r["dtype"], r["way"]): r for r in result["push"]}
    for r in result["push"]:
        ratio = r["push_s_median"] / by[(r["model"], r["dtype"], "memory")]["push_s_median"] \
            if r["way"] != "memory" else None
        lines.append(f"| {r['model']} ({r['params'] / 1e6:.1f}M) | {r['dtype']} | {r['way']} | {r['push_s_median']:.3f} | "
                     f"{'%.2fx' % ratio if ratio else '-'} | {' / '.join(mb(b) for b in r['peak_added_bytes'])} | "
                     f"{mb(r['shm_bytes'])} | {mb(r.get('kept_bytes', 0))} |")
    lines += [
        "",
        "`files` = titanrl's first path (every parameter unsharded on its own, local rank 0 writes HF safetensors into "
        "/dev/shm, a barrier, every engine re-reads them); `reload` = the push before this commit (`WeightPusher`: "
        "bucketed all-gather of the FSDP2 shards, each full tensor into the rank's engine by reference), into "
        "vLLM-CPU's packed oneDNN kernels, whose weights vLLM drops, so only its layer-wise reload can replace them (it "
        "rebuilds every layer on every push); `memory` = this commit: the same transport into an engine whose linear "
        "layers keep their weights beside their kernels (titanrl's vLLM plugin), each tensor copied in place by the "
        "model's `load_weights` (as on CUDA), then each layer's kernel packed again from its weight. Where we lose: "
        "the engine holds its linear weights twice (the kept weights' column: host memory per engine); the gathered "
        "bucket (up to 128 MB) is held while its tensors are handed over, so on `small` the in-memory ways peak "
        "~100 MB above the file path, which streamed one parameter at a time; on `small` the push is mostly the "
        "gather (the FSDP all-gather of every parameter over gloo), which the engine side does not change.",
        "",
        "## Share of the step: the main job (2 ranks x 1 thread)",
        "",
        "| model | code | steps | step s (median) | rollout s | weight_sync stage s (push + probe) | push s | "
        "engine load s | push / step | probe max |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["steps"]:
        lines.append(f"| {r.get('model', 'tiny')} | {r['code']} | {r['steps']} | {r['step_s']:.3f} | "
                     f"{r.get('rollout_s', 0.0):.3f} | {r['weight_sync_stage_s']:.3f} | {r['push_s']:.3f} | "
                     f"{r.get('load_s', 0.0):.4f} | {100 * r['push_share']:.1f}% | {r.get('probe_max', 0.0):.1e} |")
    steps = {(r.get("model", "tiny"), r["code"]): r for r in result["steps"]}
    packed = "this commit, weights dropped, reload (the push before it)"
    lines += [
        "",
        "The push is `sync/gather_s + sync/load_s` (the baseline's: `sync/export_s + sync/load_s`); the stage also "
        "runs the probe (`rollout.probe_every = 1`: a forward of the trainer's model and the engine's scoring of one "
        "response per rank); step 1 (the engines' first call) is left out. Probe max: the largest gap between the "
        "engine's and the trainer's log-probs over the steps.",
    ]
    if ("small", packed) in steps and ("small", "this commit") in steps:
        a, b = steps[("small", packed)], steps[("small", "this commit")]
        lines += [
            "",
            f"The engines compute with the same kernels both ways (vLLM-CPU's, packed again after each push): on "
            f"`small` the rollout stage takes {b['rollout_s'] / a['rollout_s']:.2f}x the packed engine's time, the "
            f"step {b['step_s'] / a['step_s']:.2f}x. There the push in the step is mostly the gather "
            f"({b['push_s']:.2f} s against {a['push_s']:.2f} s, the engine's load {b['load_s']:.3f} s against "
            f"{a['load_s']:.3f} s): the gather varies between runs by more than the load saves. On CUDA vLLM keeps "
            "the weights and nothing is packed: the push loads in place.",
        ]
    if "equality" in result:
        eq = result["equality"]
        lines += [
            "",
            "## Equal to the push before it: the main job, 2 ranks, a learning signal",
            "",
            f"{provenance_text(eq)}. Two runs of the tiny default for {len(eq['rows'])} steps with "
            "`tests/signal_reward.py` (a reward that varies within every group), the peak learning rate from the "
            "first step, old log-probs recomputed and every tensor dumped (`metrics.dump_tensors`): one whose engines "
            "drop their weights and take each push through vLLM's reload (the push before), one loading in place. "
            "Each column: the largest absolute difference between the two runs over every token of every "
            "trajectory (or every parameter after the step's update); `update` = the largest parameter change of the "
            "step itself (in-place run), the scale the parameters' difference is to be read against.",
            "",
            "| step | trajectories (advantage != 0) | rollout log-probs | old log-probs | reference log-probs | "
            "parameters | update |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in eq["rows"]:
            upd = "-" if r["update_max"] is None else f"{r['update_max']:.2e}"
            lines.append(f"| {r['step']} | {r['trajectories']} ({r['nonzero_advantages']}) | "
                         f"{r['rollout_logprobs']:.1e} | {r['old_logprobs']:.1e} | {r['ref_logprobs']:.1e} | "
                         f"{r['params/policy']:.1e} | {upd} |")
        same = all(r[k] == 0.0 for r in eq["rows"] for k in ("rollout_logprobs", "old_logprobs", "ref_logprobs",
                                                             "params/policy"))
        lines += ["", "Bit for bit: every difference is 0." if same else
                  "Not bit for bit: see the columns (same responses: the comparison needs them and checks them)."]
    proj = result["projection"]
    lines += [
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
    p.add_argument("--small-steps", type=int, default=7)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--equality", action="store_true", help="run part 3 alone, into the existing json")
    opts = p.parse_args()
    if opts.worker:
        worker(opts)
        return
    bench = ROOT / "benchmarks"
    command = "python scripts/bench_weight_sync.py"
    if opts.equality:
        result = json.loads((bench / "weight_sync.json").read_text())
        result["equality"] = equality_rows()
        (bench / "weight_sync.json").write_text(json.dumps(result, indent=1))
    elif not opts.report_only:
        baseline = subprocess.run(["git", "-C", str(ROOT), "rev-parse", opts.baseline], check=True,
                                  capture_output=True, text=True).stdout.strip()
        result = {**provenance(), "baseline": baseline,
                  "push": push_rows(["tiny", "small"], ["float32", "bfloat16"]),
                  "steps": step_rows(baseline, opts.steps, opts.small_steps), "equality": equality_rows(),
                  "projection": projection()}
        (bench / "weight_sync.json").write_text(json.dumps(result, indent=1))
    result = json.loads((bench / "weight_sync.json").read_text())
    (bench / "weight_sync.md").write_text(report(result, command))
    print((bench / "weight_sync.md").read_text())


if __name__ == "__main__":
    main()
