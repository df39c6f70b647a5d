"""The end-to-end harness (scripts/bench_e2e.py) and the busy-time accounting its limit rests on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from titanrl.rl.timing import StageTimer, busy_metrics

ROOT = Path(__file__).resolve().parents[1]


def test_busy_metrics_limit_is_the_mean_and_critical_the_busiest_rank_per_stage():
    per_rank = [{"rollout": 2.0, "update": 1.0}, {"rollout": 4.0, "update": 3.0, "data": 1.0}]
    m = busy_metrics(per_rank)
    assert m["busy/rollout"] == 3.0 and m["busy/rollout_max"] == 4.0
    assert m["busy/data"] == 0.5 and m["busy/data_max"] == 1.0  # a stage a rank never entered counts 0 there
    assert m["step/limit_s"] == pytest.approx(3.0 + 2.0 + 0.5)
    assert m["step/busy_critical_s"] == pytest.approx(4.0 + 3.0 + 1.0)


def test_stage_timer_adds_busy_seconds_per_stage_from_its_clock():
    ticks = iter([0.0, 1.5, 10.0, 10.25, 20.0, 21.0])
    timer = StageTimer(clock=lambda: next(ticks))
    with timer("update"):
        pass
    with timer("rollout"):
        pass
    with timer("update"):
        pass
    assert timer.busy == {"update": 2.5, "rollout": 0.25}
    assert set(timer.times) == {"time/update", "time/rollout"}


def test_busy_spans_of_device_events_are_read_once_when_the_metrics_are():
    """On CUDA a busy span is a pair of events: nothing waits for the device while spans are added (no
    synchronise per microbatch); reading the total waits once, for the last event, and sums elapsed times."""
    from titanrl.rl.timing import Busy

    class Event:  # torch.cuda.Event's timing interface
        waits = 0

        def __init__(self, t_ms: float) -> None:
            self.t = t_ms

        def elapsed_time(self, end: "Event") -> float:
            return end.t - self.t

        def synchronize(self) -> None:
            Event.waits += 1

    busy = Busy()
    busy.add(Event(0.0), Event(1500.0))
    busy.add(Event(2000.0), Event(2250.0))
    assert Event.waits == 0
    assert busy.seconds() == 1.75 and Event.waits == 1
    assert float(busy) == 1.75 and Event.waits == 1  # resolved once
    cpu = Busy()
    cpu.add(1.0, 3.5)  # process CPU time: added at once
    assert cpu.seconds() == 2.5


def test_stage_timer_names_only_collective_failures():
    """A collective's own error (plain RuntimeError from gloo) becomes a CollectiveError naming the stage;
    titanrl's own errors pass through unchanged, even when their text says "timeout" (a data fetch's did,
    and was reported as another rank's hang)."""
    from titanrl.data.shadow.types import DataUnavailableError
    from titanrl.rl.timing import CollectiveError

    timer = StageTimer(rank=1, collective_timeout_s=5)
    with pytest.raises(CollectiveError, match="stage 'update': rank 1 waited more than"):
        with timer("update"):
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms for recv")
    with pytest.raises(CollectiveError, match="lost its connection"):
        with timer("update"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.1]:4531")
    with pytest.raises(DataUnavailableError, match="^step 3: no data after data.fetch_timeout_s=10 s"):
        with timer("ref_logprob"):
            raise DataUnavailableError("step 3: no data after data.fetch_timeout_s=10 s: samples ['a']")


@pytest.mark.slow
def test_e2e_harness_runs_one_step_and_reports_it(tmp_path):
    out = tmp_path / "e2e"
    proc = subprocess.run([sys.executable, "scripts/bench_e2e.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    m = data["results"]["2"]["video-heavy"]["all"]["median"]
    # a real step: every stage ran, the ranks computed something, the limit is below the wall time
    for stage in ("data", "rollout", "reward", "ref_logprob", "update", "weight_sync"):
        assert f"time/{stage}" in m and f"busy/{stage}" in m, stage
    assert m["busy/rollout"] > 0 and m["busy/update"] > 0
    assert 0 < m["step/limit_s"] <= m["step/busy_critical_s"]
    assert m["step/limit_s"] < m["step/wall_s"] and m["tokens"] > 0
    report = out.with_suffix(".md").read_text()
    assert "| video-heavy | all |" in report and "torchrun --standalone --nproc-per-node 2" in report
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_scale_projection_reports_every_configuration_and_regenerates_from_its_json(tmp_path):
    out = tmp_path / "projection"
    subprocess.run([sys.executable, "scripts/project_scale.py", "--out", str(out)], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    data = json.loads(out.with_suffix(".json").read_text())
    assert set(data["projection"]) == {f"{g}|{m}" for g in (32, 128)
                                       for m in ("image-heavy", "video-heavy", "only-video")}
    for key, res in data["projection"].items():
        rows = res["rows"]
        assert list(rows) == ["verl-like", "verl-like+prefetch", "+ShadowLoader", "+FlexUlysses", "+ODC", "all"]
        for r in rows.values():
            assert r["total"] == pytest.approx(r["data"] + r["old_logprob"] + r["ref_logprob"] + r["update"])
        # prefetch only hides decode; ShadowLoader hides it behind compute (leaving each rank's fetch of its own
        # pixels, milliseconds: where prefetch hides everything, that fetch is what ShadowLoader loses);
        # FlexUlysses balances the update
        assert rows["verl-like+prefetch"]["data"] <= rows["verl-like"]["data"], key
        assert rows["+ShadowLoader"]["data"] <= rows["verl-like+prefetch"]["data"] + 0.05, key
        if rows["verl-like+prefetch"]["data"] > 0.1:
            assert rows["+ShadowLoader"]["data"] < rows["verl-like+prefetch"]["data"], key
        assert rows["+FlexUlysses"]["balance"] <= rows["+ShadowLoader"]["balance"] + 1e-9, key
    first = out.with_suffix(".md").read_text()
    subprocess.run([sys.executable, "scripts/project_scale.py", "--out", str(out), "--report-only"], cwd=ROOT,
                   check=True)
    assert out.with_suffix(".md").read_text() == first
