"""The main job end to end: GRPO with vLLM rollouts on the tiny model.

- resume: a run SIGKILLed after a checkpoint and resumed logs the same per-step losses and
  rewards as an uninterrupted run (exactly, on CPU);
- multi-rank: 2 ranks give the 1-rank losses for the same global batch and seed;
- learning: a shortened run raises the reward clearly (the full curve: benchmarks/learning_curve).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE: Path | None = None


@pytest.fixture(autouse=True)
def _shared_cache(run_cache):
    global CACHE
    CACHE = run_cache


def train_cmd(tmp: Path, *overrides: str, nproc: int | None = None) -> list[str]:
    base = ["--config", "configs/tiny_cpu.toml", f"--model.cache_dir={CACHE}", f"--job.dump_folder={tmp / 'out'}"]
    if nproc is None:
        return [sys.executable, "-m", "titanrl.train", *base, *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "titanrl.train", *base, *overrides]


def metrics(tmp: Path) -> dict[int, dict]:
    """step -> the last record logged for it (a resumed run logs its steps again)."""
    out = {}
    for line in (tmp / "out" / "tiny_cpu" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec
    return out


def run(cmd: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


KEYS = ("loss", "reward/mean", "kl", "entropy", "grad_norm")


def check_resume(tmp_path: Path, *extra: str, nproc: int | None = None) -> None:
    steps = ["--job.steps=4", "--checkpoint.interval=2", "--rl.global_batch_size=8", "--rollout.n=4", *extra]
    run(train_cmd(tmp_path / "straight", *steps, nproc=nproc))
    straight = metrics(tmp_path / "straight")

    resumed_dir = tmp_path / "resumed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(train_cmd(resumed_dir, *steps, nproc=nproc), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    marker = resumed_dir / "out" / "tiny_cpu" / "checkpoint" / "step-2"
    deadline = time.monotonic() + 600
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # let the step-2 save finish writing (DCP writes its metadata last)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "the first run never reached its step-2 checkpoint"
    run(train_cmd(resumed_dir, *steps, nproc=nproc))
    resumed = metrics(resumed_dir)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in KEYS:
            assert resumed[step][key] == straight[step][key], (step, key, resumed[step][key], straight[step][key])


@pytest.mark.slow
def test_killed_and_resumed_flex_run_matches_uninterrupted(tmp_path):
    """A 2-rank run SIGKILLed after its step-2 checkpoint and resumed gives exactly the uninterrupted run's
    statistics (model, optimizer, LR, data position, RNGs from DCP), with FlexUlysses and lb_mini
    (trajectories exchanged and sharded every step). (One process takes the same code path minus the
    collectives; this test replaced a separate 1-rank copy of itself.)"""
    check_resume(tmp_path, "--parallelism.ulysses=flex", "--parallelism.p_max=2",
                 "--balance.max_tokens_per_microbatch=200", nproc=2)


@pytest.mark.slow
def test_two_ranks_match_one(tmp_path):
    """Same global batch and seed: prompts are split across ranks by cost, but sampling seeds,
    GRPO groups, minibatches and loss normalisers depend only on global batch positions, so the
    step's statistics (and the gradient, seen through its norm) equal the 1-rank run. (4 ranks and the
    placement modes: test_placement_modes_on_four_ranks_match_one.)"""
    # entropy_coef > 0: a random policy rarely earns a reward, and the comparison needs a gradient
    common = ["--job.steps=2", "--checkpoint.enable=false", "--rl.global_batch_size=4", "--rl.minibatches=2",
              "--rl.entropy_coef=0.01"]
    run(train_cmd(tmp_path / "one", *common))
    run(train_cmd(tmp_path / "two", *common, nproc=2))
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert sorted(two) == [1, 2]
    for step in (1, 2):
        for key in ("reward/mean", "response/length_mean", "loss", "kl", "entropy", "grad_norm"):
            a, b = one[step][key], two[step][key]
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (step, key, a, b)
    assert one[1]["grad_norm"] > 0  # the comparison is not between two zeros


@pytest.mark.slow
def test_old_logprobs_from_the_first_forward_match_the_separate_pass(tmp_path):
    """rl.old_logprobs = auto takes the first minibatch's old log-probs from its own update forward (the old
    policy) and runs the old-log-prob pass only over the second minibatch; every statistic equals the run
    that recomputes all of them in a separate pass."""
    common = ["--job.steps=2", "--checkpoint.enable=false", "--rl.global_batch_size=4", "--rl.minibatches=2",
              "--rl.entropy_coef=0.01"]
    run(train_cmd(tmp_path / "auto", *common, "--rl.old_logprobs=auto"))
    run(train_cmd(tmp_path / "pass", *common, "--rl.old_logprobs=recompute"))
    auto, full = metrics(tmp_path / "auto"), metrics(tmp_path / "pass")
    for step in (1, 2):
        assert auto[step]["rl/old_logprob_pass_fraction"] == 0.5 and full[step]["rl/old_logprob_pass_fraction"] == 1
        for key in ("reward/mean", "loss", "kl", "entropy", "grad_norm", "clip_fraction"):
            a, b = full[step][key], auto[step][key]
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (step, key, a, b)
    assert full[1]["grad_norm"] > 0


@pytest.mark.slow
def test_shared_prefix_packing_matches_unshared_runs(tmp_path):
    """rl.shared_prefix computes each prompt once with its responses in the log-prob and update stages;
    3 steps on 1 rank and on 2 ranks give the statistics of the unshared run, while computing fewer
    tokens than the trajectories represent."""
    common = ["--job.steps=3", "--checkpoint.enable=false", "--rl.global_batch_size=4", "--rl.minibatches=2",
              "--rollout.n=4", "--rl.entropy_coef=0.01"]
    run(train_cmd(tmp_path / "off", *common, "--rl.shared_prefix=false"))
    run(train_cmd(tmp_path / "on", *common, "--rl.shared_prefix=true"))
    run(train_cmd(tmp_path / "on2", *common, "--rl.shared_prefix=true", nproc=2))
    off, on, on2 = metrics(tmp_path / "off"), metrics(tmp_path / "on"), metrics(tmp_path / "on2")
    for step in (1, 2, 3):
        for key in ("reward/mean", "loss", "kl", "entropy", "grad_norm", "clip_fraction"):
            for run_ in (on, on2):
                a, b = off[step][key], run_[step][key]
                assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (step, key, a, b)
        assert off[step]["train/tokens_computed"] == off[step]["train/tokens_represented"]
        assert on[step]["train/tokens_computed"] < 0.7 * on[step]["train/tokens_represented"]
    assert off[1]["grad_norm"] > 0


@pytest.mark.slow
def test_reward_rises_from_chance(tmp_path):
    """A shortened learning run of the default tiny config: the policy starts at chance (it almost
    never even answers with a colour) and within 50 steps clearly earns reward."""
    run(train_cmd(tmp_path / "learn", "--job.steps=50", "--checkpoint.enable=false", "--rollout.probe_every=0"),
        timeout=1500)
    m = metrics(tmp_path / "learn")
    first = sum(m[s]["reward/mean"] for s in range(1, 6)) / 5
    last = sum(m[s]["reward/mean"] for s in range(46, 51)) / 5
    assert first < 0.05, first
    assert last > first + 0.1, (first, last)


@pytest.mark.slow
def test_placement_modes_on_four_ranks_match_one(tmp_path):
    """FlexUlysses with ODC's lb_mini (sharded groups first, one gradient reduction per minibatch),
    fixed-degree Ulysses with lb_micro, vision balancing (images and frames encoded where the vision
    plan puts them, embeddings routed) and shared-prefix packing off (each trajectory its own unit, so
    lb_micro really syncs per microbatch), and lb_mini alone move and shard trajectories across 4 ranks
    (a small token budget forces several waves, sharded sequences and unequal microbatch counts); every
    step statistic of 3 steps equals the 1-rank run (packing on): log-probs, loss and gradient do not
    depend on where the tokens ran, nor on whether a prompt was computed once per group."""
    common = ["--job.steps=3", "--checkpoint.enable=false", "--rl.global_batch_size=4", "--rollout.n=4",
              "--rl.minibatches=2", "--rl.entropy_coef=0.01", "--balance.max_tokens_per_microbatch=160"]
    run(train_cmd(tmp_path / "one", *common))
    run(train_cmd(tmp_path / "flex", *common, "--parallelism.ulysses=flex", "--parallelism.p_max=4",
                  "--balance.strategy=lb_mini", nproc=4))
    run(train_cmd(tmp_path / "fixed", *common, "--parallelism.ulysses=fixed", "--parallelism.ulysses_degree=2",
                  "--balance.strategy=lb_micro", "--parallelism.vision_balance=true", "--rl.shared_prefix=false",
                  nproc=4))
    run(train_cmd(tmp_path / "mini", *common, "--balance.strategy=lb_mini", nproc=4))
    one, flex, fixed, mini = (metrics(tmp_path / d) for d in ("one", "flex", "fixed", "mini"))
    for other in (flex, fixed, mini):
        assert sorted(other) == [1, 2, 3]
        for step in (1, 2, 3):
            for key in ("reward/mean", "response/length_mean", "loss", "kl", "entropy", "grad_norm"):
                a, b = one[step][key], other[step][key]
                assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (step, key, a, b)
    assert all(mini[s]["balance/syncs_per_minibatch"] == 1 for s in (1, 2, 3))
    assert fixed[1]["balance/syncs_per_minibatch"] > 1
    assert one[1]["train/tokens_computed"] < fixed[1]["train/tokens_computed"] == fixed[1]["train/tokens_represented"]
    assert one[1]["grad_norm"] > 0
    assert max(flex[s]["parallel/sharded_sequences"] for s in (1, 2, 3)) > 0  # the plan really sharded
    assert fixed[1]["parallel/degree_max"] == 2 and fixed[1]["parallel/a2a_bytes"] > 0
    assert all(fixed[s]["vision/bytes_moved"] > 0 for s in (1, 2, 3))  # units really encoded elsewhere
    for s in (1, 2, 3):
        assert flex[s]["parallel/balance_planned"] >= 1.0 and flex[s]["parallel/balance_measured"] >= 1.0


def test_probe_warns_then_stops_after_consecutive_violations(capsys):
    """rollout.probe_tolerance is enforced: a violation warns with the numbers, a good check resets the
    count, and probe_max_violations in a row stop the run with a clear error."""
    from types import SimpleNamespace

    from titanrl.config import JobConfig
    from titanrl.trainer import Trainer

    cfg = JobConfig()
    cfg.rollout.probe_tolerance, cfg.rollout.probe_max_violations = 1e-3, 2
    fake = SimpleNamespace(cfg=cfg, info=SimpleNamespace(is_main=True), step=5, probe_violations=0)
    Trainer.check_probe(fake, 0.5)
    assert "differ by 0.5 (> rollout.probe_tolerance=0.001), 1 time(s) in a row" in capsys.readouterr().out
    Trainer.check_probe(fake, 1e-4)  # back within tolerance
    assert fake.probe_violations == 0
    Trainer.check_probe(fake, 0.5)
    with pytest.raises(RuntimeError, match="exceeded rollout.probe_tolerance=0.001 in 2 consecutive checks"):
        Trainer.check_probe(fake, 0.7)
