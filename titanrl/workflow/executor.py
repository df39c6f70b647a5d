"""The executor every rank runs (DistFlow sec. 5): one RL step = the workflow's nodes in order.

The executor holds no stage mechanics: for each node placed on a group this rank belongs to it gives the
node function the batch its inputs produced (``DataBuffer``), times it under the node's id
(``time/<id>``, ``busy/<id>``), and keeps its output for the nodes that read it. A node function is
``fn(batch, ctx) -> StepBatch | None`` (None: the batch it was given, changed in place).

Where a node reads the output of a node placed on a disjoint rank group, the data coordinator's ``move``
(``titanrl.workflow.coordinator.redistribute``) first moves it there; every rank calls it at the same point of
the node order. A rank of a node's group that neither produced an input nor received it (a node on ``all``
reading a ``train`` node's output, on a rollout rank) reads an empty batch.

A node that raises becomes a ``NodeError`` naming the node, the rank and the cause; the trainer reports it
and ``titanrl.workflow.abort`` stops the other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from titanrl.workflow.graph import NodeSpec, Workflow


class NodeError(RuntimeError):
    """A workflow node raised on this rank."""

    def __init__(self, node: NodeSpec, rank: int, cause: BaseException) -> None:
        first = str(cause).splitlines()[0] if str(cause) else ""
        super().__init__(f"node {node.id!r} ({node.function}) failed on rank {rank}: {type(cause).__name__}: {first}")
        self.node, self.rank, self.cause = node, rank, cause


@dataclass
class StepBatch:
    """What flows between nodes on one rank: this rank's share of the step.

    ``prompts`` ((global position, PreparedSample) pairs) until the rollout turns them into ``trajectories``
    (one per response; ``t.group`` is the prompt's global position, ``t.response_index`` its sample).
    ``media`` is the loader's view of the step (``StepData``): the stages that encode images and frames
    fetch them through it (slice-aware loading). ``metrics`` collects what nodes report for the step line.
    ``group`` is the process group of the ranks running the current node (None: every rank), set by the
    executor: a node's own collectives (the reduction of a count) go over it.
    """

    step: int
    prompts: list = field(default_factory=list)
    trajectories: list = field(default_factory=list)
    media: Any = None
    metrics: dict[str, float] = field(default_factory=dict)
    group: Any = None

    def groups(self) -> dict[int, list]:
        """Trajectories by prompt (a prompt's responses are generated and scored on one rank)."""
        out: dict[int, list] = {}
        for t in self.trajectories:
            out.setdefault(int(t.group), []).append(t)
        return out

    def keep(self, predicate: Callable[[Any], bool]) -> "StepBatch":
        """A batch with the trajectories for which ``predicate`` holds (the same objects)."""
        return StepBatch(self.step, self.prompts, [t for t in self.trajectories if predicate(t)], self.media,
                         self.metrics)


def join(batches: list[StepBatch]) -> StepBatch:
    """The batch a node with several inputs reads: the trajectories every input holds, in the first's order."""
    if len(batches) == 1:
        return batches[0]
    keys = [{(t.group, t.response_index) for t in b.trajectories} for b in batches[1:]]
    first = batches[0]
    kept = [t for t in first.trajectories if all((t.group, t.response_index) in k for k in keys)]
    return StepBatch(first.step, first.prompts, kept, first.media, first.metrics)


class DataBuffer:
    """Node outputs of the current step on this rank, by node id."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.outputs: dict[str, StepBatch] = {}
        self.media = None  # the loader's view of the step on this rank (a local resource, never moved)
        self.bytes_redistributed = 0  # sent by this rank this step
        self.moved: set[tuple[str, str]] = set()  # (producer, destination group) already redistributed

    def inputs(self, node: NodeSpec) -> StepBatch:
        if not node.inputs:
            return StepBatch(self.step, media=self.media)
        return join([self.outputs.get(i) or StepBatch(self.step, media=self.media) for i in node.inputs])


class Executor:
    def __init__(self, workflow: Workflow, functions: dict[str, Callable], rank: int,
                 groups: dict[str, frozenset[int]], move: Callable | None = None,
                 process_groups: dict[str, Any] | None = None) -> None:
        self.workflow = workflow
        self.functions = functions  # node id -> function
        self.rank = rank
        self.groups = groups
        # move(batch | None, senders, receivers, buffer) -> (received batch | None, bytes sent)
        self.move = move
        self.process_groups = process_groups or {}  # group name -> torch process group (absent: the default)

    def runs(self, node: NodeSpec) -> bool:
        return self.rank in self.groups[node.placement]

    def _route(self, node: NodeSpec, buffer: DataBuffer, timer) -> None:
        """Move every input of ``node`` produced on a group disjoint from its own (every rank, same order)."""
        receivers = self.groups[node.placement]
        for i in node.inputs:
            senders = self.groups[self.workflow.node(i).placement]
            if not senders.isdisjoint(receivers) or (i, node.placement) in buffer.moved:
                continue
            if self.move is None:
                raise RuntimeError(f"node {node.id!r} reads {i!r} from other ranks, and no data coordinator is set")
            buffer.moved.add((i, node.placement))
            with timer("redistribute"):
                received, sent = self.move(buffer.outputs.get(i), senders, receivers, buffer)
            buffer.bytes_redistributed += sent
            if received is not None:
                buffer.outputs[i] = received

    def run_step(self, step: int, ctx: Any, timer) -> DataBuffer:
        """Run every node of this rank once; ``timer(name)`` times each (a ``StageTimer``)."""
        buffer = DataBuffer(step)
        for node in self.workflow.nodes:
            self._route(node, buffer, timer)
            if not self.runs(node):
                continue
            batch = buffer.inputs(node)
            batch.group = self.process_groups.get(node.placement)
            try:
                with timer(node.id):
                    out = self.functions[node.id](batch, ctx)
            except NodeError:
                raise
            except Exception as err:
                raise NodeError(node, self.rank, err) from err
            if out is not None and not isinstance(out, StepBatch):
                raise NodeError(node, self.rank, TypeError(
                    f"a node function returns a StepBatch or None, got {type(out).__name__}"))
            buffer.outputs[node.id] = out if out is not None else batch
            if buffer.media is None:
                buffer.media = buffer.outputs[node.id].media
        return buffer
