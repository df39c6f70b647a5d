"""Two hosts: network namespaces on a bridge, a real Ray cluster across them (head on host 0, worker on
host 1) and a two-node torchrun (one rank per host, gloo over the hosts' interfaces), as in the README's
multi-node section.

- the default config (slice-aware loading on) and FlexUlysses ``flex`` with LoRA under ``odc`` (hybrid sharding
  across the hosts) each train 3 steps and exit 0;
  frames cross hosts (``vision/frames_cross_host``) and every rank fetches whole samples from its own
  host's preprocessor (``data/ranks_fetching_same_host``); the default runs without a shared cache (each host's
  model.cache_dir on its own local disk: ``Hosts.local_dir``): every host prepares what its rank reads;
- checkpoints on local disks are refused with the reason;
- with Ray's object transfer between the hosts blocked, every rank stops within seconds of start-up
  with a line naming the rank, its host and the preprocessor's host - not after data.fetch_timeout_s
  plus job.collective_timeout_s;
- blocked mid-run, a rank's fetch fails after data.fetch_timeout_s with a line naming the samples, the
  host that holds them and the one that asked, and the other rank stops too (no collective timeout).

Skipped, with the reason, where ``ip netns`` is refused (not root). Every namespace and every process in
them is removed at the end, also when a test fails.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from netns_hosts import OBJECT_MANAGER_PORT, Hosts, HostsUnavailable  # noqa: E402

# Beside other tests: the hosts live in namespaces of their own (this machine's interfaces and routes do not change)
# and their fixed ports are theirs. Only the shaped link's measurement is serial (a measured bandwidth).
pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def hosts():
    cluster = Hosts(2)
    try:
        cluster.up()
    except HostsUnavailable as error:
        pytest.skip(f"two namespaced hosts cannot be built here: {error}")
    try:
        cluster.start_ray()
        yield cluster
    finally:
        cluster.down()


def start_on_hosts(hosts: Hosts, out: Path, cache: Path | list[Path], *overrides: str,
                   port: int, config: str = "configs/tiny_cpu.toml",
                   order: list[int] | None = None) -> list[subprocess.Popen]:
    """torchrun on every host; ``cache``: the model.cache_dir of all hosts, or one per host; ``order[r]``: the host
    node rank ``r`` runs on (default: node rank r on host r)."""
    procs = []
    order = order or list(range(len(hosts)))
    for rank, h in ((r, hosts.hosts[order[r]]) for r in range(len(hosts))):
        host_cache = cache[rank] if isinstance(cache, list) else cache
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc-per-node", "1",
                "--node-rank", str(rank), "--master-addr", hosts.hosts[order[0]].ip, "--master-port", str(port),
                "-m", "titanrl.train", "--config", config, f"--model.cache_dir={host_cache}",
                f"--job.dump_folder={out}", "--job.steps=3", f"--data.ray_address={hosts.ray_address}", *overrides]
        env = {"GLOO_SOCKET_IFNAME": h.dev, "VLLM_HOST_IP": h.ip, "OMP_NUM_THREADS": "1"}
        procs.append(h.popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[subprocess.CompletedProcess]:
    done = []
    for proc in procs:
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""))
    return done


def train_on_hosts(hosts: Hosts, out: Path, cache: Path | list[Path], *overrides: str, port: int,
                   timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """torchrun with one rank on each host; returns both hosts' finished processes."""
    return wait_all(start_on_hosts(hosts, out, cache, *overrides, port=port), timeout)


def error_line(proc: subprocess.CompletedProcess, rank: int, out: Path) -> str:
    """The host's one line naming the cause: its rank's own error, or - where another host's rank failed
    first - ``rank R stopped: rank F: <cause>``. Returned as ``error on rank F: <cause>``. ``out``: the run's
    job.dump_folder (the rank's log, whose end a failure shows)."""
    own = [x for x in proc.stdout.splitlines() if x.startswith(f"[titanrl] error on rank {rank}")]
    elsewhere = [x for x in proc.stdout.splitlines() if x.startswith(f"[titanrl] rank {rank} stopped: rank ")]
    if len(own) + len(elsewhere) != 1:
        log = out / "tiny_cpu" / "logs" / f"rank{rank}.log"
        pytest.fail(f"host {rank}'s console:\n{proc.stdout[-3000:]}\n----- {log} (end) -----\n"
                    + (log.read_text(errors="replace")[-6000:] if log.exists() else "(none)"))
    if own:
        return own[0]
    return "[titanrl] error on " + elsewhere[0].split(" stopped: ", 1)[1]


