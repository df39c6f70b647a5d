"""The console a user reads: output routing, the end-of-run summary, error lines, plots."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import fork_launch
import pytest

from titanrl.metrics import format_summary
from titanrl.plot import main as plot_main

_ROUTED = textwrap.dedent("""
    import os, subprocess, sys, warnings
    from pathlib import Path
    from titanrl.console import route_output, say, report_exception
    route_output(Path(sys.argv[1]), rank=3)
    print("python print")
    os.write(2, b"raw fd 2 write\\n")
    subprocess.run([sys.executable, "-c", "print('child process print')"], check=True)
    warnings.warn("a library warning")
    say("[titanrl] our line")
    try:
        raise ValueError("bad sample 'x-1'")
    except ValueError as err:
        report_exception(err, rank=3, expected=True, verbose=False)
    try:
        raise KeyError("a bug of ours")
    except KeyError as err:
        report_exception(err, rank=3, expected=False, verbose=False)
    try:
        raise EOFError()
    except EOFError as err:
        report_exception(err, rank=3, expected=True, verbose=False)
""")


def test_routed_output_keeps_only_titanrl_lines_on_the_console(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _ROUTED, str(tmp_path / "logs")], capture_output=True, text=True,
                          timeout=120, check=True)
    console = proc.stdout + proc.stderr
    log = (tmp_path / "logs" / "rank3.log").read_text()
    for third_party in ("python print", "raw fd 2 write", "child process print", "a library warning"):
        assert third_party not in console and third_party in log, third_party
    assert "[titanrl] our line" in proc.stdout and "[titanrl] our line" in log
    # A user error: one named line, the traceback only in the log; a bug: the traceback on the console too.
    assert f"error on rank 3: bad sample 'x-1' (traceback in {tmp_path / 'logs' / 'rank3.log'})" in proc.stderr
    assert proc.stderr.count("Traceback") == 1 and "KeyError: 'a bug of ours'" in proc.stderr
    assert "error on rank 3: EOFError (traceback in" in proc.stderr  # an empty message names the type
    assert log.count("Traceback") == 3


def test_summary_reports_reached_values_stage_times_and_places():
    history = [
        {"reward/mean": 0.2, "reward/accuracy": 0.1, "time/rollout": 2.0, "time/update": 1.0,
         "throughput/tokens_per_s": 100.0, "data/skipped": 0.0},
        {"reward/mean": 0.9, "reward/accuracy": 0.8, "time/rollout": 2.0, "time/update": 3.0,
         "throughput/tokens_per_s": 300.0, "data/skipped": 2.0},
        {"reward/mean": 0.7, "reward/accuracy": 0.6, "time/rollout": 4.0, "time/update": 0.0,
         "throughput/tokens_per_s": 200.0, "data/skipped": 2.0},
    ]
    text = format_summary(history, first_step=11, wall_s=125.0, places={"metrics": "/r/metrics.jsonl"})
    lines = text.splitlines()
    assert lines[0] == "[titanrl] done: steps 11-13, 4.00 s per step; 2m05s in all (start-up and saving included)"
    assert "reward     final 0.700 (mean of the last 3: 0.600), best 0.900 at step 12" in text
    assert "accuracy   final 0.600 (mean of the last 3: 0.500), best 0.800 at step 12" in text
    assert "rollout 8s (67%), update 4s (33%)" in text
    assert "tokens/s   200 mean" in text and "skipped    2 sample(s)" in text
    assert lines[-1] == "  metrics    /r/metrics.jsonl"
    assert "no step to run" in format_summary([], first_step=5, wall_s=1.0, places={})


def test_plot_writes_reward_stage_and_balance_pngs(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "reward/mean": s / 10, "reward/accuracy": s / 20, "time/rollout": 1.0, "time/update": 0.5,
             "parallel/balance_measured": 1.1, "balance/bubble_measured": 0.05} for s in (1, 2, 3)]
    rows.append({**rows[-1], "reward/mean": 0.99})  # a resumed run logs step 3 again: the last one wins
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert plot_main([str(run)]) == 0
    for name in ("reward.png", "stages.png", "balance.png"):
        data = (run / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert "wrote" in capsys.readouterr().out
    # a single-rank run without balance metrics gets no balance plot
    solo = tmp_path / "solo"
    solo.mkdir()
    (solo / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5, "time/rollout": 1.0}) + "\n")
    plot_main([str(solo)])
    assert sorted(p.name for p in (solo / "plots").iterdir()) == ["reward.png", "stages.png"]


def test_plot_names_a_missing_metrics_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "titanrl.plot", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and f"{tmp_path / 'metrics.jsonl'} does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_hung_rank_ends_the_run_with_an_error_naming_stage_rank_and_timeout():
    script = Path(__file__).parent / "dist" / "collective_timeout.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), "3",
           "20"]
    proc = fork_launch.run(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert proc.returncode != 0
    assert ("error on rank 0: stage 'update': rank 0 waited more than job.collective_timeout_s=3 s for a collective"
            in proc.stderr), proc.stderr[-3000:]
    assert "stage 'rollout'" not in proc.stderr
    ended = re.search(r"rank 0 ended after ([\d.]+) s", proc.stderr)
    assert ended and float(ended.group(1)) < 15, proc.stderr[-3000:]  # at the timeout, not when rank 1 woke


def test_counted_errors_reach_the_step_line_and_the_summary():
    from titanrl.metrics import format_step_line
    from titanrl.rl.error_watch import ErrorWatch
    from titanrl.rl.reward_runner import RewardError

    said: list[str] = []
    watch = ErrorWatch(2, "r.py:f", is_main=True, say=said.append)
    assert "reward errors" not in format_step_line(1, 3, {"reward/errors": 0.0})
    assert "reward errors 3" in format_step_line(1, 3, {"reward/errors": 3.0, "reward/calls": 8.0})
    # the decoupled objective's mean weight and the responses rl.mask_truncated left out, where those are on
    assert format_step_line(1, 3, {"grad_norm": 0.5, "rl/behaviour_weight_mean": 0.9812,
                                   "train/masked_truncated": 7.0}) == "step 1/3 | gnorm 0.500 | iw 0.981 | masked 7"
    assert format_step_line(2, 3, {"loss": 0.0, "rollout/unfinished_groups": 4.0}) == "step 2/3 | loss 0.0000 | carried 4"
    watch.observe(1, {"reward/errors": 3.0, "reward/calls": 8.0}, {"reward": "rank 1: sample 'a': boom"})
    watch.observe(2, {"reward/errors": 1.0, "reward/calls": 8.0}, {"reward": "rank 0: sample 'b': bang"})
    assert len(said) == 1 and "rank 1: sample 'a': boom" in said[0]  # the first, once
    watch.observe(3, {"reward/errors": 8.0, "reward/calls": 8.0}, {})
    with pytest.raises(RewardError, match=r"failed in 2 consecutive steps \(3-4, rl.max_error_steps = 2\); the first "
                                          r"failure: rank 1: sample 'a': boom"):
        watch.observe(4, {"reward/errors": 8.0, "reward/calls": 8.0}, {})
    summary = format_summary([{"time/rollout": 1.0}], 1, 10.0, {}, notes=watch.summary())
    assert "errors     20 reward call(s) failed and scored 0 (reward/errors); the first: rank 1: sample 'a'" in summary
    assert ErrorWatch(3, "x", is_main=True, say=said.append).summary() == []


def test_a_silent_rank_waits_until_its_hosts_speaker_has_written_the_line(monkeypatch):
    """An error every rank meets alike: the host's first rank writes the line while the others wait (torchrun ends a
    host's workers once one exits). The wait ends when that host's speaker says so, not another host's; without a
    word it waits out its timeout."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from titanrl.workflow import abort

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setattr(abort, "_store", lambda: store)
    threading.Timer(0.5, abort.said, args=(4,)).start()  # another host's speaker
    threading.Timer(1.5, abort.said, args=(0,)).start()
    t0 = time.monotonic()
    abort.wait_for_the_speaker(0, timeout_s=20)
    assert 1.4 < time.monotonic() - t0 < 5
    t0 = time.monotonic()
    abort.wait_for_the_speaker(8, timeout_s=1.0)  # nobody speaks for host 8
    assert 0.9 < time.monotonic() - t0 < 3


