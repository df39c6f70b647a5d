"""The RL step as a graph of nodes (DistFlow sec. 4): what runs, on which ranks, reading whose output.

Standard library only: the config layer validates the graph before anything heavy loads.

A workflow is the built-in graph of ``workflow.name`` with the ``[[workflow.nodes]]`` entries applied (a
new id adds a node, a known id changes the fields it sets). ``resolve`` checks it - every input names a
node, no cycle, every function is a built-in name or has the shape of a user function, every placement
names a rank group - and orders it for execution: nodes in topological order, and nodes at the same
depth in declaration order (the built-in's first, then the added ones). Every rank runs the same order
(multi-controller); a rank runs the nodes placed on a group it belongs to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

ROLES = ("actor", "critic", "reference", "reward", "none")
TYPES = ("generate", "inference", "train", "compute")
# Rank groups (titanrl.workflow.placement): every rank, the generating ranks, the ranks holding the models.
# Colocated, all three are every rank.
GROUPS = ("all", "rollout", "train")

# "package.module:function" or "path/to/file.py:function"
_MODULE_FN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_FILE_FN = re.compile(r"^[^:]+\.py:[A-Za-z_]\w*$")

# Built-in node functions by name (titanrl.rl.nodes); the executor binds them.
BUILTIN_FUNCTIONS = ("load_prompts", "generate", "score", "group_advantages", "old_logprobs", "ref_logprobs",
                     "train_actor", "push_weights", "critic_values", "gae_advantages", "train_critic",
                     "reinforce_pp_advantages")


@dataclass(frozen=True)
class NodeSpec:
    id: str
    role: str
    type: str
    function: str
    inputs: tuple[str, ...]
    placement: str = "train"

    @property
    def builtin(self) -> bool:
        return ":" not in self.function


def _generation() -> list[NodeSpec]:
    """The nodes every built-in workflow starts with: prompts, responses, rewards."""
    return [
        # every rank plans the step from metadata (the training ranks fetch slices through it); the ranks that
        # generate materialize their prompts
        NodeSpec("data", "none", "compute", "load_prompts", (), "all"),
        NodeSpec("rollout", "actor", "generate", "generate", ("data",), "rollout"),
        NodeSpec("reward", "reward", "compute", "score", ("rollout",), "rollout"),
    ]


def builtin_graph(cfg: Any) -> list[NodeSpec]:
    """The nodes of ``cfg.rl.algorithm``'s workflow for this config (a reference model only when rl.kl_coef > 0)."""
    if cfg.rl.algorithm == "ppo":
        return ppo_graph(cfg)
    if cfg.rl.algorithm != "grpo":
        raise ValueError(f"unknown rl.algorithm {cfg.rl.algorithm!r}")
    reference = cfg.rl.kl_coef > 0
    if cfg.rl.advantage == "reinforce++":  # the KL to the reference is in each token's reward: log-probs first
        logprobs = ["old_logprob", "ref_logprob"] if reference else ["old_logprob"]
        return _generation() + [
            NodeSpec("old_logprob", "actor", "inference", "old_logprobs", ("reward",)),
            *([NodeSpec("ref_logprob", "reference", "inference", "ref_logprobs", ("reward",))] if reference else []),
            NodeSpec("advantage", "none", "compute", "reinforce_pp_advantages", tuple(logprobs)),
            NodeSpec("update", "actor", "train", "train_actor", ("advantage",)),
            NodeSpec("weight_sync", "actor", "compute", "push_weights", ("update",), "all"),
        ]
    nodes = _generation() + [
        NodeSpec("advantage", "none", "compute", "group_advantages", ("reward",)),
        NodeSpec("old_logprob", "actor", "inference", "old_logprobs", ("advantage",)),
    ]
    if reference:
        nodes.append(NodeSpec("ref_logprob", "reference", "inference", "ref_logprobs", ("advantage",)))
    nodes += [
        NodeSpec("update", "actor", "train", "train_actor",
                 ("old_logprob", "ref_logprob") if reference else ("old_logprob",)),
        NodeSpec("weight_sync", "actor", "compute", "push_weights", ("update",), "all"),
    ]
    return nodes


def ppo_graph(cfg: Any) -> list[NodeSpec]:
    """PPO: the critic's values of the responses, GAE advantages from them and the rewards, the actor's update
    and the critic's."""
    reference = cfg.rl.kl_coef > 0
    nodes = _generation() + [
        NodeSpec("values", "critic", "inference", "critic_values", ("reward",)),
        NodeSpec("old_logprob", "actor", "inference", "old_logprobs", ("reward",)),
    ]
    if reference:
        nodes.append(NodeSpec("ref_logprob", "reference", "inference", "ref_logprobs", ("reward",)))
    nodes += [
        NodeSpec("advantage", "none", "compute", "gae_advantages", ("values",)),
        NodeSpec("update", "actor", "train", "train_actor",
                 ("advantage", "old_logprob", "ref_logprob") if reference else ("advantage", "old_logprob")),
        NodeSpec("critic_update", "critic", "train", "train_critic", ("advantage",)),
        NodeSpec("weight_sync", "actor", "compute", "push_weights", ("update",), "all"),
    ]
    return nodes


