"""HetRL scheduling (titanrl/hetero, titanrl/schedule.py): cluster descriptions, the cost model, the search, the CLI.

Pure computation on made-up clusters: no ranks, no engines; the whole file runs in seconds."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import fork_launch
import numpy as np
import pytest
from train_runs import failure_report

from titanrl.hetero.cluster import (
    ClusterError,
    cluster_from_dict,
    cluster_from_profile,
    cluster_from_profile_dict,
    load_cluster,
)
from titanrl.hetero.cost import (
    Coefficients,
    GroupPlan,
    HetCostModel,
    ModelShape,
    Plan,
    PlanError,
    Workload,
    fit,
    predict_stage_times,
    workload_from_config,
)
from titanrl.hetero.search import (
    SearchSpace,
    all_plans,
    best_homogeneous_plan,
    device_counts,
    ga_only,
    random_search,
    search,
    task_groupings,
    verl_like_plan,
)

SHAPE = ModelShape(layers=16, hidden=2048, intermediate=5632, heads=16, kv_heads=4, vocab=32000, name="1B")


def two_by_two() -> dict:
    """2 fast devices on one host, 2 slow ones on two hosts of their own."""
    return {"devices": {
        "fast": dict(count=2, tflops=100, memory_gb=80, hbm_gbps=1000, intra_gbps=100, per_host=2),
        "slow": dict(count=2, tflops=25, memory_gb=24, hbm_gbps=400)},
        "links": [dict(between=["fast", "slow"], gbps=10, latency_ms=1),
                  dict(between=["slow", "slow"], gbps=25, latency_ms=0.1)]}


# ------------------------------------------------------------------------------------------------ cluster

def test_cluster_toml_expands_devices_hosts_and_links(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text("""
[devices.a100]
count = 4
tflops = 312
memory_gb = 40
hbm_gbps = 2039
intra_gbps = 600
per_host = 2
regions = ["ohio", "virginia"]

[devices.l4]
count = 2
tflops = 121
memory_gb = 24
hbm_gbps = 300
region = "virginia"

[[links]]
between = ["a100", "l4"]
gbps = 5
latency_ms = 10

[[links]]
between = ["virginia", "virginia"]
gbps = 100
latency_ms = 0.1

