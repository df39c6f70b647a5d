"""Push the trainer's current weights into the rollout engines without restarting them.

Every rank takes part in gathering the full (unsharded) state dict; one rank per machine
(local rank 0) converts it to HF names and writes one safetensors file into shared memory;
after a barrier each rank's engine reloads in place from that directory. A directory per push
(alternating between two) keeps an engine from ever reading a half-written file.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from titanrl.distributed import DistInfo, barrier
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.models.qwen2_5_vl.state_dict_adapter import save_hf_checkpoint

_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.")


def clean_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the module wrappers compile / activation checkpointing add to parameter names."""
    out = {}
    for k, v in state.items():
        for prefix in _WRAPPER_PREFIXES:
            k = k.replace(prefix, "")
        out[k] = v
    return out


def full_state_dict(model: torch.nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU copies of all parameters (a collective when distributed)."""
    if info.distributed:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    else:
        state = model.state_dict()
    return {k: v.detach().to("cpu", torch.float32) for k, v in clean_names(state).items()}


def shm_root(job_name: str) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"titanrl-{job_name}-{os.environ.get('TORCHELASTIC_RUN_ID', os.getppid())}"


class WeightPusher:
    def __init__(self, job_name: str, args: Qwen2_5_VLArgs, model_dir: Path, info: DistInfo, dtype: torch.dtype) -> None:
        self.root = shm_root(job_name)
        self.args, self.model_dir, self.info, self.dtype = args, model_dir, info, dtype
        self.pushes = 0

    def export(self, model: torch.nn.Module) -> Path:
        state = full_state_dict(model, self.info)
        target = self.root / f"slot{self.pushes % 2}"
        if self.info.local_rank == 0:
            if target.exists():
                shutil.rmtree(target)
            save_hf_checkpoint(state, self.args, target, assets_from=self.model_dir, dtype=self.dtype)
        barrier()
        self.pushes += 1
        return target

    def push(self, model: torch.nn.Module, engine) -> dict[str, float]:
        t0 = time.perf_counter()
        path = self.export(model)
        t1 = time.perf_counter()
        engine.load_weights(path)
        t2 = time.perf_counter()
        return {"sync/export_s": t1 - t0, "sync/load_s": t2 - t1}

    def close(self) -> None:
        barrier()
        if self.info.local_rank == 0 and self.root.exists():
            shutil.rmtree(self.root, ignore_errors=True)
