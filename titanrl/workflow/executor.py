"""The executor every rank runs (DistFlow sec. 5): one RL step = the workflow's nodes in order.

The executor holds no stage mechanics: for each node placed on a group this rank belongs to it gives the
node function the batch its inputs produced (``DataBuffer``), times it under the node's id
(``time/<id>``, ``busy/<id>``), and keeps its output for the nodes that read it. A node function is
``fn(batch, ctx) -> StepBatch | None`` (None: the batch it was given, changed in place).

Where a node reads the output of a node placed on a disjoint rank group, the data coordinator's ``move``
(``titanrl.workflow.coordinator.redistribute``) first moves it there; every rank calls it at the same point of
the node order. A rank of a node's group that neither produced an input nor received it (a node on ``all``
reading a ``train`` node's output, on a rollout rank) reads an empty batch.

Asynchronous (``lead`` = workflow.max_staleness = k > 0, disaggregated): the nodes that produce the batch
without the models (``producers``: the data, rollout and reward nodes and what runs on their ranks after them)
run k batches ahead of the others. Step t hands the batch of step t to its consumers first (the data
coordinator's moves), then produces the batch of step t + k, then runs the consuming nodes on batch t (the
model stages, the update, the weight push). On the rollout ranks the generation of batch t + k thus overlaps
the training of batch t on the training ranks, and ends before the push of update t: batch t + k is generated
by the weights of update t - 1. The batches in flight (``in_flight``) are per rank and saved in checkpoints.

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


def producers(workflow: Workflow) -> frozenset[str]:
    """The nodes that run ahead in an asynchronous run: placed off the ``train`` group and reading only such
    nodes (the batch as generated and scored, before any model stage)."""
    out: set[str] = set()
    for node in workflow.nodes:  # topological order
        if node.placement != "train" and all(i in out for i in node.inputs):
            out.add(node.id)
    return frozenset(out)


class Executor:
    def __init__(self, workflow: Workflow, functions: dict[str, Callable], rank: int,
                 groups: dict[str, frozenset[int]], move: Callable | None = None,
                 process_groups: dict[str, Any] | None = None, lead: int = 0) -> None:
        self.workflow = workflow
        self.functions = functions  # node id -> function
        self.rank = rank
        self.groups = groups
        # move(batch | None, senders, receivers, buffer) -> (received batch | None, bytes sent)
        self.move = move
        self.process_groups = process_groups or {}  # group name -> torch process group (absent: the default)
        self.lead = lead  # batches the producers run ahead (asynchronous; 0: synchronous)
        self.producers = producers(workflow)
        self.in_flight: dict[int, DataBuffer] = {}  # produced batches not yet consumed, by step

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

    def _run(self, node: NodeSpec, buffer: DataBuffer, ctx: Any, timer) -> None:
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

    def _nodes(self, buffer: DataBuffer, ctx: Any, timer, nodes) -> None:
        for node in nodes:
            self._route(node, buffer, timer)
            if self.runs(node):
                self._run(node, buffer, ctx, timer)

    def run_step(self, step: int, ctx: Any, timer, last: int | None = None) -> DataBuffer:
        """Run every node of this rank once; ``timer(name)`` times each (a ``StageTimer``). Asynchronous, the
        producers run for step ``step + lead`` (not past ``last``, the run's last step) and the other nodes
        for ``step``, whose batch was produced ``lead`` steps before (at the first step: now)."""
        if not self.lead:
            buffer = DataBuffer(step)
            self._nodes(buffer, ctx, timer, self.workflow.nodes)
            return buffer
        ahead = [n for n in self.workflow.nodes if n.id in self.producers]
        behind = [n for n in self.workflow.nodes if n.id not in self.producers]
        last = step + self.lead + 1 if last is None else last
        for s in range(step, min(step + self.lead, last)):  # the first step of a run: fill the pipeline
            if s not in self.in_flight:
                self.in_flight[s] = self._produce(s, ctx, timer, ahead)
        buffer = self.in_flight.pop(step)
        # hand this batch over first, so the producing ranks go on to the next one while it is consumed
        for node in behind:
            if any(i in self.producers for i in node.inputs):
                self._route(node, buffer, timer)
        if step + self.lead < last:
            self.in_flight[step + self.lead] = self._produce(step + self.lead, ctx, timer, ahead)
        self._nodes(buffer, ctx, timer, behind)
        return buffer

    def _produce(self, step: int, ctx: Any, timer, nodes) -> DataBuffer:
        buffer = DataBuffer(step)
        self._nodes(buffer, ctx, timer, nodes)
        return buffer

    # ------------------------------------------------------------------ batches in flight (checkpoints)

    def frontier(self) -> list[str]:
        """The producers whose outputs the other nodes read: what a batch in flight keeps."""
        return [p for p in sorted(self.producers)
                if any(p in n.inputs for n in self.workflow.nodes if n.id not in self.producers)]

    def in_flight_state(self) -> dict[int, dict[str, StepBatch]]:
        """The batches in flight on this rank: the frontier outputs (no media, no process group)."""
        keep = set(self.frontier())
        return {step: {i: StepBatch(step, b.prompts, b.trajectories, None, dict(b.metrics))
                       for i, b in buf.outputs.items() if i in keep}
                for step, buf in sorted(self.in_flight.items())}

    def restore_in_flight(self, state: dict[int, dict[str, StepBatch]], media: dict[int, Any]) -> None:
        """The batches in flight of a checkpoint, with ``media`` (each step's loader view, handed out again)."""
        self.in_flight = {}
        for step, outputs in sorted(state.items()):
            buffer = DataBuffer(step)
            buffer.media = media[step]
            for i, b in outputs.items():
                b.media = media[step]
                buffer.outputs[i] = b
            self.in_flight[step] = buffer
