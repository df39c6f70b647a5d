"""FlexUlysses execution: pure pieces (stage plans, frame runs, layouts, admissible degrees) and the
4-rank equality / deadlock proofs of ``tests/dist/ulysses_step.py`` (gloo, FSDP2)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import fork_launch
import pytest
import torch

from titanrl.config import JobConfig
from titanrl.config.errors import ConfigError
from titanrl.models.qwen2_5_vl.args import TextArgs
from titanrl.models.qwen2_5_vl.positions import VisionGrid
from titanrl.parallel.cost_model import CostModel
from titanrl.parallel.stage_plan import Piece, plan_stage
from titanrl.parallel.ulysses import admissible_degrees, member_order_permutation, resolve_ulysses
from titanrl.rl.units import MediaItem, TrajectoryMeta, stage_units
from titanrl.parallel.vision_plan import frame_runs

SCRIPT = Path(__file__).parent / "dist" / "ulysses_step.py"
TOL = 1e-5


# ---------------------------------------------------------------- pure pieces


def test_admissible_degrees_follow_the_heads():
    assert admissible_degrees(4, 2, 8) == (1, 2, 4)  # p = 4 > 2 KV heads: one K/V head per member
    assert admissible_degrees(28, 4, 8) == (1, 2, 4, 8)  # Qwen2.5-VL-7B at p = 8: blocks of 4 and 3 heads
    assert admissible_degrees(16, 2, 16) == (1, 2, 4, 8, 16)
    assert admissible_degrees(6, 2, 8) == (1, 2, 4)  # at most one member per query head


def test_split_heads_covers_every_head_once_and_sends_each_kv_head_once_per_member():
    from titanrl.parallel.ulysses import split_heads

    for hq, hkv in ((4, 2), (6, 2), (28, 4), (12, 4), (16, 2), (7, 7), (6, 1)):
        group = hq // hkv
        for p in admissible_degrees(hq, hkv, 64):
            split = split_heads(hq, hkv, p)
            assert [h for m in split for h in range(*m.q)] == list(range(hq))
            sizes = [m.q[1] - m.q[0] for m in split]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            for m in split:
                kv_of = [h // group for h in range(*m.q)]
                assert m.kv == (kv_of[0], kv_of[-1] + 1)  # exactly the K/V heads it reads
                if m.expand is None:  # GQA as is: each K/V head serves an equal run of its query heads
                    per = (m.q[1] - m.q[0]) // (m.kv[1] - m.kv[0])
                    assert kv_of == [m.kv[0] + i // per for i in range(m.q[1] - m.q[0])]
                else:
                    assert [m.kv[0] + e for e in m.expand] == kv_of
    # the 7B case of the FlexRL runs: 28 / 4 heads, p = 8
    split = split_heads(28, 4, 8)
    assert [m.q for m in split][:2] == [(0, 4), (4, 8)] and split[1].kv == (0, 2) and split[1].expand == (0, 0, 0, 1)
    assert split[0].expand is None and split[0].kv == (0, 1)
    # even splits are the familiar ones: K/V split p ways, or one K/V head per member
    assert [m.kv for m in split_heads(16, 4, 2)] == [(0, 2), (2, 4)]
    assert [m.kv for m in split_heads(4, 2, 4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(ValueError):
        split_heads(4, 2, 8)


def test_resolve_ulysses_errors_and_messages():
    par = JobConfig().parallelism
    text = TextArgs(num_attention_heads=28, num_key_value_heads=4, hidden_size=28 * 4, mrope_section=(1, 0, 1))
    par.ulysses, par.p_max = "flex", 8
    setup = resolve_ulysses(par, text, 8)
    assert setup.p_max == 8 and setup.degrees == (2, 4, 8) and not setup.message  # uneven head blocks at p = 8
    text = TextArgs(num_attention_heads=4, num_key_value_heads=2, hidden_size=4 * 8, mrope_section=(1, 1, 2))
    setup = resolve_ulysses(par, text, 8)
    assert setup.p_max == 4 and setup.degrees == (2, 4)
    assert "4 query / 2 key-value heads" in setup.message and "1, 2, 4" in setup.message
    par.ulysses, par.ulysses_degree = "fixed", 8
    with pytest.raises(ConfigError, match="ulysses_degree=8 cannot run: the model has 4 query"):
        resolve_ulysses(par, text, 8)
    par.ulysses_degree = 4
    assert resolve_ulysses(par, text, 8).degrees == (4,)


def test_p_max_default_follows_the_world_size():
    """Unset p_max = the largest power of two <= min(4, ranks): flex runs on 1, 2, 3, 4 and 8 ranks by default;
    an explicit p_max above the ranks stays a config error."""
    from titanrl.parallel.ulysses import default_p_max

    assert [default_p_max(w) for w in (1, 2, 3, 4, 6, 8, 16)] == [1, 2, 2, 4, 4, 4, 4]
    text = TextArgs(num_attention_heads=4, num_key_value_heads=2, hidden_size=16, mrope_section=(1, 0, 1))
    for world, top in ((1, 1), (2, 2), (4, 4), (8, 4)):
        cfg = JobConfig()
        cfg.parallelism.ulysses = "flex"
        cfg.validate()
        cfg.validate_world_size(world)
        setup = resolve_ulysses(cfg.parallelism, text, world)
        assert setup.p_max == top and not setup.message
    cfg.parallelism.p_max = 4
    with pytest.raises(ConfigError, match=r"p_max \(4\) must be <= the number of ranks \(2\)"):
        cfg.validate_world_size(2)


def test_config_rejects_impossible_ulysses_settings():
    cfg = JobConfig()
    cfg.parallelism.ulysses, cfg.parallelism.ulysses_degree = "fixed", 3
    with pytest.raises(ConfigError, match="ulysses_degree must be a power of two"):
        cfg.validate()
    cfg.parallelism.ulysses_degree = 8
    with pytest.raises(ConfigError, match=r"ulysses_degree \(8\) must be <= the number of ranks \(4\)"):
        cfg.validate_world_size(4)
    cfg.parallelism.ulysses, cfg.parallelism.p_max = "flex", 6
    with pytest.raises(ConfigError, match="p_max must be a power of two"):
        cfg.validate()
    cfg = JobConfig()
    cfg.parallelism.ulysses_degree = 2  # ignored unless ulysses = fixed: an error, not a silent no-op
    with pytest.raises(ConfigError, match="only means something with parallelism.ulysses='fixed'"):
        cfg.validate()


def test_member_order_permutation():
    # two sequences on two members: seq0 = [0,3) [3,5), seq1 = [0,2) [2,4)
    slices = [((0, 3), (3, 5)), ((0, 2), (2, 4))]
    # received rows: member0: s0[0:3], s1[0:2]; member1: s0[3:5], s1[2:4]
    perm = member_order_permutation(slices)
    assert perm.tolist() == [0, 1, 2, 5, 6, 3, 4, 7, 8]


def _meta(group, home, prompt, response, media=()):
    return TrajectoryMeta(home, 0, group, prompt, response, 0.0, tuple(media), f"s{group}")


def test_frame_runs_cover_only_touched_frames_once():
    video = MediaItem(VisionGrid(4, 4, 4, is_video=True), token_start=2, row_start=0, merge=2)  # 4 tokens / frame
    metas = [_meta(0, 0, 30, 5, [video]), _meta(0, 0, 30, 7, [video])]
    # piece 0 touches tokens 2..9 -> frames 0, 1; piece 1 touches 9..12 -> frames 1, 2
    pieces = [Piece(0, 0, 10), Piece(1, 9, 13)]
    runs = frame_runs(pieces, metas)
    assert [(r.f0, r.f1) for r in runs] == [(0, 3)]
    assert frame_runs([Piece(0, 20, 35)], metas) == []  # text only
    assert [(r.f0, r.f1) for r in frame_runs([Piece(0, 2, 6), Piece(1, 14, 18)], metas)] == [(0, 1), (3, 4)]


def test_scored_positions_of_a_slice():
    [u] = stage_units([_meta(0, 0, 10, 5)], [0], shared_prefix=False)  # tokens 0..14
    assert u.scored(0, 15).positions.tolist() == [9, 10, 11, 12, 13]  # predict the response
    assert u.scored(0, 15).targets.tolist() == [10, 11, 12, 13, 14]
    assert len(u.scored(0, 8).positions) == 0  # a prompt-only slice scores nothing
    assert u.scored(12, 15).positions.tolist() == [12, 13]


def test_stage_plans_respect_the_budget_and_cover_every_token():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(20, 400, 40)] + [1500]
    homes = [i % 4 for i in range(len(lengths))]
    for method, extra in (("flex", dict(p_max=4)), ("fixed", dict(degree=4)), ("fixed", dict(degree=2)),
                          ("bucketing", {}), ("none", {})):
        plan = plan_stage(lengths, homes, 4, method=method, max_tokens=1000, cost_model=CostModel(), **extra)
        # the 1500-token sequence fits only when it may be split
        assert plan.over_budget == (() if method in ("flex", "fixed") else (len(lengths) - 1,)), method
        covered = {s: np.zeros(h, dtype=int) for s, h in enumerate(lengths)}
        for w, wave in enumerate(plan.waves):
            for r in range(4):
                pieces = plan.pieces(w, r)
                if any(p.seq in plan.over_budget for p in pieces):
                    assert len(pieces) == 1  # an over-budget sequence runs alone
                else:
                    assert sum(p.num_tokens for p in pieces) <= 1000
                for p in pieces:
                    covered[p.seq][p.start:p.end] += 1
        assert all((c == 1).all() for c in covered.values()), method
        assert plan.moves_data() == (method != "none")
    local = plan_stage(lengths[:-1], homes[:-1], 4, method="none", max_tokens=1000, cost_model=CostModel())
    assert not local.moves_data()


def test_flex_plans_balance_a_skewed_batch_better_than_bucketing():
    lengths = [6000, 300, 280, 250, 240, 200, 180, 150, 120, 100, 90, 80]
    homes = [0] * len(lengths)
    cm = CostModel()
    flex = plan_stage(lengths, homes, 4, method="flex", max_tokens=8192, cost_model=cm, p_max=4)
    bucket = plan_stage(lengths, homes, 4, method="bucketing", max_tokens=8192, cost_model=cm)
    assert flex.degree_max == 4 and flex.sharded_sequences >= 1
    assert flex.balance_planned < 1.1 < bucket.balance_planned


# ---------------------------------------------------------------- 4 ranks, gloo


def run(out: Path, *extra: str, nproc: int = 4, timeout: float = 600) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           str(SCRIPT), "--out", str(out), *extra]
    proc = fork_launch.run(cmd, env, timeout=timeout)
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        proc = fork_launch.run(cmd, env, timeout=timeout)  # gloo teardown flake
    assert proc.returncode == 0, proc.stderr[-5000:]
    return torch.load(out)


def assert_equal(res: dict, *, sharded: bool = True) -> None:
    assert res["logp"] < TOL and res["loss"] < TOL and res["grad"] < TOL, res
    # the counted all-to-all bytes (forward, backward, recomputation) are the plans' exact volume
    assert res["a2a_bytes"] == res["a2a_bytes_expected"], res
    assert (res["a2a_bytes"] > 0) == sharded, res


# One launch runs every case (start-up, the reference and the FSDP models are shared).
CASES = ("fixed:2,fixed:4,flex,random:30,ac-random:8,seq-random:8,compile-fixed:4,deadlock:24,"
         "none,vision-none,vision-lbmicro,vision-fixed:4,vision-flex,vision-random:20,"
         "prefix-none,prefix-lbmicro,prefix-fixed:4,prefix-flex,prefix-random:10,prefix-vision-flex")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    res = run(tmp_path_factory.mktemp("ulysses") / "u.pt", "--cases", CASES, timeout=900)
    assert res["grad_norm"] > 1e-3  # the reference gradient is not zero: comparisons mean something
    return res


@pytest.mark.slow
def test_head_counts_the_degree_does_not_divide_match_single_process(tmp_path):
    """6 query / 2 K/V heads on 4 ranks: blocks of 2, 2, 1 and 1 query heads, the second straddling the two K/V
    groups (it receives both K/V heads once and repeats them per query head). Log-probs, loss and every gradient
    equal the single process at degree 2 (even) and 4 (uneven), fixed, planned and random, with vision balancing
    too; the counted all-to-all bytes are the uneven split's exact volume."""
    res = run(tmp_path / "u.pt", "--heads", "6", "--cases", "fixed:2,fixed:4,flex,random:12,vision-prefix-flex",
              timeout=900)
    assert res["grad_norm"] > 1e-3
    for case in ("fixed:2", "fixed:4", "flex", "random:12", "vision-prefix-flex"):
        assert_equal(res[case])
        assert res[case]["max_degree"] == {"fixed:2": 2, "vision-prefix-flex": res[case]["max_degree"]}.get(case, 4)
    assert res["vision-prefix-flex"]["max_degree"] >= 2 and res["vision-prefix-flex"]["route_bytes"][0] > 0


