"""Sharded (Ulysses) forward + backward of the tiny Qwen2.5-VL against the single-process result.

Under torchrun (gloo, FSDP2 over all ranks), every rank builds the same global batch of
trajectories (text, image, multi-image, short and long video prompts, 1-4 responses each, homes
spread unevenly over the ranks) and, beside the FSDP model, an unsharded copy of the same weights:
the reference, computed whole-sequence by ``pack_trajectories`` (the path proven against
transformers). For every stage plan it then exchanges the pieces (one all-to-all), runs the
sharded forward with the PPO-clip loss (advantages, old/reference log-probs, entropy: every
per-token input travels), backward, returns the log-probs to their homes, and compares log-probs,
loss and every gradient (vision tower included; each rank compares its FSDP shard) with the
reference. Rank 0 writes the largest errors per case to ``--out``.

Cases (``--cases``, all in one launch): ``fixed:<degree>``, ``flex`` (the FlexUlysses planner),
``random:<n>`` (n random plans of degrees 1/2/4 with random groups and packing), ``deadlock:<n>``
(n random plans, forward + backward only, no comparison: the test bounds the time), ``none`` and
``lbmicro`` (no sequence parallelism: trajectories at home, or Karmarkar-Karp-placed); prefixed
``ac-`` (activation checkpointing), ``compile-`` (compiled blocks), ``seq-`` (no overlap) or
``vision-`` (vision balancing: images and frames encoded where the wave's vision plan puts them,
embeddings routed to the ranks holding their tokens) or ``prefix-`` (shared-prefix packing: each prompt
once with its responses, the unit every plan places and shards).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from fsdp_step import ARGS, clean  # noqa: E402
from hf_reference import make_sample  # noqa: E402

from titanrl.data.manifest import SampleRecord  # noqa: E402
from titanrl.data.preprocess import PreparedSample  # noqa: E402
from titanrl.distributed import build_ulysses_groups  # noqa: E402
from titanrl.models.qwen2_5_vl import Qwen2_5_VLModel  # noqa: E402
from titanrl.parallel.cost_model import CostModel  # noqa: E402
from titanrl.parallel.flex_ulysses.plan import build_plan  # noqa: E402
from titanrl.parallel.parallelize import CompileOptions, parallelize_qwen2_5_vl  # noqa: E402
from titanrl.parallel.stage_plan import plan_stage, stage_from_shard_plans  # noqa: E402
from titanrl.parallel.ulysses import layout_builder, split_heads  # noqa: E402
from titanrl.rl.batch import Trajectory, dummy_pack, pack_trajectories  # noqa: E402
from titanrl.parallel.vision_plan import VisionBalancing  # noqa: E402
from titanrl.rl.stages import StageRunner  # noqa: E402
from titanrl.rl.units import gather_metadata, stage_units  # noqa: E402
from titanrl.rl.grpo import ppo_clip_loss  # noqa: E402

LOSS = dict(clip_low=0.2, clip_high=0.28, mode="seq-mean-token-mean", kl_coef=0.1, kl_estimator="k3",
            entropy_coef=0.01)


def make_trajectories(kinds, responses, *, min_response: int = 2, max_response: int = 9) -> list[Trajectory]:
    """Prompts with the media ``kinds[g]`` (hf_reference.make_sample items), ``responses[g]`` random
    responses each, with advantages and old / reference log-probs (every per-token input of the loss)."""
    rng = np.random.default_rng(0)
    trajs = []
    for g, items in enumerate(kinds):
        s = make_sample(rng, items, second_per_grid=0.5, text_len=3 + 2 * g)
        record = SampleRecord(id=f"s{g}", source="test", prompt="", media=[], answer="")
        pixels = None if s.pixel_values is None else s.pixel_values.numpy().astype(np.float32)
        prompt = PreparedSample(record, s.token_ids.astype(np.int64), s.grids, pixels, [])
        for k in range(responses[g]):
            r = int(rng.integers(min_response, max_response))
            t = Trajectory(prompt=prompt, group=g, response_ids=rng.integers(0, 280, r).astype(np.int64),
                           rollout_logprobs=np.zeros(r, np.float32))
            t.advantage = float(rng.normal())
            t.old_logprobs = torch.from_numpy(rng.normal(-5.0, 0.3, r).astype(np.float32))
            t.ref_logprobs = torch.from_numpy(rng.normal(-5.0, 0.3, r).astype(np.float32))
            trajs.append(t)
    return trajs


def global_trajectories() -> list[Trajectory]:
    kinds = [[], [("image", (1, 8, 8))], [("video", (4, 4, 6))], [("image", (1, 4, 4)), ("image", (1, 6, 4))],
             [("video", (8, 8, 8))], [], [("image", (1, 4, 8)), ("video", (2, 4, 4))]]
    return make_trajectories(kinds, RESPONSES)


RESPONSES = [2, 3, 1, 4, 2, 1, 3]  # per prompt: GRPO groups of unequal sizes (shared prefixes)


def home_of(group: int, world: int) -> int:
    return [0, 1, 0, 2, 0, 3, 1][group] % world  # uneven: rank 0 holds the long video and more


def loss_terms(logp, entropy, old, ref, adv, seq_index, seq_lengths, global_tokens, global_seqs):
    return ppo_clip_loss(logp, old, adv, seq_index, seq_lengths, global_tokens=global_tokens,
                         global_seqs=global_seqs, ref_logp=ref, entropy=entropy, **LOSS).loss


def reference(model, trajs):
    pack = pack_trajectories(trajs, ARGS, torch.device("cpu"), torch.float32, return_entropy=True)
    out = model(pack.batch, pack.targets)
    cat = lambda attr: torch.cat([getattr(t, attr) for t in trajs])  # noqa: E731
    adv = torch.cat([torch.full((t.num_response_tokens,), t.advantage) for t in trajs])
    loss = loss_terms(out.logprobs, out.entropy, cat("old_logprobs"), cat("ref_logprobs"), adv, pack.seq_index,
                      pack.seq_lengths, float(sum(t.num_response_tokens for t in trajs)), float(len(trajs)))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    logps = list(torch.split(out.logprobs.detach(), [t.num_response_tokens for t in trajs]))
    return logps, loss.item(), clean(grads)


def random_stage(lengths, homes, world, rng):
    n = len(lengths)
    degrees, blocks = [], []
    for h in lengths:
        top = min(4, world, 1 << (int(h).bit_length() - 1))
        p = int(rng.choice([d for d in (1, 2, 4) if d <= top]))
        degrees.append(p)
        blocks.append(int(rng.integers(0, world // p)))
    h_pack = int(rng.choice([8, 40, 4096]))
    plan = build_plan("random", lengths, world, 4, degrees, blocks, cost_model=CostModel.attention_only(),
                      alpha=100.0, max_degree=4, h_pack=h_pack, h_pack_cap=int(rng.choice([h_pack, 200, 16384])))
    ids = list(range(n))
    return stage_from_shard_plans("random", lengths, homes, [(ids, plan)])


def compare(model, mine, trajs, ref, loss_sum) -> dict[str, float]:
    """This rank's largest errors against the reference ``ref`` of ``trajs``: the log-probs of its home trajectories
    (``mine``, in ``new_logprobs``), the loss (``loss_sum``, already summed over ranks) and its FSDP shard of every
    gradient against the same shard of the reference."""
    ref_logps, ref_loss, ref_grads = ref
    errors = {"logp": 0.0, "loss": abs(loss_sum.item() - ref_loss), "grad": 0.0}
    for t in mine:
        i = next(j for j, u in enumerate(trajs) if u is t)
        errors["logp"] = max(errors["logp"], (t.new_logprobs - ref_logps[i]).abs().max().item())
    for name, q in model.named_parameters():
        g = ref_grads[clean({name: None}).popitem()[0]]
        ref_shard = distribute_tensor(g, q.grad.device_mesh, q.grad.placements, src_data_rank=None)
        errors["grad"] = max(errors["grad"], (q.grad.to_local() - ref_shard.to_local()).abs().max().item())
    return errors


def run_case(case: str, model, ref, mine, metas, runner, make_build, world, rank, rng, recompute: bool,
             shared_prefix: bool) -> dict:
    """``case`` = mode[:n] (fixed:<degree>, flex, random:<plans>, deadlock:<plans>): plans made here, moved and
    assembled by the trainer's ``StageRunner.inputs`` (``runner``, begun on ``mine``), one wave at a time."""
    exchange = runner.exchange
    mode, _, arg = case.partition(":")
    plans = int(arg) if mode in ("random", "deadlock") and arg else 1
    units = stage_units(metas, range(len(metas)), shared_prefix=shared_prefix)
    lengths = [u.num_tokens for u in units]
    homes = [u.home for u in units]
    build = make_build(lengths, [u.segments for u in units] if shared_prefix else None)
    global_tokens = float(sum(m.response_len for m in metas))
    global_seqs = float(len(metas))
    check = mode != "deadlock"
    errors = {"logp": 0.0, "loss": 0.0, "grad": 0.0}
    max_degree = 0
    measured_bytes, expected_bytes = 0, 0
    text = ARGS.text
    for _ in range(plans):
        if mode in ("random", "deadlock"):
            plan = random_stage(lengths, homes, world, rng)
        elif mode in ("none", "lbmicro"):
            plan = plan_stage(lengths, homes, world, method="none", max_tokens=MAX_TOKENS, cost_model=CostModel(),
                              strategy="native" if mode == "none" else "lb_micro")
        else:
            plan = plan_stage(lengths, homes, world, method=mode, max_tokens=MAX_TOKENS, cost_model=CostModel(),
                              p_max=4, degree=int(arg or 1))
        max_degree = max(max_degree, plan.degree_max)
        exchange.begin_results("new_logprobs", range(len(metas)))
        loss_sum = torch.zeros((), dtype=torch.float64)
        # what every group sends per layer and direction: (p - 1) N (hc + hq) d; activation
        # checkpointing issues the forward ones twice (recomputation)
        passes = 3 if recompute else 2
        for wave in plan.waves:
            for step in {st for rw in wave.ranks for st in rw.sharded}:
                # member m sends its n_m tokens' heads of every other member, and receives its own heads of the
                # others' tokens: sum_m n_m (W - w_m) each way, W = sum of widths (query + K + V heads), and the
                # same for the outputs (query heads)
                split = split_heads(text.num_attention_heads, text.num_key_value_heads, step.degree)
                n = [sum(b - a for a, b in (per_member[m] for per_member in step.slices)) for m in range(step.degree)]
                width = [m.width for m in split]
                q = [m.q[1] - m.q[0] for m in split]
                per_pass = sum(n_m * (sum(width) - w_m + sum(q) - q_m) for n_m, w_m, q_m in zip(n, width, q))
                expected_bytes += passes * text.num_hidden_layers * per_pass * text.head_dim * 4
        for w in range(len(plan.waves)):
            [inp], _ = runner.inputs(plan, units, [w], table=False, fields=("old_logprobs", "ref_logprobs"),
                                     return_entropy=True, layout_builder=build)
            if inp.batch is None:
                dummy = dummy_pack(ARGS, torch.device("cpu"), torch.float32)
                dummy.batch.vision_route = inp.vision_route
                (model(dummy.batch, dummy.targets).logprobs.sum() * 0.0).backward()
                exchange.return_logprobs(plan, units, [(w, inp, torch.zeros(0))], "new_logprobs", waves=[w])
                continue
            out = model(inp.batch, inp.targets)
            layout = inp.batch.attention_layout
            loss = loss_terms(out.logprobs, out.entropy, inp.fields["old_logprobs"], inp.fields["ref_logprobs"],
                              inp.advantages, inp.seq_index, inp.seq_lengths, global_tokens, global_seqs)
            loss.backward()
            measured_bytes += layout.comm.total if layout is not None else 0
            loss_sum += loss.detach().double()
            exchange.return_logprobs(plan, units, [(w, inp, out.logprobs)], "new_logprobs", waves=[w])
        if check:
            dist.all_reduce(loss_sum)
            for k, e in compare(model, mine, trajs_global, ref, loss_sum).items():
                errors[k] = max(errors[k], e)
        model.zero_grad(set_to_none=True)
    v = runner.vision_stats
    err = torch.tensor([errors["logp"], errors["loss"], errors["grad"], max_degree], dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    total = torch.tensor([measured_bytes, v.route.forward_bytes, v.route.backward_bytes, v.pixel_bytes],
                         dtype=torch.float64)
    dist.all_reduce(total)
    return {"logp": err[0].item(), "loss": err[1].item(), "grad": err[2].item(), "plans": plans,
            "max_degree": int(err[3].item()), "a2a_bytes": total[0].item(), "a2a_bytes_expected": float(expected_bytes),
            "route_bytes": (total[1].item(), total[2].item()), "pixel_bytes": total[3].item(),
            "vision_balance_planned": v.planned_peak / v.planned_mean if v.planned_mean else 1.0}


def run_stage_case(mode: str, model, trajs, ref, world, rank, groups, vision: VisionBalancing,
                   shared_prefix: bool) -> dict:
    """Through the trainer's ``StageRunner`` under ``lb_mini`` (one vision pass per minibatch): ``minibatch`` (whole
    trajectories, Karmarkar-Karp), ``minibatchflex`` (FlexUlysses), on ``trajs`` (whose reference is ``ref``):
    one update minibatch (gradients reduced once) and a log-prob stage, against the single process."""
    from types import SimpleNamespace

    runner = StageRunner(args=ARGS, rank=rank, world=world, device=torch.device("cpu"), dtype=torch.float32,
                         method="flex" if mode == "minibatchflex" else "none", strategy="lb_mini",
                         max_tokens=MAX_TOKENS, cost_model=CostModel(), p_max=4, groups=groups, vision=vision,
                         shared_prefix=shared_prefix)
    mine = [t for t in trajs if home_of(t.group, world) == rank]
    runner.begin_step(mine)

    def loss_fn(out, inp, global_tokens, global_seqs):
        return SimpleNamespace(loss=loss_terms(out.logprobs, out.entropy, inp.fields["old_logprobs"],
                                               inp.fields["ref_logprobs"], inp.advantages, inp.seq_index,
                                               inp.seq_lengths, global_tokens, global_seqs))

    results = runner.train_minibatch(model, runner.all_ids(), ("old_logprobs", "ref_logprobs"), loss_fn,
                                     temperature=1.0)
    runner.logprobs(model, "new_logprobs", temperature=1.0)
    loss_sum = torch.tensor(sum(float(r.loss.detach()) for r in results), dtype=torch.float64)
    dist.all_reduce(loss_sum)
    errors = compare(model, mine, trajs, ref, loss_sum)
    model.zero_grad(set_to_none=True)
    metrics = runner.metrics()
    err = torch.tensor([errors["logp"], errors["loss"], errors["grad"]], dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    v = runner.vision_stats
    route = torch.tensor([v.route.forward_bytes, v.route.backward_bytes], dtype=torch.float64)
    dist.all_reduce(route)
    return {"logp": err[0].item(), "loss": err[1].item(), "grad": err[2].item(), "plans": 1,
            "max_degree": int(metrics["parallel/degree_max"]), "route_bytes": tuple(route.tolist()),
            "encode_repeats": metrics["vision/encode_repeats"], "syncs": metrics["balance/syncs_per_minibatch"],
            "microbatches": (metrics["balance/microbatches_min"], metrics["balance/microbatches_max"])}


MAX_TOKENS = 120  # per-rank budget of a wave: the batch needs several waves and sharded sequences
trajs_global: list[Trajectory] = []


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", required=True,
                   help="comma-separated; each case is [ac-|compile-|seq-|vision-]mode[:n]: fixed:<degree>, "
                        "flex, random:<plans>, deadlock:<plans>, none, lbmicro; ac- = activation checkpointing, "
                        "compile- = compiled blocks (aot_eager), seq- = no all-to-all overlap, vision- = vision "
                        "balancing, prefix- = shared-prefix packing (prefixes combine)")
    p.add_argument("--heads", type=int, default=0,
                   help="query heads of the model (0: the tiny model's 4); 6 = 6 query / 2 K/V heads, which 4 does "
                        "not divide (blocks of 2, 2, 1, 1 heads, one straddling the K/V groups)")
    opts = p.parse_args()
    if opts.heads:
        global ARGS
        hidden = 16 * opts.heads  # head_dim 16: the mrope sections (2, 3, 3) cover half of it
        ARGS = dataclasses.replace(ARGS, text=dataclasses.replace(ARGS.text, hidden_size=hidden,
                                                                  num_attention_heads=opts.heads, num_key_value_heads=2),
                                   vision=dataclasses.replace(ARGS.vision, out_hidden_size=hidden))

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    groups = build_ulysses_groups(rank, world, (2, 4), torch.device("cpu"))

    torch.manual_seed(0)
    plain = Qwen2_5_VLModel(ARGS)
    plain.init_weights()
    trajs_global.extend(global_trajectories())
    ref = reference(plain, trajs_global)
    mine = [t for t in trajs_global if home_of(t.group, world) == rank]
    metas = gather_metadata(mine, rank, ARGS)
    vision_group = dist.new_group(ranks=list(range(world)))
    models: dict[tuple[str, str], Qwen2_5_VLModel] = {}
    results = {}
    rng = np.random.default_rng(1234)
    for case in opts.cases.split(","):
        *variants, base = case.split("-")  # prefixes combine: prefix-vision-flex
        ac = "full" if "ac" in variants else "none"
        backend = "aot_eager" if "compile" in variants else "none"
        key = (ac, backend)
        if key not in models:
            model = Qwen2_5_VLModel(ARGS)
            model.load_state_dict(plain.state_dict())
            models[key] = parallelize_qwen2_5_vl(
                model, dp_mesh=mesh, activation_checkpoint=ac, ulysses=True,
                compile_options=CompileOptions(enable=backend != "none", backend=backend if backend != "none"
                                               else "inductor"))
        vision = VisionBalancing(enabled="vision" in variants, cost_model=CostModel(), group=vision_group)
        def make_build(lengths, segments, overlap="seq" not in variants):
            return layout_builder(groups, rank=rank, lengths=lengths, backend="sdpa", device=torch.device("cpu"),
                                  overlap=overlap, segments=segments)

        t0 = time.perf_counter()
        if base.startswith("minibatch"):
            # "minibatch*1": only the long video's prompt (2 responses, homed on rank 0): ranks without work
            trajs = [t for t in trajs_global if t.group == 4] if base.endswith("1") else trajs_global
            if trajs is not trajs_global:
                plain.zero_grad(set_to_none=True)
            sub_ref = ref if trajs is trajs_global else reference(plain, trajs)
            results[case] = run_stage_case(base.rstrip("1"), models[key], trajs, sub_ref, world, rank, groups,
                                           vision, shared_prefix="prefix" in variants)
            results[case]["seconds"] = time.perf_counter() - t0
            continue
        # a fresh runner per case: its vision counters are per case (the plans are this harness's own)
        runner = StageRunner(args=ARGS, rank=rank, world=world, device=torch.device("cpu"), dtype=torch.float32,
                             method="none", max_tokens=MAX_TOKENS, cost_model=CostModel(), vision=vision)
        runner.begin_step(mine)
        results[case] = run_case(base, models[key], ref, mine, metas, runner, make_build, world, rank, rng,
                                 recompute=ac == "full", shared_prefix="prefix" in variants)
        results[case]["seconds"] = time.perf_counter() - t0
    if rank == 0:
        results["grad_norm"] = sum(g.norm() ** 2 for g in ref[2].values()).item()
        torch.save(results, opts.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
