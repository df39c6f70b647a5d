"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3): a frozen linear layer
``W x + b`` becomes ``W x + b + (alpha / r) B A x`` with ``A`` (r x in) and ``B`` (out x r) trained, ``B = 0`` at
first so the adapted model starts as the base.

A model transform, applied before ``parallelize`` like torchtitan's other transforms: ``apply_lora`` turns the
target ``nn.Linear`` modules of a model built on the meta device into ``LoRALinear`` (the same ``weight`` /
``bias``, plus ``lora_a`` / ``lora_b``), freezes every other parameter and keeps the frozen ones in the run's
``model.dtype`` (no float32 master copy, no gradient, no optimizer state). After the base is loaded,
``init_adapters`` fills the adapters the same way on any number of ranks (each full tensor from a generator seeded
by the run's seed and the parameter's name, then this rank's shard of it). The names follow PEFT's
(``lora_A`` / ``lora_B`` in its files: ``write_peft``), and so does A's initialisation (kaiming-uniform with
``a = sqrt(5)``: bounds of 1 / sqrt(in_features)).

``adapters_disabled(model)`` runs the base model (the reference log-probs, with no second copy of the base);
``merge_adapters`` turns the full-tensor stream of the weight push and the HF export into plain weights
``W + (alpha / r) B A``.
"""

from __future__ import annotations

import contextlib
import json
import math
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanrl.config.job_config import LORA_TOWER_ATTENTION

# lora.modules_to_save (PEFT's name; config.job_config.LORA_FULL_MODULES): trained in full, HF name -> titanrl module
FULL_MODULES = {"lm_head": "output", "embed_tokens": "tok_embeddings", "norm": "norm"}
ADAPTER_MARK = ".lora_"  # in the name of every adapter parameter (lora_a.weight, lora_b.weight)


def is_adapter(name: str) -> bool:
    return ADAPTER_MARK in name


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank update ``scale * lora_b(lora_a(dropout(x)))``. Dropout only where a gradient
    is taken (the update's forward), so the log-prob stages see the deterministic model."""

    lora_a: nn.Linear
    lora_b: nn.Linear
    scale: float
    dropout: float
    adapters_on: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapters_on:
            return out
        h = x
        if self.dropout > 0 and self.training and torch.is_grad_enabled():
            h = F.dropout(h, self.dropout)
        return out + self.lora_b(self.lora_a(h)) * self.scale


def _hf_module(name: str) -> str:
    """The HF module name of a titanrl linear layer (``layers.0.attention.wq`` -> ``model.layers.0.self_attn.q_proj``)."""
    from titanrl.models.qwen2_5_vl.state_dict_adapter import hf_name

    return hf_name(f"{name}.weight").removesuffix(".weight")


def target_modules(model: nn.Module, targets: Iterable[str], vision: bool) -> list[str]:
    """The names of the linear layers LoRA adapts: those of the decoder layers whose HF module name ends in one of
    ``targets``, and with ``vision`` the vision blocks' attention (``qkv``, ``proj``) and their MLP projections among
    ``targets``. The embeddings, the output head, the vision patch
    embedding and merger stay frozen as they are."""
    text = set(targets)
    tower = text | set(LORA_TOWER_ATTENTION)  # the vision blocks' attention, and their MLP projections among targets
    out = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        wanted = text if name.startswith("layers.") else tower if vision and name.startswith("vision.blocks.") \
            else set()
        if _hf_module(name).rsplit(".", 1)[-1] in wanted:
            out.append(name)
    return out