STAGE_CASES = ("minibatch", "vision-minibatch", "vision-prefix-minibatchflex", "minibatch1", "vision-minibatch1",
               "ac-minibatch1", "ac-vision-prefix-minibatch1")


@pytest.mark.slow
def test_lb_mini_vision_pass_matches_single_process(tmp_path):
    """The trainer's StageRunner under lb_mini: one vision pass per minibatch (each image and frame once per rank,
    with vision balancing over every rank and one route), microbatches reading its rows detached and the reducing
    microbatch taking their gradients back through it. One update minibatch and a log-prob stage on 4 ranks
    equal the single process on log-probs, loss and every gradient shard (vision tower included): the whole batch,
    with FlexUlysses and shared prefixes, and (``1``) only the long video's prompt, so two ranks have no work and
    reduce in a trailing dummy (once a collective mismatch: the dummy ran the vision tower a second time),
    with activation checkpointing too."""
    res = run(tmp_path / "s.pt", "--cases", ",".join(STAGE_CASES), timeout=900)
    for case in STAGE_CASES:
        r = res[case]
        assert r["logp"] < TOL and r["loss"] < TOL and r["grad"] < TOL, (case, r)
        assert r["syncs"] == 1, (case, r)
        if "vision" in case:
            assert r["encode_repeats"] == 1.0, (case, r)  # each image and frame encoded once per stage
        if "vision" in case and not case.endswith("1"):
            assert r["route_bytes"][0] > 0 and r["route_bytes"][1] > 0, (case, r)  # routed, gradients back
    assert res["minibatch1"]["microbatches"][0] == 1  # a rank without work ran only its trailing dummy
    assert res["vision-prefix-minibatchflex"]["max_degree"] >= 2


