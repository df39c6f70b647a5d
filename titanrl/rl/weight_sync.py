"""Push the trainer's current weights into the rollout engines without restarting them.

The weights stream: parameter by parameter, every rank takes part in unsharding it (FSDP2's
``DTensor.full_tensor``, a collective), cast to the parameter dtype before it leaves the device;
only one rank per machine (local rank 0) keeps it, converts it to its HF name and adds it to the
shard being written into shared memory (``HFShardWriter``: at most ``SHARD_BYTES`` pending); the
others drop it at once. So the extra host memory of a push is, per machine, the files themselves
plus one shard, and per non-writing rank one parameter - not a full fp32 copy of the model per rank
(28 GB per rank at 7B). After a barrier each rank's engine reloads in place from that directory.
A directory per push (alternating between two) keeps an engine from ever reading a half-written file.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor

from titanrl.distributed import DistInfo, barrier
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.models.qwen2_5_vl.state_dict_adapter import HFShardWriter, clean_name

SHARD_BYTES = 256 << 20  # what the writer holds before a shard goes to the file (bounds host memory)


def stream_full_state(model: torch.nn.Module, dtype: torch.dtype | None, *, keep: bool
                      ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, unsharded tensor) for every entry of the model's state dict, one at a time, in the same
    order on every rank (each sharded entry is a collective every rank must join). Floating tensors are
    cast to ``dtype`` on their device first; ranks with ``keep=False`` get None and hold nothing."""
    for name, value in model.state_dict().items():
        value = value.detach()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)  # before the gather: bf16 parameters move half the bytes of fp32 masters
        if isinstance(value, DTensor):
            value = value.full_tensor()
        yield clean_name(name), (value.to("cpu") if keep else None)
        del value


def write_hf(model: torch.nn.Module, args: Qwen2_5_VLArgs, outdir: Path, *,
             dtype: torch.dtype | None, writer_rank: bool, assets_from: Path | None,
             shard_bytes: int = SHARD_BYTES) -> HFShardWriter | None:
    """Stream the model's full weights into an HF directory written by the ranks with ``writer_rank``
    (the others take part in the gathers only). Returns the writer (for its counters) on writers."""
    writer = HFShardWriter(outdir, args, dtype=dtype, shard_bytes=shard_bytes) if writer_rank else None
    for name, tensor in stream_full_state(model, dtype, keep=writer is not None):
        if writer is not None:
            writer.add(name, tensor)
    if writer is not None:
        writer.close(assets_from)
    return writer


def _shm_base() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def remove_stale_push_folders(base: Path | None = None) -> list[Path]:
    """Remove the push folders (``titanrl-<job>-...-<pid>``) whose owning process is gone: what runs killed on
    this machine (kill -9, an OOM kill) left in shared memory. The owner is the pid the name ends with (the
    torchrun agent, or the process of a one-process run); a pid that lives again but started after the folder
    was made is another process, so its folder is stale too. Returns what was removed."""
    import psutil

    removed = []
    for folder in (base or _shm_base()).glob("titanrl-*"):
        pid_text = folder.name.rsplit("-", 1)[-1]
        if not folder.is_dir() or not pid_text.isdigit():
            continue
        try:
            alive = psutil.Process(int(pid_text)).create_time() <= folder.stat().st_mtime + 1.0
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
            alive = False
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def shm_root(job_name: str) -> Path:
    """The node-local folder the ranks of one job push weights through: unique per job on the node.

    Under torchrun the local ranks share their elastic agent (the parent process), whose pid no other
    live job on the node has; ``TORCHELASTIC_RUN_ID`` alone is not enough (it is "none" without
    ``--rdzv-id``). A plain ``python -m titanrl.train`` is one process: its own pid (its parent may be
    a shell or init, shared with other jobs)."""
    base = _shm_base()
    if "LOCAL_WORLD_SIZE" in os.environ:
        job = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}-{os.getppid()}"
    else:
        job = str(os.getpid())
    return base / f"titanrl-{job_name}-{job}"


class WeightPusher:
    def __init__(self, job_name: str, args: Qwen2_5_VLArgs, model_dir: Path, info: DistInfo, dtype: torch.dtype) -> None:
        self.root = shm_root(job_name)
        self.args, self.model_dir, self.info, self.dtype = args, model_dir, info, dtype
        self.pushes = 0

    def export(self, model: torch.nn.Module) -> Path:
        target = self.root / f"slot{self.pushes % 2}"
        writer_rank = self.info.local_rank == 0  # one writer per machine; the others wait at the barrier
        if writer_rank and target.exists():
            shutil.rmtree(target)
        write_hf(model, self.args, target, dtype=self.dtype, writer_rank=writer_rank,
                 assets_from=self.model_dir)
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

    def close(self, *, collective: bool = True) -> None:
        """Remove this job's push folder (local rank 0, after the others are done with it; after a failure,
        ``collective=False``, without waiting for them)."""
        if collective:
            barrier()
        if self.info.local_rank == 0 and self.root.exists():
            shutil.rmtree(self.root, ignore_errors=True)
