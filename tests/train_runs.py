"""Launching ``titanrl.train`` from tests: the command (one process or torchrun), its environment, a run killed
(``kill -9``) once a file appears, the references several tests share (run once per session), what a failed run's
assertion shows, and the Ray cluster the runs share.

**One Ray cluster per session.** A run without ``data.ray_address`` starts a private Ray instance on rank 0 and
shuts it down at the end (~6 s of a tiny 2-rank run here); the runs of a session instead join one head started
with Ray's own ``ray start --head`` on 127.0.0.1 (token authentication, a fresh token) the first time a run needs
it, stopped when the session ends (``conftest.pytest_sessionfinish``). That is the multi-node path users take
(``data.ray_address``, one preprocessor per node of the cluster); a test that is about the private instance
(SIGTERM under torchrun, the product surface) passes ``own_ray=True``. Under pytest-xdist the workers share one
head too (``SHARED_RAY_ENV``: the controller names a folder, the first worker to need a cluster starts it there,
the others join it, the controller stops it at the end): two heads on one machine were seen to lose a driver (one
GCS listened on 127.0.0.1 only while the driver dialled the machine's address)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import fork_launch
import psutil

ROOT = Path(__file__).resolve().parents[1]
TINY = "configs/tiny_cpu.toml"
# A learning signal for equality tests: a reward the random policy scores on (non-zero advantages) at the peak
# learning rate in every step (the tiny config warms up over 40 steps; constant: the rate does not depend on
# job.steps, so a shorter run is a prefix of a longer one).
SIGNAL = (f"--rl.reward={ROOT / 'tests' / 'signal_reward.py'}:reward", "--lr_scheduler.warmup_steps=0",
          "--lr_scheduler.decay_type=constant")
# Evaluation ([eval]) beside the training: before it and every 2 steps, 8 held-out prompts x 2 sampled responses.
# The equality tests' runs carry it, so every mode's evaluations are compared with the one-process reference's
# (``same_evaluations``), and the training they compare shows that evaluating changes nothing of it.
EVAL = ("--eval.every=2", "--eval.before_train", "--eval.n=2", "--eval.temperature=1.0", "--eval.max_prompts=8")
_SHARED: dict[tuple, Path] = {}


@dataclass
class RayCluster:
    address: str
    env: dict[str, str]  # what a driver needs to join (token authentication)
    pid: int  # ``ray start --head --block`` (its own session): SIGTERM stops the head's processes
    temp_dir: Path
    proc: subprocess.Popen | None = None  # started by this process (None: joined, another process stops it)


_CLUSTER: RayCluster | None = None
# Set by the xdist controller (conftest): the folder where the workers' one Ray head is described (cluster.json)
SHARED_RAY_ENV = "TITANRL_TEST_SHARED_RAY"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _start_head(temp_dir: Path, timeout_s: float) -> RayCluster:
    port = _free_port()
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    temp_dir.mkdir(parents=True, exist_ok=True)
    log = temp_dir / "head.log"
    # Not the variable a private instance sets in its process (``ray_runtime._local_env``, "0": every server binds
    # 127.0.0.1), left in this one by an in-process test: a head started with it listens on 127.0.0.1 only, while a
    # driver forked from the forkserver (whose Ray read its environment before) dials the machine's address
    base = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(port),
         "--node-ip-address", "127.0.0.1", "--num-cpus", str(os.cpu_count() or 1), "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={temp_dir}", "--object-store-memory", str(256 << 20)],
        env={**base, **env, "RAY_USAGE_STATS_ENABLED": "0"}, stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"ray start --head failed:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)
    return RayCluster(f"127.0.0.1:{port}", env, proc.pid, temp_dir, proc)


def ray_cluster(timeout_s: float = 120.0) -> RayCluster:
    """The session's Ray head (started on first use; under xdist, the workers' one head)."""
    global _CLUSTER
    if _CLUSTER is not None:
        assert _alive(_CLUSTER.pid), f"the session's Ray head exited ({_CLUSTER.temp_dir})"
        return _CLUSTER
    shared = os.environ.get(SHARED_RAY_ENV)
    if not shared:
        # short: Ray's socket paths must fit 107 bytes
        _CLUSTER = _start_head(Path("/tmp") / f"titanrl-test-ray-{os.getpid()}", timeout_s)
        return _CLUSTER
    folder = Path(shared)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker starts it, the others wait and join
        described = folder / "cluster.json"
        if described.exists():
            d = json.loads(described.read_text())
            _CLUSTER = RayCluster(d["address"], d["env"], d["pid"], Path(d["temp_dir"]))
        else:
            started = _start_head(folder / "ray", timeout_s)
            described.write_text(json.dumps({"address": started.address, "env": started.env, "pid": started.pid,
                                             "temp_dir": str(started.temp_dir)}))
            _CLUSTER = RayCluster(started.address, started.env, started.pid, started.temp_dir)  # not ours to stop
    return ray_cluster(timeout_s)


def _stop_head(pid: int, temp_dir: Path, proc: subprocess.Popen | None) -> None:
    try:
        os.kill(pid, signal.SIGTERM)  # ``ray start --block`` stops the head's processes on SIGTERM
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 60
    while (proc.poll() is None if proc else _alive(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if proc.poll() is None if proc else _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    if proc:
        proc.wait()
    shutil.rmtree(temp_dir, ignore_errors=True)  # the head's logs and sockets


def stop_ray_cluster() -> None:
    """This session's head, if this process started it (a worker leaves the shared one to the controller)."""
    global _CLUSTER
    if _CLUSTER is None:
        return
    cluster, _CLUSTER = _CLUSTER, None
    if cluster.proc is not None:
        _stop_head(cluster.pid, cluster.temp_dir, cluster.proc)


