"""Which ranks see the same folder: one machine's local disk, or every machine on a shared filesystem.

``folder_group(folder, info)`` (collective): every rank writes a token file named after the run and its rank
into ``folder``, and after a barrier looks up every rank's token by name. The ranks that find each other's
tokens share the folder. The result is a partition of the ranks into groups, checked for consistency (a rank
that sees another rank's token must be seen by it); each rank gets its own group, with a process group over
it when there is more than one. On one machine, or where every machine mounts the same filesystem, there is
one group: the whole job (``shared``).

What uses it: ``titanrl.assets`` builds the tiny checkpoint, the synthesized data and the import of
``data.path`` once per group (its first rank under the folder's file lock, the import split over the group's
ranks), so machines whose caches are local disks each prepare what their ranks read; the trainer refuses
checkpoints in a ``job.dump_folder`` the machines do not share (DCP writes one folder every rank reads).
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanrl.distributed import DistInfo, all_gather_objects, barrier


@dataclass(frozen=True)
class FolderGroup:
    """This rank's group of ranks that share a folder (``ranks`` in job rank order; ``process_group`` None
    when the group is the whole job)."""

    folder: Path
    ranks: tuple[int, ...]
    rank: int  # this rank's job rank
    world: int  # the job's ranks
    process_group: Any = None
    hosts: tuple[str, ...] = ()  # per job rank, its host name (for messages)

    @property
    def shared(self) -> bool:
        return len(self.ranks) == self.world

    @property
    def index(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.ranks[0]

    def gather(self, obj: object) -> list[object]:
        """Every group member's ``obj`` in group order (collective over the group)."""
        return all_gather_objects(obj, group=self.process_group)

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.shared:
            barrier()
        else:
            dist.barrier(group=self.process_group)

    def describe(self) -> str:
        return f"ranks {list(self.ranks)} ({', '.join(sorted({self.hosts[r] for r in self.ranks}))})" \
            if self.hosts else f"ranks {list(self.ranks)}"


def folder_group(folder: str | Path, info: DistInfo, timeout_s: float | None = None) -> FolderGroup:
    """The ranks that see ``folder`` as this rank does (collective; see the module doc). ``folder`` is created."""
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    if info.world_size == 1:
        return FolderGroup(folder, (0,), 0, 1)
    token = all_gather_objects(uuid.uuid4().hex if info.is_main else None)[0]
    probe = folder / f".titanrl-ranks-{token}"  # this run's own: another run's probe never meets it
    probe.mkdir(exist_ok=True)
    mine = probe / str(info.rank)
    mine.write_text(socket.gethostname() + "\n")
    barrier()
    # a lookup by name per rank (not a directory listing, which a network filesystem may serve from a cache)
    seen = tuple(r for r in range(info.world_size) if os.path.exists(probe / str(r)))
    views = all_gather_objects((seen, socket.gethostname()))
    barrier()
    mine.unlink(missing_ok=True)
    barrier()
    try:
        probe.rmdir()  # the first rank of each group to get here; the others find it gone
    except OSError:
        pass
    hosts = tuple(str(h) for _, h in views)
    groups = sorted({tuple(s) for s, _ in views})
    for r, (s, _) in enumerate(views):
        wrong = [o for o in s if views[o][0] != s]
        if r not in s or wrong:
            raise RuntimeError(
                f"{folder}: the ranks do not agree which of them share it (rank {r} on {hosts[r]} sees the files of "
                f"ranks {list(s)}, rank {wrong[0] if wrong else r} sees "
                f"{list(views[wrong[0]][0]) if wrong else 'not its own'}); a folder must be one machine's own or "
                "shared by whole machines")
    ranks = tuple(views[info.rank][0])
    if len(groups) == 1:
        return FolderGroup(folder, ranks, info.rank, info.world_size, None, hosts)
    from titanrl.distributed import new_group

    process_group = None
    for g in groups:  # every rank makes every group, in the same order
        pg = new_group(g, timeout_s)
        if g == ranks:
            process_group = pg
    return FolderGroup(folder, ranks, info.rank, info.world_size, process_group, hosts)
