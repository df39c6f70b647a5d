"""The tests' runs of ``titanrl.train`` (and of the scripts in ``tests/dist``) started from a process that has
imported the heavy third-party modules once.

Every launch of the tiny model spends ~11 s per rank importing vLLM, transformers, torch's compiler and Ray before
titanrl does anything (``python -X importtime -c "import vllm.entrypoints.llm"``), and the suite launches ~100
runs. Python's ``forkserver`` start method with a preload list imports them once per test session; each rank is
then a fork of that server. The list also holds the modules a rank imported after those (a tiny 2-rank run's
``sys.modules`` at its end, less titanrl's): measured under cProfile in a forked rank, its imports went from
2.3 s to 0.7 s and its whole run from 13.1 s to 9.4 s (2 steps, an idle machine). Names only: the server runs
``python -c`` with the default ``sys.path`` (a module of this folder would not import there) and skips a name that
fails with ImportError. The ranks of a multi-rank run are started by torchrun's own launcher
(``torch.distributed.run``'s argument parsing and ``elastic_launch``: the rendezvous, the agent, the environment),
with ``start_method="forkserver"`` instead of a fresh interpreter per rank; each rank runs its module or file as
``python -m`` / ``python file.py`` would (``runpy``). titanrl itself is imported afresh in every rank.

Used for the runs of :func:`train_runs.run` (those expected to fail too: a rank's console and its exit code are the
same; torchrun's own summary goes to the test's log) and the ``tests/dist`` launches; the tests of the launcher's
own behaviour (SIGTERM to torchrun, kill -9 of ranks) start real processes, and ``test_fork_launch`` shows a forked
run equals a fresh torchrun bit for bit.
A forked rank must end by returning or ``sys.exit``: torchrun's launcher waits for the return value of a rank that
exits 0, so one ending with ``os._exit(0)`` (``scripts/bench_load.py``'s worker: its test keeps a fresh torchrun)
would keep it waiting until the timeout kills the ranks. ``TITANRL_TEST_FORK=0`` turns it off (every run a fresh
``torchrun`` / ``python``)."""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import uuid
from multiprocessing import forkserver
from pathlib import Path

import psutil

PRELOAD = ["torch", "torch._dynamo", "torch._inductor.lowering", "transformers", "torchtitan", "ray",
           "vllm.entrypoints.llm",
           # what every rank imported after those (sys.modules at a tiny 2-rank run's end): ~1.7 s of each rank's
           # start-up (FSDP2 and DCP, torchtitan's components, vLLM's CPU worker, its model loader and the model)
           "torch.distributed.checkpoint", "torch.distributed.pipelining", "torch.distributed.tensor.experimental",
           "torch.profiler", "torchtitan.components", "torchtitan.config", "torchtitan.distributed",
           "torchtitan.protocols", "torchdata", "transformers.models.qwen2_5_vl",
           "transformers.tokenization_mistral_common", "vllm.v1.worker.cpu_worker", "vllm.model_executor.model_loader",
           "vllm.model_executor.models.qwen2_5_vl", "vllm.v1.core.sched.scheduler", "vllm.v1.sample.sampler",
           "vllm.lora.layers", "vllm.lora.worker_manager", "vllm.kernels", "compressed_tensors",
           "vllm.model_executor.layers.quantization.compressed_tensors", "vllm.entrypoints.launchers", "boto3"]


def enabled() -> bool:
    return os.environ.get("TITANRL_TEST_FORK", "1") != "0"


