"""The workflow end to end (tiny model, vLLM-CPU rollouts, gloo):

- ``grpo`` on 4 ranks equals the shared one-process reference over 3 steps with a learning signal, on per-token
  log-probs (rollout, old, reference) and parameter updates (``train_runs.assert_same_computation``);
- ``ppo`` on 4 ranks equals 1 rank over 2 steps (actor and critic), the same way;
- a node added from TOML (DAPO's dynamic sampling) runs and changes what the next node sees;
- a reward that raises on one rank of 4 ends all 4 ranks within seconds, with one console line naming the node,
  the rank and the cause;
- counted reward errors are shown, and a reward failing on every call stops the run with one line;
- SIGTERM during step 3 leaves a checkpoint of step 3 (PPO: the critic's state too); the rerun equals an
  uninterrupted run; SIGTERM in a step longer than the grace abandons it and every process ends within 30 s.
(kill -9 of every rank leaving no process behind: tests/test_async.py, in its resume test.)
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import torch
from train_runs import (PPO_REFERENCE, REFERENCE, alive, assert_same_computation, metrics, ppo_reference_run,
                        reference_run, run, run_tiny, shared_run, started, train_cmd)

from titanrl.rl.dump import load_dumps, max_differences

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_grpo_on_four_ranks_equals_one_rank(run_cache, tmp_path):
    """With a learning signal (non-zero advantages, the peak learning rate): per-token log-probs of 4 ranks equal
    1 rank's, and so do the parameter updates, relative to their size."""
    run(train_cmd(tmp_path / "four", run_cache, *REFERENCE, "--job.steps=3", nproc=4))
    seen = assert_same_computation(reference_run(run_cache), tmp_path / "four" / "tiny_cpu", steps=3)
    assert {"rollout_logprobs", "old_logprobs", "ref_logprobs", "update/policy"} <= set(seen), seen


def test_ppo_on_four_ranks_equals_one_rank(run_cache, tmp_path):
    """PPO (critic, GAE, clipped value loss) with the critic under the actor's modes - FlexUlysses sharding
    sequences over up to 4 ranks (a small token budget forces it), lb_micro, vision balancing, slice-aware loading
    on the video mixture: actor and critic updates, per-token log-probs, values, returns and advantages of 4 ranks
    equal the shared one-process PPO reference over 3 steps with a learning signal. (PPO under the default lb_mini:
    the SIGTERM resume test.) Both optimizers use torch's fused AdamW kernel here (``optimizer.implementation``:
    the other tests run the default foreach)."""
    four = run_tiny(tmp_path / "four", run_cache, 4, *PPO_REFERENCE, "--parallelism.ulysses=flex",
                    "--balance.strategy=lb_micro", "--parallelism.vision_balance=true",
                    "--balance.max_tokens_per_microbatch=48")
    sharded = metrics(four)
    assert all(r["parallel/degree_max"] == 4 and r["parallel/sharded_sequences"] > 0 for r in sharded.values())
    seen = assert_same_computation(ppo_reference_run(run_cache), four, steps=3)
    assert {"values", "returns", "advantages", "old_logprobs", "update/policy", "update/critic"} <= set(seen), seen
    # the critic trained: its parameters moved from the policy's initialisation
    first = load_dumps(ppo_reference_run(run_cache))[1]["params"]["critic"]
    assert float(first["value_head.weight"].abs().sum()) > 0
    rec = metrics(four)[2]
    assert {"critic/value_loss", "critic/explained_variance", "critic/values_mean"} <= set(rec)
    # the update's token counts are the policy update's (the critic's pass over the same minibatches is not added)
    for run_dir in (ppo_reference_run(run_cache), four):
        for r in metrics(run_dir).values():
            assert r["train/tokens_represented"] == r["rollout/tokens"], r


