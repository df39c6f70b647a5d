"""Process-group set-up at the edges: torchrun's environment in, a device and a mesh out.

One process without torchrun is a world of one with no process group at all, so
``python -m titanrl.train`` and ``torchrun ... -m titanrl.train`` run the same code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(timeout_s: float = 600.0, *, one_rank_group: bool = False) -> DistInfo:
    """NCCL (with gloo for CPU tensors) on CUDA machines, gloo elsewhere; the device follows LOCAL_RANK.
    ``one_rank_group``: a process that is the whole job (no torchrun, or ``--nproc-per-node 1``) still gets a
    one-rank process group (an in-memory store), so FSDP2 and its mixed-precision policy can run on a one-rank
    mesh (``build_dp_mesh(one_rank=True)``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # CUDA tensors over NCCL; the small CPU tensors of the control path (step statistics, plans, the
        # loader's metadata) over gloo, in the same groups
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    elif world == 1 and one_rank_group and not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local_rank, device)


def build_dp_mesh(info: DistInfo, *, one_rank: bool = False, ranks: Sequence[int] | None = None,
                  group=None, shard: int | None = None) -> DeviceMesh | None:
    """The data-parallel (FSDP2) mesh; None for one process unless ``one_rank`` (and a one-rank group exists).
    ``ranks`` / ``group``: the ranks holding the models and their process group, when they are not all (the
    mesh is made on those ranks only; None elsewhere). ``shard`` below the world size (every rank holds the
    models): a 2-D mesh, ``dp_replicate`` x ``dp_shard``, each group of ``shard`` consecutive ranks sharding the
    models and the groups replicating them (hybrid sharding, FSDP2's HSDP)."""
    if ranks is not None and len(ranks) != info.world_size:
        if info.rank not in ranks:
            return None
        return DeviceMesh.from_group(group, info.device.type, mesh=list(ranks), mesh_dim_names=("dp_shard",))
    if not info.distributed and not (one_rank and dist.is_initialized()):
        return None
    if shard is not None and shard < info.world_size:
        return init_device_mesh(info.device.type, (info.world_size // shard, shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp_shard",))


def machine_of_ranks(info: DistInfo) -> list[int]:
    """The machine of every rank (collective): torchrun's agent rank (``GROUP_RANK``, one agent per machine; 0
    without torchrun). Namespaced hosts on one kernel are machines here as torchrun launched them."""
    return [int(m) for m in all_gather_objects(int(os.environ.get("GROUP_RANK", "0")))] if info.distributed else [0]


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(value: torch.Tensor, group=None) -> torch.Tensor:
    """In place over ``group`` (default: all ranks)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, group=group)
    return value


def all_reduce_max(value: float, group=None) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_gather_objects(obj: object, group=None) -> list[object]:
    """Every rank's ``obj`` (small metadata only: pickled), in rank order (of ``group``, default: all ranks)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


ArraySpec = tuple[tuple[int, ...], "np.dtype"]


def all_to_all_arrays(
    send: list[list[np.ndarray]],
    recv_specs: list[list[ArraySpec]],
    *,
    rank: int,
    device: torch.device,
    collective: bool = True,
    group=None,
) -> tuple[list[list[np.ndarray]], int]:
    """One all-to-all that moves lists of numpy arrays: ``send[d]`` goes to rank ``d`` and
    ``recv_specs[s]`` gives the shapes/dtypes rank ``s`` sends here (both sides know them from
    the plan, so no sizes are exchanged first). Every array of a destination travels in one
    byte buffer; what a rank sends itself is handed over without a copy. ``collective=False``
    (every rank must agree: nothing crosses ranks) skips the collective. Returns the received
    lists and the bytes this rank sent to others. ``rank`` and the list positions are ranks of ``group``
    (default: all ranks)."""
    world = len(send)
    received: list[list[np.ndarray]] = [[] for _ in range(world)]
    received[rank] = list(send[rank])
    if world == 1 or not collective:
        for s in range(world):
            if s != rank and (send[s] or recv_specs[s]):
                raise RuntimeError(f"rank {rank} has data for rank {s} but the exchange was planned as local")
        return received, 0
    payload = [np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays])
               if arrays and d != rank else np.zeros(0, np.uint8) for d, arrays in enumerate(send)]
    in_sizes = [int(b.size) for b in payload]
    out_sizes = [0 if s == rank else sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in recv_specs[s])
                 for s in range(world)]
    inp = torch.from_numpy(np.concatenate(payload)) if sum(in_sizes) else torch.zeros(0, dtype=torch.uint8)
    out = torch.empty(sum(out_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, inp.to(device), out_sizes, in_sizes, group=group)
    buf = out.cpu().numpy()
    offset = 0
    for s in range(world):
        if s == rank:
            continue
        for shape, dt in recv_specs[s]:
            nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
            received[s].append(buf[offset:offset + nbytes].view(dt).reshape(shape))
            offset += nbytes
    return received, sum(in_sizes)


def new_group(ranks: Sequence[int], timeout_s: float | None = None):
    """A process group of ``ranks`` with ``timeout_s`` (``job.collective_timeout_s``); every rank calls it."""
    return dist.new_group(ranks=list(ranks), timeout=_timeout(timeout_s))


def _timeout(timeout_s: float | None) -> timedelta | None:
    return None if timeout_s is None else timedelta(seconds=timeout_s)


def build_ulysses_groups(rank: int, world: int, degrees: Sequence[int], device: torch.device,
                         timeout_s: float | None = None, ranks: Sequence[int] | None = None) -> dict:
    """This rank's process group for every Ulysses degree ``p > 1`` in ``degrees``: the aligned blocks of
    ``p`` consecutive ranks (the ``ulysses`` dimension of a ``(world / p, p)`` mesh: FlexRL's nested groups),
    created with ``timeout_s`` (``job.collective_timeout_s``; torch's own default is 30 minutes whatever the
    default group's). Built once at start-up (making a group is a collective every rank joins); keyed by the
    member ranks. ``p`` must divide ``world``.

    ``ranks``: the global ranks of the training group whose positions ``rank`` and the blocks count (default:
    0 .. world-1); every rank of the job calls this, also one outside ``ranks`` (it gets no group)."""
    ranks = list(range(world)) if ranks is None else list(ranks)
    groups: dict[tuple[int, ...], object] = {}
    for p in sorted(set(degrees)):
        if p <= 1:
            continue
        if world % p:
            raise ValueError(f"Ulysses degree {p} does not divide the {world} ranks")
        blocks = torch.arange(world).view(world // p, p).tolist()
        mine, _ = dist.new_subgroups_by_enumeration([[ranks[i] for i in b] for b in blocks],
                                                    timeout=_timeout(timeout_s))
        if 0 <= rank < world:
            groups[tuple(next(b for b in blocks if rank in b))] = mine
    return groups


def block_group(rank: int, world: int, size: int, timeout_s: float | None = None):
    """This rank's process group among the aligned blocks of ``size`` consecutive ranks (every rank calls it;
    None for ``size`` 1)."""
    if size <= 1:
        return None
    blocks = [list(range(b, b + size)) for b in range(0, world, size)]
    mine, _ = dist.new_subgroups_by_enumeration(blocks, timeout=_timeout(timeout_s))
    return mine


_STATELESS_PREFIX = "titanrl-stateless"


def host_store(timeout_s: float) -> dist.TCPStore:
    """A TCP store this process hosts on a free port (``.port``), for a ``stateless_group`` it is rank 0 of."""
    return dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def stateless_group(address: tuple[str, int], rank: int, world: int, device: torch.device, timeout_s: float,
                    store: dist.TCPStore | None = None):
    """A process group outside torch.distributed's world (nothing registered, no default group touched), so that
    processes of other worlds can join it: vLLM's workers and the rank that sends them weights. Rank 0 hosts the
    store (``host_store``, passed as ``store``); the others reach it at ``address``. NCCL on a CUDA device, gloo on
    the CPU; use it with ``broadcast_from_first``. Every member blocks here until all have joined."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(address[0], address[1], is_master=False, timeout=timeout)
    store = dist.PrefixStore(_STATELESS_PREFIX, store)
    if device.type == "cuda":
        group = dist.ProcessGroupNCCL(store, rank, world)
    else:
        group = dist.ProcessGroupGloo(store, rank, world, timeout)
    # the first collective connects every pair: fail here, not in the first push
    broadcast_from_first(group, torch.zeros(1, device=device))
    return group


def broadcast_from_first(group, tensor: torch.Tensor) -> None:
    """``tensor`` from the group's rank 0 to every member, in place (a group of ``stateless_group``)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()
