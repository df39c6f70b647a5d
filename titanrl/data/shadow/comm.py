"""The few collectives the loaders need, over torch.distributed's default group (or none: one process).

ShadowLoader uses them only at set-up and tear-down (who runs Ray, where preprocessors live, barriers
around shutdown); the centralized baseline also scatters each step's decoded samples with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


@dataclass(frozen=True)
class Comm:
    rank: int = 0
    world: int = 1

    @classmethod
    def from_torch(cls) -> "Comm":
        dist = _dist()
        if dist is None:
            return cls()
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def active(self) -> bool:
        return self.world > 1 and _dist() is not None

    def broadcast(self, obj: T | None, src: int = 0) -> T:
        if not self.active:
            return obj  # type: ignore[return-value]
        box = [obj]
        _dist().broadcast_object_list(box, src=src)
        return box[0]

    def all_gather(self, obj: T) -> list[T]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        _dist().all_gather_object(out, obj)
        return out

    def scatter(self, per_rank: list[T] | None, src: int = 0) -> T:
        if not self.active:
            assert per_rank is not None
            return per_rank[0]
        out: list[Any] = [None]
        _dist().scatter_object_list(out, per_rank if self.rank == src else None, src=src)
        return out[0]

    def barrier(self) -> None:
        if self.active:
            _dist().barrier()