def stop_shared_ray_cluster(folder: Path) -> None:
    """The xdist controller, at the session's end: the head a worker started for all of them."""
    described = folder / "cluster.json"
    if described.exists():
        d = json.loads(described.read_text())
        _stop_head(d["pid"], Path(d["temp_dir"]), None)
    shutil.rmtree(folder, ignore_errors=True)


# torchrun runs this file instead of ``-m <module>`` where a test pins ranks to cores or names their hosts: it pins
# the rank to one core (PIN_CORES, by LOCAL_RANK: what ``taskset`` does) and names its host (HOST_PREFIX +
# LOCAL_RANK) before running WRAP_MODULE (default titanrl.profile) as __main__. A .py file, so that the tests' forked
# launches (fork_launch) run it too.
PIN_WRAPPER = """\
import os, runpy, sys
local = int(os.environ["LOCAL_RANK"])
if os.environ.get("PIN_CORES"):
    os.sched_setaffinity(0, {int(os.environ["PIN_CORES"].split(",")[local])})
if os.environ.get("HOST_PREFIX"):
    os.environ["TITANRL_HOST"] = os.environ["HOST_PREFIX"] + str(local)
module = os.environ.get("WRAP_MODULE", "titanrl.profile")
sys.argv[0] = module
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def pin_wrapper(folder: Path) -> Path:
    """:data:`PIN_WRAPPER` written into ``folder``."""
    path = Path(folder) / "pinned_rank.py"
    path.write_text(PIN_WRAPPER)
    return path


def launch(nproc: int | None) -> list[str]:
    """``titanrl.train`` on one process (``nproc`` None or 1: no torchrun) or under torchrun."""
    if nproc is None or nproc == 1:
        return [sys.executable, "-m", "titanrl.train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
            "titanrl.train"]


def train_cmd(out: Path, cache: Path, *overrides: str, nproc: int | None = None, config: str = TINY,
              own_ray: bool = False) -> list[str]:
    """The command of a run of ``config`` (``model.cache_dir`` ``cache``, run folders under ``out``) joining the
    session's Ray cluster (``own_ray``: its own private instance, as without ``data.ray_address``)."""
    argv = launch(nproc) + ["--config", config, f"--model.cache_dir={cache}", f"--job.dump_folder={out}"]
    if not own_ray:
        argv.append(f"--data.ray_address={ray_cluster().address}")
    return argv + list(overrides)


