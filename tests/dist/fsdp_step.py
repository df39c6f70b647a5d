"""Two optimizer steps of the tiny Qwen2.5-VL on a fixed global batch.

Run plainly (one process, no FSDP: the reference) or under torchrun (gloo, FSDP2 over all
ranks, each rank taking every world_size-th sample). Writes losses and the full final
parameters to --out so the test can compare runs.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hf_reference import make_sample  # noqa: E402

from titanrl.models.packed import pack_sequences  # noqa: E402
from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, TextArgs, VisionArgs  # noqa: E402
from titanrl.models.qwen2_5_vl.inputs import make_sequence_input  # noqa: E402
from titanrl.models.qwen2_5_vl.model import LogprobTargets  # noqa: E402
from titanrl.parallel.parallelize import CompileOptions, parallelize_qwen2_5_vl  # noqa: E402

ARGS = Qwen2_5_VLArgs(
    text=TextArgs(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, mrope_section=(2, 3, 3), rope_theta=10000.0),
    vision=VisionArgs(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      window_size=56, fullatt_block_indexes=(1,)),
    image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293,
)


def global_batch():
    rng = np.random.default_rng(0)
    kinds = [[], [("image", (1, 8, 8))], [("video", (4, 4, 6))], [("image", (1, 4, 4)), ("image", (1, 6, 4))]]
    return [make_sample(rng, kinds[i % 4], text_len=3 + i) for i in range(8)]


def clean(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the wrapper prefixes compile/AC add, so all runs share parameter names."""
    return {k.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): v for k, v in state.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--compile", default="none", choices=["none", "inductor", "aot_eager"])
    p.add_argument("--ac", default="none", choices=["none", "full"])
    opts = p.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    else:
        rank, world, mesh = 0, 1, None

    torch.manual_seed(0)
    model = Qwen2_5_VLModel(ARGS)
    model.init_weights()
    compile_opts = CompileOptions(enable=opts.compile != "none", backend=opts.compile if opts.compile != "none" else "inductor")
    model = parallelize_qwen2_5_vl(model, dp_mesh=mesh, compile_options=compile_opts, activation_checkpoint=opts.ac)
    # eps well above float32 noise: Adam turns a ~1e-9 gradient into a full-size step of either
    # sign, which would compare rounding noise instead of the distributed computation.
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, weight_decay=0.1)

    samples = global_batch()
    mine = samples[rank::world]
    # next-token targets inside each sequence; normalised by the GLOBAL target count
    global_targets = sum(len(s.token_ids) - 1 for s in samples)
    losses = []
    for step in range(2):
        seqs = [make_sequence_input(ARGS, s.token_ids, s.grids, s.pixel_values) for s in mine]
        batch = pack_sequences(seqs)
        starts = batch.cu_seqlens[:-1].tolist()
        ends = batch.cu_seqlens[1:].tolist()
        positions = torch.cat([torch.arange(s, e - 1) for s, e in zip(starts, ends)])
        out = model(batch, LogprobTargets(positions=positions, token_ids=batch.input_ids[positions + 1]))
        logp = out.logprobs
        loss = -logp.sum() / global_targets
        loss.backward()
        if step == 0:
            first_grads = {
                name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                for name, p in model.named_parameters()
            }
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        if distributed:
            dist.all_reduce(total)
        losses.append(total.item())

    if distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    full = clean(full)
    if rank == 0:
        torch.save({"losses": losses, "params": full, "grads": clean(first_grads)}, opts.out)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
