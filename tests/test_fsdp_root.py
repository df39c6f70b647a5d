"""The FSDP2 root's own parameters (embedding, final norm, output head) on a one-rank mesh, in this process:
gathered from a forward to its backward (``apply_fsdp`` sets the root's reshard_after_forward to False; with
True, PyTorch gathers them again at once in backward, and torch 2.11's one-rank path lost them: the GPU check's
first 7B-shaped run, benchmarks/gpu_check.json), and freed by a stage without backward (``reshard_root_after``)."""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from titanrl.models.packed import pack_sequences
from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, load_hf_weights
from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
from titanrl.parallel.odc import reshard_root_after
from titanrl.parallel.parallelize import apply_fsdp


def gathered(model: Qwen2_5_VLModel) -> bool:
    """The root's parameters are plain tensors while gathered, DTensor shards otherwise."""
    return not isinstance(model.output.weight, DTensor)


def test_the_root_stays_gathered_after_forward_and_a_stage_without_backward_frees_it(one_rank_mesh, tiny_ckpt):
    args = Qwen2_5_VLArgs.from_pretrained(tiny_ckpt)
    model = Qwen2_5_VLModel(args)
    load_hf_weights(model, tiny_ckpt)
    apply_fsdp(model, one_rank_mesh, param_dtype=torch.bfloat16)
    ids = np.random.default_rng(0).integers(0, 900, 24)
    batch = pack_sequences([make_sequence_input(args, ids, [], None)])
    assert not gathered(model)

    with reshard_root_after(model):
        with torch.no_grad():
            model(batch)
        assert gathered(model)  # FSDP2 keeps a root gathered after forward: a backward would need it at once
        block = model.layers["0"] if isinstance(model.layers, torch.nn.ModuleDict) else model.layers[0]
        assert all(isinstance(p, DTensor) for p in block.parameters())  # blocks reshard after their forward
    assert not gathered(model)  # the stage ended without a backward: the root is resharded

    out = model(batch)
    assert gathered(model)
    out.hidden.float().sum().backward()
    assert not gathered(model)  # resharded after its backward
    assert model.tok_embeddings.weight.grad.full_tensor().abs().sum() > 0