def test_a_node_from_toml_changes_what_the_next_node_sees(run_cache, tmp_path):
    run(train_cmd(tmp_path, run_cache, "--job.steps=2", "--checkpoint.enable=false",
                  config="configs/examples/dapo_filter.toml"))
    for rec in metrics(tmp_path / "dapo_filter").values():
        assert rec["dapo/dropped_groups"] == round(rec["reward/uniform_group_fraction"] * 32)
        # the update trained exactly on what the filter kept
        assert rec["train/tokens_represented"] == rec["dapo/kept_tokens"]
    assert any(rec["dapo/dropped_groups"] > 0 for rec in metrics(tmp_path / "dapo_filter").values())


FAILING_REWARD = '''
import os
from titanrl.rl.rewards import exact_match_with_format

CALLS = 0

def reward(response, record):
    global CALLS
    CALLS += 1
    if os.environ.get("RANK") == "2" and CALLS > 200:  # during step 2 on rank 2 (~64 responses per step)
        raise ValueError("the grader rejected the response")
    return exact_match_with_format(response, record)
'''


def test_a_reward_raising_on_one_rank_ends_every_rank_with_one_named_line(run_cache, tmp_path):
    (tmp_path / "faulty_reward.py").write_text(FAILING_REWARD)
    t0 = time.monotonic()
    proc = run(train_cmd(tmp_path / "out", run_cache, "--job.steps=4", "--checkpoint.enable=false",
                         "--rl.reward=faulty_reward:reward", "--rl.on_reward_error=error",
                         "--job.collective_timeout_s=300", nproc=4),
               env={"PYTHONPATH": str(tmp_path)}, check=False)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    console = proc.stdout + proc.stderr
    lines = [x for x in console.splitlines() if x.startswith("[titanrl] error on rank")]
    assert len(lines) == 1, lines
    assert re.match(r"\[titanrl\] error on rank 2: node 'reward' \(score\) failed on rank 2: RewardError: reward "
                    r"'faulty_reward:reward' failed on sample '[^']+' \(source '[^']+'\): ValueError: the grader "
                    "rejected the response", lines[0]), lines[0]
    # every rank stopped, its log naming the cause (its watcher's "stopping: ..." or its own "stopped: ..."; torchrun
    # may end a worker before the latter), and none waited out the 300 s collective timeout
    logs = tmp_path / "out" / "tiny_cpu" / "logs"
    for rank in (0, 1, 3):
        log = (logs / f"rank{rank}.log").read_text()
        assert re.search(r"rank \d stop(ping|ped): rank 2: node 'reward'", log), rank
        if "stopping: rank 2" in log:  # the watcher saw the cause first: where the rank's threads were follows
            assert "(most recent call first)" in log.split("stopping: rank 2", 1)[1], rank
    assert elapsed < 240, elapsed


UNRELIABLE_REWARD = '''
import os
from titanrl.rl.rewards import exact_match_with_format

CALLS = 0

def reward(response, record):
    global CALLS
    CALLS += 1  # 16 calls per rank and step (8 prompts x 4 responses over 2 ranks)
    if os.environ.get("RANK") == "1" or CALLS > 32:  # rank 1 always, rank 0 from step 3
        raise ValueError("the grader is not installed")
    return exact_match_with_format(response, record)
'''