def run_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A run's environment: one thread per rank, and what joining the session's Ray cluster needs."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **(_CLUSTER.env if _CLUSTER else {}), **(extra or {})}


def _log_launch(argv: list[str], seconds: float) -> None:
    """``TITANRL_TEST_LAUNCH_LOG=<file>``: one JSON line per finished launch (the test, the command, its seconds), to
    see which runs the suite's time goes to."""
    path = os.environ.get("TITANRL_TEST_LAUNCH_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "seconds": round(seconds, 1),
                                "argv": argv}) + "\n")


def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 900,
        check: bool = True, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run a command (:func:`train_cmd`) to its end; ``check``: a failure fails the test (:func:`failure_report`).
    A ``titanrl.train`` run, expected to succeed or to fail, starts from the session's forkserver
    (:mod:`fork_launch`: the ranks' console and exit codes are a fresh launch's, torchrun's own lines go to the test's
    log) unless ``fresh``: then, as any other command, a new process (torchrun or python)."""
    t0 = time.monotonic()
    if not fresh:
        proc = fork_launch.run(argv, run_env(env), ROOT, timeout)
    else:
        proc = subprocess.run(argv, cwd=ROOT, env=run_env(env), capture_output=True, text=True, timeout=timeout)
    _log_launch(argv, time.monotonic() - t0)
    if check:
        assert proc.returncode == 0, failure_report(proc)
    return proc


def kill_when(argv: list[str], marker: Path, timeout: float = 600) -> int:
    """Start ``argv`` and, once ``marker`` exists, kill -9 every process of it (torchrun, its workers, each in a
    session of its own, their engines); returns its pid. Fails the test if ``marker`` never appeared."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    gone = (ProcessLookupError, psutil.NoSuchProcess)  # a process that already exited
    for child in children:
        with contextlib.suppress(*gone):
            child.kill()
    with contextlib.suppress(*gone):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), f"the run never wrote {marker}"
    return proc.pid


def kill_ranks_when(argv: list[str], marker: Path, timeout: float = 600, grace_s: float = 30.0) -> list[str]:
    """Start ``argv`` (torchrun) and, once ``marker`` exists, kill -9 its ranks only -- not the engines, reward
    workers or Ray daemons they started -- as a machine's OOM killer or a scheduler would; then wait up to ``grace_s``
    for every process of the run to end by itself, and for the shared memory they made (vLLM's message queues) to
    be unlinked. Returns the processes still alive then, and the segments the run's processes mapped when it was
    killed that no process maps but that are still there (none: each process a rank started dies with it, and its
    segments with it). Only the run's own segments count: a test beside it may be making or unlinking its own."""
    from titanrl.rollout.vllm_engine import mapped_shm_files  # imported now: the kill must follow the marker at once

    proc = subprocess.Popen(argv, cwd=ROOT, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), f"the run never wrote {marker}"
    root = psutil.Process(proc.pid)
    procs = [root, *root.children(recursive=True)]
    ranks = [p for p in procs[1:] if p.ppid() == proc.pid]
    assert ranks, "no rank processes"
    ours = mapped_shm_files("/dev/shm/psm_", (p.pid for p in procs))
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.kill()
    proc.wait(60)
    t0 = time.monotonic()
    left = alive(procs) + orphaned_segments(ours)
    while left and time.monotonic() - t0 < grace_s:
        time.sleep(0.5)
        left = alive(procs) + orphaned_segments(ours)
    return left


