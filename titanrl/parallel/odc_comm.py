"""ODC's on-demand communication on one machine (ODC paper sec. 3 and appendix B): FSDP2's memory, one
barrier per minibatch, no collective for parameters or gradients.

FSDP2 keeps its layout (every rank owns a shard of every parameter; a unit's full parameters exist only
while it runs) and its hooks (when a unit is gathered and freed). What changes is the communication, through
FSDP2's own extension points:

- **gather**: a custom ``AllGather`` (``FSDPModule.set_custom_all_gather``) fills the other ranks' parts of a
  unit's gather buffer by copying them from their *publications*: every rank keeps a copy of its shards, as
  FSDP2 would send them (``param_dtype``, padded), in a shared-memory file every rank of the machine maps
  (the CPU analogue of CUDA IPC). The owner takes no part in the copy.
- **scatter-accumulate**: gradients never reach FSDP2's reduce-scatter. A hook on each unsharded parameter
  (``register_post_accumulate_grad_hook``) adds each owner's rows of the gradient into that owner's
  accumulation buffer (float32, in shared memory, the shard's layout) under the owner's lock (an ``fcntl``
  byte-range lock: one-sided, like ``MPI_Accumulate``), then drops the unsharded gradient. FSDP2 then finds no
  gradient to reduce. The paper's GPU design has the owner accumulate from one staging buffer per client in a
  daemon; on CPU a daemon would take the owner's core, which is its compute, so the client adds under the lock.
- **one barrier per minibatch**: when a rank has run its microbatches, it waits on a barrier; after it every
  owner's buffer holds the minibatch's summed gradient, which becomes its shards' ``.grad`` (a view, no copy).
- **freshness**: each rank counts the stages it entered (the same sequence on every rank) and writes the count
  to a shared version slot after it has zeroed its buffer and refreshed its publication (when its shards
  changed: an optimizer step, a checkpoint load). A gather from owner ``r`` waits until ``r``'s slot reaches the
  reader's count: point to point, not a barrier. An owner rewrites its publication only after an optimizer
  step, which follows a train stage's barrier, which every reader passes only after its last gather.

The files are unlinked as soon as every rank has mapped them: nothing is left in /dev/shm, whatever ends the
run (kill -9 included).

**Several machines: hybrid sharding** (ODC sec. 3's answer). The model's mesh is 2-D (FSDP2's HSDP,
``distributed.build_dp_mesh``): parameters, gradients and optimizer state are sharded over one machine's ranks
(``dp_shard``) and replicated across machines (``dp_replicate``), so every gather and gradient push above stays
in the machine's shared memory. After the minibatch's barrier each owner's buffer holds its machine's gradient;
one all-reduce over the owner's replicas (the ranks of the same shard on the other machines) sums the machines'
before the optimizer step: one cross-machine collective per minibatch, of one shard's bytes per rank. (The paper
shards the optimizer state across machines too; here it is replicated with the parameters, as HSDP does.)
"""

from __future__ import annotations

import fcntl
import os
import time
import uuid
import weakref
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin, _get_param_all_gather_inputs

from titanrl.config.errors import ConfigError

WAIT_S = float(os.environ.get("TITANRL_ODC_WAIT_S", "600"))  # a gather waits this long for an owner's publication


def _shm_dir() -> Path:
    """Where the shared files go: ``TITANRL_ODC_DIR`` if set (a container's /dev/shm may be too small), else
    /dev/shm (memory), else the temporary folder."""
    if os.environ.get("TITANRL_ODC_DIR"):
        return Path(os.environ["TITANRL_ODC_DIR"])
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def _free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def _map(path: Path, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=max(numel, 1), dtype=dtype)[:numel]


class _Gather(DefaultAllocMixin, AllGather):
    """FSDP2's all-gather of one unit, as copies from the owners' publications (FSDP2's own allocation)."""

    def __init__(self, comm: "OdcComm", index: int) -> None:
        self.comm, self.index = comm, index

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.comm.gather(self.index, output_tensor)
        return None


