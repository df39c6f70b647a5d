"""Meta-device build and sharded checkpoint loading (``build_parallel_model``): on 2 ranks every parameter of the
policy, the reference model and a critic equals the checkpoint read whole (the critic's new value head zeros),
each rank holding only its FSDP shard; one process loads the same model unsharded. Runs the per-rank body of
scripts/bench_load.py (which measures the host memory this saves: benchmarks/load.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_sharded_load_equals_the_checkpoint(tiny_ckpt, tmp_path, world):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(ROOT / "scripts" / "bench_load.py"), "--worker", "--ckpt", str(tiny_ckpt), "--out", str(tmp_path),
           "--mode", "meta", "--check"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"meta_w{world}_rank{r}.json").read_text()) for r in range(world)]
    for r in ranks:
        assert r["max_abs_difference"] == 0.0, r
        assert r["sharded"] == (world > 1), r
        assert r["policy_params"] > 0 and r["critic_params"] == r["policy_params"] + 1  # value head w+b, no output
    if world > 1:  # each rank holds about half of the parameters
        total = sum(r["local_param_mib"] for r in ranks)
        assert all(r["local_param_mib"] < 0.75 * total for r in ranks), ranks


@pytest.mark.slow
def test_offloaded_reference_gives_the_resident_reference_log_probs(tmp_path, run_cache):
    """rl.ref_offload: the reference model's shards in host memory (FSDP2's CPUOffloadPolicy), on 2 ranks and on one
    process (a one-rank mesh): reference and old log-probs equal the one-process run with a resident reference
    within 1e-6, and with a learning signal its parameter updates within 1e-4 of their size."""
    from train_runs import assert_same_computation, train_tiny

    base_dir, _ = train_tiny(tmp_path, run_cache, "resident", 1, shared=True)
    one_dir, _ = train_tiny(tmp_path, run_cache, "offload1", 1, "--rl.ref_offload=true")
    two_dir, _ = train_tiny(tmp_path, run_cache, "offload2", 2, "--rl.ref_offload=true")
    for other in (one_dir, two_dir):
        seen = assert_same_computation(base_dir, other, tol=1e-6)
        assert {"ref_logprobs", "old_logprobs", "update/policy"} <= set(seen), seen


OFFLOAD_PROBE = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs
from titanrl.parallel.parallelize import build_parallel_model

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
args = Qwen2_5_VLArgs.from_pretrained(sys.argv[1])
for offload in (False, True):
    model = build_parallel_model(args, sys.argv[1], device=torch.device("cpu"), dp_mesh=mesh, trainable=False,
                                 offload=offload)
    units = [m for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    flags = {p.offload_to_cpu for m in units for p in m._get_fsdp_state()._fsdp_param_group.fsdp_params}
    print(offload, len(units), sorted(flags))
dist.destroy_process_group()
"""


def test_ref_offload_puts_every_unit_under_the_cpu_offload_policy(tiny_ckpt):
    """The build that rl.ref_offload selects: every FSDP unit's parameters are offloaded (FSDP2's own flag), and
    none without it."""
    proc = subprocess.run([sys.executable, "-c", OFFLOAD_PROBE, str(tiny_ckpt)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    resident, offloaded = (line.split(" ", 2) for line in lines[:2])
    assert resident[0] == "False" and resident[2] == "[False]"
    assert offloaded[0] == "True" and offloaded[2] == "[True]" and int(offloaded[1]) > 2