@pytest.mark.slow
@pytest.mark.parametrize("degree", [2, 4])
def test_fixed_degree_matches_single_process(four_ranks, degree):
    res = four_ranks[f"fixed:{degree}"]
    assert res["max_degree"] == degree
    assert_equal(res)


@pytest.mark.slow
def test_flex_planner_matches_single_process(four_ranks):
    res = four_ranks["flex"]
    assert res["max_degree"] == 4  # the budget forces the long video to be split 4 ways
    assert_equal(res)


@pytest.mark.slow
def test_random_plans_match_single_process(four_ranks):
    res = four_ranks["random:30"]
    assert res["plans"] == 30 and res["max_degree"] == 4
    assert_equal(res)


@pytest.mark.slow
def test_activation_checkpointing_and_no_overlap_match(four_ranks):
    assert_equal(four_ranks["ac-random:8"])
    assert_equal(four_ranks["seq-random:8"])


@pytest.mark.slow
def test_compiled_blocks_match_single_process(four_ranks):
    # p = 4 gives one query head per member: the case where an un-waited collective output once
    # reached the compiled block and lost its gradient
    assert_equal(four_ranks["compile-fixed:4"])


@pytest.mark.slow
def test_random_plans_do_not_deadlock(four_ranks):
    # 24 plans run forward and backward only, beside the 76 random plans the cases above run and compare (a deadlock
    # in any of them hits the launch's timeout)
    res = four_ranks["deadlock:24"]
    assert res["plans"] == 24 and res["max_degree"] == 4
    assert res["seconds"] < 300  # a hang would have hit the launch's timeout already


