"""Plan a titanrl job on heterogeneous devices (HetRL's scheduler) and write the config that runs the plan.

    python -m titanrl.schedule --config C.toml --profile profile.json --out plan.toml [--budget N] [--seed S]
    python -m titanrl.schedule --config C.toml --cluster cluster.toml --out plan.toml [--section.key=value ...]

The devices come from a profile (``python -m titanrl.profile --out profile.json``, one device per rank; with the
cost model's coefficients when ``python -m titanrl.calibrate`` has fitted them into it) or a hand-written
``cluster.toml`` (docs/hetrl.md); the workload (model shape, batch, ``rollout.n``, lengths,
algorithm, mode) from the config. The search (:func:`titanrl.hetero.search.search`) keeps to plans titanrl can
run: everything colocated, or the rollout on its own ranks (``workflow.placement = "disaggregated"``, required for
``workflow.mode = "async"``), with vLLM tensor parallelism in either (colocated: not with partial rollouts); FSDP
over every training rank; a Ulysses degree (FlexUlysses' ``p_max``; over ranks of unequal speed too, which the
FlexUlysses planner balances by finish time, a group at its slowest member's speed, as the cost model prices it),
not with ``balance.strategy = "native"``. The cost model prices memory with ``titanrl.memory`` (the trainer's own
check). It prints the chosen plan's predicted stage and step times beside its baselines (module
:mod:`titanrl.hetero.search`), and writes ``--out``: the config with

- ``workflow.placement`` / ``workflow.rollout_ranks``: titanrl generates on the first ``rollout_ranks`` ranks, so
  the plan's ranks are renumbered rollout devices first; when that is not the order the devices were profiled or
  listed in, the file and the console say which device each rank must run on;
- ``rollout.tensor_parallel_size``, ``parallelism.ulysses`` / ``parallelism.p_max``;
- ``balance.rank_speeds``: each rank's speed relative to the fastest of its group (training FLOP/s on ranks
  that hold models, decode tokens/s on rollout-only ranks: titanrl splits work within each group), when they
  differ by more than ``SPEED_TOLERANCE``.

The plan defines the world size: every device of the cluster is a rank (the torchrun command is printed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Sequence

from titanrl.calibrate import profile_coefficients
from titanrl.config import ConfigError, config_to_toml, load_config
from titanrl.hetero.cluster import Cluster, ClusterError, cluster_from_profile, load_cluster
from titanrl.hetero.cost import GroupPlan, HetCostModel, Plan, workload_from_config
from titanrl.hetero.search import SearchSpace, search, verl_like_plan


SPEED_TOLERANCE = 0.05
"""Speeds within this fraction of each other count as equal (a profile's measurement noise): no rank speeds are
written for them."""


def _differ(values: Sequence[float]) -> bool:
    return min(values) < (1 - SPEED_TOLERANCE) * max(values)


def titanrl_space(cfg, cluster: Cluster) -> SearchSpace:
    """The plans titanrl can run with ``cfg`` on ``cluster`` (module doc)."""
    ulysses_ok = cfg.balance.strategy != "native"
    tp = (1, 2, 4, 8) if cfg.rollout.engine == "vllm" else (1,)
    # colocated engines span tp ranks too (rollout.tensor_parallel_size)
    return SearchSpace(groupings="titanrl", tp_choices=tp, max_ulysses=8 if ulysses_ok else 1, fsdp="full")


def rank_order(plan: Plan) -> list[int]:
    """Device of each new rank: the rollout group's devices first (titanrl's rollout ranks are the first ones)."""
    gen = plan.group_of("rollout")
    return list(gen.devices) + [d for g in plan.groups if g is not gen for d in g.devices]


def apply_plan(cfg, plan: Plan, model: HetCostModel) -> list[int]:
    """Set ``cfg``'s placement, TP, Ulysses and rank speeds to ``plan``; returns the device of every rank."""
    order = rank_order(plan)
    gen = plan.group_of("rollout")
    models = plan.group_of("update")
    if plan.colocated:
        cfg.workflow.placement, cfg.workflow.rollout_ranks = "colocated", 0
    else:
        cfg.workflow.placement, cfg.workflow.rollout_ranks = "disaggregated", len(gen.devices)
    cfg.rollout.tensor_parallel_size = gen.tp
    cfg.parallelism.data_parallel_shard_degree = -1
    if models.ulysses > 1:
        cfg.parallelism.ulysses, cfg.parallelism.ulysses_degree, cfg.parallelism.p_max = "flex", 1, models.ulysses
    else:
        cfg.parallelism.ulysses, cfg.parallelism.ulysses_degree, cfg.parallelism.p_max = "none", 1, None
    speeds = model.device_speeds(plan)
    relative = {}
    for g in plan.groups:  # titanrl splits work within the rollout ranks and within the training ranks
        top = max(speeds[d] for d in g.devices)
        relative.update({d: float(f"{speeds[d] / top:.4g}") for d in g.devices})
    listed = [relative[d] for d in order]
    cfg.balance.rank_speeds = listed if plan.speed_aware and _differ(listed) else []
    return order


