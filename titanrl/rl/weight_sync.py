"""The trainer's current weights into the rollout engines, in memory, without restarting them.

Gather: the model's FSDP2 shards are cast to the engine's dtype on their device and all-gathered in buckets
(``bucket_bytes`` of full tensors: one ``all_gather_into_tensor`` per bucket, not one collective per parameter),
then converted to HF names (``full_state``). At most one bucket of full tensors exists at a time, on the training
device: nothing goes through host memory on a GPU, and nothing is written to a file.

Colocated: every rank joins the gathers and hands each full tensor straight to its own engine
(``engine.update_weights``: the model's ``load_weights`` in place, in the rank's process); an engine over T ranks
(``rollout.tensor_parallel_size``) gets the full tensors on each of its ranks and vLLM's loaders keep each rank's part.

Disaggregated (the engines on ranks that hold no model, their workers in processes of their own): the training
ranks gather as above, and the first training rank broadcasts each bucket over a process group made for the push
(``titanrl.distributed.stateless_group``: NCCL on GPU, gloo on CPU) whose other members are every engine's
workers; the rollout ranks only tell their engines to receive (``engine.receive_weights``).

What moves: the first push (at start-up after a resume, else after the first step) sends the whole model; after it,
only the *push units* a step can change (``push_unit``: a decoder layer or vision block whole, else a top-level
module such as the embeddings or the merger) whose parameters train. A frozen vision tower
(``model.freeze_vision_tower``) and LoRA's frozen base outside the adapted layers stay as the engines have them.
Units are whole blocks so that an engine's fused modules (q/k/v, gate/up) are always given whole.

Before the first push each engine checks the update's names, shapes and dtypes against the checkpoint it started
from (a reload that fails half-way would kill vLLM). ``write_hf`` is the same gather into HF safetensors files:
``checkpoint.export_hf``, not the push.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from titanrl.distributed import (DistInfo, all_gather_objects, broadcast_from_first, host_store,
                                 stateless_group)
from titanrl.memory import PUSH_BUCKET_BYTES
from titanrl.models.lora import has_adapters, is_adapter, merge_adapters, trained_names, write_peft
from titanrl.models.lora import scales as lora_scales
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from titanrl.models.qwen2_5_vl.state_dict_adapter import HFShardWriter, Qwen2_5_VLStateDictAdapter, clean_name
from titanrl.rollout.weights import TensorInfo, safetensors_dtype

# full tensors per gather (and per broadcast): bounds the push's extra device memory (the planner's weight_push)
BUCKET_BYTES = PUSH_BUCKET_BYTES
SHARD_BYTES = 256 << 20  # what write_hf holds before a shard goes to the file


def _shard_dim0(value: torch.Tensor) -> bool:
    """Whether ``value`` is sharded on dim 0 over its mesh's last dimension and replicated over any other (FSDP2,
    and its hybrid sharding), the layout the bucketed gather handles (over the last dimension: within a machine)."""
    if not isinstance(value, DTensor):
        return False
    *replicated, placement = value.placements
    return (isinstance(placement, Shard) and placement.dim == 0
            and all(isinstance(p, Replicate) for p in replicated))


def _rows(full: int, world: int, rank: int) -> int:
    """Rows of dim 0 that ``rank`` holds of ``full`` sharded over ``world`` (torch.chunk's split: FSDP2's, DTensor's)."""
    chunk = -(-full // world)
    return max(0, min(chunk, full - rank * chunk))


def _gather_bucket(entries: list[tuple[str, DTensor]], dtype: torch.dtype | None, keep: bool = True
                   ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """One all-gather for the full tensors of ``entries`` (dim-0 shards on one mesh): each rank's shards padded to
    the chunk size and laid end to end as bytes. Each full tensor is put together as it is taken (one at a time
    beside the gathered bytes); ``keep=False``: not at all (None)."""
    mesh = entries[0][1].device_mesh
    dim = mesh.ndim - 1  # the shard dimension (hybrid sharding: the replicas hold the same shards)
    world, me = mesh.size(dim), mesh.get_local_rank(dim)
    locals_, layouts, size = [], [], 0
    for name, value in entries:
        local = value.to_local().detach()
        if dtype is not None and local.is_floating_point():
            local = local.to(dtype)  # before the gather: bf16 moves half the bytes of fp32 masters
        full0, rest = value.shape[0], tuple(value.shape[1:])
        chunk = -(-full0 // world)
        row = local.element_size() * (int(torch.Size(rest).numel()) if rest else 1)
        if local.shape[0] != _rows(full0, world, me):
            raise ValueError(f"{name}: shard of {local.shape[0]} rows, expected {_rows(full0, world, me)}")
        locals_.append(local)
        layouts.append((name, full0, rest, local.dtype, row, chunk, size))
        size += chunk * row
    device = locals_[0].device
    mine = torch.zeros(size, dtype=torch.uint8, device=device)
    for local, (_, _, _, _, row, _, offset) in zip(locals_, layouts):
        if local.numel():
            mine[offset:offset + local.shape[0] * row] = local.contiguous().reshape(-1).view(torch.uint8)
    del locals_
    if world == 1:
        gathered = mine
    else:
        gathered = torch.empty(world * size, dtype=torch.uint8, device=device)
        dist.all_gather_single(gathered, mine, group=mesh.get_group(dim))
    del mine
    for name, full0, rest, dt, row, _, offset in layouts:
        if not keep:
            yield name, None
            continue
        parts = [gathered[r * size + offset:r * size + offset + _rows(full0, world, r) * row] for r in range(world)]
        flat = parts[0] if world == 1 else torch.cat(parts)
        yield name, flat.view(dt).reshape(full0, *rest)


def push_unit(name: str) -> str:
    """The push unit of a titanrl state-dict name: a decoder layer (``layers.3``) or vision block
    (``vision.blocks.3``) whole, else its top-level module (``tok_embeddings``, ``vision.merger``, ...)."""
    parts = name.split(".")
    depth = 3 if parts[:2] == ["vision", "blocks"] else 2 if parts[0] in ("layers", "vision") else 1
    return ".".join(parts[:depth])


def changing_units(model: torch.nn.Module) -> Callable[[str], bool] | None:
    """Which titanrl names a training step can change: those of the push units holding a trained parameter (LoRA's
    adapters change their layer's merged weight). None: every unit trains."""
    trained = {push_unit(clean_name(n)) for n, p in model.named_parameters(remove_duplicate=False)  # tied: both
               if p.requires_grad}
    every = {push_unit(clean_name(n)) for n in model.state_dict()}
    if trained >= every:
        return None
    return lambda name: push_unit(name) in trained


@torch.no_grad()  # (DTensor.to_local without autograd's function per tensor: a push's Python cost halves)
def gather_full_state(model: torch.nn.Module, dtype: torch.dtype | None, *, keep: bool = True,
                      bucket_bytes: int = BUCKET_BYTES, only: Callable[[str], bool] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(titanrl name, full tensor on the model's device) of every state-dict entry, in state-dict order on every
    rank (the gathers are collectives every rank of the model's mesh must join). Floating tensors are cast to
    ``dtype``; dim-0 shards are gathered ``bucket_bytes`` of full tensors at a time. ``keep=False``: the rank joins
    the gathers and gets None (a full tensor is never copied off its device here). ``only``: the names to gather
    (the same on every rank; None: all)."""
    pending: list[tuple[str, DTensor]] = []
    pending_bytes = 0

    def flush():
        nonlocal pending, pending_bytes
        done = _gather_bucket(pending, dtype, keep) if pending else iter(())
        pending, pending_bytes = [], 0
        return done

    for name, value in model.state_dict().items():
        name = clean_name(name)
        if only is not None and not only(name):
            continue
        if _shard_dim0(value):
            if pending and value.device_mesh is not pending[0][1].device_mesh:
                yield from flush()
            pending.append((name, value))
            itemsize = value.element_size() if dtype is None or not value.is_floating_point() else \
                torch.empty((), dtype=dtype).element_size()
            pending_bytes += value.numel() * itemsize
            if pending_bytes >= bucket_bytes:
                yield from flush()
            continue
        yield from flush()
        value = value.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()  # another layout (replicated, or a 2-D mesh): DTensor's own gather
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        yield name, value if keep else None
    yield from flush()


def hf_layout(model: torch.nn.Module, args: Qwen2_5_VLArgs, dtype: torch.dtype | None,
              only: Callable[[str], bool] | None = None) -> dict[str, TensorInfo]:
    """HF name -> full shape and dtype of every tensor the push sends (``only``: of those names), in the order it
    sends them (no data moves: meta tensors through the same merge and name conversion as ``hf_state``)."""
    adapter = Qwen2_5_VLStateDictAdapter(args)

    def metas():
        for name, value in model.state_dict().items():
            name = clean_name(name)
            if only is not None and not only(name):
                continue
            dt = dtype if dtype is not None and value.is_floating_point() else value.dtype
            yield name, torch.empty(value.shape, dtype=dt, device="meta")

    stream = merge_adapters(metas(), lora_scales(model)) if has_adapters(model) else metas()
    out: dict[str, TensorInfo] = {}
    for name, meta in stream:
        for hf, t in adapter.to_hf({name: meta}).items():
            out[hf] = TensorInfo(tuple(t.shape), safetensors_dtype(t.dtype))
    return out


def merged_state(model: torch.nn.Module, dtype: torch.dtype | None, *, keep: bool = True,
                 bucket_bytes: int = BUCKET_BYTES, only: Callable[[str], bool] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``gather_full_state`` with LoRA adapters folded into their layers' weights (``W + (alpha / r) B A``,
    ``titanrl.models.lora.merge_adapters``): the plain model the engines and HF files take. A model without
    adapters: ``gather_full_state`` as it is."""
    stream = gather_full_state(model, dtype, keep=keep, bucket_bytes=bucket_bytes, only=only)
    return merge_adapters(stream, lora_scales(model)) if has_adapters(model) else stream


def hf_state(model: torch.nn.Module, args: Qwen2_5_VLArgs, dtype: torch.dtype | None, *, keep: bool = True,
             bucket_bytes: int = BUCKET_BYTES, only: Callable[[str], bool] | None = None
             ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``merged_state`` under HF names (what engines and HF files take)."""
    adapter = Qwen2_5_VLStateDictAdapter(args)
    for name, tensor in merged_state(model, dtype, keep=keep, bucket_bytes=bucket_bytes, only=only):
        if tensor is None:  # keep=False: the gathers only
            yield name, None
        else:
            yield from adapter.to_hf({name: tensor}).items()


def write_hf(model: torch.nn.Module, args: Qwen2_5_VLArgs, outdir: Path, *,
             dtype: torch.dtype | None, writer_rank: bool, assets_from: Path | None,
             shard_bytes: int = SHARD_BYTES) -> HFShardWriter | None:
    """The model's full weights as an HF directory written by the ranks with ``writer_rank`` (the others take part
    in the gathers only). Returns the writer (for its counters) on writers."""
    writer = HFShardWriter(outdir, args, dtype=dtype, shard_bytes=shard_bytes) if writer_rank else None
    for name, tensor in merged_state(model, dtype, keep=writer is not None):
        if writer is not None:
            writer.add(name, tensor)
    if writer is not None:
        writer.close(assets_from)
    return writer


def write_adapters(model: torch.nn.Module, outdir: Path, *, writer_rank: bool, rank: int, alpha: float,
                   dropout: float, base: str) -> None:
    """A LoRA model's adapters (and the modules it trains in full), gathered in float32, as a PEFT folder written by
    ``writer_rank`` (collective over the model's mesh)."""
    trained = {clean_name(n) for n in trained_names(model)}
    adapters, full = {}, {}
    for name, tensor in gather_full_state(model, None, keep=writer_rank):
        if name in trained:
            (adapters if is_adapter(name) else full)[name] = tensor
    if writer_rank:
        write_peft(adapters, outdir, rank=rank, alpha=alpha, dropout=dropout, base=base, full=full)


@dataclass(frozen=True)
class Bucket:
    """What one broadcast of the disaggregated push carries: (HF name, shape, safetensors dtype, byte offset)."""
    entries: tuple[tuple[str, tuple[int, ...], str, int], ...]
    nbytes: int

    def to_wire(self) -> list:
        """Plain lists (what vLLM's rpc serialisation carries to its workers intact)."""
        return [[[name, list(shape), dt, offset] for name, shape, dt, offset in self.entries], self.nbytes]

    @classmethod
    def from_wire(cls, wire) -> "Bucket":
        entries, nbytes = wire
        return cls(tuple((name, tuple(shape), dt, int(offset)) for name, shape, dt, offset in entries), int(nbytes))


def plan_buckets(layout: dict[str, TensorInfo], bucket_bytes: int = BUCKET_BYTES) -> list[Bucket]:
    """Consecutive tensors of ``layout`` (in its order) grouped into byte buckets of about ``bucket_bytes``; the
    sender and every receiver compute the same plan from the same layout."""
    buckets, entries, offset = [], [], 0
    for name, info in layout.items():
        entries.append((name, info.shape, info.dtype, offset))
        offset += info.nbytes
        if offset >= bucket_bytes:
            buckets.append(Bucket(tuple(entries), offset))
            entries, offset = [], 0
    if entries:
        buckets.append(Bucket(tuple(entries), offset))
    return buckets


def send_buckets(tensors: Iterator[tuple[str, torch.Tensor]], buckets: list[Bucket], group,
                 device: torch.device) -> int:
    """The first training rank: the full tensors into the plan's byte buckets, each broadcast to the engines'
    workers as it fills (one bucket of extra memory). Returns the bytes sent."""
    sent = 0
    stream = iter(tensors)
    for bucket in buckets:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        for name, shape, _, offset in bucket.entries:
            got, tensor = next(stream)
            if got != name or tuple(tensor.shape) != tuple(shape):
                raise RuntimeError(f"weight push out of order: sent {got} {tuple(tensor.shape)}, planned {name} {shape}")
            nbytes = tensor.numel() * tensor.element_size()
            buf[offset:offset + nbytes] = tensor.contiguous().reshape(-1).view(torch.uint8)
        broadcast_from_first(group, buf)
        sent += bucket.nbytes
    return sent


def receive_buckets(buckets: list[Bucket], group, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """An engine worker (or an in-process engine): the full tensors of every bucket the first training rank
    broadcasts, as (HF name, tensor on ``device``)."""
    from titanrl.rollout.weights import torch_dtype

    for bucket in buckets:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        broadcast_from_first(group, buf)
        for name, shape, dt, offset in bucket.entries:
            info = TensorInfo(tuple(shape), dt)
            yield name, buf[offset:offset + info.nbytes].view(torch_dtype(dt)).reshape(shape)


class WeightPusher:
    """The trainer's weight push (see the module doc); every rank calls ``push`` at the same point."""

    def __init__(self, args: Qwen2_5_VLArgs, info: DistInfo, dtype: torch.dtype, placement=None, *,
                 timeout_s: float = 600.0, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.args, self.info, self.dtype = args, info, dtype
        self.placement = placement  # titanrl.workflow.placement.Placement; None: colocated
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.pushes = 0
        self.bytes_pushed = 0
        # [the whole model, the units a step changes] (the second None when every unit trains)
        self._layouts: list[dict[str, TensorInfo] | None] | None = None
        self._buckets: list[list[Bucket] | None] | None = None
        self._only: Callable[[str], bool] | None = None
        self._group = None  # disaggregated: the push's own process group (first training rank + engine workers)

    @property
    def disaggregated(self) -> bool:
        return self.placement is not None and self.placement.disaggregated

    def _model_layouts(self, model) -> list[dict[str, TensorInfo] | None]:
        """The whole model's layout and that of the units a step changes (``changing_units``; None if all)."""
        self._only = changing_units(model)
        full = hf_layout(model, self.args, self.dtype)
        return [full, None if self._only is None else hf_layout(model, self.args, self.dtype, self._only)]

    def _which(self) -> int:
        """0: the whole model (the first push: the engines may hold other weights, a resumed run's); 1: the units a
        step changes."""
        return 1 if self.pushes and self._layouts[1] is not None else 0

    def _disaggregated_setup(self, model, engine) -> None:
        """Once (every rank): the layouts from the first training rank, and the push's process group, which the
        first training rank hosts and every engine's workers join."""
        placement = self.placement
        first = placement.train[0]
        mine = None
        # every training rank: ``_only`` for its gathers; the first sends the layouts to every rank
        layouts = self._model_layouts(model) if model is not None else None
        if self.info.rank == first:
            store = host_store(self.timeout_s)
            mine = (_reachable_address(), store.port, layouts)
        every = all_gather_objects((mine, engine.workers if engine is not None else 0, _reachable_address()))
        host, port, self._layouts = every[first][0]
        if every[self.info.rank][2] == every[first][2]:
            # the store listens on every interface: at its own address, loopback. (Host names would not do:
            # namespaced hosts, containers and some clusters share one name across machines.)
            host = "127.0.0.1"
        self._buckets = [None if lay is None else plan_buckets(lay, self.bucket_bytes) for lay in self._layouts]
        workers = [n for _, n, _ in every]
        world = 1 + sum(workers)
        if self.info.rank == first:
            self._group = stateless_group((host, port), 0, world, self.info.device, self.timeout_s, store=store)
        elif engine is not None:
            for lay in self._layouts:  # before joining: a rejected update stops the run here
                if lay is not None:
                    engine.check_update(lay)
            engine.join_weight_group((host, port), world, 1 + sum(workers[:self.info.rank]), self.timeout_s)

    def push(self, model: torch.nn.Module | None, engine) -> dict[str, float]:
        """Every rank: the model's new weights into every engine (``model`` / ``engine`` None where a rank of a
        disaggregated placement holds none). Returns the seconds of the gathers and of the engine's load."""
        t0 = time.perf_counter()
        if self.disaggregated:
            if self._buckets is None:
                self._disaggregated_setup(model, engine)
            which = self._which()
            self.pushes += 1
            if model is not None:
                keep = self.info.rank == self.placement.train[0]
                tensors = hf_state(model, self.args, self.dtype, keep=keep, bucket_bytes=self.bucket_bytes,
                                   only=self._only if which else None)
                if keep:
                    sent = send_buckets(tensors, self._buckets[which], self._group, self.info.device)
                    self.bytes_pushed += sent
                    return {"sync/gather_s": time.perf_counter() - t0, "sync/bytes": float(sent)}
                for _ in tensors:  # the gathers only
                    pass
                return {"sync/gather_s": time.perf_counter() - t0}
            if engine is not None:
                engine.receive_weights(self._buckets[which])
                return {"sync/load_s": time.perf_counter() - t0}
            return {}
        if self._layouts is None:
            self._layouts = self._model_layouts(model)
        which = self._which()
        layout = self._layouts[which]
        gathered = _Timed(hf_state(model, self.args, self.dtype, bucket_bytes=self.bucket_bytes,
                                   only=self._only if which else None))
        engine.update_weights(layout, gathered)
        self.pushes += 1
        self.bytes_pushed += sum(i.nbytes for i in layout.values())
        return {"sync/gather_s": gathered.seconds, "sync/load_s": time.perf_counter() - t0 - gathered.seconds,
                "sync/bytes": float(sum(i.nbytes for i in layout.values()))}

    def close(self) -> None:
        self._group = None


class _Timed:
    """An iterator's own time (the gathers), apart from its consumer's (the engine's load)."""

    def __init__(self, it) -> None:
        self.it, self.seconds = iter(it), 0.0

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self.it)
        finally:
            self.seconds += time.perf_counter() - t0


def _reachable_address() -> str:
    """This host's address for the push group's store: VLLM_HOST_IP when set (vLLM's own rule for the address
    its workers use), else the host name's address."""
    import os

    if os.environ.get("VLLM_HOST_IP"):
        return os.environ["VLLM_HOST_IP"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
