"""Where the workflow's rank groups are (DistFlow sec. 6): which ranks generate and which hold the models.

``colocated``: every group is every rank (each rank generates, then trains). ``disaggregated``: the first
``rollout_ranks`` ranks form the ``rollout`` group (engines, rewards), the others the ``train`` group (models,
FSDP over those ranks only); ``all`` is every rank. With vLLM tensor parallelism over ``tp`` ranks: colocated, each
block of ``tp`` ranks shares one engine in their processes and every rank still generates its own prompts (the
engine runs the block's prompts together); disaggregated, every ``tp``-th rollout rank holds an engine (its workers
in child processes on the block's devices) and generation runs data-parallel over those (``engines``). Plain data:
the trainer makes the process groups.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    kind: str  # colocated | disaggregated
    world: int
    rollout: tuple[int, ...]
    train: tuple[int, ...]
    tp: int = 1  # rollout ranks per engine

    @property
    def engines(self) -> tuple[int, ...]:
        """The ranks that generate, each with prompts of its own: colocated every rank; disaggregated the first of
        each ``tp`` rollout ranks (the one that holds the engine)."""
        return self.rollout[::self.tp] if self.disaggregated else self.rollout

    @property
    def engine_share(self) -> int:
        """Ranks whose devices run one generating rank's share of the engines (its speed is theirs summed)."""
        return self.tp if self.disaggregated else 1

    @property
    def disaggregated(self) -> bool:
        return self.kind == "disaggregated"

    def groups(self) -> dict[str, frozenset[int]]:
        """The named rank groups nodes are placed on."""
        return {"all": frozenset(range(self.world)), "rollout": frozenset(self.rollout),
                "train": frozenset(self.train)}

    def train_rank(self, rank: int) -> int:
        """``rank``'s position in the training group (-1: it holds no model)."""
        return self.train.index(rank) if rank in self.train else -1

    def describe(self) -> str:
        if not self.disaggregated:
            engines = f" ({self.world // self.tp} engines of {self.tp} ranks)" if self.tp > 1 else ""
            return f"colocated on {self.world} rank(s){engines}"
        engines = f" ({len(self.engines)} engines of {self.tp} ranks)" if self.tp > 1 else ""
        return (f"disaggregated: rollout on ranks {_span(self.rollout)}{engines}, training on ranks "
                f"{_span(self.train)}")


def _span(ranks: tuple[int, ...]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def plan_placement(kind: str, world: int, rollout_ranks: int = 0, tp: int = 1) -> Placement:
    everyone = tuple(range(world))
    if kind == "colocated":
        if world % tp:
            raise ValueError(f"rollout.tensor_parallel_size = {tp} must divide the {world} ranks")
        return Placement(kind, world, everyone, everyone, tp)
    if kind != "disaggregated":
        raise ValueError(f"unknown workflow.placement {kind!r}")
    if not 1 <= rollout_ranks < world:
        raise ValueError(f"workflow.rollout_ranks = {rollout_ranks} must be between 1 and {world - 1} "
                         f"(the ranks after it train) on {world} ranks")
    if rollout_ranks % tp:
        raise ValueError(f"rollout.tensor_parallel_size = {tp} must divide workflow.rollout_ranks = {rollout_ranks}")
    return Placement(kind, world, everyone[:rollout_ranks], everyone[rollout_ranks:], tp)
