"""Host memory while loading a checkpoint: meta-device build + per-rank shard reads vs a full model on every rank.

    python scripts/bench_load.py            # writes benchmarks/load.{json,md}

For the ``small`` random checkpoint (titanrl.models.make_tiny) on 1, 2 and 4 ranks (torchrun, gloo, one
thread each), every rank builds the policy and the reference model as the trainer does and reports its peak
resident memory during the build (sampled every 2 ms) minus its resident memory before it:

- ``meta``: ``titanrl.parallel.parallelize.build_parallel_model`` -- built on the meta device, FSDP2-sharded,
  ``to_empty``, and each rank reads only its own rows of every tensor (safetensors slices);
- ``full`` (the baseline, what the trainer did before): the whole fp32 model built on every rank and the
  whole checkpoint read, then sharded.

Each run first checks that the loaded shards equal the full checkpoint (every parameter's ``full_tensor()``
against the tensors read whole through the state-dict adapter), for the policy and a critic.
``--worker`` is the per-rank body (tests/test_sharded_load.py runs it too).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from bench_common import PeakRSS, provenance, provenance_text  # noqa: E402
WORLDS = (1, 2, 4)


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def worker(args: argparse.Namespace) -> None:
    import torch

    from titanrl.distributed import build_dp_mesh, init_distributed, shutdown
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel
    from titanrl.models.qwen2_5_vl.state_dict_adapter import (Qwen2_5_VLStateDictAdapter, clean_name,
                                                              read_hf_safetensors)
    from titanrl.parallel.parallelize import build_parallel_model, parallelize_qwen2_5_vl

    torch.set_num_threads(1)
    info = init_distributed(300)
    mesh = build_dp_mesh(info)
    margs = Qwen2_5_VLArgs.from_pretrained(args.ckpt)
    out: dict = {"rank": info.rank, "world": info.world_size, "mode": args.mode}
    gc.collect()
    out["rss_before_mib"] = rss_mib()
    sampler = PeakRSS(interval_s=0.002)  # every 2 ms: ru_maxrss would be the whole process's peak
    try:
        if args.mode == "meta":
            policy = build_parallel_model(margs, args.ckpt, device=info.device, dp_mesh=mesh)
            ref = build_parallel_model(margs, args.ckpt, device=info.device, dp_mesh=mesh, trainable=False)
        else:  # the previous trainer: a full model per rank, the whole checkpoint read, then sharded
            models = []
            for trainable in (True, False):
                model = Qwen2_5_VLModel(margs)
                # the previous load: the whole checkpoint read into host memory, renamed, copied in
                ours = Qwen2_5_VLStateDictAdapter(margs).from_hf(read_hf_safetensors(args.ckpt))
                model.load_state_dict({k: t.float() for k, t in ours.items()}, strict=True)
                del ours
                if not trainable:
                    model.requires_grad_(False)
                models.append(parallelize_qwen2_5_vl(model, dp_mesh=mesh))
                del model
            policy, ref = models
    finally:
        out["load_mib"] = sampler.stop() / 2**20
    out["after_mib"] = rss_mib()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in policy.parameters())
    out["local_param_mib"] = local * 4 / 2**20
    if args.check:
        full = Qwen2_5_VLStateDictAdapter(margs).from_hf(read_hf_safetensors(args.ckpt))
        critic = build_parallel_model(margs, args.ckpt, device=info.device, dp_mesh=mesh, value_head=True)
        worst = 0.0
        for name, model in (("policy", policy), ("reference", ref), ("critic", critic)):
            for pname, p in model.named_parameters():
                pname = clean_name(pname)
                value = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                expected = torch.zeros_like(value) if pname.startswith("value_head.") else full[pname].float()
                worst = max(worst, float((value.detach().float() - expected).abs().max()))
            out[f"{name}_params"] = len(list(model.parameters()))
        out["max_abs_difference"] = worst
        out["sharded"] = any(hasattr(p, "to_local") for p in policy.parameters())
    Path(args.out, f"{args.mode}_w{info.world_size}_rank{info.rank}.json").write_text(json.dumps(out))
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads may still be joinable at interpreter exit ("terminate called ..." aborts)


def launch(ckpt: Path, out: Path, world: int, mode: str, check: bool) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(Path(__file__).resolve()), "--worker", "--ckpt", str(ckpt), "--out", str(out), "--mode", mode]
    if check:
        cmd.append("--check")
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} x{world} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"{mode}_w{world}_rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt")
    ap.add_argument("--out")
    ap.add_argument("--mode", choices=["meta", "full"], default="meta")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--size", default="small")
    ap.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    ap.add_argument("--work", default="/tmp/titanrl_bench_load")
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks"))
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from titanrl.models.make_tiny import make_tiny_checkpoint

    prov = provenance()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"model_{args.size}"
    if not (ckpt / "config.json").is_file():
        make_tiny_checkpoint(ckpt, size=args.size, seed=0)
    ckpt_mib = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 2**20
    rows = []
    for world in args.worlds:
        for mode in ("full", "meta"):
            ranks = launch(ckpt, work, world, mode, check=mode == "meta")
            rows.append({"world": world, "mode": mode, "ranks": ranks})
            print(world, mode, [round(r["load_mib"]) for r in ranks], flush=True)
    result = {**prov, "size": args.size, "checkpoint_mib": ckpt_mib, "rows": rows}
    out_dir = Path(args.out_dir)
    (out_dir / "load.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Host memory while loading the policy and the reference model",
        "",
        f"Measured: {provenance_text(result)}. Written by `scripts/bench_load.py`; never hand-edited.",
        "",
        f"The `{args.size}` random Qwen2.5-VL checkpoint ({ckpt_mib:.0f} MiB of safetensors), policy + reference",
        "built as the trainer builds them, torchrun on gloo (CPU). `load MiB`: a rank's peak resident memory during",
        "the build minus its resident memory before it (the largest rank). `meta`: meta-device build, FSDP2",
        "shards, each rank reading its own rows (`build_parallel_model`); `full`: the previous path, the whole",
        "fp32 model and checkpoint on every rank, then sharded. Every `meta` run also checked its shards",
        "against the whole checkpoint (max abs difference, policy, reference and critic).",
        "",
        "| ranks | full: load MiB | meta: load MiB | meta / full | meta: own parameters MiB | shards = checkpoint |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    by = {(r["world"], r["mode"]): r["ranks"] for r in rows}
    for world in args.worlds:
        full, meta = by[(world, "full")], by[(world, "meta")]
        f, m = max(r["load_mib"] for r in full), max(r["load_mib"] for r in meta)
        diff = max(r["max_abs_difference"] for r in meta)
        lines.append(f"| {world} | {f:.0f} | {m:.0f} | {m / f:.2f} | {meta[0]['local_param_mib']:.0f} | "
                     f"max abs difference {diff:g} |")
    lines += ["", "Resident memory counts pages touched; the safetensors files are memory-mapped, so the page cache",
              "a rank reads through is counted while mapped. One machine holds every rank here: the total over ranks",
              "is what a node with that many GPUs would need."]
    (out_dir / "load.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
