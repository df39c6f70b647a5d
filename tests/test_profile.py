"""titanrl.profile: the per-rank hardware profile (HetRL's profiler).

In process (a world of one, nothing left behind), the command line alone (with the HF engine on the tiny
checkpoint), and under torchrun with two ranks: one rank alone on a core and one sharing its core with three
busy processes must measure clearly less compute, and the pair's link must be measured; the all-to-all link
method (NCCL's) runs on gloo with two namespaced "hosts".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import fork_launch
import pytest
from train_runs import pin_wrapper

ROOT = Path(__file__).resolve().parents[1]
RANK_KEYS = {"rank", "host", "device", "device_name", "matmul_tflops", "attention_tflops", "memory_gb", "hbm_gbps",
             "gen_tokens_per_s"}


def check_schema(profile: dict, world: int) -> None:
    assert profile["version"] == 1 and profile["world_size"] == world
    assert profile["dtype"] == "float32"
    assert [r["rank"] for r in profile["ranks"]] == list(range(world))
    for r in profile["ranks"]:
        assert RANK_KEYS <= set(r), RANK_KEYS - set(r)
        assert r["host"] in profile["hosts"] and r["device"] == "cpu" and r["device_name"]
        for key in ("matmul_tflops", "attention_tflops", "memory_gb", "hbm_gbps"):
            assert isinstance(r[key], float) and r[key] > 0, (key, r[key])
        assert all(v > 0 for v in r["attention_by_seq"].values())
        assert r["cpu_affinity"]
    pairs = [(link["src"], link["dst"]) for link in profile["links"]]
    assert pairs == [(a, b) for a in range(world) for b in range(a + 1, world)]
    for link in profile["links"]:
        assert link["gbps"] > 0 and link["latency_ms"] > 0


def run(argv: list[str], *, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``argv`` to its end, started from the tests' forkserver (``fork_launch``: torchrun's ranks, or one process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = fork_launch.run(argv, env, ROOT, timeout)
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        # gloo's rare teardown abort after the work was done (see tests/test_distributed.py): once more
        proc = fork_launch.run(argv, env, ROOT, timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def torchrun(wrapper: Path, nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            str(wrapper), *args]


@pytest.fixture
def wrapper(tmp_path: Path) -> Path:
    """torchrun runs it instead of ``-m titanrl.profile`` (``train_runs.PIN_WRAPPER``): PIN_CORES, HOST_PREFIX,
    WRAP_MODULE."""
    return pin_wrapper(tmp_path)


def test_profile_ranks_in_process_leaves_nothing_behind():
    import torch
    import torch.distributed as dist

    from titanrl.profile import format_table, profile_ranks

    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    profile = profile_ranks(seconds=0.2)
    check_schema(profile, 1)
    assert profile["ranks"][0]["gen_tokens_per_s"] is None and profile["links"] == []
    assert not dist.is_initialized()
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads
    assert "matmul" in format_table(profile)
    json.dumps(profile)  # plain JSON types only


def test_cli_one_process_writes_json(tmp_path: Path):
    out = tmp_path / "profile.json"
    started = time.perf_counter()
    proc = run([sys.executable, "-m", "titanrl.profile", "--out", str(out), "--seconds", "0.3"],
               env={"OMP_NUM_THREADS": "2", "TITANRL_HOST": "box-a"})
    print(f"one process: {time.perf_counter() - started:.1f} s")
    profile = json.loads(out.read_text())
    check_schema(profile, 1)
    assert profile["hosts"] == ["box-a"]
    assert "TFLOP/s" in proc.stdout  # the table


def test_cli_engine_needs_config(tmp_path: Path):
    proc = subprocess.run([sys.executable, "-m", "titanrl.profile", "--out", str(tmp_path / "p.json"), "--engine"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--engine needs --config" in proc.stderr


@pytest.mark.slow
def test_cli_hf_engine_generation(tmp_path: Path, tiny_ckpt: Path):
    out = tmp_path / "profile.json"
    started = time.perf_counter()
    run([sys.executable, "-m", "titanrl.profile", "--out", str(out), "--seconds", "0.3", "--quiet", "--config",
         "configs/tiny_cpu.toml", "--engine", "--rollout.engine=hf", f"--model.path={tiny_ckpt}"])
    print(f"hf engine: {time.perf_counter() - started:.1f} s")
    profile = json.loads(out.read_text())
    check_schema(profile, 1)
    assert profile["ranks"][0]["gen_tokens_per_s"] > 0 and profile["engine"] == "hf"


@pytest.mark.slow
@pytest.mark.serial
def test_two_ranks_a_shared_core_measures_slower(tmp_path: Path, wrapper: Path, run_cache: Path):
    """Rank 0 alone on one core, rank 1 on another core shared with three spinning processes (so it gets about a
    quarter of it; even if something else lands on rank 0's core, rank 0 keeps about half). `titanrl.schedule` on
    that profile writes a config that trains 2 steps, each rank pinned to the core of the device the plan gives it
    (a plan on the fast rank alone is one rank)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    c0, c1 = cores[:2]
    spin = f"import os\nos.sched_setaffinity(0, {{{c1}}})\nwhile True:\n    pass\n"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(3)]
    out = tmp_path / "profile.json"
    try:
        started = time.perf_counter()
        run(torchrun(wrapper, 2, "--out", str(out), "--seconds", "0.5"), env={"PIN_CORES": f"{c0},{c1}"})
        print(f"two ranks, pinned: {time.perf_counter() - started:.1f} s")
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
    profile = json.loads(out.read_text())
    check_schema(profile, 2)
    r0, r1 = profile["ranks"]
    assert r0["cpu_affinity"] == [c0] and r1["cpu_affinity"] == [c1]
    assert r0["host"] == r1["host"] and profile["hosts"] == [r0["host"]]
    assert r0["ranks_on_host"] == 2 and r0["memory_gb"] == pytest.approx(r0["host_memory_gb"] / 2, rel=1e-3)
    assert r1["matmul_tflops"] < 0.75 * r0["matmul_tflops"], (r0["matmul_tflops"], r1["matmul_tflops"])
    link = profile["links"][0]
    assert (link["src"], link["dst"]) == (0, 1) and link["gbps"] > 0 and link["method"] == "p2p"
    plan = tmp_path / "plan.toml"
    printed = run([sys.executable, "-m", "titanrl.schedule", "--config", "configs/tiny_cpu.toml", "--profile",
                   str(out), "--out", str(plan), "--budget", "200", "--job.steps=2", "--checkpoint.enable=false",
                   f"--model.cache_dir={run_cache}", f"--job.dump_folder={tmp_path / 'run'}"]).stdout
    ranks = int(re.search(r"torchrun --nproc-per-node (\d+) ", printed).group(1))
    moved = re.findall(r"#   rank (\d+): device (\d+) ", plan.read_text())
    order = [int(d) for _, d in sorted(moved)] if moved else list(range(ranks))
    assert len(order) == ranks
    run(torchrun(wrapper, ranks, "--config", str(plan)), timeout=600,
        env={"WRAP_MODULE": "titanrl.train", "PIN_CORES": ",".join(str((c0, c1)[d]) for d in order)})
    records = (tmp_path / "run" / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records if "step/wall_s" in r] == [1, 2]


@pytest.mark.slow
def test_two_hosts_alltoall_links(tmp_path: Path, wrapper: Path):
    """The all-to-all link method (the NCCL default) on gloo, with the ranks named as two hosts."""
    out = tmp_path / "profile.json"
    started = time.perf_counter()
    run(torchrun(wrapper, 2, "--out", str(out), "--seconds", "0.1", "--link-method", "alltoall", "--link-mb", "4",
                 "--quiet"), env={"HOST_PREFIX": "node"})
    print(f"two ranks, alltoall: {time.perf_counter() - started:.1f} s")
    profile = json.loads(out.read_text())
    check_schema(profile, 2)
    assert profile["hosts"] == ["node0", "node1"] and profile["link_method"] == "alltoall"
    r0 = profile["ranks"][0]
    assert r0["ranks_on_host"] == 1 and r0["memory_gb"] == r0["host_memory_gb"]
    assert profile["links"][0]["bytes"] == 4 << 20
