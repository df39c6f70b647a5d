"""Push the trainer's current weights into the rollout engines without restarting them.

The weights stream: parameter by parameter, every rank takes part in unsharding it (FSDP2's
``DTensor.full_tensor``, a collective), cast to the parameter dtype before it leaves the device;
only one rank per machine (local rank 0) keeps it, converts it to its HF name and adds it to the
shard being written into shared memory (``HFShardWriter``: at most ``SHARD_BYTES`` pending); the
others drop it at once. So the extra host memory of a push is, per machine, the files themselves
plus one shard, and per non-writing rank one parameter - not a full fp32 copy of the model per rank
(28 GB per rank at 7B). After a barrier each rank's engine reloads in place from that directory.
A directory per push (alternating between two) keeps an engine from ever reading a half-written file.

Disaggregated placement (the engines on ranks that hold no model): each training rank sends its own FSDP
shard of every entry (cast to the parameter dtype) point-to-point to one rollout rank per machine, which
concatenates the shards into the full tensor and writes it the same way; then every rollout rank's engine
reloads from its machine's folder. No rank gathers the model before it leaves the training ranks.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from titanrl.distributed import DistInfo, all_gather_objects, barrier
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


def _sharded(value: torch.Tensor) -> bool:
    """Whether every training rank holds a different part of ``value`` (FSDP2: dim 0); otherwise the first
    training rank's copy is the tensor."""
    if not isinstance(value, DTensor) or all(p.is_replicate() for p in value.placements):
        return False
    if any(not (p.is_replicate() or (isinstance(p, Shard) and p.dim == 0)) for p in value.placements):
        raise ValueError(f"the weight push sends shards of dim 0 only, not {value.placements}")
    return True


def shard_layout(model: torch.nn.Module, dtype: torch.dtype | None) -> list[tuple[str, tuple, tuple, str, bool]]:
    """(name, full shape, this rank's shard shape, dtype, sharded) of every state-dict entry."""
    out = []
    for name, value in model.state_dict().items():
        sharded = _sharded(value)
        local = value.to_local() if isinstance(value, DTensor) else value
        dt = dtype if dtype is not None and value.is_floating_point() else value.dtype
        out.append((clean_name(name), tuple(value.shape), tuple(local.shape), str(dt).removeprefix("torch."),
                    sharded))
    return out


def send_shards(model: torch.nn.Module, dtype: torch.dtype | None, writers: list[int], *, first: bool) -> int:
    """This training rank's shard of every entry, in state-dict order, to every writer (``first``: this rank
    also sends the entries that are not sharded). Returns the bytes sent."""
    sent = 0
    for value in model.state_dict().values():
        value = value.detach()
        if not (_sharded(value) or first):
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        if dtype is not None and local.is_floating_point():
            local = local.to(dtype)
        if local.numel() == 0:
            continue
        local = local.contiguous()
        for r in [dist.isend(local, dst=w) for w in writers]:
            r.wait()
        sent += local.numel() * local.element_size() * len(writers)
    return sent


def receive_full_state(layouts: list[list[tuple]], senders: list[int], device: torch.device
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """On a writer: (name, full tensor on the CPU) of every entry, put together from the shards ``senders``
    send (``layouts[i]``: what ``shard_layout`` gave on ``senders[i]``)."""
    for e, (name, shape, _, dt, sharded) in enumerate(layouts[0]):
        dtype = getattr(torch, dt)
        parts = []
        for i, src in enumerate(senders if sharded else senders[:1]):
            local = layouts[i][e][2]
            if 0 in local:
                continue
            buf = torch.empty(local, dtype=dtype, device=device)
            dist.recv(buf, src=src)
            parts.append(buf.cpu())
        yield name, parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


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
    def __init__(self, job_name: str, args: Qwen2_5_VLArgs, model_dir: Path, info: DistInfo, dtype: torch.dtype,
                 placement=None) -> None:
        self.root = shm_root(job_name)
        self.args, self.model_dir, self.info, self.dtype = args, model_dir, info, dtype
        self.placement = placement  # titanrl.workflow.placement.Placement; None: colocated
        self.pushes = 0
        self._layouts: list | None = None
        self._writers: list[int] | None = None

    def _disaggregated_setup(self, model) -> None:
        """Once (every rank): the training ranks' shard layouts and the writing rollout rank of each machine."""
        mine = (socket.gethostname(), shard_layout(model, self.dtype) if model is not None else None)
        every = all_gather_objects(mine)
        self._layouts = [every[r][1] for r in self.placement.train]
        first_on_host: dict[str, int] = {}
        for r in self.placement.rollout:
            first_on_host.setdefault(every[r][0], r)
        self._writers = sorted(first_on_host.values())

    def export(self, model: torch.nn.Module | None) -> Path:
        target = self.root / f"slot{self.pushes % 2}"
        disaggregated = self.placement is not None and self.placement.disaggregated
        if disaggregated and self._writers is None:
            self._disaggregated_setup(model)
        # one writer per machine; the others wait at the barrier
        writer_rank = self.info.rank in self._writers if disaggregated else self.info.local_rank == 0
        if writer_rank and target.exists():
            shutil.rmtree(target)
        if not disaggregated:
            write_hf(model, self.args, target, dtype=self.dtype, writer_rank=writer_rank,
                     assets_from=self.model_dir)
        else:
            if model is not None:
                send_shards(model, self.dtype, self._writers, first=self.info.rank == self.placement.train[0])
            if writer_rank:
                writer = HFShardWriter(target, self.args, dtype=self.dtype, shard_bytes=SHARD_BYTES)
                for name, tensor in receive_full_state(self._layouts, list(self.placement.train), self.info.device):
                    writer.add(name, tensor)
                writer.close(self.model_dir)
        barrier()
        self.pushes += 1
        return target

    def push(self, model: torch.nn.Module | None, engine) -> dict[str, float]:
        """Every rank: the model's new weights into every engine (``model`` / ``engine`` None where a rank of a
        disaggregated placement holds none)."""
        t0 = time.perf_counter()
        path = self.export(model)
        t1 = time.perf_counter()
        if engine is not None:
            engine.load_weights(path)
        t2 = time.perf_counter()
        # a rank without the model only waits in the export (for the training ranks' update, then their shards)
        return {**({"sync/export_s": t1 - t0} if model is not None else {}),
                **({"sync/load_s": t2 - t1} if engine is not None else {})}

    def close(self, *, collective: bool = True) -> None:
        """Remove this job's push folder (local rank 0, after the others are done with it; after a failure,
        ``collective=False``, without waiting for them)."""
        if collective:
            barrier()
        if self.info.local_rank == 0 and self.root.exists():
            shutil.rmtree(self.root, ignore_errors=True)
