"""What a person sees on the console, and where everything else goes.

A training rank hosts vLLM, Ray's driver, torch and their logs; on a multi-rank run they drown the
progress line (vLLM alone logs several lines per rank per weight push). ``route_output`` moves the
process's own stdout and stderr file descriptors to ``<run dir>/logs/rank<N>.log`` - at the fd
level, so C++ logs, child processes and libraries that captured ``sys.stdout`` early are caught
too - and keeps a private copy of the original console for titanrl's own messages (``say``).
``metrics.verbose = true`` leaves the descriptors alone (everything on the console, as without
titanrl), which is also what happens before the run directory is known.

Every ``say`` line is also written to the rank's log, so the log alone tells the whole story.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import TextIO

_console_out: TextIO | None = None
_console_err: TextIO | None = None
_log_path: Path | None = None


def route_output(log_dir: Path, rank: int) -> Path:
    """Send this process's fds 1 and 2 to ``log_dir/rank<rank>.log``; ``say`` keeps the console."""
    global _console_out, _console_err, _log_path
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank{rank}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    if _console_out is None:
        _console_out = os.fdopen(os.dup(1), "w", buffering=1)
        _console_err = os.fdopen(os.dup(2), "w", buffering=1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # sys.stdout/sys.stderr keep their fds (1, 2); make them line-buffered so the log stays in order.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
    _log_path = path
    return path


def log_path() -> Path | None:
    """This rank's log file, or None when output is not routed (verbose, or before the run starts)."""
    return _log_path


def say(message: str, *, error: bool = False, log_only: bool = False) -> None:
    """A titanrl message for the person at the console (and, when routed, for the rank's log); ``log_only``:
    the rank's log alone (stderr when not routed)."""
    if log_only:
        print(message, file=sys.stderr if _console_out is None else sys.stdout, flush=True)
        return
    if _console_out is None:
        print(message, file=sys.stderr if error else sys.stdout, flush=True)
        return
    print(message, file=sys.stdout, flush=True)  # the log
    stream = _console_err if error else _console_out
    print(message, file=stream, flush=True)


def refuse(message: str) -> int:
    """A refusal every rank of a host meets before the run starts (a config error, a run folder in use): the host's
    first rank says it, the others wait for torchrun to end them once that rank has exited, so the console holds it
    once and not once per rank, written over each other. Returns the exit code, 2."""
    if int(os.environ.get("LOCAL_RANK", "0")):
        time.sleep(3)
    say(message, error=True)
    return 2


def report_exception(err: BaseException, *, rank: int, expected: bool, verbose: bool, console: bool = True) -> None:
    """End a run that raised: the traceback always goes to the rank's log (or stderr); the console
    gets one named line for errors the user can fix (``expected``: bad config, bad sample, bad
    reward function, unreachable Ray) and the traceback too for anything else (a bug of ours).
    ``console=False``: the log alone (an error that is the consequence of another rank's failure)."""
    text = "".join(traceback.format_exception(err))
    cause = describe(err)
    if not console:
        print(text, file=sys.stderr, flush=True)  # the log, or stderr when not routed
        return
    if _console_out is None:  # not routed: stderr is the console
        print(text if (verbose or not expected) else "", end="", file=sys.stderr, flush=True)
        print(f"[titanrl] error on rank {rank}: {cause}", file=sys.stderr, flush=True)
        return
    print(text, file=sys.stderr, flush=True)  # the log
    if not expected:
        print(text, end="", file=_console_err, flush=True)
    where = f" (traceback in {_log_path})" if expected else ""
    print(f"[titanrl] error on rank {rank}: {cause}{where}", file=_console_err, flush=True)


def describe(err: BaseException) -> str:
    """The error's message, or its type where the message is empty (``EOFError()``, ``KeyboardInterrupt``)."""
    return str(err) or type(err).__name__