def orphaned_segments(segments: set[str]) -> list[str]:
    """Those of ``segments`` still in /dev/shm that no live process maps."""
    left = [s for s in segments if Path(s).exists()]
    if not left:
        return []
    from titanrl.rollout.vllm_engine import mapped_shm_files

    mapped = mapped_shm_files("/dev/shm/psm_")
    return [f"{s} (mapped by no process)" for s in sorted(left) if s not in mapped]


def started(argv: list[str], out: Path, env: dict | None = None, steps: int = 2) -> subprocess.Popen:
    """A run in the background (console captured), once ``<out>/tiny_cpu/metrics.jsonl`` holds ``steps`` more
    records than when it started (a resumed run's folder holds the earlier runs' records already)."""
    log = out / "tiny_cpu" / "metrics.jsonl"
    before = len(log.read_text().splitlines()) if log.exists() else 0
    proc = subprocess.Popen(argv, cwd=ROOT, env=run_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 600
    while not (log.exists() and len(log.read_text().splitlines()) >= before + steps):
        assert proc.poll() is None and time.monotonic() < deadline, f"the run never reached {steps} more step(s)"
        time.sleep(0.1)
    return proc


def alive(procs: list) -> list[str]:
    """The processes of ``procs`` still running (zombies count as ended), described."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


def run_tiny(out: Path, cache: Path, nproc: int, *overrides: str, timeout: float = 1200, config: str = TINY) -> Path:
    """``titanrl.train`` on ``configs/tiny_cpu.toml`` (or ``config``, a job named tiny_cpu) with ``overrides``, its
    run folder under ``out``; returns the run folder (a failed run fails the test with :func:`failure_report`)."""
    run(train_cmd(out, cache, *overrides, nproc=nproc, config=config), timeout=timeout)
    return Path(out) / "tiny_cpu"


def shared_run(cache: Path, nproc: int, *overrides: str) -> Path:
    """A reference run several tests compare against (:func:`run_tiny`): made once per session under ``cache`` and
    reused by every test that asks for the same one. Returns its run folder."""
    key = (str(cache), nproc, overrides)
    if key not in _SHARED:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")  # xdist's workers share the cache folder
        _SHARED[key] = run_tiny(Path(cache) / "shared_runs" / f"{worker}-run{len(_SHARED)}", cache, nproc, *overrides)
    return _SHARED[key]


def train_tiny(tmp_path, cache, name, nproc, *extra, shared: bool = False, config: str = TINY):
    """``titanrl.train`` on the tiny CPU config (2 steps, tensors dumped, old log-probs recomputed, video-heavy,
    4 prompts, 2 minibatches, 300 tokens per microbatch, a learning signal: ``SIGNAL``) with ``nproc`` ranks (1: no torchrun) and ``extra``
    overrides; returns the run folder (``titanrl.rl.dump.load_dumps`` reads it) and its metric records.
    ``shared``: a reference other tests use too (:func:`shared_run`), run once per session."""
    common = ["--job.steps=2", "--checkpoint.enable=false", "--metrics.dump_tensors", "--rl.old_logprobs=recompute",
              "--rl.minibatches=2", "--rl.global_batch_size=4", "--data.mixture=video-heavy",
              "--balance.max_tokens_per_microbatch=300", *SIGNAL]
    if shared:
        run_dir = shared_run(cache, nproc, *common, *extra)
    else:
        run_dir = run_tiny(tmp_path / name, cache, nproc, *common, *extra, config=config)
    return run_dir, metric_records(run_dir)


def assert_same_computation(a_dir: Path, b_dir: Path, *, tol: float = 1e-5, update_rtol: float = 1e-4,
                            fields: tuple[str, ...] | None = None, steps: int | None = None,
                            b_subset: bool = False) -> dict:
    """Two runs' dumps (``metrics.dump_tensors``) computed the same thing, in steps that learn:

    - the same responses, and every per-token field (log-probs, values, returns, advantages) within ``tol`` in the
      first step (the same weights, computed in another order) and ``10 tol`` after it (the weights then differ by
      their updates' rounding: measured up to 1.1e-5 on log-probs for shared-prefix packing against none, 2
      steps at the peak learning rate);
    - every step has non-zero advantages on at least a quarter of its responses (a policy-gradient term);
    - each step after the first moves the parameters of every dumped model (``theta_after - theta_before``) by a
      real update (largest element > 1e-4), and the two runs' updates differ by at most ``update_rtol`` of its size,
      in norm over the model: ||delta_a - delta_b|| <= update_rtol ||delta_a|| (measured ~7e-6 for 4 ranks against
      1). Not element-wise: a few tensors (the attention key bias here) get gradients near rounding level, which
      AdamW's normalisation turns into steps of full size and either sign (up to ~7e-4 of that tensor's update
      norm apart here).

    ``b_subset``: ``b`` left some responses out of its model stages (a node of its workflow dropped them): the
    per-token fields are compared over the responses ``b`` computed old log-probs for.

    Returns the largest differences seen (per-token fields absolute, ``update/<model>`` relative)."""
    from titanrl.rl.dump import PER_TOKEN, load_dumps, max_differences

    a, b = load_dumps(Path(a_dir)), load_dumps(Path(b_dir))
    # ``a`` may be a longer reference (``reference_run``): the steps ``b`` ran are compared
    assert sorted(b) == sorted(a)[:len(b)] and len(b) >= 2, (sorted(a), sorted(b))
    if steps is not None:
        assert len(b) == steps, sorted(b)
    a = {step: a[step] for step in b}
    if b_subset:
        for step in b:
            keep = {k for k, rec in b[step]["trajectories"].items() if "old_logprobs" in rec}
            assert 0 < len(keep) < len(b[step]["trajectories"]), (step, len(keep))
            for side in (a[step], b[step]):
                side["trajectories"] = {k: v for k, v in side["trajectories"].items() if k in keep}
    seen: dict[str, float] = {}
    for step in sorted(a):
        diff = max_differences(a[step], b[step], fields or PER_TOKEN)
        bound = tol if step == min(a) else 10 * tol
        for k, v in diff.items():
            if not k.startswith("params/"):
                assert v <= bound, (step, k, v, diff)
                seen[k] = max(seen.get(k, 0.0), v)
        # the trajectory's advantage (GRPO), or its largest per-token one (PPO's GAE)
        advantages = [float(abs(t["advantages"]).max()) if "advantages" in t else abs(t["advantage"])
                      for t in a[step]["trajectories"].values()]
        assert sum(x > 1e-6 for x in advantages) >= len(advantages) / 4, (step, advantages[:16])
    ordered = sorted(a)
    for before, after in zip(ordered, ordered[1:]):
        for model in a[after]["params"]:
            pa0, pa1, pb0, pb1 = (a[before]["params"][model], a[after]["params"][model],
                                  b[before]["params"][model], b[after]["params"][model])
            largest = max(float((pa1[k] - pa0[k]).abs().max()) for k in pa1)
            assert largest > 1e-4, f"step {after}: {model} barely moved (largest update {largest:.3g})"
            size = sum(float((pa1[k] - pa0[k]).double().pow(2).sum()) for k in pa1) ** 0.5
            gap = sum(float(((pa1[k] - pa0[k]) - (pb1[k] - pb0[k])).double().pow(2).sum()) for k in pa1) ** 0.5
            assert gap <= update_rtol * size, (f"step {after}: {model}'s updates differ by {gap:.3g} in norm, "
                                               f"{gap / size:.3g} of the update's norm {size:.3g}")
            seen[f"update/{model}"] = max(seen.get(f"update/{model}", 0.0), gap / size)
    evals = same_evaluations(a_dir, b_dir, last=max(b))
    if evals:
        seen["evaluations"] = float(len(evals))
    return seen


def evaluations(run_dir: Path) -> dict[int, list[dict]]:
    """A run's evaluations ([eval]): step -> every response as scored (``eval/step-<N>.jsonl``)."""
    folder = Path(run_dir) / "eval"
    return {int(f.stem.removeprefix("step-")): [json.loads(line) for line in f.read_text().splitlines()]
            for f in sorted(folder.glob("step-*.jsonl"))} if folder.is_dir() else {}


