"""One live run per run folder (``<job.dump_folder>/<job.name>``).

Two runs writing one folder overwrite each other's checkpoints, metrics and logs; a second launch of a
command whose first run is still going (another terminal, a forgotten tmux pane) does exactly that. The
run's rank 0 holds an exclusive ``flock`` on ``<run dir>/.lock`` for its whole life (:func:`hold`); every rank
of a new run first checks that nobody holds it (:func:`check_free`), before its logs or anything else are
written there. The kernel drops the lock when the holding process ends, however it ends (a SIGKILL
included), so no stale lock outlives a run. ``flock`` is advisory and per host: ranks on other hosts writing
their own file systems are not covered (nor do they collide).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import IO

from titanrl.config.errors import ConfigError

LOCK_NAME = ".lock"


def _busy(run_dir: Path, holder: str) -> ConfigError:
    who = f" ({holder})" if holder else ""
    return ConfigError(
        f"the run folder {run_dir} is in use by a live run{who}: two runs writing one folder overwrite each "
        "other's checkpoints and metrics. Wait for it to end, or give this run another folder "
        "(--job.dump_folder or --job.name)")


def _holder(f: IO[str]) -> str:
    f.seek(0)
    return f.read().strip()


def check_free(run_dir: Path) -> None:
    """Raise ConfigError (naming the folder and the live run's pid, host and start) when a live run holds
    ``run_dir``; return at once when it is free or does not exist yet. Takes nothing."""
    path = Path(run_dir) / LOCK_NAME
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(run_dir, _holder(f)) from None
        fcntl.flock(f, fcntl.LOCK_UN)


def hold(run_dir: Path) -> IO[str]:
    """Take ``run_dir`` for this process (rank 0) until the returned file is closed or the process ends; write
    who holds it into the lock file. ConfigError when a live run holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / LOCK_NAME, "a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(f)
        f.close()
        raise _busy(run_dir, holder) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f