def apply_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float, targets: Iterable[str],
               vision: bool, modules_to_save: Iterable[str] = (), base_dtype: torch.dtype | None = None) -> list[str]:
    """Adapters on ``model``'s target layers (``target_modules``); the ``modules_to_save`` (``FULL_MODULES``' HF
    names) trained in full; everything else frozen (in ``base_dtype`` when given: the frozen weights need no float32
    master). Before ``parallelize``, on the meta device or not. Returns the adapted layers' names."""
    names = target_modules(model, targets, vision)
    if not names:
        raise ValueError(f"lora.targets={list(targets)} matches no linear layer of the model")
    full = {id(p) for m in modules_to_save for p in model.get_submodule(FULL_MODULES[m]).parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in full)
    if base_dtype is not None:
        for module in model.modules():
            for key, p in list(module._parameters.items()):
                if p is not None and p.is_floating_point() and p.dtype != base_dtype and id(p) not in full:
                    module._parameters[key] = nn.Parameter(p.detach().to(base_dtype), requires_grad=False)
    for name in names:
        layer = model.get_submodule(name)
        device = layer.weight.device
        layer.__class__ = LoRALinear
        layer.lora_a = nn.Linear(layer.in_features, rank, bias=False, device=device, dtype=torch.float32)
        layer.lora_b = nn.Linear(rank, layer.out_features, bias=False, device=device, dtype=torch.float32)
        layer.scale, layer.dropout, layer.adapters_on = alpha / rank, dropout, True
    return names


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def has_adapters(model: nn.Module | None) -> bool:
    return model is not None and any(True for _ in lora_layers(model))


def _clean(name: str) -> str:
    from titanrl.models.qwen2_5_vl.state_dict_adapter import clean_name

    return clean_name(name)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Every adapter's initial value, the same on any number of ranks: A kaiming-uniform (bound 1 / sqrt(in)) from
    a generator seeded by ``seed`` and the layer's name, B zero; a sharded parameter (FSDP2's DTensor) takes its
    rank's rows of the full tensor."""
    from titanrl.models.qwen2_5_vl.state_dict_adapter import local_box

    for name, layer in lora_layers(model):
        for which, param in (("a", layer.lora_a.weight), ("b", layer.lora_b.weight)):
            full = torch.zeros(param.shape, dtype=param.dtype)
            if which == "a":
                gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(_clean(name).encode())) % 2**63)
                bound = 1.0 / math.sqrt(layer.in_features)
                full.uniform_(-bound, bound, generator=gen)
            offset, shape, local = local_box(param)
            local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's storage on this rank (its shard when sharded; under no_grad the tensor itself)."""
    from titanrl.models.qwen2_5_vl.state_dict_adapter import local_box

    return local_box(p)[2]


_BASE_KEY = "_titanrl_base_of_saved"


@torch.no_grad()
def keep_base(model: nn.Module, modules_to_save: Iterable[str]) -> None:
    """Keep the base values of the parameters lora.modules_to_save trains in full (this rank's shards, float32), so
    that ``adapters_disabled`` runs the base model whole (PEFT's modules_to_save keeps the original modules for
    its ``disable_adapter`` likewise). Call it once the base weights are loaded, before any training or checkpoint
    load. A tied output head and embedding are one parameter, kept once."""
    params = {id(p): p for m in modules_to_save for p in model.get_submodule(FULL_MODULES[m]).parameters()}
    model.__dict__[_BASE_KEY] = [(p, _local(p).clone()) for p in params.values()]


def fsdp_reshard(model: nn.Module) -> None:
    """Every FSDP unit of ``model`` back to its shards (a unit gathered by a forward without backward would
    otherwise keep the values it gathered)."""
    from titanrl.parallel.odc import fsdp_modules

    for m in fsdp_modules(model):
        m.reshard()


@contextlib.contextmanager
def adapters_disabled(model: nn.Module | None, *, quiesce: Callable[[], None] | None = None):
    """``model`` as its base while inside (a model without adapters: as it is): the adapters off and, where
    ``keep_base`` kept them, the base values of lora.modules_to_save's parameters copied into their shards, the
    trained ones copied back on exit (bit for bit; the FSDP units resharded both times, so forwards gather what the
    shards hold). ``quiesce``: called before each of the two copies, where other ranks read this rank's shards
    without its part (ODC's shared-memory gathers: a barrier); on an error inside, the copy back skips it."""
    layers = [m for _, m in lora_layers(model)] if model is not None else []
    saved = model.__dict__.get(_BASE_KEY) if model is not None else None
    trained = None
    if saved:
        if quiesce is not None:
            quiesce()
        fsdp_reshard(model)
        with torch.no_grad():
            trained = [_local(p).clone() for p, _ in saved]
            for p, base in saved:
                _local(p).copy_(base)
    for m in layers:
        m.adapters_on = False
    finished = False
    try:
        yield model
        finished = True
    finally:
        for m in layers:
            m.adapters_on = True
        if trained is not None:
            if finished and quiesce is not None:
                quiesce()
            fsdp_reshard(model)
            with torch.no_grad():
                for (p, _), value in zip(saved, trained):
                    _local(p).copy_(value)


