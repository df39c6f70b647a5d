"""Apply parallelism and training techniques to a Qwen2.5-VL model from the outside.

Order, as in torchtitan: Ulysses attention wrapper -> activation checkpointing -> per-block
torch.compile -> FSDP2.
Each vision block and each decoder layer is its own FSDP unit (all-gathered just in time,
resharded after use); the vision tower's remaining parameters (patch embedding, merger) are a unit
of their own, and the root unit holds the token embeddings, final norm and output. The tower is
kept out of the root because, under ``lb_mini``, its gradient arrives only in a minibatch's last
backward while the language model's accumulates over every microbatch: FSDP2 accumulates a
unit's unreduced gradients in ``reduce_dtype`` and reduces the last backward's in ``param_dtype``,
and one unit holding both would mix bfloat16 and float32 in one reduce-scatter.

Gradient reduction is a plain SUM (divide factor 1, force-sum): the trainer normalises the
loss by *global* token/sequence counts, so summing is exactly the single-process gradient
whatever the per-rank batch sizes are (ranks get unequal microbatch counts under ODC-style
balancing). Force-sum also avoids PREMUL_SUM, which gloo rejects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titanrl.models.qwen2_5_vl.model import Qwen2_5_VLModel
from titanrl.parallel.ulysses import apply_ulysses

ActivationCheckpoint = Literal["none", "full"]


@dataclass(frozen=True)
class CompileOptions:
    enable: bool = False
    backend: str = "inductor"
    dynamic: bool = True


def transformer_blocks(model: Qwen2_5_VLModel) -> list[tuple[nn.ModuleDict, str]]:
    """(container, key) of every repeated block: vision blocks then decoder layers."""
    return [(model.vision.blocks, k) for k in model.vision.blocks] + [(model.layers, k) for k in model.layers]


def apply_activation_checkpointing(model: Qwen2_5_VLModel, mode: ActivationCheckpoint) -> None:
    if mode == "none":
        return
    if mode != "full":
        raise ValueError(f"activation_checkpoint={mode!r}: expected 'none' or 'full'")
    for container, key in transformer_blocks(model):
        container[key] = checkpoint_wrapper(container[key], preserve_rng_state=False)


def apply_compile(model: Qwen2_5_VLModel, options: CompileOptions) -> None:
    """Compile each block separately: the blocks repeat, so one compiled graph serves them
    all, and the data-dependent packing logic (masks, window permutation) stays eager."""
    if not options.enable:
        return
    for container, key in transformer_blocks(model):
        container[key].compile(backend=options.backend, dynamic=options.dynamic)


def apply_fsdp(
    model: Qwen2_5_VLModel,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    offload: bool = False,
) -> None:
    """``offload``: the shards live in host memory (``CPUOffloadPolicy``, pinned when CUDA is there), copied to the
    device per unit for its all-gather (a frozen reference model: ``rl.ref_offload``)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    kw = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    for container, key in transformer_blocks(model):
        fully_shard(container[key], **kw)
    fully_shard(model.vision, **kw)
    # The root's own parameters (embedding, final norm, output head) are the first the backward needs: resharding
    # them after forward would only gather them again at once (an all-gather of ~1.1 B parameters per microbatch
    # at 7B). PyTorch keeps a root gathered only when reshard_after_forward is left unset; say it. Stages without
    # a backward reshard it when they end (titanrl.parallel.odc.reshard_root_after).
    fully_shard(model, **{**kw, "reshard_after_forward": False})
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def parallelize_qwen2_5_vl(
    model: Qwen2_5_VLModel,
    *,
    dp_mesh: DeviceMesh | None,
    compile_options: CompileOptions = CompileOptions(),
    activation_checkpoint: ActivationCheckpoint = "none",
    param_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    ulysses: bool = False,
    offload: bool = False,
) -> Qwen2_5_VLModel:
    if ulysses:
        apply_ulysses(model)
    apply_activation_checkpointing(model, activation_checkpoint)
    apply_compile(model, compile_options)
    if dp_mesh is not None:
        apply_fsdp(model, dp_mesh, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward,
                   offload=offload)
    elif offload:
        raise ValueError("offload needs FSDP: a data-parallel mesh (a one-rank one for one process)")
    return model


def build_parallel_model(
    args,
    checkpoint,
    *,
    device: torch.device,
    dp_mesh: DeviceMesh | None,
    trainable: bool = True,
    value_head: bool = False,
    attn_backend: str = "sdpa",
    lora=None,
    freeze_vision: bool = False,
    seed: int = 0,
    **parallel: object,
) -> Qwen2_5_VLModel:
    """A Qwen2.5-VL model ready to run: built on the meta device, parallelised (``parallelize_qwen2_5_vl`` with
    ``parallel``), materialised on ``device`` and filled from the HF ``checkpoint`` folder, each rank allocating
    and reading only its own FSDP shards (torchtitan's order: meta build, parallelize, ``to_empty``, load).
    ``trainable=False``: no gradients, eval mode (a reference model). ``lora`` (a ``[lora]`` section with
    ``rank > 0``): adapters on the target layers before parallelising, the base frozen in ``param_dtype``, the
    adapters initialised from ``seed`` after the load (``titanrl.models.lora``). ``freeze_vision``: the vision tower
    gets no gradients (model.freeze_vision_tower)."""
    from titanrl.models.lora import apply_lora, init_adapters
    from titanrl.models.qwen2_5_vl.state_dict_adapter import load_hf_weights

    with torch.device("meta"):
        model = Qwen2_5_VLModel(args, value_head=value_head)
    model.set_attention_backend(attn_backend)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    if freeze_vision:
        model.vision.requires_grad_(False)
    if lora is not None:
        apply_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets,
                   vision=lora.vision, modules_to_save=lora.modules_to_save, base_dtype=parallel.get("param_dtype"))
    model = parallelize_qwen2_5_vl(model, dp_mesh=dp_mesh, **parallel)
    # offloaded shards are materialised in host memory; FSDP2 copies them to ``device`` per unit
    model.to_empty(device="cpu" if parallel.get("offload") else device)
    model.reinit_buffers()  # non-persistent buffers (rotary frequencies) are not in the checkpoint
    load_hf_weights(model, checkpoint)
    if lora is not None:
        init_adapters(model, seed)
    return model
