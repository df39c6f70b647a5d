"""The tests' runs of ``titanrl.train`` started from a process that has imported the heavy third-party modules once.

Every launch of the tiny model spends ~11 s per rank importing vLLM, transformers, torch's compiler and Ray before
titanrl does anything (``python -X importtime -c "import vllm.entrypoints.llm"``), and the suite launches ~100
runs. Python's ``forkserver`` start method with a preload list imports them once per test session; each rank is
then a fork of that server. The ranks of a multi-rank run are started by torchrun's own launcher
(``torch.distributed.run``'s argument parsing and ``elastic_launch``, the rendezvous, the agent), with
``start_method="forkserver"`` instead of a fresh interpreter per rank; each rank runs ``titanrl.train.main`` as
``python -m titanrl.train`` would. titanrl itself is imported afresh in every rank (it is not preloaded).

Used for runs expected to succeed (:func:`train_runs.run` with ``check``); the tests of the launcher's own
behaviour (SIGTERM to torchrun, kill -9 of ranks, a failing rank's console) start real processes.
``TITANRL_TEST_FORK=0`` turns it off (every run a fresh ``torchrun`` / ``python``)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from multiprocessing import forkserver
from pathlib import Path

import psutil

PRELOAD = ["torch", "torch._dynamo", "torch._inductor.lowering", "transformers", "torchtitan", "ray",
           "vllm.entrypoints.llm"]
_TRAIN = ["-m", "titanrl.train"]
_started = False


def enabled() -> bool:
    return os.environ.get("TITANRL_TEST_FORK", "1") != "0"


def _context():
    global _started
    ctx = multiprocessing.get_context("forkserver")
    if not _started:
        ctx.set_forkserver_preload(PRELOAD)
        _started = True
    return ctx


def _entry(argv: list[str], env: dict[str, str], cwd: str, out: str | None = None, err: str | None = None):
    """A rank: the run's environment, its working folder, then ``titanrl.train.main`` (its exit code)."""
    os.environ.update(env)
    os.chdir(cwd)
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
    sys.argv = ["titanrl.train", *argv]
    from titanrl.train import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)


def split(argv: list[str]) -> tuple[list[str] | None, list[str]] | None:
    """``(torchrun's arguments or None for one process, titanrl.train's arguments)`` of a command made by
    :func:`train_runs.launch`, or None for any other command."""
    if argv[:1] != [sys.executable]:
        return None
    if argv[1:3] == _TRAIN:
        return None, argv[3:]
    if argv[1:3] == ["-m", "torch.distributed.run"] and "titanrl.train" in argv:
        i = argv.index("titanrl.train")
        if argv[i - 1] == "-m":
            return argv[3:i - 1], argv[i + 1:]
    return None


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess | None:
    """Run a ``titanrl.train`` command from the forkserver; None when ``argv`` is not one (run it as a process)."""
    parts = split(argv)
    if parts is None:
        return None
    launcher, train_argv = parts
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="titanrl-fork-") as tmp:
        if launcher is None:
            out, err = f"{tmp}/stdout", f"{tmp}/stderr"
            proc = ctx.Process(target=_entry, args=(train_argv, env, str(cwd), out, err))
            proc.start()
            proc.join(timeout)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
                raise subprocess.TimeoutExpired(argv, timeout)
            code = proc.exitcode
            stdout, stderr = Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace")
        else:
            code, stdout, stderr = _torchrun(launcher, train_argv, env, str(cwd), Path(tmp), timeout)
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


def _torchrun(launcher: list[str], train_argv: list[str], env: dict[str, str], cwd: str, tmp: Path,
             timeout: float):
    saved = dict(os.environ)  # torchrun's argument handling sets OMP_NUM_THREADS in the launcher's environment
    try:
        return _launch(launcher, train_argv, env, cwd, tmp, timeout)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _launch(launcher: list[str], train_argv: list[str], env: dict[str, str], cwd: str, tmp: Path, timeout: float):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    args = parse_args([*launcher, "-m", "titanrl.train"])
    assert args.standalone, "the tests' multi-rank runs are --standalone"
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
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
        elastic_launch(config, entrypoint=_entry)(train_argv, env, cwd)
    except ChildFailedError:
        code = 1  # what torchrun exits with when a rank fails
    finally:
        timer.cancel()
    if expired.is_set():
        raise subprocess.TimeoutExpired(["torchrun", *launcher, "-m", "titanrl.train", *train_argv], timeout)
    stdout = stderr = ""
    for rank in range(config.nproc_per_node):
        found = sorted(tmp.glob(f"logs/**/attempt_0/{rank}"))
        for d in found:
            stdout += (d / "stdout.log").read_text(errors="replace") if (d / "stdout.log").exists() else ""
            stderr += (d / "stderr.log").read_text(errors="replace") if (d / "stderr.log").exists() else ""
    return code, stdout, stderr