def test_counted_reward_errors_are_shown_and_a_reward_that_always_fails_stops_the_run(run_cache, tmp_path):
    """rl.on_reward_error = zero (the default): a reward failing on every call of rank 1 is visible -- the step line
    counts the errors, the first one is printed once naming its rank, sample and message -- and once every call of
    every rank fails (from step 3), the run stops after rl.max_error_steps (3) such steps with one line naming the
    first failure, no traceback on the console. A data.path that does not exist is one line too."""
    (tmp_path / "unreliable_reward.py").write_text(UNRELIABLE_REWARD)
    proc = run(train_cmd(tmp_path / "out", run_cache, "--job.steps=8", "--checkpoint.enable=false",
                         "--rl.reward=unreliable_reward:reward", "--rl.global_batch_size=8", "--rollout.n=4", nproc=2),
               env={"PYTHONPATH": str(tmp_path)}, check=False)
    assert proc.returncode != 0
    console = proc.stdout + proc.stderr
    steps = [x for x in console.splitlines() if re.search(r"step \d/8", x)]
    assert len(steps) == 5 and all("reward errors" in x for x in steps), steps
    assert "reward errors 16" in steps[0] and "reward errors 32" in steps[4]
    warnings = [x for x in console.splitlines() if "a reward call failed on" in x]
    assert len(warnings) == 1 and re.search(r"rank 1: sample '[^']+' \(source '[^']+'\): ValueError: the grader is "
                                            "not installed", warnings[0]), warnings
    errors = [x for x in console.splitlines() if x.startswith("[titanrl] error on rank")]
    assert len(errors) == 1 and errors[0].startswith(
        "[titanrl] error on rank 0: every call of reward 'unreliable_reward:reward' failed in 3 consecutive steps "
        "(3-5, rl.max_error_steps = 3); the first failure: rank 1: sample"), errors
    assert not re.search(r'File ".*/titanrl/', console)  # no traceback of ours (torchrun prints its own)

    missing = run(train_cmd(tmp_path / "out2", run_cache, f"--data.path={tmp_path / 'nowhere.parquet'}", nproc=2),
                  check=False)
    lines = [x for x in (missing.stdout + missing.stderr).splitlines() if "nowhere.parquet" in x]
    assert missing.returncode != 0 and len(lines) == 1 and "does not exist" in lines[0], lines
    assert not re.search(r'File ".*/titanrl/', missing.stdout + missing.stderr)


# The SIGTERM tests' runs: PPO (the critic, its optimizer and LR schedule are in the checkpoint too) with FlexUlysses
# and lb_mini (trajectories exchanged and sharded every step: a small token budget), the vision tower frozen in the
# policy and the critic (optimizer states without it), 5 steps, a checkpoint every 2, and a reward that hangs only
# while the test's marker file exists (tests/stalling_reward.py).
SIGTERM_RUN = ("--rl.algorithm=ppo", "--model.freeze_vision_tower", "--job.steps=5", "--checkpoint.interval=2", "--metrics.dump_tensors",
               "--rl.old_logprobs=recompute", "--rl.reward_timeout_s=300", "--parallelism.ulysses=flex",
               "--parallelism.p_max=2", "--balance.strategy=lb_mini", "--balance.max_tokens_per_microbatch=200",
               f"--rl.reward={ROOT / 'tests' / 'stalling_reward.py'}:reward")


def _tree(pid: int) -> list:
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