def _context():
    """The forkserver context; the preload list applies when the server starts (the first launch)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(target: str, argv: list[str], env: dict[str, str], cwd: str, out: str | None = None,
           err: str | None = None):
    """A rank: the run's environment, its working folder, then ``target`` as ``python -m target argv`` (a module)
    or ``python target argv`` (a ``.py`` file) would run it (its exit code)."""
    os.environ.update(env)
    os.chdir(cwd)
    # what a fresh interpreter takes from PYTHONPATH at start (a test's reward or environment module)
    for entry in reversed([e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if out is not None:  # one process: its console into files (torchrun's launcher redirects its ranks itself)
        for path, fd in ((out, 1), (err, 2)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
    if "ray" in sys.modules:  # vLLM imported Ray in the server: its native config read the server's environment
        from ray._raylet import Config

        Config.initialize("")
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:  # a fresh interpreter reads it when torch's thread pool starts; the fork's pool has not started
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = [target, *argv]
    try:
        if target.endswith(".py"):
            sys.path.insert(0, str(Path(target).resolve().parent))
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def split(argv: list[str]) -> tuple[list[str] | None, str, list[str]] | None:
    """``(torchrun's arguments or None for one process, the module or .py file, its arguments)`` of a command
    ``python -m module ...``, ``python file.py ...`` or ``python -m torch.distributed.run [options] (-m module |
    file.py) ...``; None for any other command."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] == "-m" and len(argv) > 2 and argv[2] != "torch.distributed.run":
        return None, argv[2], argv[3:]
    if argv[1].endswith(".py"):
        return None, argv[1], argv[2:]
    if argv[1:3] == ["-m", "torch.distributed.run"]:
        from torch.distributed.run import parse_args

        args = parse_args(argv[3:])
        if args.no_python or not (args.module or args.training_script.endswith(".py")):
            return None
        n = len(args.training_script_args)
        return argv[3:len(argv) - n - 1], args.training_script, argv[len(argv) - n:]
    return None


def run(argv: list[str], env: dict[str, str] | None = None, cwd: Path | str | None = None,
        timeout: float = 900) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``, with a command
    :func:`split` reads started from the forkserver (one process, or torchrun's ranks)."""
    parts = split(argv) if enabled() else None
    env = dict(os.environ) if env is None else env
    cwd = os.getcwd() if cwd is None else str(cwd)
    if parts is None:
        return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    launcher, target, target_argv = parts
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="titanrl-fork-") as tmp:
        if launcher is None:
            out, err = f"{tmp}/stdout", f"{tmp}/stderr"
            proc = ctx.Process(target=_entry, args=(target, target_argv, env, cwd, out, err))
            proc.start()
            proc.join(timeout)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
                raise subprocess.TimeoutExpired(argv, timeout)
            code = proc.exitcode
            stdout, stderr = Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace")
        else:
            code, stdout, stderr = _torchrun(launcher, target, target_argv, env, cwd, Path(tmp), timeout)
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


def _torchrun(launcher: list[str], target: str, target_argv: list[str], env: dict[str, str], cwd: str, tmp: Path,
              timeout: float) -> tuple[int, str, str]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args([*launcher, target])
    assert args.standalone, "the tests' multi-rank runs are --standalone"
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    saved = dict(os.environ)  # torchrun's launcher sets OMP_NUM_THREADS (and its own variables) in its environment
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    config.logs_specs = DefaultLogsSpecs(log_dir=str(tmp / "logs"), redirects=Std.ALL)
    _context()  # the preload list, before torch's launcher starts the server
    code = 0
    expired = threading.Event()

    def expire():  # kill -9 the server's children (this run's ranks): torchrun's launcher then ends the run
        expired.set()
        for child in psutil.Process(forkserver._forkserver._forkserver_pid).children():
            child.kill()

    timer = threading.Timer(timeout, expire)
    timer.start()
    try:
        elastic_launch(config, entrypoint=_entry)(target, target_argv, env, cwd)
    except ChildFailedError:
        code = 1  # what torchrun exits with when a rank fails
    finally:
        timer.cancel()
        os.environ.clear()
        os.environ.update(saved)
    if expired.is_set():
        raise subprocess.TimeoutExpired(["torchrun", *launcher, target, *target_argv], timeout)
    logs = [d for rank in range(config.nproc_per_node) for d in sorted(tmp.glob(f"logs/**/attempt_0/{rank}"))]
    stdout, stderr = ("".join((d / name).read_text(errors="replace") for d in logs if (d / name).exists())
                      for name in ("stdout.log", "stderr.log"))
    return code, stdout, stderr