_BUSY_RANK = """
import sys, time
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
from titanrl.console import route_output
from titanrl.workflow import abort

store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))
abort._store = lambda: store
route_output(Path(sys.argv[1]), 1)
control = abort.RunControl(1, poll_s=0.1, grace_s=0.5)
control.watch(cleanup=lambda: print("cleanup ran", flush=True))
store.add(abort.COUNT_KEY, 1)
store.set(abort.KEY, "rank 0: node 'reward' failed: boom")
time.sleep(60)  # busy in something that waits for nobody: the watcher ends it
"""


@pytest.mark.parametrize("local", [False, True], ids=["other-host", "same-host"])
def test_a_rank_busy_past_the_grace_after_another_failed_ends_with_the_cause_on_its_hosts_console(tmp_path, local):
    """Rank 1 is busy (a fetch, a generation) when rank 0 fails: its watcher ends it after grace_s, and the line
    naming rank 0's cause is on the console of rank 1's host when rank 0 is elsewhere (that host's only line), in
    rank 1's log alone when both share the host (rank 0's own line is on it)."""
    import time

    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1" if local else "0", "LOCAL_WORLD_SIZE": "2" if local else "1"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _BUSY_RANK, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - t0 < 30, proc
    line = "[titanrl] rank 1 stopped: rank 0: node 'reward' failed: boom"
    log = (tmp_path / "rank1.log").read_text()
    assert "cleanup ran" in log and "still busy 0 s after another rank failed" in log, log
    assert log.count(line) == 1 and "where its threads are" in log, log
    said = [x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("[titanrl]")]
    assert said == ([] if local else [line]), proc