def plan_from_config(cfg, world_size: int, devices: Sequence[int] | None = None) -> Plan:
    """The plan a titanrl config runs on ``world_size`` ranks (the inverse of :func:`apply_plan`), for predicting
    a run's stage times: ``devices[r]`` is the cluster device rank ``r`` runs on (default: device ``r``, as in a
    profile of the same launch)."""
    ids = tuple(devices if devices is not None else range(world_size))
    if len(ids) != world_size:
        raise ValueError(f"devices names {len(ids)} devices for {world_size} ranks")
    w = workload_from_config(cfg)
    par = cfg.parallelism
    k = cfg.workflow.rollout_ranks if cfg.workflow.placement == "disaggregated" else 0
    if par.ulysses == "flex":  # FlexUlysses' largest group; its default: the largest power of two <= min(4, ranks)
        ulysses = par.p_max or 1 << (min(4, world_size - k).bit_length() - 1)
    else:
        ulysses = par.ulysses_degree if par.ulysses == "fixed" else 1
    speed_aware = cfg.balance.speeds() is not None
    if k:
        models = tuple(t for t in w.tasks if t != "rollout")
        groups = (GroupPlan(("rollout",), ids[:k], tp=cfg.rollout.tensor_parallel_size),
                  GroupPlan(models, ids[k:], ulysses=ulysses))
    else:
        groups = (GroupPlan(w.tasks, ids, tp=cfg.rollout.tensor_parallel_size, ulysses=ulysses),)
    return Plan(groups, speed_aware=speed_aware)


def launch_notes(cluster: Cluster, order: Sequence[int]) -> list[str]:
    """How to start the ranks so that rank ``r`` runs on device ``order[r]``: nothing when that is the given order,
    else one line per rank and per host (CUDA_VISIBLE_DEVICES order, or the cores to pin a CPU rank to)."""
    if list(order) == sorted(order) == list(range(len(cluster))):
        return []
    why = ("the plan uses some of the devices only" if len(order) < len(cluster) else "the rollout ranks come first")
    lines = [f"rank order: {why}, so launch rank r on the device listed for it:"]
    for r, d in enumerate(order):
        dev = cluster.devices[d]
        where = f"{dev.host}"
        if dev.local_rank is not None:
            where += f" local rank {dev.local_rank} of the profile"
        if dev.cpu_affinity:
            where += f", cores {_cores(dev.cpu_affinity)} (taskset -c {_cores(dev.cpu_affinity)})"
        lines.append(f"  rank {r}: device {d} ({dev.type}) on {where}")
    by_host: dict[str, list[int]] = {}
    for r, d in enumerate(order):
        by_host.setdefault(cluster.devices[d].host, []).append(r)
    for host, ranks in by_host.items():
        devices = [cluster.devices[order[r]] for r in ranks]
        line = f"  host {host}: ranks {', '.join(map(str, ranks))}"
        cuda = [d.device_name.rsplit("cuda:", 1)[-1].rstrip(")") for d in devices if "cuda:" in d.device_name]
        if len(cuda) == len(devices):
            line += f" -> CUDA_VISIBLE_DEVICES={','.join(cuda)} (local rank i uses the i-th)"
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            line += " (not contiguous: torchrun numbers each host's ranks contiguously, so reorder the hosts' node " \
                    "ranks or devices until they are)"
        lines.append(line)
    return lines


def _cores(cores: Sequence[int]) -> str:
    return ",".join(map(str, cores))


