"""Where each rank's vLLM engine runs: the device and the parallel layout a rank hands to vLLM.

Colocated engines run SPMD inside the torchrun ranks, the way verl and vLLM's own torchrun example run them:
vLLM's ``external_launcher`` executor, in the rank's process, with vLLM's world = torchrun's world. vLLM then takes
the rank's ``RANK`` / ``LOCAL_RANK`` for its worker, so the worker binds ``cuda:LOCAL_RANK`` (the in-process
``uni`` executor would take device index 0 on every rank), and it cuts its tensor-parallel groups out of the world
as consecutive blocks of ``tensor_parallel_size`` ranks: an engine spans T ranks of one machine, and generation is
data-parallel over the world / T engines. The CPU build goes through the same executor (the device is the CPU).

A process that is the whole job with no process group (``python -m titanrl.train`` in float32) runs the ``uni``
executor: the same worker in-process, on device 0.

Disaggregated engines run in child processes of the rollout rank, on the devices of the rollout ranks they span
(``CUDA_VISIBLE_DEVICES`` from the engine's first rank): vLLM's engine core, with its one worker inside it at tensor
parallelism 1 (vLLM's ``uni`` executor, as vLLM lays out one GPU), or the ``mp`` executor's worker processes, a
torch.distributed world of their own. Plain data: ``VLLMEngine`` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineLaunch:
    backend: str  # vLLM's distributed_executor_backend: external_launcher | uni | mp (own_process: in the engine core)
    tensor_parallel_size: int
    rank: int  # the worker's rank in vLLM's world (external_launcher: the torchrun rank)
    local_rank: int  # the worker's device index on its machine (external_launcher: LOCAL_RANK)
    device: str  # the device the (first) worker binds: "cuda:3", "cpu"
    engine_ranks: tuple[int, ...]  # the ranks sharing this engine (its tensor-parallel group)
    visible_devices: tuple[int, ...] = ()  # mp: the devices the child workers see (CUDA_VISIBLE_DEVICES)
    env: dict[str, str] = field(default_factory=dict)  # set while the engine starts (and restored after)
    own_process: bool = False  # vLLM's engine core in a child process (the disaggregated placement)

    @property
    def in_process(self) -> bool:
        return not self.own_process


def engine_launch(rank: int, local_rank: int, world: int, tp: int, device_type: str, *,
                  process_group: bool, own_process: bool = False, local_world: int | None = None) -> EngineLaunch:
    """The layout of the engine rank ``rank`` builds (or joins, with ``tp > 1`` colocated).

    ``process_group``: a torch.distributed group exists in this process (torchrun, or a one-rank group);
    ``own_process``: the disaggregated placement's engine, in child processes, over ranks rank .. rank + tp - 1;
    ``local_world``: ranks on this machine (LOCAL_WORLD_SIZE; an engine may not span machines)."""
    local_world = world if local_world is None else local_world
    cuda = device_type == "cuda"
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if own_process:
        if local_rank + tp > local_world:
            raise ValueError(f"an engine over {tp} ranks from local rank {local_rank} spans machines "
                             f"({local_world} ranks per machine)")
        devices = tuple(range(local_rank, local_rank + tp)) if cuda else ()
        return EngineLaunch("uni" if tp == 1 else "mp", tp, 0, 0, f"cuda:{local_rank}" if cuda else "cpu",
                            tuple(range(rank, rank + tp)), devices, own_process=True)
    if not process_group:
        if world != 1 or tp != 1:
            raise ValueError("several ranks or tensor parallelism need a torch.distributed process group")
        return EngineLaunch("uni", 1, 0, 0, "cuda:0" if cuda else "cpu", (rank,))
    if world % tp or local_world % tp:
        raise ValueError(f"rollout.tensor_parallel_size = {tp} must divide the ranks per machine ({local_world}) "
                         f"and the world ({world}): an engine spans {tp} ranks of one machine")
    first = rank - rank % tp
    return EngineLaunch("external_launcher", tp, rank, local_rank, f"cuda:{local_rank}" if cuda else "cpu",
                        tuple(range(first, first + tp)),
                        env={"RANK": str(rank), "LOCAL_RANK": str(local_rank)})
