"""Planning from metadata only: the step's global batch, who consumes each sample, where it is decoded.

Every function here is a pure function of the metadata, the seed and the step, so every rank computes
the same plan without talking to any other (multi-controller planning, as in DistFlow): no process
ships pixels, or even metadata, to another to plan.

- :class:`ProxyLoader` is the stateful ``torchdata.nodes`` pipeline (a seeded per-epoch permutation
  source -> Batcher -> Mapper to :class:`SampleMeta`) that yields one global batch per step; its state
  resumes the sequence exactly.
- ``assign_*`` split a batch over ranks (the ``assign`` callable of the loaders).
- :func:`route_samples` is the routing table (what the paper's MetaStore records): sample ->
  preprocessor, least-loaded by estimated decode cost, identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torchdata.nodes as tn

from titanrl.data.shadow.metadata import MetadataTable, SampleMeta

AssignFn = Callable[[Sequence[SampleMeta], int], list[list[int]]]


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """Sample order of an epoch: a seeded permutation (the rule of ``Trainer.global_batch_indices``)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


class PermutationSource(tn.BaseNode[tuple[int, int]]):
    """Yields (epoch, manifest index) forever: epoch e visits the samples in ``epoch_permutation`` order.

    The state is (epoch, offset into the epoch), so a restored source continues mid-epoch exactly; a
    batch may straddle two epochs, as in a plain concatenation of the epochs' orders.
    """

    def __init__(self, num_samples: int, seed: int) -> None:
        super().__init__()
        if num_samples < 1:
            raise ValueError("the manifest has no samples")
        self.num_samples = num_samples
        self.seed = seed
        self._order: np.ndarray | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        state = initial_state or {"epoch": 0, "offset": 0}
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = epoch_permutation(self.num_samples, self.seed, self.epoch)

    def next(self) -> tuple[int, int]:
        if self.offset == self.num_samples:
            self.epoch, self.offset = self.epoch + 1, 0
            self._order = epoch_permutation(self.num_samples, self.seed, self.epoch)
        assert self._order is not None
        item = (self.epoch, int(self._order[self.offset]))
        self.offset += 1
        return item

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset}


class ProxyLoader:
    """Global batches of metadata, one per step, identical on every rank; exact resume.

    ``state_dict()`` is the state before the next batch that :meth:`next_batch` will return, so a
    caller that plans ahead (prefetch) saves ``state_at(step)`` of the first step it has not handed
    out, not the pipeline's live state.
    """

    def __init__(self, table: MetadataTable, global_batch_size: int, seed: int) -> None:
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.table = table
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._root = tn.Mapper(
            tn.Batcher(PermutationSource(len(table), seed), global_batch_size, drop_last=True), self._to_metas
        )
        self._root.reset()
        self.step = 0  # the step the next next_batch() returns

    def _to_metas(self, keys: list[tuple[int, int]]) -> list[SampleMeta]:
        return [self.table.get(index, epoch) for epoch, index in keys]

    def next_batch(self) -> tuple[int, list[SampleMeta], dict[str, Any]]:
        """(step, metas, state to resume *at* this step)."""
        state = self.state_dict()
        metas = next(self._root)
        step = self.step
        self.step += 1
        return step, metas, state

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "nodes": self._root.state_dict(), "num_samples": len(self.table),
                "global_batch_size": self.global_batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = (len(self.table), self.global_batch_size, self.seed)
        got = (state["num_samples"], state["global_batch_size"], state["seed"])
        if got != expected:
            raise ValueError(
                f"loader state was saved for (num_samples, global_batch_size, seed) = {got}, this run has {expected}"
            )
        self._root.reset(state["nodes"])
        self.step = int(state["step"])


# --------------------------------------------------------------------------------------- assign


def sample_cost(meta: SampleMeta) -> float:
    """Planning cost of a sample: its prompt tokens (vision tokens dominate). Bad samples cost 0."""
    return 0.0 if meta.problem is not None else float(meta.num_tokens)