def _stage_line(stages: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in stages.items() if v)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m titanrl.schedule",
        description="Search a heterogeneity-aware plan (HetRL) for a titanrl config and write the config that runs "
                    "it. Arguments not listed here are config overrides (--section.key=value).")
    p.add_argument("--config", required=True, help="the job's config (TOML): model, batch, lengths, algorithm, mode")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--profile", help="a `python -m titanrl.profile` JSON: one device per profiled rank")
    source.add_argument("--cluster", help="a cluster.toml describing device types and links (docs/hetrl.md)")
    p.add_argument("--out", required=True, help="where to write the planned config (TOML)")
    p.add_argument("--budget", type=int, default=2000, help="plans the search prices (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="search seed (default 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if not args.profile and not args.cluster:
        print("error: no devices to plan for: profile the ranks first (`torchrun --nproc-per-node N -m "
              "titanrl.profile --out profile.json --config C.toml`, or `python -m titanrl.profile` for one) and pass "
              "--profile profile.json, or describe them in --cluster cluster.toml (docs/hetrl.md)", file=sys.stderr)
        return 2
    if args.budget < 1:
        print(f"error: --budget must be >= 1, got {args.budget}", file=sys.stderr)
        return 2
    try:
        # validated once the plan has set the placement (workflow.mode = "async" needs the disaggregated one)
        cfg = load_config(args.config, overrides, validate=False)
        cluster = cluster_from_profile(args.profile) if args.profile else load_cluster(args.cluster)
        coefficients = profile_coefficients(json.loads(Path(args.profile).expanduser().read_text()),
                                            source=Path(args.profile).name) if args.profile else None
        workload = workload_from_config(cfg)
    except (ConfigError, ClusterError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = HetCostModel(cluster, workload, coefficients)
    space = titanrl_space(cfg, cluster)
    print(cluster.describe())
    print(f"workload: {workload.describe()}")
    print(f"cost model: fitted to {coefficients.fitted} (the profile's calibration)" if coefficients else
          "cost model: default coefficients (round numbers, not fitted to these devices; `python -m "
          "titanrl.calibrate` fits them to a few measured runs)")
    if not cfg.model.path:
        print(f"note: model.path is empty, so this plans the built-in '{cfg.model.flavor}' model "
              f"({workload.model.name}); pass --model.path <a folder with your model's config.json> to plan yours")
    if space.max_ulysses == 1 and len(cluster) > 1:
        print("note: Ulysses not considered (balance.strategy = 'native' keeps trajectories where generated)")
    try:
        result = search(cluster, workload, budget=args.budget, seed=args.seed, space=space, model=model)
    except ValueError as err:  # e.g. workflow.mode = "async" on one device: no disaggregated plan exists
        print(f"error: {err} (workflow.mode = {cfg.workflow.mode!r})", file=sys.stderr)
        return 2
    if result.plan is None or not math.isfinite(result.step_s):
        why = model.why_infeasible(verl_like_plan(cluster, workload, model=model, space=space))
        biggest = max(d.memory_gb for d in cluster.devices)
        print(f"error: no plan fits in memory on these devices ({why}); `python -m titanrl.memory --config "
              f"{args.config} --world <ranks> --device-memory {biggest:g}GB` lists the settings that shrink a rank "
              "(e.g. --balance.max_tokens_per_microbatch, --rollout.kv_cache_bytes)", file=sys.stderr)
        return 1
    plan, estimate = result.plan, result.estimate
    found = (f"the search's best of {result.evaluations} plans priced" if result.chosen == "search" else
             f"the baseline '{result.chosen}': the search's best of {result.evaluations} plans was slower")
    print(f"\nplan ({found}; {result.wall_s:.2f} s):")
    print("  " + plan.describe(cluster).replace("\n", "\n  "))
    print(f"  predicted step {estimate.step_s:.4g} s: {_stage_line(estimate.stages)}")
    print("  baselines, priced in the same space (plans titanrl runs):")
    for name, seconds in result.baselines:
        ratio = f", {seconds / estimate.step_s:.2f}x the plan's" if math.isfinite(seconds) else " (does not fit)"
        print(f"    {name}: {seconds:.4g} s{ratio}")

    order = apply_plan(cfg, plan, model)
    try:
        cfg.validate()
        cfg.validate_world_size(len(order))
    except ConfigError as err:
        print(f"error: the plan does not make a valid config: {err}", file=sys.stderr)
        return 1
    notes = launch_notes(cluster, order)
    command = f"torchrun --nproc-per-node {len(order)} -m titanrl.train --config {args.out}"
    hosts = {cluster.devices[d].host for d in order}  # the plan's (a plan may leave devices out)
    if len(hosts) > 1:
        command = (f"torchrun --nnodes {len(hosts)} --nproc-per-node <ranks on the host> ... -m titanrl.train "
                   f"--config {args.out}")
    header = [f"# written by python -m titanrl.schedule --config {args.config} "
              f"{'--profile ' + args.profile if args.profile else '--cluster ' + args.cluster} "
              f"--budget {args.budget} --seed {args.seed}",
              f"# {len(order)} ranks: {command}",
              *[f"# {line}" for line in plan.describe(cluster).splitlines()],
              f"# predicted step {estimate.step_s:.4g} s ({_stage_line(estimate.stages)}); cost model, not measured",
              *[f"# {line}" for line in notes], ""]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(header) + config_to_toml(cfg, with_docs=False))
    print(f"\nwrote {out}")
    for line in notes:
        print(line)
    print(f"run it: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
