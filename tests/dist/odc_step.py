"""Two optimizer steps of the tiny Qwen2.5-VL through the trainer's StageRunner under each
``balance.strategy`` (and lb_mini combined with FlexUlysses), against one plain process.

Run plainly (one process, no FSDP: the reference, whole sequences through ``pack_trajectories``) or
under torchrun (gloo, FSDP2). A case ``<strategy>@bf16`` computes in bfloat16 (FSDP2's ``param_dtype``) and is
compared with the first ``@bf16`` case of the launch (``pair_err``) rather than with the float32 reference. The batch is skewed (a long video and short text/image prompts, homes
uneven), the per-rank token budget small, so ranks need different numbers of microbatches.
Distributed runs also count, per minibatch, the FSDP collectives every rank issued (by wrapping
``dist.reduce_scatter_single`` / ``dist.all_gather_single``, what FSDP2 calls) and the microbatches
each rank ran. Rank 0 writes the largest parameter / loss errors and the counts to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from fsdp_step import ARGS, clean  # noqa: E402
from ulysses_step import LOSS, global_trajectories, home_of  # noqa: E402

from titanrl.models.qwen2_5_vl import Qwen2_5_VLModel  # noqa: E402
from titanrl.parallel.cost_model import CostModel  # noqa: E402
from titanrl.parallel.odc_comm import attached  # noqa: E402
from titanrl.parallel.parallelize import parallelize_qwen2_5_vl  # noqa: E402
from titanrl.rl.batch import pack_trajectories  # noqa: E402
from titanrl.rl.grpo import ppo_clip_loss  # noqa: E402

MAX_TOKENS = 64  # the long videos fill a rank alone; the others need several microbatches
STEPS = 2


def optimizer(model):
    # eps well above float32 noise (see fsdp_step.py)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, weight_decay=0.1)


def reference(trajs) -> tuple[dict, list[float]]:
    torch.manual_seed(0)
    model = Qwen2_5_VLModel(ARGS)
    model.init_weights()
    opt = optimizer(model)
    losses = []
    for _ in range(STEPS):
        pack = pack_trajectories(trajs, ARGS, torch.device("cpu"), torch.float32, return_entropy=True)
        out = model(pack.batch, pack.targets)
        cat = lambda attr: torch.cat([getattr(t, attr) for t in trajs])  # noqa: E731
        adv = torch.cat([torch.full((t.num_response_tokens,), t.advantage) for t in trajs])
        loss = ppo_clip_loss(out.logprobs, cat("old_logprobs"), adv, pack.seq_index, pack.seq_lengths,
                             global_tokens=float(sum(t.num_response_tokens for t in trajs)),
                             global_seqs=float(len(trajs)), ref_logp=cat("ref_logprobs"), entropy=out.entropy,
                             **LOSS).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return clean({k: v.detach().clone() for k, v in model.state_dict().items()}), losses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ref", help="the plain run's output (distributed runs compare against it)")
    p.add_argument("--cases", default="native,lb_micro,lb_mini", help="strategy or strategy+flex, comma-separated")
    opts = p.parse_args()
    trajs = global_trajectories()
    if "WORLD_SIZE" not in os.environ:
        params, losses = reference(trajs)
        torch.save({"params": params, "losses": losses}, opts.out)
        return

    from torch.distributed.device_mesh import init_device_mesh

    from titanrl.distributed import build_ulysses_groups
    from titanrl.rl.stages import StageRunner

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = torch.load(opts.ref)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    # "/hybrid": odc's hybrid sharding, 2 replicas of world / 2 shard ranks each (as 2 machines would run it)
    hybrid = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
              if any("/hybrid" in c for c in opts.cases.split(",")) else None)
    groups = build_ulysses_groups(rank, world, [d for d in (2, 4) if d <= world], torch.device("cpu"))
    mine = [t for t in trajs if home_of(t.group, world) == rank]

    calls = {"reduce_scatter": 0, "all_gather": 0}
    for name, attr in (("reduce_scatter", "reduce_scatter_single"), ("all_gather", "all_gather_single")):
        original = getattr(dist, attr)

        def counted(*a, _original=original, _name=name, **k):
            calls[_name] += 1
            return _original(*a, **k)

        setattr(dist, attr, counted)

    results, kept = {}, {}
    for case in opts.cases.split(","):
        name, _, dtype = case.partition("@")
        name, _, layout = name.partition("/")
        strategy, _, ulysses = name.partition("+")
        torch.manual_seed(0)
        model = Qwen2_5_VLModel(ARGS)
        model.init_weights()
        model = parallelize_qwen2_5_vl(model, dp_mesh=hybrid if layout == "hybrid" else mesh, ulysses=bool(ulysses),
                                       param_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        opt = optimizer(model)
        runner = StageRunner(args=ARGS, rank=rank, world=world, device=torch.device("cpu"), dtype=torch.float32,
                             method=ulysses or "none", strategy=strategy, max_tokens=MAX_TOKENS,
                             cost_model=CostModel(), p_max=min(4, world), groups=groups)

        def loss_fn(out, inp, global_tokens, global_seqs):
            return ppo_clip_loss(out.logprobs, inp.fields["old_logprobs"], inp.advantages, inp.seq_index,
                                 inp.seq_lengths, global_tokens=global_tokens, global_seqs=global_seqs,
                                 ref_logp=inp.fields["ref_logprobs"], entropy=out.entropy, **LOSS)

        losses, counts, micro, barriers, reductions = [], [], [], [], []
        for _ in range(STEPS):
            runner.begin_step(mine)
            ids = runner.all_ids()
            before = dict(calls)
            res = runner.train_minibatch(model, ids, ("old_logprobs", "ref_logprobs"), loss_fn, temperature=1.0)
            counts.append({k: calls[k] - before[k] for k in calls})
            comm = attached(model)
            barriers.append(comm.barriers if comm is not None else None)
            reductions.append(comm.replica_reductions if comm is not None else None)
            micro.append(runner.plan(ids)[1].microbatch_counts())
            total = torch.tensor([sum(r.loss.item() for r in res)], dtype=torch.float64)
            dist.all_reduce(total)
            losses.append(total.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        err = 0.0
        for name, q in model.state_dict().items():
            shard = distribute_tensor(ref["params"][clean({name: None}).popitem()[0]], q.device_mesh, q.placements,
                                      src_data_rank=None)
            err = max(err, (q.to_local() - shard.to_local()).abs().max().item())
        e = torch.tensor([err], dtype=torch.float64)
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        # "@bf16" cases compare with each other: the first of them is the reference of the next (same shards)
        local = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        pair = torch.tensor([max(((local[k] - kept[dtype, layout][k]).abs().max().item() for k in local), default=0.0)
                             if (dtype, layout) in kept else -1.0], dtype=torch.float64)
        dist.all_reduce(pair, op=dist.ReduceOp.MAX)
        kept.setdefault((dtype, layout), local)  # (a hybrid mesh's shards have another size)
        comm = attached(model)
        units = sum(1 for m in model.modules() if hasattr(m, "set_requires_gradient_sync"))
        every = [None] * world
        dist.all_gather_object(every, counts)
        results[case] = {"param_err": e.item(), "loss_err": max(abs(a - b) for a, b in zip(losses, ref["losses"])),
                         "collectives": every, "microbatches": micro, "fsdp_units": units,
                         "metrics": runner.metrics(), "odc_barriers": barriers, "losses": losses,
                         "odc_replica_reductions": reductions,
                         "replicas": None if comm is None else comm.replicas,
                         "pair_err": pair.item(), "direct": None if comm is None else all(comm.direct)}
    if rank == 0:
        torch.save(results, opts.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