class OdcComm:
    """One FSDP2 model's ODC state on this rank (module docstring). Built collectively by :func:`odc_comm`."""

    def __init__(self, model: nn.Module) -> None:
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        modules[0]._get_fsdp_state()._lazy_init()  # the root's: dtypes and streams, as before its first forward
        self.groups = []
        for m in modules:
            groups = m._get_fsdp_state()._fsdp_param_groups
            if len(groups) != 1:
                raise ValueError(f"balance.strategy='odc' needs one FSDP parameter group per unit ({type(m).__name__})")
            self.groups.append(groups[0])
        info = self.groups[0].mesh_info
        self.pg = info.shard_process_group
        self.rank, self.world = info.shard_mesh_rank, info.shard_mesh_size
        # hybrid sharding: the ranks holding this rank's shard on the other machines (None: one machine)
        self.replicas = getattr(info, "replicate_mesh_size", 1)
        self.replicate_pg = info.replicate_process_group if self.replicas > 1 else None
        self.replica_reductions = 0
        for g in self.groups:
            for fp in g.fsdp_params:
                if fp.fsdp_placement.dim != 0:
                    raise ValueError(f"balance.strategy='odc' shards on dim 0 only ({fp._param_fqn})")
                if fp.device.type != "cpu":
                    raise ConfigError("balance.strategy='odc' is built for CPU ranks (shared memory); on CUDA its "
                                      "symmetric-memory path is not built yet: use lb_mini or lb_micro")
        self._layout()
        self._map_files()
        self._place_shards()
        self.version = 0  # the stages this rank entered
        self.active = False  # inside a stage: gathers are allowed
        self.barriers = 0
        for i, m in enumerate(modules):
            m.set_custom_all_gather(_Gather(self, i))
        self.enter(train=False)
        # FSDP2 creates a unit's unsharded parameters at its first gather and keeps the objects: hook them now
        for gi, (m, g) in enumerate(zip(modules, self.groups)):
            m.unshard()
            for pi, fp in enumerate(g.fsdp_params):
                if (gi, pi) in self.acc_off:
                    fp.unsharded_param.register_post_accumulate_grad_hook(partial(self._push, gi, pi))
            m.reshard()
        self.exit()

    def _layout(self) -> None:
        """Offsets in the two files: per unit its gather input's bytes (equal on every rank: FSDP pads the shards),
        and per trainable parameter its padded shard in the float32 accumulation buffer."""
        self.pub_off: list[tuple[int, int]] = []
        self.direct: list[bool] = []
        off = 0
        for g in self.groups:
            n = sum(t.numel() * t.element_size() for ts in _get_param_all_gather_inputs(g.fsdp_params) for t in ts)
            self.pub_off.append((off, n))
            # no cast on the way (param_dtype = the parameters' dtype): the shards themselves are the publication,
            # moved into the shared file, so others read the owner's parameters and nothing is copied or doubled
            direct, pos = True, off
            for fp in g.fsdp_params:
                data = fp._sharded_param_data
                direct &= (fp.param_dtype is None and not fp.offload_to_cpu and pos % data.element_size() == 0
                           and not hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"))
                pos += data.numel() * data.element_size()
            self.direct.append(direct and pos == off + n)
            off += n
        self.pub_bytes = off
        self.acc_off: dict[tuple[int, int], int] = {}
        off = 0
        for gi, g in enumerate(self.groups):
            for pi, fp in enumerate(g.fsdp_params):
                if fp.sharded_param.requires_grad:
                    self.acc_off[(gi, pi)] = off
                    off += fp.padded_sharded_param_size.numel()
        self.acc_numel = off

    def _map_files(self) -> None:
        """Each rank creates its two files (rank 0 also the version slots, whose file carries the locks), every
        rank maps every rank's, then each unlinks its own (collective)."""
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(token, group_src=0, group=self.pg)
        folder = _shm_dir()
        name = lambda kind, r: folder / f"titanrl-odc-{token[0]}-{kind}-{r}"  # noqa: E731
        # every rank's files at once must fit (a full tmpfs kills a rank with SIGBUS on first touch, not an error)
        every: list = [None] * self.world  # (bytes this rank needs, bytes free where it looks)
        dist.all_gather_object(every, (self.pub_bytes + 4 * self.acc_numel + 8 * self.world, _free_bytes(folder)),
                               group=self.pg)
        need, free = sum(e[0] for e in every), min(e[1] for e in every)
        if need > free:
            raise ConfigError(f"balance.strategy='odc' needs {need / 2**20:.0f} MiB of shared memory in {folder} for "
                              f"this model's shards and gradient buffers, and {free / 2**20:.0f} MiB are free there: "
                              "enlarge it (a container's --shm-size) or set TITANRL_ODC_DIR to a tmpfs folder with "
                              "room")
        for kind, nbytes in (("pub", self.pub_bytes), ("acc", 4 * self.acc_numel)):
            with open(name(kind, self.rank), "wb") as f:
                f.truncate(max(nbytes, 1))
        if self.rank == 0:
            with open(name("ver", 0), "wb") as f:
                f.truncate(8 * self.world)
        dist.barrier(group=self.pg)
        seen = all(name(kind, r).exists() for r in range(self.world) for kind in ("pub", "acc"))
        every = [None] * self.world
        dist.all_gather_object(every, seen, group=self.pg)
        if not all(every):
            for kind in ("pub", "acc"):
                name(kind, self.rank).unlink(missing_ok=True)
            if self.rank == 0:
                name("ver", 0).unlink(missing_ok=True)
            raise ConfigError(f"balance.strategy='odc' maps every rank's shards in one machine's shared memory "
                              f"({folder}), but ranks {[r for r, ok in enumerate(every) if not ok]} of a shard "
                              "group do not see the others' files: the group spans machines. Leave "
                              "parallelism.data_parallel_shard_degree at -1 (hybrid sharding over each machine's "
                              "ranks, machines as torchrun launched them) or set it to the ranks of one machine")
        self.pub = [_map(name("pub", r), self.pub_bytes, torch.uint8) for r in range(self.world)]
        self.acc = [_map(name("acc", r), self.acc_numel, torch.float32) for r in range(self.world)]
        self.versions = _map(name("ver", 0), self.world, torch.int64)
        self._lock_fd = os.open(name("ver", 0), os.O_RDWR)
        weakref.finalize(self, os.close, self._lock_fd)
        dist.barrier(group=self.pg)
        for kind in ("pub", "acc"):
            name(kind, self.rank).unlink()
        if self.rank == 0:
            name("ver", 0).unlink()

    # ------------------------------------------------------------------ stage boundaries

    @property
    def shared_bytes(self) -> int:
        """This rank's shared memory that is not its parameter shards: the accumulation buffer (where FSDP2 would
        keep the gradient shards) and the copies published for units with a cast."""
        copies = sum(n for (_, n), direct in zip(self.pub_off, self.direct) if not direct)
        return 4 * self.acc_numel + copies

    def _place_shards(self) -> None:
        """Move the shards of the units without a cast into this rank's publication (the storage FSDP2 and the
        optimizer use from now on: its local tensors are re-pointed, the old storage is freed)."""
        mine = self.pub[self.rank]
        with torch.no_grad():
            for g, (off, _), direct in zip(self.groups, self.pub_off, self.direct):
                if not direct:
                    continue
                pos = off
                for fp in g.fsdp_params:
                    old = fp._sharded_param_data
                    nbytes = old.numel() * old.element_size()
                    flat = mine[pos:pos + nbytes].view(old.dtype)
                    flat.copy_(old)
                    local = fp._sharded_local_tensor
                    local.set_(flat.untyped_storage(), flat.storage_offset(), local.size(), local.stride())
                    fp._sharded_param_data = flat
                    pos += nbytes

    def enter(self, *, train: bool) -> None:
        """A stage begins: zero this rank's buffer (train), refresh its publication, then announce the stage (its
        version slot). Every rank enters the same stages in the same order. A unit with a cast (``param_dtype``
        below the parameters') has its publication rewritten at every entry (a copy of the rank's shards, cheaper
        than a forward); the others' shards live in it. Either way its bytes change only by an optimizer step,
        which comes after a train stage's barrier, so no reader is reading them then."""
        if train:
            self.acc[self.rank].zero_()
        mine = self.pub[self.rank]
        with torch.no_grad():
            for g, (off, n), direct in zip(self.groups, self.pub_off, self.direct):
                if direct:
                    continue  # the shards live in the publication
                pos = off
                for ts in _get_param_all_gather_inputs(g.fsdp_params):
                    for t in ts:
                        b = t.reshape(-1).view(torch.uint8)
                        mine[pos:pos + b.numel()].copy_(b)
                        pos += b.numel()
                assert pos == off + n, (pos, off, n)
        self.version += 1
        self.versions[self.rank] = self.version
        self.active = True

    def exit(self) -> None:
        self.active = False

    def finish_train(self) -> None:
        """The minibatch's one barrier; then this rank's buffer is its shards' gradient (views, no copy). With
        hybrid sharding the buffer is first summed over the shard's replicas on the other machines (one
        all-reduce)."""
        dist.barrier(group=self.pg)
        self.barriers += 1
        mine = self.acc[self.rank]
        if self.replicate_pg is not None:
            dist.all_reduce(mine, group=self.replicate_pg)
            self.replica_reductions += 1
        for (gi, pi), off in self.acc_off.items():
            fp = self.groups[gi].fsdp_params[pi]
            local = mine[off:off + fp.sharded_size.numel()].view(fp.sharded_size)
            grad = fp.to_sharded_dtensor(local if local.dtype == fp.orig_dtype else local.to(fp.orig_dtype))
            if fp.sharded_param.grad is None:
                fp.sharded_param.grad = grad
            else:  # a gradient from outside the stage (none in the trainer): add, do not lose it
                fp.sharded_param.grad += grad

    # ------------------------------------------------------------------ gather and scatter-accumulate

    def gather(self, index: int, output: torch.Tensor) -> None:
        off, n = self.pub_off[index]
        if not self.active:
            raise RuntimeError("balance.strategy='odc': a forward outside a stage (the publications may be stale: "
                               "run it under titanrl.parallel.odc.forward_scope)")
        out = output.view(torch.uint8)
        for r in range(self.world):
            if r == self.rank:
                continue  # FSDP2 copied this rank's own part in
            self._wait(r)
            out[r * n:(r + 1) * n].copy_(self.pub[r][off:off + n])

    def _wait(self, owner: int) -> None:
        if int(self.versions[owner]) >= self.version:
            return
        deadline = time.monotonic() + WAIT_S
        while int(self.versions[owner]) < self.version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"balance.strategy='odc': rank {owner} has not published its parameters for stage "
                                   f"{self.version} in {WAIT_S:.0f} s (it stopped or is stuck)")
            time.sleep(0.0002)

    def _push(self, gi: int, pi: int, param: torch.Tensor) -> None:
        """Add each owner's rows of ``param``'s gradient into its buffer (under its lock), then drop it."""
        fp = self.groups[gi].fsdp_params[pi]
        grad = param.grad
        param.grad = None
        rows = fp.padded_sharded_param_size[0]
        flat_rows = grad.reshape(grad.shape[0], -1) if grad.dim() > 1 else grad.reshape(-1, 1)
        off = self.acc_off[(gi, pi)]
        with torch.no_grad():
            for k in range(self.world):
                r = (self.rank + k) % self.world  # each rank starts with its own buffer: ranks seldom wait on a lock
                part = flat_rows[r * rows:(r + 1) * rows]
                if part.numel() == 0:
                    continue
                fcntl.lockf(self._lock_fd, fcntl.LOCK_EX, 1, r)
                try:
                    self.acc[r][off:off + part.numel()].add_(part.reshape(-1))
                finally:
                    fcntl.lockf(self._lock_fd, fcntl.LOCK_UN, 1, r)


def attached(model: nn.Module) -> OdcComm | None:
    """``model``'s ODC state if :func:`odc_comm` built one (no collective)."""
    return model.__dict__.get("_odc_comm")


def odc_comm(model: nn.Module) -> OdcComm | None:
    """``model``'s ODC state, built at the first call (collective over its FSDP group); None without FSDP."""
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return None
    comm = model.__dict__.get("_odc_comm")
    if comm is None:
        comm = model.__dict__["_odc_comm"] = OdcComm(model)
    return comm