def assign_round_robin(metas: Sequence[SampleMeta], world: int) -> list[list[int]]:
    """Position p goes to rank p % world (the trainer's ``[rank::world]`` split)."""
    return [list(range(r, len(metas), world)) for r in range(world)]


def assign_balanced(metas: Sequence[SampleMeta], world: int) -> list[list[int]]:
    """Greedy longest-first: each sample, costliest first, to the least-loaded rank; then, at equal
    load, to the rank with fewer samples, then the lowest rank. Deterministic."""
    load = [0.0] * world
    count = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for pos in sorted(range(len(metas)), key=lambda p: (-sample_cost(metas[p]), p)):
        rank = min(range(world), key=lambda r: (load[r], count[r], r))
        out[rank].append(pos)
        load[rank] += sample_cost(metas[pos])
        count[rank] += 1
    return [sorted(x) for x in out]


def check_assignment(assignment: list[list[int]], num_positions: int, world: int) -> list[list[int]]:
    """Validate an ``assign`` result; a position may go to several ranks (sliced samples)."""
    if len(assignment) != world:
        raise ValueError(f"assign returned {len(assignment)} rank lists for a world of {world}")
    for rank, positions in enumerate(assignment):
        for p in positions:
            if not 0 <= p < num_positions:
                raise ValueError(f"assign gave rank {rank} position {p}, outside the batch of {num_positions}")
        if len(set(positions)) != len(positions):
            raise ValueError(f"assign gave rank {rank} a position twice: {positions}")
    return [list(map(int, positions)) for positions in assignment]


def consumers_of(assignment: list[list[int]], num_positions: int) -> list[list[int]]:
    """For each position, the ranks that consume it (in rank order)."""
    out: list[list[int]] = [[] for _ in range(num_positions)]
    for rank, positions in enumerate(assignment):
        for p in positions:
            out[p].append(rank)
    return out


# ---------------------------------------------------------------------------------------- route


def decode_cost(meta: SampleMeta) -> float:
    """Estimated decode work: pixels a sequential decoder produces (frames up to the last sampled one)."""
    return float(sum(m.decode_pixels for m in meta.media))


@dataclass(frozen=True)
class Route:
    preprocessor: int  # index into the job's preprocessor list
    consumers: tuple[int, ...]  # ranks that fetch this sample


def route_samples(
    metas: Sequence[SampleMeta],
    consumers: Sequence[Sequence[int]],
    preprocessor_nodes: Sequence[str],
    rank_nodes: Sequence[str],
    remote_penalty: float = 0.5,
) -> list[Route | None]:
    """Sample -> preprocessor, least-loaded by estimated decode cost, preferring the consumer's node.

    Costliest samples first; each goes to the preprocessor minimising load + cost, where a preprocessor
    on another node than the sample's first consumer pays ``remote_penalty * cost`` more (the transfer).
    On one node this is plain least-loaded; across nodes it keeps most traffic node-local while still
    spreading a skewed batch. Samples with no consumer, no media or a known problem get None (never
    sent to a preprocessor).
    """
    if not preprocessor_nodes:
        raise ValueError("no preprocessors to route to")
    load = [0.0] * len(preprocessor_nodes)
    routes: list[Route | None] = [None] * len(metas)
    order = sorted(range(len(metas)), key=lambda p: (-decode_cost(metas[p]), p))
    for pos in order:
        meta, ranks = metas[pos], consumers[pos]
        if meta.problem is not None or not ranks or not meta.media:
            continue  # bad, unconsumed, or text-only: nothing to decode
        cost = max(decode_cost(meta), 1.0)
        home = rank_nodes[ranks[0]]

        def total(i: int) -> tuple[float, int]:
            penalty = 0.0 if preprocessor_nodes[i] == home else remote_penalty * cost
            return (load[i] + cost + penalty, i)

        best = min(range(len(preprocessor_nodes)), key=total)
        load[best] += cost
        routes[pos] = Route(best, tuple(ranks))
    return routes