@dataclass(frozen=True)
class Workflow:
    nodes: tuple[NodeSpec, ...]  # in execution order

    def node(self, node_id: str) -> NodeSpec:
        return next(n for n in self.nodes if n.id == node_id)

    def consumers(self, node_id: str) -> list[str]:
        return [n.id for n in self.nodes if node_id in n.inputs]

    def describe(self) -> str:
        return "\n".join(f"  {i + 1}. {n.id} [{n.role}/{n.type} on {n.placement}] = {n.function}"
                         f"({', '.join(n.inputs) or 'step'})" for i, n in enumerate(self.nodes))


class WorkflowError(ValueError):
    """The workflow cannot run; the message names the node."""


def _merge(base: list[NodeSpec], changes: list[Any]) -> list[NodeSpec]:
    nodes = {n.id: n for n in base}
    order = [n.id for n in base]
    for i, c in enumerate(changes):
        if not c.id:
            raise WorkflowError(f"workflow.nodes[{i}] has no id")
        if c.id in nodes:
            old = nodes[c.id]
            nodes[c.id] = replace(
                old, role=c.role or old.role, type=c.type or old.type, function=c.function or old.function,
                inputs=tuple(c.inputs) if c.inputs is not None else old.inputs, placement=c.placement or old.placement)
        else:
            if not c.function:
                raise WorkflowError(f"workflow node {c.id!r} has no function")
            nodes[c.id] = NodeSpec(c.id, c.role or "none", c.type or "compute", c.function, tuple(c.inputs or ()),
                                   c.placement)
            order.append(c.id)
    # a new node without a placement runs where its first input ran
    unplaced = [i for i in order if not nodes[i].placement]
    for _ in range(len(unplaced)):
        for i in unplaced:
            if not nodes[i].placement:
                first = nodes.get(nodes[i].inputs[0]) if nodes[i].inputs else None
                if first is None:
                    nodes[i] = replace(nodes[i], placement="all")
                elif first.placement:
                    nodes[i] = replace(nodes[i], placement=first.placement)
    for i in unplaced:  # inputs on a cycle or missing: _check names the problem
        if not nodes[i].placement:
            nodes[i] = replace(nodes[i], placement="all")
    return [nodes[i] for i in order]


def _check(nodes: list[NodeSpec]) -> None:
    ids = [n.id for n in nodes]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise WorkflowError(f"workflow nodes {sorted(dup)} are defined twice")
    for n in nodes:
        for name in n.inputs:
            if name not in ids:
                raise WorkflowError(f"workflow node {n.id!r} reads {name!r}, which is no node of the workflow "
                                    f"(nodes: {', '.join(ids)})")
            if name == n.id:
                raise WorkflowError(f"workflow node {n.id!r} reads its own output")
        if n.role not in ROLES:
            raise WorkflowError(f"workflow node {n.id!r}: role {n.role!r} is not one of {', '.join(ROLES)}")
        if n.type not in TYPES:
            raise WorkflowError(f"workflow node {n.id!r}: type {n.type!r} is not one of {', '.join(TYPES)}")
        if n.placement not in GROUPS:
            raise WorkflowError(f"workflow node {n.id!r} is placed on {n.placement!r}, which names no ranks "
                                f"(rank groups: {', '.join(GROUPS)})")
        if n.builtin and n.function not in BUILTIN_FUNCTIONS:
            raise WorkflowError(f"workflow node {n.id!r}: unknown function {n.function!r} (built-in: "
                                f"{', '.join(BUILTIN_FUNCTIONS)}; or 'package.module:function' / 'file.py:function')")
        if not n.builtin and not (_MODULE_FN.match(n.function) or _FILE_FN.match(n.function)):
            raise WorkflowError(f"workflow node {n.id!r}: function {n.function!r} is not 'package.module:function' "
                                "or 'path/to/file.py:function'")


def _order(nodes: list[NodeSpec]) -> list[NodeSpec]:
    """Topological order; at equal depth, declaration order (DistFlow's serialisation of a colocated graph)."""
    by_id = {n.id: n for n in nodes}
    depth: dict[str, int] = {}
    visiting: list[str] = []

    def visit(node_id: str) -> int:
        if node_id in depth:
            return depth[node_id]
        if node_id in visiting:
            cycle = visiting[visiting.index(node_id):] + [node_id]
            raise WorkflowError(f"workflow node {node_id!r} is on a cycle: {' -> '.join(cycle)}")
        visiting.append(node_id)
        d = 1 + max((visit(i) for i in by_id[node_id].inputs), default=-1)
        visiting.pop()
        depth[node_id] = d
        return d

    for n in nodes:
        visit(n.id)
    position = {n.id: i for i, n in enumerate(nodes)}
    return sorted(nodes, key=lambda n: (depth[n.id], position[n.id]))


def resolve(cfg: Any) -> Workflow:
    """The workflow ``cfg`` asks for, checked and in execution order; raises WorkflowError naming the node."""
    nodes = _merge(builtin_graph(cfg), list(cfg.workflow.nodes))
    _check(nodes)
    return Workflow(tuple(_order(nodes)))


def workflow_problems(cfg: Any) -> list[str]:
    try:
        resolve(cfg)
    except WorkflowError as err:
        return [str(err)]
    return []