def same_evaluations(a_dir: Path, b_dir: Path, last: int | None = None) -> list[int]:
    """Both runs evaluated at the same steps (up to ``last``) the same responses with the same rewards, and logged
    the same ``eval/*`` metrics (but the seconds); returns those steps."""
    a, b = evaluations(a_dir), evaluations(b_dir)
    steps = [s for s in sorted(a) if last is None or s <= last]
    assert steps == sorted(b), (sorted(a), sorted(b))
    ma, mb = metrics(a_dir), metrics(b_dir)
    for step in steps:
        assert a[step] == b[step], (step, a[step][:4], b[step][:4])
        ka = {k: v for k, v in ma[step].items() if k.startswith("eval/") and k != "eval/seconds"}
        kb = {k: v for k, v in mb[step].items() if k.startswith("eval/") and k != "eval/seconds"}
        assert ka == kb and ka["eval/responses"] > 0, (step, ka, kb)
    return steps


# The one-process reference the equality tests of several modes compare against (run once per session): 4 steps with
# a learning signal, old log-probs recomputed, 2 minibatches, tensors dumped. A mode's run with the same overrides
# (and at most 4 steps) must compute the same numbers.
REFERENCE = ("--job.steps=4", "--checkpoint.enable=false", "--metrics.dump_tensors", "--rl.old_logprobs=recompute",
             "--rl.minibatches=2", *SIGNAL, *EVAL)


