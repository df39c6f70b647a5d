"""Optimizer and LR schedule from the config (plain torch components)."""

from __future__ import annotations

import math

import torch

from titanrl.config import JobConfig


def build_optimizer(cfg: JobConfig, params, *, lr: float | None = None) -> torch.optim.Optimizer:
    """AdamW of ``[optimizer]`` (``lr``: another peak learning rate, e.g. the critic's)."""
    o = cfg.optimizer
    if o.name != "AdamW":
        raise ValueError(f"optimizer.name={o.name!r}: only 'AdamW' is supported")
    kernel = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}
    if o.implementation not in kernel:
        raise ValueError(f"optimizer.implementation={o.implementation!r}: one of {sorted(kernel)}")
    opt = torch.optim.AdamW(
        params, lr=o.lr if lr is None else lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
        **kernel[o.implementation]
    )
    # A checkpoint's param groups bring back the settings they were saved with (torch's load_state_dict, which
    # DCP's set_optimizer_state_dict calls): the config's constant hyper-parameters and kernel win on resume.
    # The learning rate is the checkpointed schedule's.
    configured = {k: opt.defaults[k] for k in ("betas", "eps", "weight_decay", "foreach", "fused")}

    def keep_configured(optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group.update(configured)

    opt.register_load_state_dict_post_hook(keep_configured)
    return opt


def lr_factor(step: int, *, warmup_steps: int, decay_steps: int, decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the base LR before optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_type == "constant" or decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps))
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler.decay_type={decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(cfg: JobConfig, optimizer: torch.optim.Optimizer, *,
                       warmup_steps: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """``[lr_scheduler]``'s schedule (``warmup_steps``: another warmup length, e.g. the critic's)."""
    s = cfg.lr_scheduler
    warmup = s.warmup_steps if warmup_steps is None else warmup_steps
    decay_steps = s.decay_steps if s.decay_steps is not None else max(0, cfg.job.steps - warmup)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step, warmup_steps=warmup, decay_steps=decay_steps, decay_type=s.decay_type,
            min_lr_factor=s.min_lr_factor,
        ),
    )