[default_link]
gbps = 8
latency_ms = 20
""")
    c = load_cluster(path)
    assert [d.id for d in c.devices] == list(range(6))
    assert [d.host for d in c.devices] == ["a100-0", "a100-0", "a100-1", "a100-1", "l4-0", "l4-1"]
    assert [d.region for d in c.devices] == ["ohio", "ohio", "virginia", "virginia", "virginia", "virginia"]
    assert c.link(0, 1) == pytest.approx((600e9, 5e-6))  # one host: intra_gbps (GB/s), default 5 us
    assert c.link(0, 4) == pytest.approx((5e9 / 8, 10e-3))  # a100 <-> l4: Gbit/s -> bytes/s
    # a100-1 and l4-0 are both in virginia: the region entry (2 + 2) is more specific than the type entry (1 + 1)
    assert c.link(2, 4) == pytest.approx((100e9 / 8, 0.1e-3))
    assert c.link(4, 5) == pytest.approx((100e9 / 8, 0.1e-3))
    assert c.link(0, 2) == pytest.approx((8e9 / 8, 20e-3))  # ohio <-> virginia a100 hosts: the default
    assert c.bandwidth[3, 3] == math.inf and c.latency[3, 3] == 0
    assert np.allclose(c.bandwidth, c.bandwidth.T)


@pytest.mark.parametrize("change, message", [
    (lambda t: t["devices"]["fast"].update(tflops=-3), "cluster.toml: devices.fast.tflops must be > 0, got -3"),
    (lambda t: t["devices"]["fast"].update(count=0), "devices.fast.count must be an integer >= 1, got 0"),
    (lambda t: t["devices"]["fast"].update(per_host=3), "devices.fast.count (2) must be a multiple of"),
    (lambda t: t["devices"]["fast"].update(speed=3), "unknown key devices.fast.speed"),
    (lambda t: t["devices"]["fast"].pop("memory_gb"), "devices.fast.memory_gb is required"),
    (lambda t: t["devices"]["fast"].pop("intra_gbps"), "devices.fast.intra_gbps is required"),
    (lambda t: t["links"][0].update(between=["fast", "h100"]), "links[0].between names 'h100'"),
    (lambda t: t["links"][1].update(gbps=0), "links[1].gbps must be > 0, got 0"),
    (lambda t: t["links"].pop(1), "no link between host slow-0 (slow, region default) and host slow-1"),
    (lambda t: t.update(nodes=[]), "unknown key 'nodes'"),
])
def test_cluster_mistakes_name_the_file_and_key(change, message):
    table = two_by_two()
    change(table)
    with pytest.raises(ClusterError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        cluster_from_dict(table, source="cluster.toml")


def profile_dict() -> dict:
    return {"version": 1, "dtype": "float32", "world_size": 3, "hosts": ["h0", "h1"],
            "ranks": [{"rank": r, "local_rank": r % 2, "host": f"h{r // 2}", "device": "cpu",
                       "device_name": "AMD EPYC", "matmul_tflops": [0.05, 0.05, 0.02][r], "attention_tflops": 0.03,
                       "memory_gb": 12.0, "hbm_gbps": 10.0, "gen_tokens_per_s": [3000.0, None, None][r],
                       "cpu_affinity": [r], "pid": 1} for r in range(3)],
            "links": [{"src": 0, "dst": 1, "gbps": 20.0, "latency_ms": 0.05},
                      {"src": 0, "dst": 2, "gbps": 1.0, "latency_ms": 2.0},
                      {"src": 1, "dst": 2, "gbps": 1.0, "latency_ms": 2.0}]}


def test_profile_ranks_become_devices_with_their_rank_ids(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_dict()))
    c = cluster_from_profile(path)
    assert [d.id for d in c.devices] == [0, 1, 2] and [d.host for d in c.devices] == ["h0", "h0", "h1"]
    assert c.devices[2].tflops == 0.02 and c.devices[0].gen_tokens_per_s == 3000.0
    assert c.devices[0].memory_gb == pytest.approx(12 * 2**30 / 1e9)  # the profile's GiB
    assert c.link(2, 0) == c.link(0, 2) == pytest.approx((1e9 / 8, 2e-3))
    broken = profile_dict()
    del broken["links"][1]
    path.write_text(json.dumps(broken))
    with pytest.raises(ClusterError, match="no link measured between ranks 0 and 2"):
        cluster_from_profile(path)
    broken = profile_dict()
    del broken["ranks"][1]["matmul_tflops"]
    path.write_text(json.dumps(broken))
    with pytest.raises(ClusterError, match=r"profile.json: ranks\[1\].matmul_tflops is missing"):
        cluster_from_profile(path)


def test_measured_generation_speed_calibrates_the_device():
    c = cluster_from_profile_dict(profile_dict())
    w = Workload(ModelShape(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=1024), 64, 16, 8, 4,
                 dtype_bytes=4, reference=False, old_logprobs=False)
    m = HetCostModel(c, w)
    assert m.gen_scale[1] == 1.0 and m.gen_scale[0] != 1.0
    faster = replace(c.devices[0], gen_tokens_per_s=6000.0)
    m2 = HetCostModel(replace(c, devices=(faster, *c.devices[1:])), w)
    assert m2.gen_scale[0] == pytest.approx(2 * m.gen_scale[0])


# ------------------------------------------------------------------------------------------------ cost model

def test_speed_aware_split_follows_speed_and_even_split_waits_for_the_slowest():
    """Compute-bound update on 2 devices at 4 : 1 speed: an even split takes (F/2) / slow, speed-aware F / (fast +
    slow)."""
    c = cluster_from_dict({"devices": {"fast": dict(count=1, tflops=400, memory_gb=80, hbm_gbps=2000),
                                       "slow": dict(count=1, tflops=100, memory_gb=80, hbm_gbps=500)},
                           "links": [dict(between=["fast", "slow"], gbps=1e6, latency_ms=0)]})
    w = Workload(ModelShape(layers=2, hidden=256, intermediate=512, heads=4, kv_heads=4, vocab=1000), 512, 512, 64, 8)
    m = HetCostModel(c, w)
    group = GroupPlan(w.tasks, (0, 1), fsdp=1)
    aware = m.predict_stage_times(Plan((group,), speed_aware=True))
    even = m.predict_stage_times(Plan((group,), speed_aware=False))
    assert even["update"] / aware["update"] == pytest.approx((0.5 / 100) / (1 / 500), rel=1e-6)
    assert even["reference"] / aware["reference"] == pytest.approx(2.5, rel=1e-6)
    assert aware["rollout"] < even["rollout"]  # decoding is memory-bound: 4 : 1 memory bandwidth


def test_memory_constraint_costs_inf_and_says_why():
    c = cluster_from_dict(two_by_two())
    w = Workload(SHAPE, 512, 512, 64, 4)
    m = HetCostModel(c, w)
    replicated = Plan((GroupPlan(w.tasks, (0, 1, 2, 3), fsdp=1),))  # 1.2B params x 16 bytes, a reference, an engine
    est = m.evaluate(replicated)
    assert est.step_s == math.inf and not est.feasible
    # titanrl.memory's prediction for the config the bare shape makes (synthesized_config), named by its terms
    assert est.why_infeasible.startswith("device 2 (slow on slow-0)") and "titanrl.memory predicts" in \
        est.why_infeasible and "largest: optimizer" in est.why_infeasible and "fsdp 1" in est.why_infeasible
    assert m.why_infeasible(replicated) == est.why_infeasible
    sharded = Plan((GroupPlan(w.tasks, (0, 1, 2, 3), fsdp=4),))
    assert m.why_infeasible(sharded) is None and math.isfinite(m.step_time(sharded))


def test_odc_across_hosts_is_priced_as_the_trainer_runs_it():
    """balance.strategy = odc on devices of several hosts: a colocated group is priced with hybrid sharding (the
    models sharded over one host's devices, titanrl.memory's shard), a model group without the rollout that spans
    hosts is infeasible (the trainer refuses it), and one on a single host is not."""
    from titanrl.config import load_config

    c = cluster_from_dict({"devices": {"g": dict(count=4, tflops=50, memory_gb=80, hbm_gbps=1000, intra_gbps=100,
                                                  per_host=2)}, "links": [dict(between=["g", "g"], gbps=10)]})
    odc = workload_from_config(load_config("configs/tiny_cpu.toml", ["--balance.strategy=odc"]))
    mini = workload_from_config(load_config("configs/tiny_cpu.toml"))
    models = ("reference", "update")
    colocated = Plan((GroupPlan(odc.tasks, (0, 1, 2, 3), fsdp=4),))
    one_host = Plan((GroupPlan(("rollout",), (0, 1)), GroupPlan(models, (2, 3), fsdp=2)))
    spanning = Plan((GroupPlan(("rollout",), (0,)), GroupPlan(models, (1, 2, 3), fsdp=3)))
    m = HetCostModel(c, odc)
    assert m.why_infeasible(colocated) is None and m.why_infeasible(one_host) is None
    assert "built for workflow.placement='colocated'" in m.why_infeasible(spanning)
    # as many devices on every host: 2 + 1 is refused as the trainer refuses it
    uneven = Plan((GroupPlan(odc.tasks, (0, 1, 2), fsdp=3),))
    assert "needs as many training ranks on every machine" in m.why_infeasible(uneven)
    assert HetCostModel(c, mini).why_infeasible(spanning) is None


def test_step_combines_stages_by_placement_and_mode():
    """Sync: stages add; tasks of a phase in one group add, in different groups overlap (Phi); async overlaps the
    rollout with the rest only when the rollout has devices of its own."""
    c = cluster_from_dict(two_by_two())
    ppo = Workload(SHAPE, 512, 512, 64, 4, algorithm="ppo")
    split = Plan((GroupPlan(("rollout", "reference", "old_logprobs", "update"), (0, 1), fsdp=2),
                  GroupPlan(("values", "critic_update"), (2, 3), fsdp=2)))
    s = HetCostModel(c, ppo).evaluate(split)
    st = s.stages
    inference = max(st["reference"] + st["old_logprobs"], st["values"])
    train = max(st["update"], st["critic_update"])
    assert s.step_s == pytest.approx(st["rollout"] + st["redistribute"] + inference + train + st["weight_sync"])
    assert st["redistribute"] > 0 and st["weight_sync"] > 0

    grpo = Workload(SHAPE, 512, 512, 64, 4, mode="async")
    apart = Plan((GroupPlan(("rollout",), (2, 3), tp=2), GroupPlan(("reference", "old_logprobs", "update"), (0, 1))))
    a = HetCostModel(c, grpo).evaluate(apart)
    st = a.stages
    models = st["reference"] + st["old_logprobs"] + st["update"]
    assert a.step_s == pytest.approx(max(st["rollout"] + st["redistribute"], models) + st["weight_sync"])
    sync = HetCostModel(c, replace(grpo, mode="sync")).evaluate(apart)
    assert sync.step_s == pytest.approx(st["rollout"] + st["redistribute"] + models + st["weight_sync"])
    colocated = Plan((GroupPlan(grpo.tasks, (0, 1, 2, 3), fsdp=4),))
    sync_colocated = HetCostModel(c, replace(grpo, mode="sync")).step_time(colocated)
    assert HetCostModel(c, grpo).step_time(colocated) == sync_colocated
    assert set(predict_stage_times(c, grpo, apart)) == {"rollout", "reference", "old_logprobs", "values", "update",
                                                         "critic_update", "weight_sync", "redistribute"}


def test_plans_that_do_not_fit_the_workload_are_refused():
    c = cluster_from_dict(two_by_two())
    w = Workload(SHAPE, 512, 512, 64, 4)
    m = HetCostModel(c, w)
    with pytest.raises(PlanError, match="task 'update' is in no group"):
        m.evaluate(Plan((GroupPlan(("rollout", "reference", "old_logprobs"), (0, 1, 2, 3)),)))
    with pytest.raises(PlanError, match=r"groups\[0\].tp = 3 must divide"):
        m.evaluate(Plan((GroupPlan(w.tasks, (0, 1, 2, 3), tp=3),)))
    with pytest.raises(PlanError, match="device 1 is in two groups"):
        m.evaluate(Plan((GroupPlan(("rollout",), (0, 1)), GroupPlan(("reference", "old_logprobs", "update"), (1, 2)))))
    with pytest.raises(PlanError, match="'old_logprobs' must share a group with 'update'"):
        m.evaluate(Plan((GroupPlan(("rollout", "old_logprobs"), (0, 1)), GroupPlan(("reference", "update"), (2, 3)))))


def test_fit_recovers_known_coefficients_from_synthetic_timings():
    """Stage and step times made with known efficiencies (per term and device type), comm and latency factors and
    fixed costs are fitted back exactly from the model's features, and the fitted model prices every stage and
    step as the truth does."""
    c = cluster_from_dict(two_by_two())
    w = Workload(SHAPE, 512, 512, 64, 4, algorithm="ppo", mode="sync")
    truth = {"train:fast": 1 / 0.3, "train:slow": 1 / 0.6, "inference:fast": 1 / 0.4, "inference:slow": 1 / 0.5,
             "gen_compute:fast": 1 / 0.35, "gen_compute:slow": 1 / 0.45, "gen_hbm:fast": 1 / 0.5,
             "gen_hbm:slow": 1 / 0.8, "comm": 1.7, "latency": 2.5,
             "overhead:rollout_call": 0.2, "overhead:rollout_prompt": 3e-3, "overhead:decode_step": 1e-3,
             "overhead:model_call": 0.05, "overhead:microbatch": 0.01, "overhead:sync_call": 0.1,
             "overhead:sync_byte": 1e-10, "overhead:step_call": 0.3, "overhead:exchange_prompt": 2e-3,
             "overhead:push_call": 0.4, "overhead:engine_process_call": 0.25}
    true_coefficients = Coefficients(
        by_type=tuple((k.partition(":")[0], k.partition(":")[2], 1 / v) for k, v in truth.items()
                      if ":" in k and not k.startswith("overhead:")),
        comm=truth["comm"], latency=truth["latency"],
        overheads=tuple((k.partition(":")[2], v) for k, v in truth.items() if k.startswith("overhead:")))
    model = HetCostModel(c, w, true_coefficients)
    rows, plans = [], []
    # two response lengths: with one, the decode steps per rollout are a constant (rollout_call's twin)
    for m in (model, HetCostModel(c, replace(w, response_len=256), true_coefficients)):
        for plan in all_plans(c, m.workload):
            est = m.evaluate(plan)
            if not est.feasible:
                continue
            if m is model:
                plans.append(plan)
            for stage, features in est.features.items():
                if features:
                    assert sum(truth[k] * v for k, v in features.items()) == pytest.approx(est.stages[stage]), stage
                    rows.append((features, est.stages[stage]))
            assert sum(truth[k] * v for k, v in est.step_features.items()) == pytest.approx(est.step_s)
            rows.append((est.step_features, est.step_s))
    fitted = fit(rows, fitted="synthetic")
    assert fitted.comm == pytest.approx(1.7, rel=1e-6) and fitted.latency == pytest.approx(2.5, rel=1e-6)
    for key, factor in truth.items():
        term, _, rest = key.partition(":")
        if term == "overhead":
            assert fitted.overhead(rest) == pytest.approx(factor, rel=1e-6), key
        elif rest:
            assert fitted.efficiency(term, rest) == pytest.approx(1 / factor, rel=1e-6), key
    assert fitted.fitted == "synthetic" and Coefficients.from_dict(fitted.to_dict()) == fitted
    refit = HetCostModel(c, w, fitted)
    for plan in plans[:40]:
        assert refit.evaluate(plan).step_s == pytest.approx(model.evaluate(plan).step_s, rel=1e-6)
    assert refit.coefficients.by_type  # the fitted model prices with the per-type efficiencies
    with pytest.raises(ValueError, match="at least as many rows as features"):
        fit([({"train:fast": 1.0, "comm": 2.0}, 3.0)])


def test_workload_from_the_tiny_config():
    from titanrl.config import load_config

    cfg = load_config("configs/tiny_cpu.toml")
    w = workload_from_config(cfg)
    assert (w.model.layers, w.model.hidden, w.model.vocab) == (2, 128, 1024)
    assert (w.global_batch, w.n, w.prompt_len, w.response_len) == (32, 8, 256, 2)
    assert w.dtype_bytes == 4 and w.shared_prefix and w.reference and not w.old_logprobs
    assert w.tasks == ("rollout", "reference", "update")
    ppo = workload_from_config(load_config("configs/tiny_cpu.toml", ["--rl.algorithm=ppo", "--rl.kl_coef=0",
                                                                     "--rl.minibatches=2"]))
    assert ppo.tasks == ("rollout", "old_logprobs", "values", "update", "critic_update")


# ------------------------------------------------------------------------------------------------ search

def test_groupings_and_counts():
    ppo = Workload(SHAPE, 512, 512, 64, 4, algorithm="ppo")
    assert len(task_groupings(ppo)) == 15  # partitions of rollout, reference, actor, critic
    assert all(g[0][0] == "rollout" for g in task_groupings(ppo))
    assert task_groupings(ppo, SearchSpace(groupings="titanrl")) == [
        (ppo.tasks,), (("rollout",), ("reference", "old_logprobs", "values", "update", "critic_update"))]
    assert task_groupings(replace(ppo, mode="async"), SearchSpace(groupings="titanrl")) == [
        (("rollout",), ("reference", "old_logprobs", "values", "update", "critic_update"))]
    assert device_counts(4, 2) == [(1, 3), (2, 2), (3, 1)]
    assert device_counts(10, 2, step=4) == [(6, 4)]


@pytest.mark.parametrize("algorithm, mode", [("ppo", "sync"), ("grpo", "async"), ("grpo", "sync")])
def test_search_finds_the_enumerated_optimum(algorithm, mode):
    """Every plan of a 2 fast + 2 slow cluster over all its devices priced: the search's own best, within its
    budget, is their optimum; plans that do not fit in memory are never chosen; and what it returns is never worse
    than that or any baseline it prices (a plan on the fast devices alone beats every 4-device plan of PPO here)."""
    c = cluster_from_dict(two_by_two())
    w = Workload(SHAPE, 512, 512, 64, 4, algorithm=algorithm, mode=mode)
    m = HetCostModel(c, w)
    costs = [m.step_time(p) for p in all_plans(c, w)]
    feasible = [x for x in costs if math.isfinite(x)]
    assert len(feasible) < len(costs)  # memory rules some out
    optimum = min(feasible)
    for seed in (0, 1):
        r = search(c, w, budget=1500, seed=seed, model=m)
        assert r.evaluations == 1500 and len(r.history) == 1500
        assert r.history[-1] == pytest.approx(optimum, rel=1e-9), seed
        assert r.step_s == min([r.history[-1], *(x for _, x in r.baselines)]) == m.step_time(r.plan)
        assert (r.chosen == "search") == (r.step_s == r.history[-1])
        assert r.estimate.feasible and m.why_infeasible(r.plan) is None
    assert m.step_time(verl_like_plan(c, w, model=m)) > optimum


def test_search_is_deterministic_and_spends_its_budget():
    c = cluster_from_dict(two_by_two())
    w = Workload(SHAPE, 512, 512, 64, 4, algorithm="ppo")
    for method in (search, ga_only, random_search):
        a = method(c, w, budget=200, seed=3)
        b = method(c, w, budget=200, seed=3)
        assert a.plan == b.plan and a.history == b.history and a.evaluations == 200
        assert all(x >= y for x, y in zip(a.history, a.history[1:]))  # best so far
        assert a.step_s == min([a.history[-1], *(x for _, x in a.baselines)]) == a.estimate.step_s


def test_verl_like_and_homogeneous_baselines():
    c = cluster_from_dict(two_by_two())
    w = Workload(SHAPE, 512, 512, 64, 4)
    verl = verl_like_plan(c, w)
    assert verl.colocated and not verl.speed_aware and verl.groups[0].devices == (0, 1, 2, 3)
    plan, seconds, device_type = best_homogeneous_plan(c, w)
    assert plan.colocated and {c.devices[d].type for d in plan.devices} == {device_type}
    assert seconds == HetCostModel(c, w).step_time(plan)
    verl_async = verl_like_plan(c, replace(w, mode="async"))
    assert verl_async.groups[0].tasks == ("rollout",) and verl_async.groups[0].devices == (0, 1)


# ------------------------------------------------------------------------------------------------ CLI

def write_cluster(tmp_path) -> str:
    path = tmp_path / "cluster.toml"
    path.write_text("""
