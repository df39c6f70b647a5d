"""Host memory of one weight push (trainer -> rollout engines), per rank.

    python scripts/bench_weight_sync.py        # -> benchmarks/weight_sync.{json,md}

The `small` model (random init) under FSDP2 on 2 gloo ranks, what the trainer does in a push, without
the engine reload: the weights become an HF directory in /dev/shm written by one rank per machine.
Each way in its own launch (a process keeps memory it freed), each measured as the peak resident memory a rank adds while it runs
(sampled every 20 ms) and the bytes of the files it leaves in /dev/shm (shared memory: host RAM too):

- ``full_state_dict``: what a user of torch's DCP API writes (and titanrl did before): every rank
  materialises ``get_model_state_dict(full_state_dict=True)`` in fp32 on the host, rank 0 saves it;
- ``full_state_dict, cpu_offload``: the same API at its best (``StateDictOptions(cpu_offload=True)``, what
  torch documents for saving a full state dict: every tensor is gathered, only rank 0 keeps it, on the host);
- ``streamed`` (titanrl's ``write_hf``): one parameter at a time is unsharded, cast to the parameter
  dtype, kept only by the writer, which flushes a shard to the file every ``SHARD_BYTES``; run with
  the default shard budget and with a budget below the model's size (the bound at work).

The 7B projection uses the shapes of Qwen2.5-VL-7B (``configs/qwen2_5_vl_7b.toml``'s model): bytes per
rank of each way on an 8-rank node, bf16 parameters.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_common import provenance, provenance_text  # noqa: E402

# Qwen2.5-VL-7B-Instruct: text 28 layers x 3584 (18944 MLP, 28 q / 4 kv heads of 128), vocab 152064 (untied),
# vision 32 blocks x 1280 (3420 MLP) + merger to 3584.
WAYS = ("full_state_dict", "full_state_dict, cpu_offload", "streamed", "streamed, 8 MB shards")
_7B = {"params": 8_292_166_656, "largest_tensor": 152064 * 3584, "ranks_per_node": 8}


def worker(opts) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from bench_common import PeakRSS
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, save_hf_checkpoint
    from titanrl.parallel.parallelize import parallelize_qwen2_5_vl
    from titanrl.models.qwen2_5_vl.state_dict_adapter import clean_name
    from titanrl.rl.weight_sync import SHARD_BYTES, write_hf

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args = Qwen2_5_VLArgs.from_pretrained(Path(opts.model_dir))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[opts.dtype]
    torch.manual_seed(0)
    model = Qwen2_5_VLModel(args)
    model.init_weights()
    # as the trainer: fp32 master parameters sharded by FSDP2, compute (and file) in ``dtype``
    model = parallelize_qwen2_5_vl(model, dp_mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)),
                                   param_dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    rows = []

    def full_state_dict_way(target: Path, cpu_offload: bool = False) -> None:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
        state = {clean_name(k): v.detach().to("cpu", torch.float32) for k, v in state.items()}
        if rank == 0:
            save_hf_checkpoint(state, args, target, dtype=dtype)
        del state

    ways = [("full_state_dict", full_state_dict_way, None),
            ("full_state_dict, cpu_offload", lambda t: full_state_dict_way(t, cpu_offload=True), None),
            ("streamed", lambda t: write_hf(model, args, t, dtype=dtype, writer_rank=rank == 0, assets_from=None),
             SHARD_BYTES),
            ("streamed, 8 MB shards",
             lambda t: write_hf(model, args, t, dtype=dtype, writer_rank=rank == 0, assets_from=None,
                                shard_bytes=8 << 20), 8 << 20)]
    name, way, shard = next(w for w in ways if w[0] == opts.way)
    target = shm / f"titanrl-bench-sync-{os.getppid()}"
    dist.barrier()
    memory = PeakRSS()
    t0 = time.perf_counter()
    way(target)
    dist.barrier()
    seconds = time.perf_counter() - t0
    added = memory.stop()
    files = sum(p.stat().st_size for p in target.glob("*.safetensors")) if rank == 0 else 0
    every = [None] * world
    dist.all_gather_object(every, added)
    rows.append({"way": name, "shard_bytes": shard, "peak_added_bytes": every, "file_bytes": files,
                 "seconds": seconds})
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(target, ignore_errors=True)
    if rank == 0:
        largest = max(p.numel() for p in model.parameters())
        Path(opts.out).write_text(json.dumps({"world": world, "dtype": opts.dtype, "params": params,
                                              "largest_tensor": largest, "rows": rows}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def projection(dtype_bytes: int, shard_bytes: int) -> dict[str, float]:
    p, largest, ranks = _7B["params"], _7B["largest_tensor"], _7B["ranks_per_node"]
    return {
        "full_state_dict per rank": p * 4,
        "full_state_dict per node (+ file)": p * 4 * ranks + p * dtype_bytes,
        "full_state_dict, cpu_offload writer rank": p * 4,
        "full_state_dict, cpu_offload per node (+ file)": p * 4 + p * dtype_bytes,
        "streamed writer rank": shard_bytes + largest * dtype_bytes,
        "streamed other rank": largest * dtype_bytes,
        "streamed per node (+ file)": shard_bytes + ranks * largest * dtype_bytes + p * dtype_bytes,
    }


def report(result: dict, command: str) -> str:
    from titanrl.rl.weight_sync import SHARD_BYTES

    mb = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    gb = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
    lines = [
        "# Weight push: host memory per rank",
        "",
        "Generated by `scripts/bench_weight_sync.py` from `benchmarks/weight_sync.json` (do not edit).",
        f"The `small` model ({result['params'] / 1e6:.1f}M parameters, {result['dtype']}, largest tensor "
        f"{result['largest_tensor'] / 1e6:.1f}M elements), FSDP2 on {result['world']} gloo ranks, one machine: the "
        f"weights become an HF directory in /dev/shm written by rank 0 ({provenance_text(result)}). Peak resident memory each rank adds during "
        "the push (sampled every 20 ms; each way in a fresh launch); the files are host memory too (tmpfs).",
        "",
        "| way | shard budget MB | peak added MB per rank | files in /dev/shm MB | push s (wall) |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        shard = "-" if row["shard_bytes"] is None else mb(row["shard_bytes"])
        secs = f"{row['seconds']:.2f}" if "seconds" in row else "-"
        lines.append(f"| {row['way']} | {shard} | {' / '.join(mb(b) for b in row['peak_added_bytes'])} | "
                     f"{mb(row['file_bytes'])} | {secs} |")
    proj = projection(2, SHARD_BYTES)
    lines += [
        "",
        "`full_state_dict` = `get_model_state_dict(full_state_dict=True)` in fp32 on every rank, rank 0 saves (the "
        "DCP-API way, and titanrl's push before); `full_state_dict, cpu_offload` = the same with "
        "`StateDictOptions(cpu_offload=True)`, the baseline at its documented best: only rank 0 keeps the gathered "
        "fp32 tensors; `streamed` = `titanrl.rl.weight_sync.write_hf`: one parameter "
        "unsharded at a time, cast to the parameter dtype, kept by the writer only, a shard flushed every budget.",
        "",
        "## Projection: Qwen2.5-VL-7B, bf16 parameters, 8 ranks on a node",
        "",
        f"{_7B['params'] / 1e9:.2f}B parameters; largest tensor (embedding / lm_head) {_7B['largest_tensor'] / 1e6:.0f}M "
        f"elements; shard budget {mb(SHARD_BYTES)} MB. (On GPUs the non-writers' unsharded tensor lives in GPU "
        "memory, not on the host.)",
        "",
        "| | GB |",
        "|---|---|",
        *[f"| {k} | {gb(v)} |" for k, v in proj.items()],
        "",
        f"Reproduce: `{command}`.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--model-dir", default="")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--way", default="streamed")
    opts = p.parse_args()
    if opts.worker:
        worker(opts)
        return
    bench = ROOT / "benchmarks"
    command = "python scripts/bench_weight_sync.py"
    if not opts.report_only:
        from titanrl.models.make_tiny import make_tiny_checkpoint

        model_dir = Path(os.path.expanduser("~/.cache/titanrl/models/qwen2_5_vl_small_seed0"))
        if not (model_dir / "config.json").is_file():
            make_tiny_checkpoint(model_dir, size="small", seed=0)
        result = None
        for way in WAYS:  # each in a fresh launch: a process's freed memory is not returned to the OS
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "r.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       __file__, "--worker", "--out", str(out), "--model-dir", str(model_dir), "--dtype", opts.dtype,
                       "--way", way]
                subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                one = json.loads(out.read_text())
            if result is None:
                result = {**one, **provenance()}
            else:
                result["rows"] += one["rows"]
        (bench / "weight_sync.json").write_text(json.dumps(result, indent=1) + "\n")
    result = json.loads((bench / "weight_sync.json").read_text())
    (bench / "weight_sync.md").write_text(report(result, command))
    print((bench / "weight_sync.md").read_text())


if __name__ == "__main__":
    main()