# Not serial: most of its time waits on a hanging grader and the grace; its deadlines (15 s for a tiny step and its
# save, 30 s for every process to end) hold with another test beside it
def test_sigterm_past_the_grace_abandons_the_step_within_it_saves_it_and_the_reruns_resume_exactly(run_cache,
                                                                                                   tmp_path):
    """SIGTERM to torchrun (2 ranks; job.preempt_grace_s 15, torchrun kills 30 s after it forwards SIGTERM), twice:

    1. A grader that hangs in step 3: every process of the run (ranks, engines, reward workers, the Ray daemons rank
       0 started) ends within 30 s, the console says the step was abandoned and which checkpoint stands (step 2, the
       last periodic one).
    2. The rerun resumes from it; a SIGTERM once it has trained a step: the step ends and is saved, every rank exits
       normally.
    3. The next rerun resumes from that checkpoint. Steps 3-5 of the three runs equal the uninterrupted run's
       exactly: per-token log-probs, parameters and statistics (model, optimizer, LR, data position, RNGs from DCP;
       PPO's critic, its optimizer and LR schedule too), with FlexUlysses sharding sequences (asserted). The vision
       tower (model.freeze_vision_tower) keeps the checkpoint's weights in the policy and the critic over the 5
       steps, bit for bit, while the rest of both trains.

    (Disaggregated and asynchronous, with the engine in child processes of the rollout rank: test_async's resume
    test.) The stopped runs have their own Ray instance: rank 0's daemons must survive torchrun's SIGTERM to the
    group until the step and its checkpoint are done."""
    marker = tmp_path / "stall"
    env = {"TITANRL_TEST_STALL": str(marker)}
    common = [*SIGTERM_RUN, "--job.preempt_grace_s=15"]  # the default's 25 s, shortened: the test waits it out
    straight = shared_run(run_cache, 2, *SIGTERM_RUN)  # uninterrupted
    out = tmp_path / "stopped"
    proc = started(train_cmd(out, run_cache, *common, nproc=2, own_ray=True), out, env)
    marker.touch()  # step 3's grader hangs
    time.sleep(3.0)
    procs = _tree(proc.pid)  # the launcher, the ranks and everything they started
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    console, _ = proc.communicate(timeout=120)
    while alive(procs) and time.monotonic() - t0 < 30:
        time.sleep(0.5)
    assert not alive(procs), (time.monotonic() - t0, alive(procs))
    assert time.monotonic() - t0 < 30
    assert re.search(r"SIGTERM during step 3: abandoned .*job.preempt_grace_s=15 s\); the last checkpoint, .*step-2, "
                     "stands", console), console[-3000:]
    assert sorted(d.name for d in (out / "tiny_cpu" / "checkpoint").iterdir()) == ["step-2"]
    marker.unlink()

    logs = [out / "tiny_cpu" / "logs" / f"rank{rank}.log" for rank in (0, 1)]
    sizes = [log.stat().st_size if log.exists() else 0 for log in logs]
    proc = started(train_cmd(out, run_cache, *common, nproc=2, own_ray=True), out, env, steps=1)
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers, during the step after the first
    console, _ = proc.communicate(timeout=300)
    assert "resumed from step 2" in console, console[-3000:]
    stopped = re.search(r"\[titanrl\] stopped by SIGTERM after step (\d+): checkpoint at", console)
    assert stopped and 3 <= int(stopped[1]) < 5, console[-3000:]
    assert (out / "tiny_cpu" / "checkpoint" / f"step-{stopped[1]}").is_dir()
    for log, size in zip(logs, sizes):  # each worker ended normally (the launcher itself reports the signal)
        assert "error on rank" not in log.read_text()[size:]

    resumed = run(train_cmd(out, run_cache, *common, nproc=2), env=env)
    assert f"resumed from step {stopped[1]}" in resumed.stdout + resumed.stderr
    a, b = load_dumps(straight), load_dumps(out / "tiny_cpu")
    ma, mb = metrics(straight), metrics(out / "tiny_cpu")
    assert max(ma[s]["parallel/sharded_sequences"] for s in (1, 2, 3, 4, 5)) > 0  # FlexUlysses really sharded
    for model in ("policy", "critic"):
        first, last = a[1]["params"][model], a[5]["params"][model]
        tower = [k for k in first if k.startswith("vision.")]
        assert tower and all(torch.equal(first[k], last[k]) for k in tower), model
        assert all(not torch.equal(first[k], last[k]) for k in ("layers.0.attention.wq.weight", "norm.weight")), model
    for step in (3, 4, 5):
        diff = max_differences(a[step], b[step])
        assert {"rollout_logprobs", "old_logprobs", "ref_logprobs", "params/policy", "params/critic"} <= set(diff) \
            and all(v == 0.0 for v in diff.values()), (step, diff)
        for key in ("loss", "reward/mean", "kl", "entropy", "grad_norm"):
            assert ma[step][key] == mb[step][key], (step, key)

    # a rerun with other settings (the tower trained: optimizer states the checkpoint lacks) ends every rank with one
    # line naming the checkpoint, the missing state and what to do (DCP's own exception passes `except Exception`)
    other = [a for a in common if a != "--model.freeze_vision_tower"]
    refused = run(train_cmd(out, run_cache, *other, "--job.steps=6", nproc=2), env=env, check=False)
    assert refused.returncode != 0
    line = [x for x in (refused.stdout + refused.stderr).splitlines() if x.startswith("[titanrl] error on rank")]
    assert len(line) == 1 and re.search(r"checkpoint load in .*checkpoint failed on rank\(s\) \[0, 1\]: RuntimeError: Missing key in "
                              r"checkpoint state_dict: \w*optimizer\.state\.vision\..*saved with other settings \(model\."
                              r"freeze_vision_tower", line[0]), line