[devices.fast]
count = 2
tflops = 0.2
memory_gb = 8
hbm_gbps = 20
intra_gbps = 10
per_host = 2

[devices.slow]
count = 2
tflops = 0.05
memory_gb = 8
hbm_gbps = 40
intra_gbps = 10
per_host = 2

[[links]]
between = ["fast", "slow"]
gbps = 10
latency_ms = 0.1
""")
    return str(path)


@pytest.mark.parametrize("overrides", [[], ["--workflow.mode=async"]])
def test_schedule_writes_a_config_the_trainer_loads(tmp_path, capsys, overrides):
    from titanrl import schedule
    from titanrl.config import load_config

    out = tmp_path / "plan.toml"
    rc = schedule.main(["--config", "configs/tiny_cpu.toml", "--cluster", write_cluster(tmp_path), "--out", str(out),
                        "--budget", "200", *overrides])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "verl-like (every device" in printed and "on the fast devices only: " in printed
    assert "torchrun" in printed
    cfg = load_config(out)
    cfg.validate_world_size(4)
    text = out.read_text()
    assert text.startswith("# written by python -m titanrl.schedule")
    if overrides:
        assert cfg.workflow.mode == "async" and cfg.workflow.placement == "disaggregated"
        assert 1 <= cfg.workflow.rollout_ranks < 4
        assert cfg.workflow.rollout_ranks % cfg.rollout.tensor_parallel_size == 0
    else:
        assert cfg.workflow.placement in ("colocated", "disaggregated")
    # (Ulysses is in the space over unequal speeds too: FlexUlysses plans by finish time)
    assert schedule.titanrl_space(cfg, load_cluster(tmp_path / "cluster.toml")).max_ulysses == 8
    # the search again, as the CLI ran it: the file holds its plan
    c = load_cluster(tmp_path / "cluster.toml")
    result = search(c, workload_from_config(cfg), budget=200, seed=0, space=schedule.titanrl_space(cfg, c))
    order = schedule.rank_order(result.plan)
    assert cfg.workflow.rollout_ranks == (0 if result.plan.colocated else len(result.plan.group_of("rollout").devices))
    assert cfg.rollout.tensor_parallel_size == result.plan.group_of("rollout").tp
    mixed = any(len({c.devices[d].type for d in g.devices}) > 1 for g in result.plan.groups)
    speeds = cfg.balance.rank_speeds  # relative within each group, written when they differ
    assert (len(speeds) == 4 and max(speeds) == 1.0) if mixed else speeds == []
    assert ("# rank order" in text) == (order != [0, 1, 2, 3])


QWEN2_5_VL_7B_TEXT = dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                          num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)  # the published config

CLUSTERS = {
    # the issue's: 8 A100-40GB on one host + 8 L4-24GB on two hosts of 4; 5 Gbit/s between the types, 25 between L4s
    "a100+l4": {"devices": {
        "a100": dict(count=8, tflops=312, memory_gb=40, hbm_gbps=1555, intra_gbps=300, per_host=8),
        "l4": dict(count=8, tflops=121, memory_gb=24, hbm_gbps=300, intra_gbps=16, per_host=4)},
        "links": [dict(between=["a100", "l4"], gbps=5, latency_ms=0.5),
                  dict(between=["l4", "l4"], gbps=25, latency_ms=0.1)]},
    "8xh100": {"devices": {"h100": dict(count=8, tflops=989, memory_gb=80, hbm_gbps=3350, intra_gbps=450,
                                        per_host=8)}},
    "h100+a100+l4": {"devices": {
        "h100": dict(count=4, tflops=989, memory_gb=80, hbm_gbps=3350, intra_gbps=450, per_host=4),
        "a100": dict(count=4, tflops=312, memory_gb=80, hbm_gbps=2039, intra_gbps=300, per_host=4),
        "l4": dict(count=4, tflops=121, memory_gb=24, hbm_gbps=300, intra_gbps=16, per_host=4)},
        "links": [dict(between=["h100", "a100"], gbps=100, latency_ms=0.1),
                  dict(between=["h100", "l4"], gbps=10, latency_ms=0.5),
                  dict(between=["a100", "l4"], gbps=10, latency_ms=0.5)]},
}


@pytest.mark.parametrize("name", sorted(CLUSTERS))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_plan_is_never_worse_than_a_baseline_it_prices(tmp_path, name, mode):
    """Qwen2.5-VL-7B (its published shape) on the issue's A100 + L4 cluster, 8 H100 and three device types: the
    plan written is the cheapest of the search's own and every baseline printed (colocated on every device, on each
    type alone, verl-like), all priced in the space titanrl runs."""
    from titanrl import schedule

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"text_config": QWEN2_5_VL_7B_TEXT}))
    c = cluster_from_dict(CLUSTERS[name])
    # 4096-token microbatches: at the config's 8192, titanrl.memory's training ranks need ~41 GiB, over an A100-40GB
    args = ["--config", "configs/qwen2_5_vl_7b.toml", f"--model.path={tmp_path / 'model'}",
            f"--workflow.mode={mode}", "--balance.max_tokens_per_microbatch=4096"]
    from titanrl.config import load_config

    cfg = load_config("configs/qwen2_5_vl_7b.toml", args[2:], validate=False)
    w = workload_from_config(cfg)
    assert w.model.hidden == 3584 and w.model.layers == 28
    r = search(c, w, budget=300, seed=0, space=schedule.titanrl_space(cfg, c))
    assert len(r.baselines) == 2 + (len(c.types) if len(c.types) > 1 else 0)
    assert math.isfinite(r.step_s) and all(r.step_s <= seconds for _, seconds in r.baselines), r.baselines
    assert r.step_s == HetCostModel(c, w).step_time(r.plan)


def test_schedule_from_a_profile_and_without_one(tmp_path, capsys):
    from titanrl import schedule
    from titanrl.config import load_config

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_dict()))
    out = tmp_path / "plan.toml"
    rc = schedule.main(["--config", "configs/tiny_cpu.toml", "--profile", str(path), "--out", str(out),
                        "--budget", "100", "--rl.global_batch_size=6"])
    assert rc == 0, capsys.readouterr()
    cfg = load_config(out)
    assert cfg.rl.global_batch_size == 6 and len(cfg.balance.rank_speeds) == 3
    rc = schedule.main(["--config", "configs/tiny_cpu.toml", "--out", str(out)])
    assert rc == 2 and "python -m titanrl.profile" in capsys.readouterr().err


def test_apply_plan_sets_ulysses_and_placement_fields():
    from titanrl import schedule
    from titanrl.config import load_config

    c = cluster_from_dict({"devices": {"gpu": dict(count=4, tflops=100, memory_gb=80, hbm_gbps=2000, intra_gbps=300,
                                                   per_host=4)}})
    cfg = load_config("configs/tiny_cpu.toml", ["--workflow.mode=async"], validate=False)
    w = workload_from_config(cfg)
    plan = Plan((GroupPlan(("rollout",), (3, 1), tp=2), GroupPlan(("reference", "update"), (0, 2), ulysses=2)))
    order = schedule.apply_plan(cfg, plan, HetCostModel(c, w))
    assert order == [3, 1, 0, 2]
    assert (cfg.workflow.placement, cfg.workflow.rollout_ranks, cfg.rollout.tensor_parallel_size) == \
        ("disaggregated", 2, 2)
    assert (cfg.parallelism.ulysses, cfg.parallelism.p_max) == ("flex", 2)
    assert cfg.balance.rank_speeds == []  # equal devices
    cfg.validate()
    cfg.validate_world_size(4)
    notes = schedule.launch_notes(c, order)
    assert "rank 0: device 3 (gpu) on gpu-0" in "\n".join(notes)


def test_plan_from_config_inverts_apply_plan():
    from titanrl import schedule
    from titanrl.config import load_config

    c = cluster_from_dict(two_by_two())
    cfg = load_config("configs/tiny_cpu.toml", ["--workflow.mode=async"], validate=False)
    w = workload_from_config(cfg)
    plan = Plan((GroupPlan(("rollout",), (2, 3), tp=2), GroupPlan(("reference", "update"), (0, 1))))
    order = schedule.apply_plan(cfg, plan, HetCostModel(c, w))
    again = schedule.plan_from_config(cfg, 4, devices=order)
    m = HetCostModel(c, w)
    assert m.predict_stage_times(again) == m.predict_stage_times(plan)
    colocated = load_config("configs/tiny_cpu.toml")
    assert schedule.plan_from_config(colocated, 2).groups == (GroupPlan(("rollout", "reference", "update"), (0, 1)),)


@pytest.mark.slow
def test_profile_schedule_train_end_to_end(run_cache, tmp_path):
    """The whole path on this machine with 4 ranks (two to a core, so their measured speeds differ by the other
    worker's load): `titanrl.profile` (links included), `titanrl.schedule` on its JSON, and the written config
    trains 2 steps with torchrun as the scheduler prints it, each rank on the device the plan gives it. (The other
    live plans: 2 ranks, one slowed by spinners, `test_profile`; two namespaced hosts behind a shaped link,
    `test_multihost`.)"""
    import os
    import sys
    from pathlib import Path

    from titanrl.config import load_config

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]

    def run(cmd):  # started from the tests' forkserver (fork_launch: torchrun's ranks, or one process)
        proc = fork_launch.run(cmd, env, root, timeout=900)
        assert proc.returncode == 0, failure_report(proc)
        return proc.stdout

    profile, plan = tmp_path / "profile.json", tmp_path / "plan.toml"
    run(torchrun + ["-m", "titanrl.profile", "--out", str(profile), "--seconds", "0.3", "--quiet"])
    printed = run([sys.executable, "-m", "titanrl.schedule", "--config", "configs/tiny_cpu.toml", "--profile",
                   str(profile), "--out", str(plan), "--budget", "200", "--job.steps=2",
                   "--checkpoint.enable=false", f"--model.cache_dir={run_cache}",
                   f"--job.dump_folder={tmp_path / 'out'}"])
    assert "torchrun --nproc-per-node 4" in printed
    cfg = load_config(plan)
    cfg.validate_world_size(4)
    run(torchrun + ["-m", "titanrl.train", "--config", str(plan)])
    records = (tmp_path / "out" / cfg.job.name / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records] == [1, 2]


# ------------------------------------------------------------------------------------------------ calibration

def _fake_run(folder, overrides, truth, profile, devices, steps=4):
    """A run folder as the trainer leaves it (config.toml, metrics.jsonl) whose stage and step times are what the
    cost model with ``truth`` coefficients predicts for it on ``profile``, plus per-step noise of +-2%."""
    from titanrl.config import config_to_toml, load_config
    from titanrl.hetero.cost import TITANRL_NODES
    from titanrl.schedule import plan_from_config

    cfg = load_config("configs/tiny_cpu.toml", overrides, validate=False)
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(config_to_toml(cfg))
    est = HetCostModel(cluster_from_profile_dict(profile), workload_from_config(cfg), truth).evaluate(
        plan_from_config(cfg, len(devices), devices))
    stages = {s: v for s, v in est.stages.items() if s in TITANRL_NODES and v}
    if cfg.workflow.placement == "disaggregated":  # its rollout ranks wait inside weight_sync for the training ranks
        stages["weight_sync"] += sum(v for s, v in stages.items() if s not in ("rollout", "weight_sync"))
    lines = [json.dumps({"step": 0, "eval/accuracy": 0.1})]  # step 0's evaluation: no step/wall_s
    for step in range(1, steps + 1):
        noise = 1.0 + 0.02 * ((step % 3) - 1)
        rec = {"step": step, "step/wall_s": est.step_s * noise * (3.0 if step == 1 else 1.0)}
        rec.update({f"time/{TITANRL_NODES[s]}": v * noise for s, v in stages.items()})
        lines.append(json.dumps(rec))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return est


def test_calibrate_fits_measured_runs_into_the_profile_and_schedule_prices_with_it(tmp_path, capsys):
    """`python -m titanrl.calibrate` on run folders: the fit (overheads included) predicts the fit runs' stages and
    steps and a held-out run's, it is written into the profile, and `titanrl.schedule --profile` prices with it."""
    from titanrl import calibrate, schedule
    from titanrl.hetero.cost import OVERHEAD_TERMS

    profile = profile_dict()
    profile["world_size"] = 2
    profile["ranks"] = profile["ranks"][:2]
    profile["links"] = profile["links"][:1]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    truth = Coefficients(train=0.2, inference=0.3, gen_compute=0.25, gen_hbm=0.6, comm=1.5, latency=2.0,
                         overheads=(("rollout_call", 0.3), ("rollout_prompt", 2e-3), ("decode_step", 4e-3),
                                    ("model_call", 0.05), ("microbatch", 0.02), ("sync_call", 0.1),
                                    ("sync_byte", 1e-9), ("step_call", 0.2), ("exchange_prompt", 3e-3),
                                    ("push_call", 0.5), ("engine_process_call", 0.25)))
    disagg = ["--workflow.placement=disaggregated", "--workflow.rollout_ranks=1"]
    fits = {"a": ([], (0, 1)), "b": (["--rl.global_batch_size=16", "--rollout.max_new_tokens=16"], (0, 1)),
            "c": (["--rollout.n=4", "--balance.max_tokens_per_microbatch=1024"], (0, 1)),
            "d": (disagg, (1, 0)), "e": ([*disagg, "--rl.global_batch_size=8", "--rollout.max_new_tokens=8"], (0, 1))}
    specs = []
    for name, (overrides, devices) in fits.items():
        _fake_run(tmp_path / name, overrides, truth, profile, devices)
        specs.append(f"{tmp_path / name}@{','.join(map(str, devices))}")
    held = _fake_run(tmp_path / "held", ["--rl.global_batch_size=24", "--rollout.max_new_tokens=4"], truth, profile,
                     (0, 1))
    assert calibrate.main(["--profile", str(path), *specs]) == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert "fitted to 5 measured run(s)" in printed and "wrote calibration into" in printed
    stored = json.loads(path.read_text())
    fitted = calibrate.profile_coefficients(stored)
    assert set(dict(fitted.overheads)) <= set(OVERHEAD_TERMS) and fitted.overhead("step_call") > 0
    assert [r["devices"] for r in stored["calibration"]["runs"]] == [list(d) for _, d in fits.values()]
    cluster = cluster_from_profile_dict(stored)
    for name, (_, devices) in [*fits.items(), ("held", ([], (0, 1)))]:
        run = calibrate.read_run(f"{tmp_path / name}@{','.join(map(str, devices))}", 2)
        assert run.steps == 3  # the first step left out
        predicted = calibrate.predictions(run, cluster, fitted)
        for stage, measured in [*run.stages.items(), (calibrate.STEP, run.step_s)]:
            assert predicted[stage] == pytest.approx(measured, rel=0.03), (name, stage)
    assert calibrate.predictions(run, cluster, fitted)[calibrate.STEP] == pytest.approx(held.step_s, rel=0.03)
    # the scheduler prices with the profile's calibration
    out = tmp_path / "plan.toml"
    assert schedule.main(["--config", "configs/tiny_cpu.toml", "--profile", str(path), "--out", str(out),
                          "--budget", "50"]) == 0
    assert "cost model: fitted to 5 measured run(s)" in capsys.readouterr().out
    # mistakes name the file
    (tmp_path / "a" / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    assert calibrate.main(["--profile", str(path), str(tmp_path / "a")]) == 2
    assert "no training step after the first 1" in capsys.readouterr().err
    assert calibrate.main(["--profile", str(path), f"{tmp_path / 'b'}@0,7"]) == 2
    assert "devices must be distinct ids of the profile's 0..1" in capsys.readouterr().err
    stored["calibration"]["coefficients"]["overheads"] = {"per_moon": 1.0}
    path.write_text(json.dumps(stored))
    assert schedule.main(["--config", "configs/tiny_cpu.toml", "--profile", str(path), "--out", str(out)]) == 2
    assert "calibration.coefficients" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", ["2 equal", "2 fast + 2 slow", "2 hosts of 2"])
def test_every_plan_of_the_titanrl_space_is_a_config_the_trainer_accepts(name, mode):
    """The scheduler's space is the trainer's: every plan `titanrl_space` allows on small clusters of this machine's
    kind (equal ranks, ranks of unequal speed, two hosts) becomes, through `apply_plan`, a config that passes the
    trainer's start-up checks on its world size (config, world size, Ulysses against the model's heads), and reads
    back (`plan_from_config`) as a plan priced the same."""
    from titanrl import schedule
    from titanrl.config import load_config
    from titanrl.memory import flavor_shape
    from titanrl.parallel.ulysses import resolve_ulysses

    cpu = dict(memory_gb=12, hbm_gbps=10, intra_gbps=50)
    devices = {"2 equal": {"cpu": dict(count=2, tflops=0.2, per_host=2, **cpu)},
               "2 fast + 2 slow": {"fast": dict(count=2, tflops=0.2, per_host=2, **cpu),
                                   "slow": dict(count=2, tflops=0.1, per_host=2, **cpu)},
               "2 hosts of 2": {"cpu": dict(count=4, tflops=0.2, per_host=2, **cpu)}}[name]
    c = cluster_from_dict({"devices": devices, "default_link": dict(gbps=1, latency_ms=0.1)})
    base = load_config("configs/tiny_cpu.toml", [f"--workflow.mode={mode}"], validate=False)
    w = workload_from_config(base)
    space = schedule.titanrl_space(base, c)
    args = flavor_shape(base.model.flavor)
    model = HetCostModel(c, w)
    seen = 0
    for plan in all_plans(c, w, space):
        cfg = load_config("configs/tiny_cpu.toml", [f"--workflow.mode={mode}"], validate=False)
        order = schedule.apply_plan(cfg, plan, model)
        cfg.validate()
        cfg.validate_world_size(len(order))
        resolve_ulysses(cfg.parallelism, args.text, cfg.workflow.training_ranks(len(order)))
        again = schedule.plan_from_config(cfg, len(order), devices=order)
        assert model.evaluate(again).step_s == pytest.approx(model.evaluate(plan).step_s), plan
        seen += 1
    assert seen >= (1 if name == "2 equal" else 10)