def step_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("flex", [False, True], ids=["default-local-caches", "flex+lora"])
def test_two_hosts_train_with_slice_loading(hosts, run_cache, tmp_path, flex):
    """Two hosts, one rank each, slice-aware loading through each host's preprocessor. The default config runs
    without a shared cache: each host's model.cache_dir on its own local disk, at a different path on each, so every
    host builds the tiny checkpoint and the data its rank reads and its preprocessor reads its own host's copy. The
    second variant shares one cache and runs FlexUlysses with LoRA adapters (the merged push on each host: the probe
    checks its engine after every push) under odc, which spans the hosts by hybrid sharding (each host's rank holds
    its replica; the adapters' gradients summed across the hosts once per minibatch), with SAPO weighted by the
    engine's nucleus (rl.behaviour_weight = always, top_p 0.9). The default's vision tower is frozen (after the first
    push only the language model goes to each host's engine; the probe checks it)."""
    extra = (["--parallelism.ulysses=flex", "--lora.rank=8", "--lora.alpha=16", "--balance.strategy=odc",
              "--rl.policy_loss=sapo", "--rl.behaviour_weight=always", "--rollout.top_p=0.9"] if flex
             else ["--model.freeze_vision_tower"])
    caches = run_cache if flex else [hosts.local_dir / f"cache-h{i}" for i in range(len(hosts))]
    results = train_on_hosts(hosts, tmp_path / "out", caches, *extra, port=29555 + flex)
    for rank, proc in enumerate(results):
        assert proc.returncode == 0, f"host {rank}:\n{proc.stdout[-4000:]}"
    hybrid = "odc with hybrid sharding: the models sharded over groups of 1 rank(s), each within a machine, 2 replicas"
    assert (hybrid in results[0].stdout) == flex, results[0].stdout[-3000:]
    steps = step_metrics(tmp_path / "out")
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["probe/logprob_max_diff"] <= 1e-4 for m in steps), steps
    if flex:
        assert "LoRA rank 8, alpha 16" in results[0].stdout, results[0].stdout[-3000:]
        assert all(0.5 < m["rl/behaviour_weight_mean"] < 1.0 for m in steps), steps  # the nucleus's mass, < 1
    else:
        assert "model.cache_dir" in results[0].stdout and "is not shared by every machine" in results[0].stdout
        for i, h in enumerate(hosts.hosts):
            own = h.disk / f"cache-h{i}"  # what host i's processes saw at caches[i]
            assert [p.name for p in h.disk.iterdir()] == [own.name]  # nothing of the other host's
            assert len(list(own.glob("models/*/.complete"))) == 1 and len(list(own.glob("data/*/.complete"))) == 1
    # slice-aware loading is on and some encoded frames came from the other host's preprocessor
    assert sum(m["vision/frames_cross_host"] for m in steps) > 0, steps
    assert all(m["vision/frames_fetched"] == m["vision/frames_cross_host"] + m["vision/frames_same_host"]
               for m in steps)
    # both per-node preprocessors served their own host's rank
    assert all(m["data/ranks_fetching_same_host"] == 2 for m in steps), steps
    assert all(m["data/samples_same_host"] > 0 for m in steps)


def test_checkpoints_on_local_disks_are_refused_on_every_host(hosts, tmp_path):
    """A checkpoint folder on the hosts' local disks is refused on both hosts with the reason, one line each."""
    caches = [hosts.local_dir / f"cache-h{i}" for i in range(len(hosts))]
    refused = train_on_hosts(hosts, tmp_path / "out2", caches, f"--checkpoint.folder={hosts.local_dir}/ckpt",
                             port=29560, timeout=300)
    for rank, proc in enumerate(refused):
        assert proc.returncode != 0, f"host {rank}:\n{proc.stdout[-3000:]}"
        assert "checkpoint.enable needs a checkpoint folder every machine shares" in proc.stdout, proc.stdout[-3000:]
        assert "titanrl/trainer.py" not in proc.stdout  # one line, no traceback of ours (torchrun prints its own)


def test_unreachable_object_store_fails_in_seconds_on_every_rank(hosts, run_cache, tmp_path):
    """Object transfers between the hosts blocked (a firewall on Ray's object-manager port): every rank
    ends with the named cause within seconds of start-up."""
    for i in range(len(hosts)):
        hosts.throttle_port(i, OBJECT_MANAGER_PORT)
    try:
        t0 = time.monotonic()
        results = train_on_hosts(hosts, tmp_path / "out", run_cache, "--data.fetch_timeout_s=300",
                                 "--job.collective_timeout_s=600", port=29557, timeout=300)
        elapsed = time.monotonic() - t0
    finally:
        for i in range(len(hosts)):
            hosts.unshape(i)
    for rank, proc in enumerate(results):
        assert proc.returncode != 0, f"host {rank} did not fail:\n{proc.stdout[-3000:]}"
        line = error_line(proc, rank, tmp_path / "out")
        assert "received no data from the preprocessor on host" in line, line
        assert hosts[0].ip in line and hosts[1].ip in line, line
    # start-up (~15 s here) + the reachability probe (20 s), far from 300 + 600 s
    assert elapsed < 150, elapsed


