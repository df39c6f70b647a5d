"""Peak memory of one update minibatch under ``lb_micro``, ``odc`` and ``lb_mini`` (issue 48), one launch each
strategy in turn, on a model wide enough that parameters and gradients dominate (8 decoder layers of width 512:
~25M parameters) and a short batch (activations small).

Per rank and strategy: a warm-up minibatch and optimizer step (AdamW's state and odc's shared memory exist
after it), then the measured minibatch, clipping, step and ``zero_grad``, sampled by ``HeapSampler`` (glibc's
live heap, where torch's CPU tensors are: the planner's quantity on CPU). odc's shared memory is not heap: the
rank's own files (its publication and accumulation buffer, resident for the run) are added to its figure; the
other ranks' files it maps are theirs. Optionally (``--kill-rank R``) rank R kills itself (SIGKILL) in its first
odc microbatch's backward, to check that the job ends rather than waits; ``--refuse`` checks odc's refusals at its
start. Rank 0 writes ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_common import HeapSampler  # noqa: E402
from fsdp_step import ARGS  # noqa: E402
from ulysses_step import LOSS, home_of, make_trajectories  # noqa: E402

from titanrl.models.qwen2_5_vl import Qwen2_5_VLModel  # noqa: E402
from titanrl.parallel.cost_model import CostModel  # noqa: E402
from titanrl.parallel.parallelize import parallelize_qwen2_5_vl  # noqa: E402
from titanrl.rl.grpo import ppo_clip_loss  # noqa: E402

WIDE = dataclasses.replace(ARGS, text=dataclasses.replace(ARGS.text, hidden_size=512, intermediate_size=1536,
                                                          num_hidden_layers=8, num_attention_heads=8,
                                                          num_key_value_heads=2, mrope_section=(8, 12, 12)),
                           vision=dataclasses.replace(ARGS.vision, out_hidden_size=512))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategies", default="lb_micro,odc,lb_mini")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--refuse", choices=["hosts", "space"], help="a folder per rank (ranks on different machines), "
                   "or a folder reported nearly full: odc must refuse at its start with the reason")
    opts = p.parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    from titanrl.parallel import odc_comm
    from titanrl.rl.stages import StageRunner

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    kinds = [[], [("image", (1, 8, 8))], [], [("image", (1, 4, 4))], [], [], [("image", (1, 4, 8))]]
    trajs = make_trajectories(kinds, [2, 3, 1, 4, 2, 1, 3], min_response=8, max_response=40)
    mine = [t for t in trajs if home_of(t.group, world) == rank]
    if opts.refuse == "hosts":
        private = Path(opts.out).parent / f"shm-rank{rank}"
        private.mkdir(exist_ok=True)
        odc_comm._shm_dir = lambda: private
    elif opts.refuse == "space":
        odc_comm._free_bytes = lambda folder: 4096
    if opts.kill_rank == rank:
        original = odc_comm.OdcComm._push

        def push_then_die(self, *a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *a, **k)

        odc_comm.OdcComm._push = push_then_die

    def loss_fn(out, inp, global_tokens, global_seqs):
        return ppo_clip_loss(out.logprobs, inp.fields["old_logprobs"], inp.advantages, inp.seq_index,
                             inp.seq_lengths, global_tokens=global_tokens, global_seqs=global_seqs,
                             ref_logp=inp.fields["ref_logprobs"], entropy=out.entropy, **LOSS)

    libc = ctypes.CDLL("libc.so.6")
    results = {}
    for strategy in opts.strategies.split(","):
        torch.manual_seed(0)
        model = Qwen2_5_VLModel(WIDE)
        model.init_weights()
        model = parallelize_qwen2_5_vl(model, dp_mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runner = StageRunner(args=WIDE, rank=rank, world=world, device=torch.device("cpu"), dtype=torch.float32,
                             method="none", strategy=strategy, max_tokens=96, cost_model=CostModel(), p_max=1)
        added = None
        for measured in (False, True):
            runner.begin_step(mine)
            gc.collect()
            libc.malloc_trim(0)
            dist.barrier()
            heap = HeapSampler(interval_s=0.002)
            start = heap.report()["peak_heap_live_bytes"]
            heap.peak_live = start
            runner.train_minibatch(model, runner.all_ids(), ("old_logprobs", "ref_logprobs"), loss_fn,
                                   temperature=1.0)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            heap.stop()
            added = heap.report()["peak_heap_live_bytes"] - start
        comm = odc_comm.attached(model)
        shared = comm.shared_bytes if comm is not None else 0
        direct = all(comm.direct) if comm is not None else None
        every = [None] * world
        dist.all_gather_object(every, {"heap_added": added, "shared": shared,
                                       "barriers": comm.barriers if comm is not None else None,
                                       "microbatches": runner.stats.microbatches, "direct": direct}, group=None)
        results[strategy] = every
        del model, opt, runner, comm
    if rank == 0:
        Path(opts.out).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
