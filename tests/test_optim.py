"""``optimizer.implementation``: torch's AdamW with the kernel the key names, on the FSDP2 shards (DTensors) the
trainer gives it; the three kernels make the same update up to float rounding, a state saved by one drives
another, and a resume keeps the configured kernel and hyper-parameters."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from titanrl.config import load_config
from titanrl.models.packed import pack_sequences
from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, load_hf_weights
from titanrl.models.qwen2_5_vl.inputs import make_sequence_input
from titanrl.optim import build_optimizer
from titanrl.parallel.parallelize import apply_fsdp

TINY = "configs/tiny_cpu.toml"
KINDS = ("foreach", "fused", "for-loop")


def test_the_key_picks_torchs_kernel():
    for kind in KINDS:
        opt = build_optimizer(load_config(TINY, [f"--optimizer.implementation={kind}"]), [torch.nn.Parameter(
            torch.zeros(3))])
        assert isinstance(opt, torch.optim.AdamW)
        assert (opt.defaults["fused"], opt.defaults["foreach"]) == {
            "foreach": (None, True), "fused": (True, None), "for-loop": (None, False)}[kind]


def _stepped(kind: str, mesh, ckpt, steps: int = 3, state: dict | None = None):
    """``steps`` AdamW steps of ``kind`` on the tiny model's FSDP shards, each with the same real gradient scaled
    by 1, -0.5, 2, ... (the gradient is fed, not recomputed from the moving weights: Adam divides by the gradient's
    running magnitude, so a rounding-level change of a near-zero gradient's sign would move a weight by ~lr)."""
    args = Qwen2_5_VLArgs.from_pretrained(ckpt)
    model = Qwen2_5_VLModel(args)
    load_hf_weights(model, ckpt)
    apply_fsdp(model, mesh)
    opt = build_optimizer(load_config(TINY, [f"--optimizer.implementation={kind}", "--optimizer.lr=0.01"]),
                          model.parameters())
    if state is not None:
        opt.load_state_dict(copy.deepcopy(state))  # torch keeps the saved ``step`` tensors and counts them on
    batch = pack_sequences([make_sequence_input(args, np.random.default_rng(0).integers(0, 900, 20), [], None)])
    (model(batch).hidden.float() ** 2).mean().backward()
    grads = {p: p.grad.detach().clone() for p in model.parameters() if p.grad is not None}  # not the vision tower's
    assert len(grads) > 10 and all(isinstance(p, DTensor) and isinstance(g, DTensor) for p, g in grads.items())
    for k in range(steps):
        for p, g in grads.items():
            p.grad = g * (1.0, -0.5, 2.0)[k % 3]
        opt.step()
    opt.zero_grad(set_to_none=True)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return params, opt.state_dict()


def _diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_the_kernels_make_the_same_update_on_fsdp_shards_and_share_their_state(one_rank_mesh, tiny_ckpt):
    start, _ = _stepped("foreach", one_rank_mesh, tiny_ckpt, steps=0)
    ref, ref_state = _stepped("foreach", one_rank_mesh, tiny_ckpt)
    assert _diff(ref, start) > 1e-3  # lr 0.01 over 3 steps: the comparison below is not between untouched weights
    for kind in ("fused", "for-loop"):
        got, state = _stepped(kind, one_rank_mesh, tiny_ckpt)
        assert _diff(got, ref) <= 1e-6, (kind, _diff(got, ref))
        assert state["state"].keys() == ref_state["state"].keys()
    # the state a foreach run saved drives a fused optimizer (a checkpoint resumed with the other key): a step
    # from it equals a foreach step from it, and differs from a step from a fresh state
    resumed, state = _stepped("fused", one_rank_mesh, tiny_ckpt, steps=1, state=ref_state)
    assert state["param_groups"][0]["fused"] is True  # the configured kernel ran, not the saved group's
    again, _ = _stepped("foreach", one_rank_mesh, tiny_ckpt, steps=1, state=ref_state)
    fresh, _ = _stepped("foreach", one_rank_mesh, tiny_ckpt, steps=1)
    assert _diff(resumed, again) <= 1e-6 < _diff(resumed, fresh)


def test_a_resume_keeps_the_configured_hyper_parameters():
    """torch's load_state_dict restores each param group's settings from the saved state; build_optimizer's
    hook puts the config's back (the key does what it says after a resume too); the LR stays the schedule's."""
    saved = build_optimizer(load_config(TINY, ["--optimizer.weight_decay=0.01", "--optimizer.eps=1e-8"]),
                            [torch.nn.Parameter(torch.ones(3))], lr=0.5).state_dict()
    cfg = load_config(TINY, ["--optimizer.weight_decay=0.05", "--optimizer.eps=1e-6", "--optimizer.betas=[0.8, 0.9]",
                             "--optimizer.implementation=for-loop"])
    opt = build_optimizer(cfg, [torch.nn.Parameter(torch.ones(3))], lr=0.1)
    opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert (group["weight_decay"], group["eps"], group["betas"], group["foreach"], group["fused"]) == (
        0.05, 1e-6, (0.8, 0.9), False, None)
    assert group["lr"] == 0.5