@pytest.mark.slow
@pytest.mark.parametrize("case", ["vision-none", "vision-lbmicro", "vision-fixed:4", "vision-flex",
                                  "vision-random:20"])
def test_vision_balancing_matches_single_process(four_ranks, case):
    """Images and frames encoded where the wave's vision plan puts them (not where their tokens are),
    embeddings routed by one autograd all-to-all: log-probs, loss and every gradient (vision tower
    included) still equal the single-process result, alone and under Ulysses plans of degree 2 and 4."""
    res = four_ranks[case]
    assert_equal(res, sharded=case not in ("vision-none", "vision-lbmicro"))
    forward, backward = res["route_bytes"]
    assert forward > 0 and backward == forward  # embeddings crossed ranks; their gradients came back
    if case == "vision-none":  # trajectories stay home: only ranks with work in a wave can take units
        assert res["vision_balance_planned"] < 0.7 * four_ranks["none"]["vision_balance_planned"], res
    else:
        assert res["vision_balance_planned"] < 1.15, res


@pytest.mark.slow
def test_encoding_where_the_tokens_are_matches_too(four_ranks):
    assert_equal(four_ranks["none"], sharded=False)
    assert four_ranks["none"]["route_bytes"] == (0.0, 0.0) and four_ranks["none"]["pixel_bytes"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["prefix-none", "prefix-lbmicro", "prefix-fixed:4", "prefix-flex",
                                  "prefix-random:10", "prefix-vision-flex"])
def test_shared_prefix_packing_matches_single_process(four_ranks, case):
    """Each prompt computed once with its 1-4 responses (the unit every plan places): log-probs, loss
    and every gradient equal the unshared single-process reference - units kept home, Karmarkar-Karp
    placed, sharded 4 ways, by the flex planner, under random plans, and with vision balancing."""
    res = four_ranks[case]
    assert_equal(res, sharded=case not in ("prefix-none", "prefix-lbmicro"))
    if case == "prefix-random:10":
        assert res["max_degree"] == 4