def reference_run(cache: Path) -> Path:
    """The run folder of the shared one-process reference (``REFERENCE``)."""
    return shared_run(cache, 1, *REFERENCE)


# PPO's one-process reference (the critic, GAE, the video mixture, torch's fused AdamW), shared the same way by the
# 4-rank PPO test and the compiled trainer's test.
PPO_REFERENCE = ("--rl.algorithm=ppo", "--job.steps=3", "--checkpoint.enable=false", "--metrics.dump_tensors",
                 "--rl.old_logprobs=recompute", "--rl.minibatches=2", "--rl.global_batch_size=4",
                 "--data.mixture=video-heavy", "--optimizer.implementation=fused", *SIGNAL)


def ppo_reference_run(cache: Path) -> Path:
    """The run folder of the shared one-process PPO reference (``PPO_REFERENCE``)."""
    return shared_run(cache, 1, *PPO_REFERENCE)


def metric_records(run_dir: Path) -> list[dict]:
    """A run's ``metrics.jsonl``, one record per line (a resumed run logs its steps again)."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def metrics(run_dir: Path) -> dict[int, dict]:
    """step -> the last record logged for it."""
    return {rec["step"]: rec for rec in metric_records(run_dir)}


def failure_report(proc: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """A failed ``titanrl.train`` run: the ends of its stdout and stderr, then of every rank's log under the
    command's ``--job.dump_folder`` (a rank that hung writes its threads' stacks there when another rank fails:
    ``titanrl.workflow.abort``)."""
    parts = [proc.stdout[-tail:], proc.stderr[-tail:]]
    folders = [a.split("=", 1)[1] for a in proc.args if isinstance(a, str) and a.startswith("--job.dump_folder=")]
    for folder in folders:
        for log in sorted(Path(folder).glob("*/logs/rank*.log")):
            parts.append(f"\n----- {log} (end) -----\n" + log.read_text(errors="replace")[-tail:])
    return "".join(parts)