def scales(model: nn.Module) -> dict[str, float]:
    """Layer name (as in state-dict names, wrappers removed) -> alpha / r."""
    return {_clean(name): layer.scale for name, layer in lora_layers(model)}


def merge_adapters(stream: Iterable[tuple[str, torch.Tensor | None]], layer_scales: dict[str, float]
                   ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """A stream of (name, full tensor) in state-dict order with the adapters folded in: each adapted layer's
    ``weight`` comes out as ``W + scale * B A`` (computed in float32, returned in W's dtype) once its ``lora_b``
    has passed, and no adapter entry comes out. None tensors (a rank that only joins the gathers) pass as None."""
    held: dict[str, dict[str, torch.Tensor | None]] = {}
    for name, tensor in stream:
        layer, _, leaf = name.rpartition(".")
        if leaf == "weight" and layer in layer_scales:
            held[layer] = {"weight": tensor}
            continue
        if is_adapter(name):
            owner, _, part = name.partition(ADAPTER_MARK)  # part: "a.weight" / "b.weight"
            held[owner][part[0]] = tensor
            if len(held[owner]) == 3:
                parts = held.pop(owner)
                w = parts["weight"]
                if w is None:
                    yield f"{owner}.weight", None
                else:
                    delta = parts["b"].float() @ parts["a"].float()
                    yield f"{owner}.weight", (w.float() + layer_scales[owner] * delta).to(w.dtype)
            continue
        yield name, tensor
    if held:
        raise RuntimeError(f"adapted layers without both adapters in the stream: {sorted(held)[:4]}")


def trained_names(model: nn.Module) -> set[str]:
    """The names of the parameters a LoRA run trains: the adapters and the modules trained in full."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


class AdapterCheckpoint(nn.Module):
    """What a LoRA run's checkpoint holds of the policy: what it trains (the adapters, and lora.modules_to_save);
    the frozen base is ``model.path``'s, read again at start. A module view for torchtitan's ``CheckpointManager``,
    which saves ``state_dict()`` and restores with ``load_state_dict(strict=False)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule: its base stays out of this state dict
        object.__setattr__(self, "_names", trained_names(model))

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        return {k: v for k, v in self._model.state_dict().items() if k in self._names}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        mine = {k: v for k, v in state_dict.items() if k in self._names}
        missing = sorted(self._names - set(mine))
        if missing:
            raise KeyError(f"the checkpoint holds no adapter for {missing[:4]} (saved without LoRA, or another "
                           "lora.targets / lora.vision / lora.modules_to_save?)")
        return self._model.load_state_dict(mine, strict=False)


def write_peft(adapters: dict[str, torch.Tensor], outdir: Path, *, rank: int, alpha: float, dropout: float,
               base: str, full: dict[str, torch.Tensor] | None = None) -> Path:
    """The adapters (titanrl names -> full tensors) as a PEFT LoRA folder: ``adapter_config.json`` and
    ``adapter_model.safetensors`` with PEFT's names (``base_model.model.<HF module>.lora_A.weight``); ``full``: the
    weights of the modules trained in full (PEFT's ``modules_to_save``, saved under their HF names)."""
    from safetensors.torch import save_file

    from titanrl.models.qwen2_5_vl.state_dict_adapter import hf_name

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    tensors, modules = {}, set()
    saved = sorted({k for k, v in FULL_MODULES.items() for n in (full or {}) if n.startswith(v + ".")})
    for name, tensor in (full or {}).items():
        tensors[f"base_model.model.{hf_name(name)}"] = tensor.detach().contiguous().cpu()
    for name, tensor in adapters.items():
        owner, _, part = name.partition(ADAPTER_MARK)
        hf = _hf_module(owner)
        modules.add(hf.rsplit(".", 1)[-1])
        tensors[f"base_model.model.{hf}.lora_{part[0].upper()}.weight"] = tensor.detach().contiguous().cpu()
    save_file(tensors, str(outdir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "lora_dropout": dropout, "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": base, "inference_mode": True, "modules_to_save": saved or None}
    (outdir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return outdir