def test_fetch_blocked_mid_run_names_the_samples_and_hosts_and_stops_every_rank(hosts, run_cache, tmp_path):
    out = tmp_path / "out"
    procs = start_on_hosts(hosts, out, run_cache, "--job.steps=30", "--data.fetch_timeout_s=10",
                           "--job.collective_timeout_s=600", "--checkpoint.enable=false", port=29558)
    try:
        log = out / "tiny_cpu" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no step 2"
            time.sleep(0.5)
        for i in range(len(hosts)):
            hosts.throttle_port(i, OBJECT_MANAGER_PORT)
        t0 = time.monotonic()
        results = wait_all(procs, timeout=300)
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
        for i in range(len(hosts)):
            hosts.unshape(i)
    assert all(p.returncode != 0 for p in results)
    lines = [error_line(proc, rank, out) for rank, proc in enumerate(results)]
    named = [x for x in lines if "no data after data.fetch_timeout_s=10 s: samples [" in x]
    assert named, lines  # at least one rank's own fetch failed, naming what and where
    for line in named:
        rank = int(line.split("error on rank ")[1].split(":")[0])
        assert f"held by the preprocessor on host {hosts[1 - rank].ip}" in line, line
        assert f"asked by rank {rank} on host {hosts[rank].ip}" in line, line
    # fetch_timeout_s (10 s) and the tear-down: the other rank does not wait out its 600 s collective
    assert elapsed < 90, (elapsed, lines)


@pytest.mark.serial
def test_profile_measures_a_shaped_link_and_the_scheduler_prices_it(hosts, run_cache, tmp_path):
    """`titanrl.profile` across two namespaced hosts whose links tbf limits to 20 Mbit/s measures about that
    bandwidth between them, the scheduler's cluster takes the pair's link from it (HetRL's profiler), and the config
    `titanrl.schedule` writes on that profile trains 2 steps on the two hosts, each rank on the host the plan
    names."""
    from titanrl.hetero.cluster import cluster_from_profile

    profile = tmp_path / "profile.json"
    for i in range(2):
        hosts.shape(i, "20mbit", burst="256kbit")
    try:
        procs = []
        for rank, h in enumerate(hosts.hosts):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--node-rank", str(rank), "--master-addr", hosts[0].ip, "--master-port", "29731",
                    "-m", "titanrl.profile", "--out", str(profile), "--seconds", "0.2", "--link-mb", "2", "--quiet"]
            env = {"GLOO_SOCKET_IFNAME": h.dev, "OMP_NUM_THREADS": "1", "TITANRL_HOST": f"host{rank}"}
            procs.append(h.popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True))
        for proc in wait_all(procs, timeout=300):
            assert proc.returncode == 0, proc.stdout[-3000:]
    finally:
        for i in range(2):
            hosts.unshape(i)
    data = json.loads(profile.read_text())
    assert data["hosts"] == ["host0", "host1"]
    (link,) = data["links"]
    assert 0.01 < link["gbps"] < 0.025, link  # 20 Mbit/s less TCP and tbf overheads
    cluster = cluster_from_profile(profile)
    assert {d.host for d in cluster.devices} == {"host0", "host1"}
    assert cluster.bandwidth[0, 1] * 8 / 1e9 == pytest.approx(link["gbps"], rel=0.01)
    plan = tmp_path / "plan.toml"
    sched = subprocess.run([sys.executable, "-m", "titanrl.schedule", "--config", "configs/tiny_cpu.toml", "--profile",
                            str(profile), "--out", str(plan), "--budget", "200", "--job.steps=2",
                            "--checkpoint.enable=false"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert sched.returncode == 0, sched.stdout[-3000:] + sched.stderr[-3000:]
    assert "torchrun --nnodes 2" in sched.stdout, sched.stdout[-3000:]
    # over this link the rollout goes to a host of its own: the push crosses hosts (its store is reached at the
    # training host's address, not loopback)
    assert 'placement = "disaggregated"' in plan.read_text(), sched.stdout[-3000:]
    # the profile's device d is host d's rank; a plan that puts the rollout on device 1 names it rank 0
    moved = re.findall(r"#   rank (\d+): device (\d+) ", plan.read_text())
    order = [int(d) for _, d in sorted(moved)] if moved else [0, 1]
    results = wait_all(start_on_hosts(hosts, tmp_path / "out", run_cache, "--job.steps=2", config=str(plan),
                                      order=order, port=29733), timeout=600)
    for rank, proc in enumerate(results):
        assert proc.returncode == 0, f"rank {rank}:\n{proc.stdout[-4000:]}"
    assert [m["step"] for m in step_metrics(tmp_path / "out")] == [1, 2]
