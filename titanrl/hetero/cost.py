"""HetRL's cost model (HetRL sec. 3.3, appendix B): predicted seconds of one RL step for a plan on a cluster.

A :class:`Plan` puts the RL tasks (:data:`TASKS`) into task groups, each on its own devices with its own
parallelism. :class:`HetCostModel` prices every task and the transfers between groups, per device, from the
device's TFLOP/s, memory bandwidth and memory and the links between devices (:mod:`titanrl.hetero.cluster`):

- **rollout** (actor generation, paper ``C^1``, ``Psi^gen``): one engine per ``tp`` consecutive devices of the
  group. Prefill is compute-bound (prompts once each: ``n`` samples share the prompt's KV); decoding one step of a
  batch of ``b`` sequences costs ``max(compute, bytes / memory bandwidth)``: the FLOPs of ``b`` tokens against
  reading the engine's weight shard and the batch's KV cache (paper ``C_hbm``, plus the KV reads it leaves out),
  plus two TP all-reduces per layer over the engine's slowest ring link. The batch is capped by the KV cache
  that fits beside everything else on the devices (and ``max_decode_batch``); more sequences run in waves.
- **reference / old_logprobs / values** (inference, ``Psi^inf``) and **update / critic_update** (training,
  ``Psi^train``, 3x the forward FLOPs, 4x with activation checkpointing): the group's devices form Ulysses units
  of ``ulysses`` consecutive devices (every member computes ``1/p`` of each sequence; a unit is as fast as its
  slowest member, ``p`` times), FSDP shards the models over blocks of ``fsdp`` consecutive devices (the blocks
  replicate each other: HSDP). Per micro-batch FSDP all-gathers the parameters (training: twice, plus a
  reduce-scatter of the gradients) over the block's ring, overlapped with compute (``max``); Ulysses adds its
  all-to-alls (not overlapped); training adds an all-reduce of the gradient shards across the replicas once per
  minibatch. There is no pipeline parallelism (titanrl has none), so the paper's bubble term is 0: what remains of
  "bubbles" is the imbalance between units, which the ``max`` over units shows.
- **weight_sync** (the paper's ``C_reshard`` / ``C_sync``): every generation device needs ``1/tp`` of the actor's
  weights; it takes each FSDP shard from the replica with the best link to it, over independent links (the paper's
  per-edge model), and no faster than its best inbound link carries the whole slice. Colocated, a ring all-gather
  inside each FSDP block.
- **redistribute**: trajectories (token ids, log-probs: 4 bytes per prompt token, 8 per response token) from the
  generation devices to every other group, and the reference log-probs / values to the training group when they
  were computed elsewhere.

Collectives on a set of devices use a ring ordered region by region (greedy: the next region is the one with
the best link), host by host; a ring step costs the slowest edge's ``latency + chunk / bandwidth`` (appendix B's
``min_ring max_edge``). Rings, shares and group results are cached per device tuple, so a search re-prices only the
groups it changed.

**Speed-aware balancing** (HetRL sec. 4.2, ``Plan.speed_aware``): work is split over a group's units in
proportion to their speed (generation: each engine's decode throughput at an even share; inference/training: the
unit's TFLOP/s), so a stage takes about ``total / sum of speeds``; speed-oblivious, every unit gets an even share
and the slowest sets the pace. Shares are continuous (titanrl splits whole prompt groups).

**The step** (``Phi``, appendix B.4): tasks of one phase (the inference tasks; the training tasks) that sit in the
same group add, different groups run in parallel (the paper's ``eta`` is 0 within a group, 1 across). Synchronous:
``rollout + redistribute + Phi(inference) + Phi(training) + weight_sync``. Asynchronous, with the rollout alone in
its group: ``max(rollout + redistribute, Phi(inference) + Phi(training)) + weight_sync`` (titanrl's engines do
not generate while weights are pushed); a rollout sharing devices cannot overlap, so async costs as sync.

**Memory** (constraint C3) is ``titanrl.memory``'s prediction, the trainer's own start-up check: a group that
holds the models is the config's training ranks on the group's devices (with the engine, sharded over its TP
ranks, when the rollout shares them), a rollout-only group's ranks hold an engine each
(``memory.predict_rollout_rank``). A workload built from a config (:func:`workload_from_config`) is checked against
each device's memory with the config's vLLM KV cache (``rollout.kv_cache_bytes``); a bare shape (HetRL's setting)
gets a config synthesized from its fields (:func:`synthesized_config`: the defaults, no vision tower) whose KV cache
is what ``memory_util`` of the device leaves (vLLM's ``gpu_memory_utilization``), at least one sequence's. An
infeasible plan costs ``inf`` and :meth:`HetCostModel.why_infeasible` names the device, the prediction and its
largest term.

**Efficiencies** (:class:`Coefficients`): FLOP/s and memory bandwidth are multiplied by an efficiency per term
(``train``, ``inference``, ``gen_compute``, ``gen_hbm``), optionally per device type; bytes over links are
multiplied by ``comm`` and latencies by ``latency``. :func:`fit` recovers them from measured stage times by
non-negative least squares on the stage's features (:meth:`HetCostModel.features`: the seconds each term
contributes at efficiency 1 on the stage's critical unit). A profiled ``gen_tokens_per_s`` scales that device's
generation speed by measured / predicted on the profiler's probe (``PROBE_*``).

The defaults are round numbers, not fitted to any measurement (docs/hetrl.md): every time this module
predicts is a model output. What it leaves out: the vision tower (text tokens only), pipeline parallelism, the
optimizer step, reward computation, the CPU side of titanrl's stages, and contention of many flows on one NIC
beyond the per-device inbound bound.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from titanrl.config.errors import ConfigError
from titanrl.hetero.cluster import Cluster
from titanrl.parallel.cost_model import CostModel

TASKS = ("rollout", "reference", "old_logprobs", "values", "update", "critic_update")
"""The RL tasks a plan places, named as the stages they report."""
STAGES = (*TASKS, "weight_sync", "redistribute")
"""What :meth:`HetCostModel.predict_stage_times` returns (a run reports the same names)."""
TITANRL_NODES = {"rollout": "rollout", "reference": "ref_logprob", "old_logprobs": "old_logprob", "values": "values",
                 "update": "update", "critic_update": "critic_update", "weight_sync": "weight_sync"}
"""The titanrl workflow node (titanrl/workflow/graph.py) whose time each stage predicts; ``redistribute`` (moving
trajectories between rank groups) has no node of its own: titanrl does it inside the nodes that read them."""
MODEL_TASKS = frozenset(TASKS) - {"rollout"}
TRAIN_TASKS = ("update", "critic_update")
INFERENCE_TASKS = ("reference", "old_logprobs", "values")
EFFICIENCY_TERMS = ("train", "inference", "gen_compute", "gen_hbm")
OVERHEAD_TERMS = {
    "rollout_call": "one rollout stage (per step): the engine call, its scheduler start, the reward hand-over",
    "rollout_prompt": "one prompt on the busiest engine: its tokenizing, media processing and prefill set-up",
    "decode_step": "one decode step of the busiest engine (the engine's per-step scheduling)",
    "engine_process_call": "one rollout of an engine in a process of its own (ranks that only generate run vLLM's "
                           "engine core as a child process: each call crosses processes)",
    "model_call": "one log-prob or update stage (per step): its plan and the step's hand-over to it",
    "exchange_prompt": "one prompt a colocated rank receives and assembles for the step's first model stage "
                       "(trajectories and pixels moved between ranks to the balancer's plan)",
    "microbatch": "one microbatch of the busiest unit (forward / backward launch, FSDP hooks, optimizer at the end)",
    "sync_call": "one weight push (per step)",
    "push_call": "one weight push to engines on other ranks (disaggregated: both sides meet for it)",
    "sync_byte": "one byte of the weights an engine receives (gather, cast, load into the engine)",
    "step_call": "one step beyond its stages: data, reward, advantages, metrics",
}
"""Fixed costs a fit adds to the model's FLOP and byte terms (seconds per unit; ``Coefficients.overheads``).
A large GPU model hides them; a small model, a CPU or a short response does not. They are host work: on a GPU
they take the same seconds whatever the GPU; on a CPU device (a profiled CPU rank) they run on the device itself,
so they are seconds on a CPU of ``HOST_TFLOPS`` and scale with the device's measured speed."""
HOST_TFLOPS = 0.1

# titanrl/profile.py's engine probe (``gen_tokens_per_s``): 8 short text prompts x 4 samples, 32 new tokens each.
PROBE_SEQUENCES = 32
PROBE_PROMPT_TOKENS = 32
PROBE_NEW_TOKENS = 32

_NOMINAL_DECODE_BATCH = 64.0  # decode batch at which a device's generation speed is quoted (device_speeds, task_work)
_TRAJ_PROMPT_BYTES, _TRAJ_RESPONSE_BYTES = 4, 8  # int32 ids; ids + fp32 log-probs


class PlanError(ValueError):
    """A plan that does not fit its workload or cluster; the message names the group and key."""


# ------------------------------------------------------------------------------------------------ workload

@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (the language model; a vision tower is not priced)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0  # 0: hidden // heads
    tied_embeddings: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
            if getattr(self, key) < 1:
                raise ValueError(f"ModelShape.{key} must be >= 1, got {getattr(self, key)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelShape.heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def params_per_layer(self) -> int:
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        return self.layers * self.params_per_layer + embed * (1 if self.tied_embeddings else 2) + self.hidden

    @classmethod
    def from_args(cls, args: Any, name: str = "") -> "ModelShape":
        """The language model of a Qwen2.5-VL shape (``Qwen2_5_VLArgs``, what ``titanrl.memory.resolve_shape``
        reads from a config)."""
        t = args.text
        return cls(layers=t.num_hidden_layers, hidden=t.hidden_size, intermediate=t.intermediate_size,
                   heads=t.num_attention_heads, kv_heads=t.num_key_value_heads, vocab=t.vocab_size,
                   head_dim=t.head_dim, tied_embeddings=t.tie_word_embeddings, name=name)

    def cost_model(self, head_out: int | None = None) -> CostModel:
        """The balancers' FLOP model (``titanrl.parallel.cost_model.CostModel.for_shape``) of this shape, with
        ``head_out`` output columns (the vocabulary; 1 for a value head). No vision tower."""
        return CostModel.for_shape(layers=self.layers, hidden=self.hidden, q_dim=self.heads * self.head_dim,
                                   kv_dim=self.kv_heads * self.head_dim, intermediate=self.intermediate,
                                   head_out=self.vocab if head_out is None else head_out)

    def linear_flops_per_token(self, head_out: int | None = None) -> float:
        """Forward FLOPs of one token's matmuls: the layers and the output head (``head_out`` columns:
        the vocabulary, 1 for a value head)."""
        return self.cost_model(head_out).forward_linear_per_token

    def attention_flops(self, length: float) -> float:
        """Forward FLOPs of causal attention over one sequence of ``length`` tokens (QK^T and PV, halved)."""
        return self.cost_model().forward_attention(length)

    @property
    def kv_bytes_per_token_value(self) -> int:
        """K and V values per token over all layers (times the dtype's bytes for bytes)."""
        return 2 * self.layers * self.kv_heads * self.head_dim

    @property
    def alltoall_values_per_token(self) -> int:
        """Values one token sends per layer in Ulysses' forward all-to-alls (Q, K, V in, the output back)."""
        return 2 * self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Workload:
    """One RL step: who computes what, for how many tokens.

    ``global_batch`` prompts per step, ``n`` responses each, ``prompt_len`` / ``response_len`` tokens (the
    maxima, as HetRL prices). ``algorithm`` ``ppo`` adds a critic (``critic`` shape, default the actor's):
    its values (inference) and its update (training). ``reference`` / ``old_logprobs`` say whether those
    forward passes run (titanrl: a reference only with ``rl.kl_coef > 0``; no separate old-log-prob pass with
    one epoch of one minibatch). ``shared_prefix`` computes a prompt once per group of ``n`` in inference and
    training (titanrl's default). ``micro_batch_tokens`` per device per micro-batch.
    """

    model: ModelShape
    prompt_len: int
    response_len: int
    global_batch: int
    n: int
    algorithm: str = "grpo"
    mode: str = "sync"
    dtype_bytes: int = 2
    critic: ModelShape | None = None
    reference: bool = True
    old_logprobs: bool = True
    shared_prefix: bool = False
    ppo_epochs: int = 1
    minibatches: int = 1
    micro_batch_tokens: int = 8192
    activation_checkpoint: bool = True
    # the titanrl config and its model's shape (Qwen2_5_VLArgs) whose memory titanrl.memory predicts: from
    # workload_from_config, or synthesized from the fields above for a bare shape (HetRL's setting)
    config: Any = field(default=None, compare=False, repr=False)
    args: Any = field(default=None, compare=False, repr=False)
    synthesized: bool = field(default=False, compare=False, repr=False)  # config made from the fields (no file)

    def __post_init__(self) -> None:
        if self.algorithm not in ("grpo", "ppo"):
            raise ValueError(f"Workload.algorithm must be 'grpo' or 'ppo', got {self.algorithm!r}")
        # a bare shape (or a copy of one, dataclasses.replace): memory is titanrl.memory's for a config made of its
        # fields. A workload from a config keeps that config: change the config, not the fields.
        if self.config is None or self.synthesized:
            cfg, args = synthesized_config(self)
            object.__setattr__(self, "config", cfg)
            object.__setattr__(self, "args", args)
            object.__setattr__(self, "synthesized", True)
        if self.mode not in ("sync", "async"):
            raise ValueError(f"Workload.mode must be 'sync' or 'async', got {self.mode!r}")
        for key in ("prompt_len", "response_len", "global_batch", "n", "dtype_bytes", "ppo_epochs", "minibatches",
                    "micro_batch_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"Workload.{key} must be >= 1, got {getattr(self, key)}")

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks of this workload, in :data:`TASKS` order."""
        out = ["rollout"]
        if self.reference:
            out.append("reference")
        if self.old_logprobs:
            out.append("old_logprobs")
        if self.algorithm == "ppo":
            out.append("values")
        out.append("update")
        if self.algorithm == "ppo":
            out.append("critic_update")
        return tuple(out)

    @property
    def critic_shape(self) -> ModelShape:
        return self.critic or self.model

    @property
    def sequences(self) -> int:
        return self.global_batch * self.n

    def describe(self) -> str:
        name = self.model.name or f"{self.model.params / 1e9:.3g}B-param model"
        return (f"{name}, {self.algorithm.upper()} {self.mode}, {self.global_batch} prompts x {self.n} responses, "
                f"prompt {self.prompt_len} + response {self.response_len} tokens")


def workload_from_config(cfg: Any) -> Workload:
    """The :class:`Workload` of a titanrl ``JobConfig``: its model's shape (``titanrl.memory.resolve_shape``: the
    ``config.json`` of ``model.path``, a published shape named by its folder, or the built-in ``model.flavor``),
    batch, ``rollout.n``, lengths (``data.max_prompt_tokens``, ``rollout.max_new_tokens``), algorithm, mode, dtype,
    and which passes its settings run. It carries the config: memory is priced by ``titanrl.memory``."""
    from titanrl.memory import resolve_shape

    try:
        args, where = resolve_shape(cfg)
    except ValueError as err:  # ConfigError included: the message names the key
        raise ValueError(str(err)) from None
    name = Path(cfg.model.path).name if cfg.model.path else f"titanrl {cfg.model.flavor}"
    old = not (cfg.rl.old_logprobs == "auto" and cfg.rl.ppo_epochs == 1 and cfg.rl.minibatches == 1)
    return Workload(
        model=ModelShape.from_args(args, name=name), prompt_len=cfg.data.max_prompt_tokens,
        response_len=cfg.rollout.max_new_tokens, global_batch=cfg.rl.global_batch_size, n=cfg.rollout.n,
        algorithm=cfg.rl.algorithm, mode=cfg.workflow.mode, dtype_bytes=4 if cfg.model.dtype == "float32" else 2,
        reference=cfg.rl.kl_coef > 0, old_logprobs=old, shared_prefix=cfg.rl.shared_prefix,
        ppo_epochs=cfg.rl.ppo_epochs, minibatches=cfg.rl.minibatches,
        micro_batch_tokens=cfg.balance.max_tokens_per_microbatch,
        activation_checkpoint=cfg.parallelism.activation_checkpoint == "full", config=cfg, args=args)


def synthesized_config(w: Workload) -> tuple[Any, Any]:
    """(JobConfig, Qwen2_5_VLArgs) of a bare shape: titanrl's defaults with the workload's batch, lengths,
    algorithm, mode, dtype, passes and microbatch budget, the vLLM engine (its KV cache sized by the cost model),
    and the shape's language model without a vision tower."""
    from titanrl.config import JobConfig
    from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs

    m = w.model
    if m.head_dim * m.heads != m.hidden:
        raise ValueError(f"ModelShape {m.name or m}: head_dim {m.head_dim} x heads {m.heads} must equal hidden "
                         f"{m.hidden} (titanrl's Qwen2.5-VL layout) for titanrl.memory to price it")
    half, side = m.head_dim // 2, 3 * (m.head_dim // 2) // 8
    args = Qwen2_5_VLArgs.from_hf_config({
        "model_type": "qwen2_5_vl", "vocab_size": m.vocab, "hidden_size": m.hidden,
        "intermediate_size": m.intermediate, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads, "tie_word_embeddings": m.tied_embeddings,
        "rope_scaling": {"mrope_section": [half - 2 * side, side, side]},
        "vision_config": {"depth": 0, "hidden_size": 8, "intermediate_size": 8, "num_heads": 1,
                          "out_hidden_size": m.hidden, "fullatt_block_indexes": []}})
    cfg = JobConfig()
    cfg.model.dtype = "float32" if w.dtype_bytes == 4 else "bfloat16"
    cfg.model.attn_backend = "flash"
    cfg.model.max_seq_len = w.prompt_len + w.response_len
    cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens = w.prompt_len, w.response_len
    cfg.rl.global_batch_size, cfg.rollout.n = w.global_batch, w.n
    cfg.rl.algorithm, cfg.workflow.mode = w.algorithm, w.mode
    cfg.rl.kl_coef = cfg.rl.kl_coef if w.reference else 0.0
    cfg.rl.old_logprobs = "recompute" if w.old_logprobs else "auto"
    cfg.rl.shared_prefix, cfg.rl.ppo_epochs, cfg.rl.minibatches = w.shared_prefix, w.ppo_epochs, w.minibatches
    cfg.balance.strategy = "lb_micro"
    cfg.balance.max_tokens_per_microbatch = w.micro_batch_tokens
    cfg.parallelism.activation_checkpoint = "full" if w.activation_checkpoint else "none"
    cfg.rollout.engine, cfg.rollout.kv_cache_bytes = "vllm", 0
    return cfg, args


def _is_cpu(device: Any) -> bool:
    """A profiled CPU rank (its cores recorded, or the profile's device ``cpu``)."""
    return device.cpu_affinity is not None or device.device_name.endswith("(cpu)")


# ------------------------------------------------------------------------------------------------ plan

@dataclass(frozen=True)
class GroupPlan:
    """One task group: its tasks, its devices (ids, in order: the order forms TP engines, Ulysses units and FSDP
    blocks of consecutive devices) and its parallelism. ``tp``: devices per generation engine (vLLM tensor
    parallelism); ``ulysses``: devices per sequence in inference/training; ``fsdp``: devices a model is sharded
    over (blocks that replicate each other; 0 = every device of the group)."""

    tasks: tuple[str, ...]
    devices: tuple[int, ...]
    tp: int = 1
    ulysses: int = 1
    fsdp: int = 0

    @property
    def fsdp_degree(self) -> int:
        return self.fsdp or len(self.devices)

    @property
    def has_models(self) -> bool:
        return any(t in MODEL_TASKS for t in self.tasks)

    @property
    def engines(self) -> int:
        """Generation engines (data-parallel degree of the rollout)."""
        return len(self.devices) // self.tp if "rollout" in self.tasks else 0

    @property
    def data_parallel(self) -> int:
        """Data-parallel degree of inference/training (Ulysses units)."""
        return len(self.devices) // self.ulysses if self.has_models else 0

    def describe(self) -> str:
        parts = []
        if "rollout" in self.tasks:
            parts.append(f"tp {self.tp}")
        if self.has_models:
            parts.append(f"ulysses {self.ulysses}, fsdp {self.fsdp_degree}")
        return f"{'+'.join(self.tasks)} on {len(self.devices)} device(s) [{', '.join(parts)}]"


@dataclass(frozen=True)
class Plan:
    """Where every task runs: disjoint task groups. ``speed_aware``: split work over units in proportion to their
    speed (HetRL sec. 4.2), else evenly."""

    groups: tuple[GroupPlan, ...]
    speed_aware: bool = True

    def group_of(self, task: str) -> GroupPlan:
        for g in self.groups:
            if task in g.tasks:
                return g
        raise KeyError(task)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for g in self.groups for d in g.devices)

    @property
    def colocated(self) -> bool:
        return len(self.groups) == 1

    def describe(self, cluster: Cluster | None = None) -> str:
        lines = []
        for g in self.groups:
            line = g.describe()
            if cluster is not None:
                types: dict[str, int] = {}
                for d in g.devices:
                    types[cluster.devices[d].type] = types.get(cluster.devices[d].type, 0) + 1
                line += " " + ", ".join(f"{c} {t}" for t, c in types.items())
            lines.append(line)
        lines.append("speed-aware split" if self.speed_aware else "even split (speed-oblivious)")
        return "\n".join(lines)

    def check(self, workload: Workload, cluster: Cluster) -> None:
        """Raise :class:`PlanError` unless every task of ``workload`` is in exactly one group, groups use distinct
        devices of ``cluster``, and every degree divides its group."""
        seen: dict[str, int] = {}
        used: set[int] = set()
        if not self.groups:
            raise PlanError("plan: no task groups")
        for i, g in enumerate(self.groups):
            key = f"groups[{i}]"
            if not g.devices:
                raise PlanError(f"plan: {key}.devices is empty")
            for t in g.tasks:
                if t not in workload.tasks:
                    raise PlanError(f"plan: {key}.tasks has {t!r}, which is not a task of this workload "
                                    f"({', '.join(workload.tasks)})")
                if t in seen:
                    raise PlanError(f"plan: task {t!r} is in groups[{seen[t]}] and {key}")
                seen[t] = i
            for d in g.devices:
                if not 0 <= d < len(cluster):
                    raise PlanError(f"plan: {key}.devices has {d}, the cluster has devices 0..{len(cluster) - 1}")
                if d in used:
                    raise PlanError(f"plan: device {d} is in two groups")
                used.add(d)
            n = len(g.devices)
            if g.tp < 1 or n % g.tp or (g.tp > 1 and "rollout" not in g.tasks):
                raise PlanError(f"plan: {key}.tp = {g.tp} must divide its {n} devices (and be 1 without rollout)")
            if g.ulysses < 1 or n % g.ulysses or workload.model.heads % g.ulysses or (
                    g.ulysses > 1 and not g.has_models):
                raise PlanError(f"plan: {key}.ulysses = {g.ulysses} must divide its {n} devices and the model's "
                                f"{workload.model.heads} heads (and be 1 without model tasks)")
            if g.fsdp < 0 or n % g.fsdp_degree:
                raise PlanError(f"plan: {key}.fsdp = {g.fsdp} must divide its {n} devices")
        missing = [t for t in workload.tasks if t not in seen]
        if missing:
            raise PlanError(f"plan: task {missing[0]!r} is in no group")
        for a, b in (("old_logprobs", "update"), ("values", "critic_update")):
            if a in seen and b in seen and seen[a] != seen[b]:
                raise PlanError(f"plan: {a!r} must share a group with {b!r} (they read the same weights)")


# ------------------------------------------------------------------------------------------------ coefficients

@dataclass(frozen=True)
class Coefficients:
    """What turns the model's FLOPs and bytes into seconds (module doc). Efficiencies are fractions of the
    device's peak FLOP/s (``train``, ``inference``, ``gen_compute``) or memory bandwidth (``gen_hbm``);
    ``by_type`` overrides one term for one device type: ``((term, type, efficiency), ...)``."""

    train: float = 0.45
    inference: float = 0.5
    gen_compute: float = 0.5
    gen_hbm: float = 0.7
    by_type: tuple[tuple[str, str, float], ...] = ()
    comm: float = 1.0
    latency: float = 1.0
    memory_util: float = 0.9
    max_decode_batch: int = 256
    overheads: tuple[tuple[str, float], ...] = ()  # ((term of OVERHEAD_TERMS, seconds per unit), ...): 0 unless fitted
    fitted: str = ""  # what the coefficients were fitted to (empty: the defaults, round numbers)

    def __post_init__(self) -> None:
        for term, value in self.overheads:
            if term not in OVERHEAD_TERMS or not value >= 0:
                raise ValueError(f"Coefficients.overheads entry ({term!r}, {value}) needs a term of "
                                 f"{tuple(OVERHEAD_TERMS)} and seconds >= 0")
        for term in EFFICIENCY_TERMS:
            if not getattr(self, term) > 0:
                raise ValueError(f"Coefficients.{term} must be > 0, got {getattr(self, term)}")
        for term, _, value in self.by_type:
            if term not in EFFICIENCY_TERMS or not value > 0:
                raise ValueError(f"Coefficients.by_type entry ({term!r}, ..., {value}) needs a term of "
                                 f"{EFFICIENCY_TERMS} and an efficiency > 0")
        if self.comm < 0 or self.latency < 0:
            raise ValueError("Coefficients.comm and .latency must be >= 0")
        if not 0 < self.memory_util <= 1:
            raise ValueError(f"Coefficients.memory_util must be in (0, 1], got {self.memory_util}")

    def efficiency(self, term: str, device_type: str) -> float:
        for t, dt, value in self.by_type:
            if t == term and dt == device_type:
                return value
        return getattr(self, term)

    def overhead(self, term: str) -> float:
        """Seconds per unit of the fixed cost ``term`` (:data:`OVERHEAD_TERMS`), 0 unless fitted."""
        return dict(self.overheads).get(term, 0.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (a profile's ``calibration.coefficients``); :meth:`from_dict` reads it back."""
        out = dataclasses.asdict(self)
        out["by_type"] = [list(e) for e in self.by_type]
        out["overheads"] = dict(self.overheads)
        return out

    @classmethod
    def from_dict(cls, table: Mapping[str, Any], *, source: str = "coefficients") -> "Coefficients":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        values = dict(table)
        if "by_type" in values:
            values["by_type"] = tuple((str(t), str(dt), float(v)) for t, dt, v in values["by_type"])
        if "overheads" in values:
            values["overheads"] = tuple(sorted((str(k), float(v)) for k, v in dict(values["overheads"]).items()))
        try:
            return cls(**values)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{source}: {err}") from None


def fit(rows: Sequence[tuple[Mapping[str, float], float]], *, base: Coefficients | None = None,
        relative: bool = False, fitted: str = "", negligible: float = 0.0,
        link_negligible: float = 0.0) -> Coefficients:
    """Coefficients that make the model's stage times match measured ones.

    Each row is ``(features, seconds)``: one stage (or one step) of a measured run, its features from
    :meth:`HetCostModel.evaluate` (seconds each term contributes at efficiency 1 on the stage's critical unit:
    ``"<term>:<device type>"``, ``"comm"``, ``"latency"``; units of a fixed cost: ``"overhead:<term>"``) and the
    measured seconds. The stage time is linear in ``1 / efficiency`` per term and type, in the ``comm`` /
    ``latency`` factors and in the overheads' seconds per unit, which non-negative least squares
    (``scipy.optimize.nnls``) recovers; a term whose fitted factor is 0 (never the bottleneck in the rows) keeps
    ``base``'s value. ``relative``: each row weighted by 1 / its seconds, so a short stage's error counts as much
    as a long one's (what a per-stage ratio target asks). ``negligible``: a term (other than a fixed cost) whose
    seconds under ``base`` stay below this fraction of every row's keeps ``base``'s value; ``link_negligible`` the
    same for the link factors (``comm``, ``latency``).
    """
    from scipy.optimize import nnls

    base = base or Coefficients()

    def base_factor(name: str) -> float:  # seconds per unit of the feature under ``base``
        if name in ("comm", "latency"):
            return getattr(base, name)
        term, _, device_type = name.partition(":")
        return 0.0 if term == "overhead" else 1.0 / base.efficiency(term, device_type)

    # a term that is under ``negligible`` of every row's seconds under ``base`` cannot be told from noise: it keeps
    # ``base``'s value (e.g. the link factors, fitted on one host's fast links)
    def significant(k: str, v: float, seconds: float) -> bool:
        share = link_negligible if k in ("comm", "latency") else negligible
        return k.startswith("overhead:") or v * base_factor(k) >= share * seconds

    names = sorted({k for f, s in rows for k, v in f.items() if v and significant(k, v, s)})
    if len(rows) < len(names):
        raise ValueError(f"fit needs at least as many rows as features ({len(names)}: {', '.join(names)}), "
                         f"got {len(rows)}")
    a = np.array([[float(f.get(k, 0.0)) for k in names] for f, _ in rows])
    # what the terms left out contribute at base's values is known: it comes off the measured seconds
    y = np.array([float(s) - sum(v * base_factor(k) for k, v in f.items() if k not in names) for f, s in rows])
    if relative:
        measured = np.array([float(s) for _, s in rows])
        if (measured <= 0).any():
            raise ValueError("fit(relative=True) needs every measured seconds > 0")
        a, y = a / measured[:, None], y / measured
    scale = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)  # columns of seconds vs. of milliseconds
    x = nnls(a / scale, y, maxiter=50 * len(names) + 100)[0] / scale
    by_type = {(t, dt): v for t, dt, v in base.by_type}
    overheads = dict(base.overheads)
    changes: dict[str, Any] = {"fitted": fitted or base.fitted}
    for name, value in zip(names, x):
        if name in ("comm", "latency"):
            changes[name] = float(value)
            continue
        if name.startswith("overhead:"):
            term = name.partition(":")[2]
            if term not in OVERHEAD_TERMS:
                raise ValueError(f"fit: unknown feature {name!r}")
            overheads[term] = float(value)
            continue
        term, _, device_type = name.partition(":")
        if term not in EFFICIENCY_TERMS or not device_type:
            raise ValueError(f"fit: unknown feature {name!r}")
        if value > 1e-12:
            by_type[term, device_type] = float(1.0 / value)
    return replace(base, by_type=tuple((t, dt, v) for (t, dt), v in sorted(by_type.items())),
                   overheads=tuple(sorted(overheads.items())), **changes)


# ------------------------------------------------------------------------------------------------ estimates

@dataclass(frozen=True)
class Estimate:
    """The cost model's answer for one plan: the step's seconds (``inf`` when infeasible), every stage's seconds,
    and per stage the features a fit uses."""

    step_s: float
    stages: dict[str, float]
    why_infeasible: str | None = None
    features: dict[str, dict[str, float]] = field(default_factory=dict)
    step_features: dict[str, float] = field(default_factory=dict)  # the step's: its critical path's stages summed

    @property
    def feasible(self) -> bool:
        return self.why_infeasible is None


@dataclass
class _Stage:
    seconds: float
    features: dict[str, float]


@dataclass
class _Group:
    problem: str | None
    stages: dict[str, _Stage]
    shares: np.ndarray | None = None  # rollout: sequences' share per engine


class HetCostModel:
    """Prices plans of ``workload`` on ``cluster`` (module doc). Results are cached per group; ``evaluations``
    counts :meth:`evaluate` calls (what a search's budget counts)."""

    def __init__(self, cluster: Cluster, workload: Workload, coefficients: Coefficients | None = None) -> None:
        self.cluster = cluster
        self.workload = workload
        self.coefficients = c = coefficients or Coefficients()
        self.evaluations = 0
        devs = cluster.devices
        self.types = cluster.types
        self.type_of = np.array([self.types.index(d.type) for d in devs])
        self.tflops = np.array([d.tflops for d in devs]) * 1e12
        self.hbm = np.array([d.hbm_gbps for d in devs]) * 1e9
        self.memory = np.array([d.memory_gb for d in devs]) * 1e9
        self.bw = np.asarray(cluster.bandwidth)
        self.lat = np.asarray(cluster.latency)
        self.eff = {t: np.array([c.efficiency(t, d.type) for d in devs]) for t in EFFICIENCY_TERMS}
        regions = cluster.regions
        self.region_of = np.array([regions.index(d.region) for d in devs])
        hosts = cluster.hosts
        self.host_of = np.array([hosts.index(d.host) for d in devs])
        self._region_bw = self._region_bandwidths(len(regions))
        self._derive_workload()
        self.gen_scale = np.array([self._gen_scale(d.id) for d in devs])
        # fixed costs run on the host: a CPU device is its own host (OVERHEAD_TERMS)
        self.host_scale = np.array([HOST_TFLOPS * 1e12 / self.tflops[d.id] if _is_cpu(d) else 1.0 for d in devs])
        self._rings: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        self._pairs: dict[tuple[int, ...], tuple[float, float]] = {}
        self._groups: dict[tuple, _Group] = {}

    # -------------------------------------------------------------- workload constants

    def _derive_workload(self) -> None:
        w = self.workload
        m, cm = w.model, w.critic_shape
        b = w.dtype_bytes
        P, R, B, S = w.prompt_len, w.response_len, w.global_batch, w.sequences
        if w.shared_prefix:
            tokens = B * (P + w.n * R)

            def attn(shape: ModelShape) -> float:
                return B * (shape.attention_flops(P) + w.n * (shape.attention_flops(P + R) - shape.attention_flops(P)))
        else:
            tokens = S * (P + R)

            def attn(shape: ModelShape) -> float:
                return S * shape.attention_flops(P + R)
        self.tokens = float(tokens)
        self.fwd_flops = {"actor": tokens * m.linear_flops_per_token() + attn(m),
                          "critic": tokens * cm.linear_flops_per_token(head_out=1) + attn(cm)}
        self.params = {"actor": float(m.params), "critic": float(cm.params)}
        self.shape = {"actor": m, "critic": cm}
        self.train_factor = (4.0 if w.activation_checkpoint else 3.0) * w.ppo_epochs
        self.seq_len = P + R
        self.weight_bytes = m.params * b
        self.kv_bytes_per_token = m.kv_bytes_per_token_value * b
        self.decode_ctx = P + R / 2  # mean context length while decoding
        self.traj_bytes = (B if w.shared_prefix else S) * P * _TRAJ_PROMPT_BYTES + S * R * _TRAJ_RESPONSE_BYTES

    def _decode_flops(self, context: float) -> float:
        """Forward FLOPs of decoding one token against ``context`` cached tokens (matmuls, QK^T and PV)."""
        m = self.workload.model
        return m.linear_flops_per_token() + 4.0 * m.layers * m.heads * m.head_dim * context

    def _gen_scale(self, device: int) -> float:
        """measured / predicted generation throughput on the profiler's probe (1 when not measured), predicted with
        the *default* efficiencies: so with default coefficients the probe's speed is what a device generates at,
        and a fitted ``gen_compute`` / ``gen_hbm`` scales it (their ratio to the defaults: real rollouts against the
        probe), linearly, as a fit needs."""
        measured = self.cluster.devices[device].gen_tokens_per_s
        if measured is None:
            return 1.0
        m = self.workload.model
        default = Coefficients()
        gc = self.tflops[device] * default.gen_compute
        gh = self.hbm[device] * default.gen_hbm
        prefill = PROBE_SEQUENCES * (PROBE_PROMPT_TOKENS * m.linear_flops_per_token()
                                     + m.attention_flops(PROBE_PROMPT_TOKENS)) / gc
        ctx = PROBE_PROMPT_TOKENS + PROBE_NEW_TOKENS / 2
        flops = PROBE_SEQUENCES * self._decode_flops(ctx)
        nbytes = self.weight_bytes + PROBE_SEQUENCES * ctx * self.kv_bytes_per_token
        predicted = PROBE_SEQUENCES * PROBE_NEW_TOKENS / (prefill + PROBE_NEW_TOKENS * max(flops / gc, nbytes / gh))
        return measured / predicted

    # -------------------------------------------------------------- public API

    def evaluate(self, plan: Plan) -> Estimate:
        """The step time, stage times and features of ``plan`` (``inf`` with the reason when it does not fit)."""
        self.evaluations += 1
        plan.check(self.workload, self.cluster)
        w = self.workload
        groups = [self._group(g, plan.speed_aware) for g in plan.groups]
        for g in groups:
            if g.problem:
                return Estimate(math.inf, {s: math.inf for s in STAGES}, g.problem)
        stages: dict[str, _Stage] = {}
        for g in groups:
            stages.update(g.stages)
        gen_i = next(i for i, g in enumerate(plan.groups) if "rollout" in g.tasks)
        stages["weight_sync"] = self._weight_sync(plan.groups[gen_i], plan.group_of("update"))
        stages["redistribute"] = self._redistribute(plan, gen_i, groups[gen_i].shares)
        for s in STAGES:
            stages.setdefault(s, _Stage(0.0, {}))
        seconds = {s: stages[s].seconds for s in STAGES}

        def phi(tasks: Sequence[str]) -> tuple[float, list[str]]:
            """The slowest group's seconds over ``tasks`` (groups run in parallel) and that group's stages."""
            per = [[t for t in g.stages if t in tasks] for g in groups]
            sums = [sum(seconds[t] for t in names) for names in per]
            k = int(np.argmax(sums)) if sums else 0
            return (sums[k], per[k]) if sums else (0.0, [])

        (inference, inf_path), (training, train_path) = phi(INFERENCE_TASKS), phi(TRAIN_TASKS)
        models, model_path = inference + training, inf_path + train_path
        rollout, rollout_path = seconds["rollout"] + seconds["redistribute"], ["rollout", "redistribute"]
        if w.mode == "async" and plan.groups[gen_i].tasks == ("rollout",):
            path = rollout_path if rollout >= models else model_path
            step = max(rollout, models) + seconds["weight_sync"]
        else:
            path = rollout_path + model_path
            step = rollout + models + seconds["weight_sync"]
        hs = float(self.host_scale[list(plan.devices)].max())
        step += hs * self.coefficients.overhead("step_call")
        step_features = {"overhead:step_call": hs}
        for s in [*path, "weight_sync"]:
            for k, v in stages[s].features.items():
                step_features[k] = step_features.get(k, 0.0) + v
        return Estimate(step, seconds, None, {s: dict(stages[s].features) for s in STAGES}, step_features)

    def step_time(self, plan: Plan) -> float:
        return self.evaluate(plan).step_s

    def predict_stage_times(self, plan: Plan) -> dict[str, float]:
        """Seconds of every stage of :data:`STAGES` (what a run can report beside its measured times)."""
        return self.evaluate(plan).stages

    def features(self, plan: Plan) -> dict[str, dict[str, float]]:
        """Per stage, the seconds each term contributes at efficiency 1 on the stage's critical unit (:func:`fit`)."""
        return self.evaluate(plan).features

    def why_infeasible(self, plan: Plan) -> str | None:
        """Why ``plan`` does not fit in memory (None: it does). Does not count as an evaluation."""
        plan.check(self.workload, self.cluster)
        for g in plan.groups:
            problem = self._group(g, plan.speed_aware).problem
            if problem:
                return problem
        return None

    def group_problem(self, group: GroupPlan) -> str | None:
        """Why ``group`` does not fit in memory (None: it does); cheap, and not counted as an evaluation."""
        return self._memory(group)[0]

    def device_speeds(self, plan: Plan) -> dict[int, float]:
        """Each device's speed as the plan's speed-aware split sees it: in a group that holds models, its training
        FLOP/s (efficiency included); in a rollout-only group, its decode tokens/s at a batch of 64 (compute- or
        memory-bound, whichever is slower). titanrl's ``balance.rank_speeds`` takes these, relative."""
        flops_tok = self._decode_flops(self.decode_ctx)
        batch = _NOMINAL_DECODE_BATCH
        out = {}
        for g in plan.groups:
            for d in g.devices:
                if g.has_models:
                    out[d] = float(self.tflops[d] * self.eff["train"][d])
                else:
                    gc = self.tflops[d] * self.eff["gen_compute"][d] * self.gen_scale[d]
                    gh = self.hbm[d] * self.eff["gen_hbm"][d] * self.gen_scale[d]
                    nbytes = self.weight_bytes + batch * self.decode_ctx * self.kv_bytes_per_token
                    out[d] = float(batch / max(batch * flops_tok / gc, nbytes / gh))
        return out

    def task_work(self, task: str) -> float:
        """Seconds of ``task`` on one device of the cluster's mean speed, ignoring memory and communication: a
        hint for how many devices a task group deserves."""
        w = self.workload
        if task == "rollout":
            m = w.model
            gc = float(np.mean(self.tflops * self.eff["gen_compute"]))
            gh = float(np.mean(self.hbm * self.eff["gen_hbm"]))
            batch = _NOMINAL_DECODE_BATCH
            per_token = max(self._decode_flops(self.decode_ctx) / gc,
                            (self.weight_bytes / batch + self.decode_ctx * self.kv_bytes_per_token) / gh)
            prefill = w.global_batch * (w.prompt_len * m.linear_flops_per_token() + m.attention_flops(w.prompt_len))
            return w.sequences * w.response_len * per_token + prefill / gc
        role = "critic" if task in ("values", "critic_update") else "actor"
        kind = "train" if task in TRAIN_TASKS else "inference"
        factor = self.train_factor if task in TRAIN_TASKS else 1.0
        return self.fwd_flops[role] * factor / float(np.mean(self.tflops * self.eff[kind]))

    # -------------------------------------------------------------- rings and links

    def _region_bandwidths(self, regions: int) -> np.ndarray:
        out = np.zeros((regions, regions))
        for a in range(regions):
            ia = np.flatnonzero(self.region_of == a)
            for b in range(regions):
                if a != b:
                    ib = np.flatnonzero(self.region_of == b)
                    out[a, b] = self.bw[np.ix_(ia, ib)].max()
        return out

    def _ring(self, devices: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(bandwidth, latency) of each edge of a good ring through ``devices``: region by region (greedy tour
        by best link), host by host."""
        ring = self._rings.get(devices)
        if ring is not None:
            return ring
        idx = np.array(devices)
        present = list(dict.fromkeys(self.region_of[idx].tolist()))
        tour = [min(present)]
        left = set(present) - {tour[0]}
        while left:
            nxt = max(sorted(left), key=lambda r: self._region_bw[tour[-1], r])
            tour.append(nxt)
            left.remove(nxt)
        pos = {r: i for i, r in enumerate(tour)}
        order = idx[np.lexsort((idx, self.host_of[idx], [pos[r] for r in self.region_of[idx]]))]
        nxt = np.roll(order, -1)
        ring = (self.bw[order, nxt], self.lat[order, nxt])
        self._rings[devices] = ring
        return ring

    def _ring_collective(self, devices: tuple[int, ...], steps: int, chunk_bytes: float) -> tuple[float, float]:
        """(bandwidth seconds, latency seconds) of a ring collective of ``steps`` steps moving ``chunk_bytes`` per
        step; each step waits for the ring's slowest edge (chosen with the current coefficients)."""
        if len(devices) < 2 or steps == 0:
            return 0.0, 0.0
        bw, lat = self._ring(devices)
        c = self.coefficients
        e = int(np.argmax(c.comm * chunk_bytes / bw + c.latency * lat))
        return float(steps * chunk_bytes / bw[e]), float(steps * lat[e])

    def _pairwise(self, devices: tuple[int, ...]) -> tuple[float, float]:
        """(worst bandwidth, worst latency) between any two of ``devices`` (all-to-all)."""
        pair = self._pairs.get(devices)
        if pair is None:
            idx = np.array(devices)
            pair = self._pairs[devices] = (float(self.bw[np.ix_(idx, idx)].min()),
                                           float(self.lat[np.ix_(idx, idx)].max()))
        return pair

    # -------------------------------------------------------------- groups

    def _group(self, g: GroupPlan, speed_aware: bool) -> _Group:
        key = (g, speed_aware)
        cached = self._groups.get(key)
        if cached is not None:
            return cached
        problem, kv_room = self._memory(g)
        result = _Group(problem, {})
        if problem is None:
            if "rollout" in g.tasks:
                stage, shares, problem = self._rollout(g, speed_aware, kv_room)
                result = _Group(problem, {"rollout": stage}, shares)
            if result.problem is None:
                for t in g.tasks:
                    if t != "rollout":
                        result.stages[t] = self._model_task(g, t, speed_aware)
                if "update" in g.tasks:
                    self._first_model_stage(g, result.stages, speed_aware)
        self._groups[key] = result
        return result

    def _first_model_stage(self, g: GroupPlan, stages: dict[str, _Stage], speed_aware: bool) -> None:
        """titanrl's first model stage of a step is its old_logprob node (with no pass of its own when the first
        minibatch's update forward gives the old log-probs: one call). Colocated, it also receives and assembles
        the prompts the balancer moved to each unit (``exchange_prompt`` per prompt of the busiest unit)."""
        c = self.coefficients
        idx = np.array(g.devices).reshape(-1, g.ulysses)
        hs = self.host_scale[idx].max(axis=1)
        calls = 0.0 if "old_logprobs" in g.tasks else 1.0  # its own pass already counts its call
        prompts = np.zeros(len(hs))
        if "rollout" in g.tasks:
            speed = (self.tflops[idx] * self.eff["inference"][idx]).min(axis=1)
            shares = speed / speed.sum() if speed_aware else np.full(len(hs), 1.0 / len(hs))
            prompts = self.workload.global_batch * shares
        per = hs * (calls * c.overhead("model_call") + c.overhead("exchange_prompt") * prompts)
        u = int(np.argmax(per))
        stage = stages.get("old_logprobs") or _Stage(0.0, {})
        features = dict(stage.features)
        if calls:
            features["overhead:model_call"] = features.get("overhead:model_call", 0.0) + float(hs[u])
        if "rollout" in g.tasks:
            features["overhead:exchange_prompt"] = float(hs[u] * prompts[u])
        stages["old_logprobs"] = _Stage(stage.seconds + float(per[u]), features)

    def _memory(self, g: GroupPlan) -> tuple[str | None, np.ndarray]:
        """(problem or None, bytes per device for generation's KV cache), by ``titanrl.memory`` (module doc): a
        group holding the models is the config's training ranks on its devices, with the group's TP and Ulysses; a
        rollout-only group's ranks hold an engine each. A config's vLLM KV cache is ``rollout.kv_cache_bytes`` per
        rank and the check is the trainer's (the prediction against the device's memory); a bare shape's KV cache
        is what ``memory_util`` of the device leaves."""
        from titanrl import memory

        w, c = self.workload, self.coefficients
        cfg = copy.deepcopy(w.config)
        idx = np.array(g.devices)
        device = "cpu" if all(_is_cpu(self.cluster.devices[d]) for d in g.devices) else "cuda"
        cfg.rollout.tensor_parallel_size = g.tp
        cfg.parallelism.data_parallel_shard_degree = -1
        if g.has_models:
            cfg.workflow.placement = "colocated" if "rollout" in g.tasks else "disaggregated"
            if g.ulysses > 1:
                cfg.parallelism.ulysses, cfg.parallelism.p_max = "flex", g.ulysses
            # FSDP shards over blocks of fsdp_degree devices (titanrl: the whole group; HSDP in HetRL's wider space);
            # odc on several hosts shards over one host's devices (hybrid sharding), colocated only, as the trainer
            try:
                shard = memory.fsdp_shard_degree(cfg, [self.cluster.devices[d].host for d in g.devices],
                                                 disaggregated="rollout" not in g.tasks)
            except ConfigError as err:
                return f"the group of {'+'.join(g.tasks)}: {err}", np.zeros(len(idx))
            shard = shard if shard < len(g.devices) else None  # (else the group's fsdp_degree)
            plan = memory.predict(cfg, w.args, g.fsdp_degree, device=device, shard=shard)
        else:
            cfg.workflow.placement = "disaggregated"
            plan = memory.predict_rollout_rank(cfg, w.args, len(g.devices), device=device)
        budget = self.memory[idx] * (c.memory_util if w.synthesized else 1.0)
        short = np.flatnonzero(plan.total > budget)
        if len(short):
            d = int(idx[short[0]])
            dev = self.cluster.devices[d]
            big = plan.largest
            return (f"device {d} ({dev.type} on {dev.host}) in the group of {'+'.join(g.tasks)}: titanrl.memory "
                    f"predicts {plan.total / 1e9:.3g} GB per rank (largest: {big.name} {big.bytes / 1e9:.3g} GB), over "
                    f"the {budget[short[0]] / 1e9:.3g} GB usable of its {dev.memory_gb:.3g} GB (tp {g.tp}, ulysses "
                    f"{g.ulysses}, fsdp {g.fsdp_degree if g.has_models else 1}, {len(g.devices)} rank(s))"), \
                np.zeros(len(idx))
        if "rollout" not in g.tasks:
            return None, np.zeros(len(idx))
        if w.synthesized:  # the KV cache takes what generation leaves: everything but the rollout phase's peers
            during = sum(t.bytes for t in plan.terms if t.phase in ("resident", "rollout"))
            return None, budget - during
        if cfg.rollout.engine == "vllm":
            return None, np.full(len(idx), float(cfg.rollout.kv_cache_bytes))
        kv = next((t.bytes for t in plan.terms if t.name == "engine_generate_kv"), 0)
        return None, budget - plan.total + kv

    def _rollout(self, g: GroupPlan, speed_aware: bool, kv_room: np.ndarray
                 ) -> tuple[_Stage, np.ndarray, str | None]:
        w, c = self.workload, self.coefficients
        m = w.model
        tp = g.tp
        idx = np.array(g.devices).reshape(-1, tp)
        engines = idx.shape[0]
        gc_all = self.tflops[idx] * self.eff["gen_compute"][idx] * self.gen_scale[idx]
        gh_all = self.hbm[idx] * self.eff["gen_hbm"][idx] * self.gen_scale[idx]
        ci = np.argmin(gc_all, axis=1)
        hi = np.argmin(gh_all, axis=1)
        rows = np.arange(engines)
        gc, gh = gc_all[rows, ci], gh_all[rows, hi]
        cap = np.floor(kv_room.reshape(-1, tp).min(axis=1) / (self.seq_len * self.kv_bytes_per_token / tp))
        cap = np.minimum(cap, c.max_decode_batch)
        if (cap < 1).any():
            e = int(np.argmin(cap))
            return _Stage(math.inf, {}), np.zeros(engines), (
                f"engine of devices {idx[e].tolist()}: no room for one sequence's KV cache")
        flops_tok = self._decode_flops(self.decode_ctx)
        kv_tok = self.decode_ctx * self.kv_bytes_per_token
        # TP: two all-reduces per layer per decode step over the engine's ring
        if tp > 1:
            comm_steps = 2 * (tp - 1) * 2 * m.layers
            tp_bw = np.empty(engines)
            tp_lat = np.empty(engines)
            for e in range(engines):
                bw, lat = self._ring(tuple(idx[e].tolist()))
                k = int(np.argmax(c.comm * m.hidden * w.dtype_bytes / bw + c.latency * lat))
                tp_bw[e], tp_lat[e] = bw[k], lat[k]
        else:
            comm_steps, tp_bw, tp_lat = 0, np.full(engines, np.inf), np.zeros(engines)

        def step(batch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            compute = batch * flops_tok / tp / gc
            memory = (self.weight_bytes + batch * kv_tok) / tp / gh
            comm_bw = comm_steps * batch * m.hidden * w.dtype_bytes / tp / tp_bw
            comm_lat = comm_steps * tp_lat
            return compute, memory, comm_bw, comm_lat

        total = float(w.sequences)
        even = np.minimum(cap, total / engines)
        compute, memory, cb, cl = step(even)
        rate = even / (np.maximum(compute, memory) + c.comm * cb + c.latency * cl)
        shares = rate / rate.sum() if speed_aware else np.full(engines, 1.0 / engines)
        seqs = total * shares
        batch = np.minimum(seqs, cap)
        waves = np.maximum(1.0, seqs / cap) * w.response_len
        compute, memory, cb, cl = step(batch)
        prompts = seqs / w.n
        prefill = prompts * (w.prompt_len * m.linear_flops_per_token() + m.attention_flops(w.prompt_len)) / tp / gc
        prefill_cb = (2 * (tp - 1) * 2 * m.layers * prompts * w.prompt_len * m.hidden * w.dtype_bytes / tp / tp_bw
                      if tp > 1 else np.zeros(engines))
        prefill_cl = 2 * (tp - 1) * 2 * m.layers * tp_lat
        hs = self.host_scale[idx].max(axis=1)
        own_process = 0.0 if g.has_models else 1.0
        fixed = hs * (c.overhead("rollout_call") + c.overhead("rollout_prompt") * prompts
                      + c.overhead("decode_step") * waves + own_process * c.overhead("engine_process_call"))
        times = (prefill + waves * np.maximum(compute, memory) + c.comm * (waves * cb + prefill_cb)
                 + c.latency * (waves * cl + prefill_cl) + fixed)
        e = int(np.argmax(times))
        raw_c = self.tflops[idx[e, ci[e]]] * self.gen_scale[idx[e, ci[e]]]
        raw_h = self.hbm[idx[e, hi[e]]] * self.gen_scale[idx[e, hi[e]]]
        features: dict[str, float] = {}
        tc = self.types[self.type_of[idx[e, ci[e]]]]
        features[f"gen_compute:{tc}"] = float(prefill[e] * gc[e] / raw_c)
        if compute[e] >= memory[e]:
            features[f"gen_compute:{tc}"] += float(waves[e] * compute[e] * gc[e] / raw_c)
        else:
            th = self.types[self.type_of[idx[e, hi[e]]]]
            features[f"gen_hbm:{th}"] = float(waves[e] * memory[e] * gh[e] / raw_h)
        if tp > 1:
            features["comm"] = float(waves[e] * cb[e] + prefill_cb[e])
            features["latency"] = float(waves[e] * cl[e] + prefill_cl[e])
        features.update({"overhead:rollout_call": float(hs[e]), "overhead:rollout_prompt": float(hs[e] * prompts[e]),
                         "overhead:decode_step": float(hs[e] * waves[e])})
        if own_process:
            features["overhead:engine_process_call"] = float(hs[e])
        return _Stage(float(times[e]), features), shares, None

    def _model_task(self, g: GroupPlan, task: str, speed_aware: bool) -> _Stage:
        w, c = self.workload, self.coefficients
        role = "critic" if task in ("values", "critic_update") else "actor"
        shape = self.shape[role]
        train = task in TRAIN_TASKS
        kind = "train" if train else "inference"
        p, f = g.ulysses, g.fsdp_degree
        devices = g.devices
        idx = np.array(devices).reshape(-1, p)
        units = idx.shape[0]
        eff_speed = self.tflops[idx] * self.eff[kind][idx]
        member = np.argmin(eff_speed, axis=1)
        rows = np.arange(units)
        speed = p * eff_speed[rows, member]
        shares = speed / speed.sum() if speed_aware else np.full(units, 1.0 / units)
        flops = self.fwd_flops[role] * (self.train_factor if train else 1.0) * shares
        epochs = w.ppo_epochs if train else 1
        tokens = self.tokens * shares * epochs
        compute = flops / speed
        micro = np.maximum(1.0, tokens / (p * w.micro_batch_tokens))
        directions = (3 if w.activation_checkpoint else 2) if train else 1
        if p > 1:
            a2a_bw = np.empty(units)
            a2a_lat = np.empty(units)
            for u in range(units):
                bw, lat = self._pairwise(tuple(idx[u].tolist()))
                a2a_bw[u] = (tokens[u] / p * shape.alltoall_values_per_token * w.dtype_bytes * shape.layers
                             * directions * (p - 1) / p / bw)
                a2a_lat[u] = micro[u] * shape.layers * 4 * directions * lat
        else:
            a2a_bw = a2a_lat = np.zeros(units)
        hs = self.host_scale[idx].max(axis=1)
        fixed = hs * (c.overhead("model_call") + c.overhead("microbatch") * micro)
        unit_time = compute + c.comm * a2a_bw + c.latency * a2a_lat + fixed
        # FSDP: per micro-batch all-gathers (training: fwd + bwd + reduce-scatter), overlapped with compute
        fs_bw = fs_lat = 0.0
        if f > 1:
            collectives = (3 if train else 1) * float(micro.max())
            chunk = self.params[role] * w.dtype_bytes / f
            worst = (-1.0, 0.0, 0.0)
            for start in range(0, len(devices), f):
                bw_s, lat_s = self._ring_collective(devices[start:start + f], f - 1, chunk)
                t = c.comm * bw_s + c.latency * lat_s
                if t > worst[0]:
                    worst = (t, bw_s, lat_s)
            fs_bw, fs_lat = collectives * worst[1], collectives * worst[2]
        u = int(np.argmax(unit_time))
        d = int(idx[u, member[u]])
        fsdp_time = c.comm * fs_bw + c.latency * fs_lat + fixed[u]
        overheads = {"overhead:model_call": float(hs[u]), "overhead:microbatch": float(hs[u] * micro[u])}
        if unit_time[u] >= fsdp_time:
            seconds = float(unit_time[u])
            features = {f"{kind}:{self.types[self.type_of[d]]}": float(flops[u] / (p * self.tflops[d])),
                        "comm": float(a2a_bw[u]), "latency": float(a2a_lat[u]), **overheads}
        else:
            seconds = fsdp_time
            features = {"comm": fs_bw, "latency": fs_lat, **overheads}
        # HSDP: all-reduce the gradient shards across the replicas once per minibatch
        replicas = len(devices) // f
        if train and replicas > 1:
            chunk = self.params[role] * w.dtype_bytes / f / replicas
            worst = (-1.0, 0.0, 0.0)
            for s in range(f):
                bw_s, lat_s = self._ring_collective(devices[s::f], 2 * (replicas - 1), chunk)
                t = c.comm * bw_s + c.latency * lat_s
                if t > worst[0]:
                    worst = (t, bw_s, lat_s)
            times = w.minibatches * w.ppo_epochs
            seconds += times * worst[0]
            features["comm"] = features.get("comm", 0.0) + times * worst[1]
            features["latency"] = features.get("latency", 0.0) + times * worst[2]
        return _Stage(seconds, {k: v for k, v in features.items() if v})

    # -------------------------------------------------------------- between groups

    def _weight_sync(self, gen: GroupPlan, train: GroupPlan) -> _Stage:
        """The push's transfer (below) plus its fixed costs: per push and per byte an engine receives."""
        c = self.coefficients
        received = self.weight_bytes / gen.tp
        stage = self._weight_transfer(gen, train)
        hs = float(self.host_scale[list(gen.devices) + list(train.devices)].max())
        remote = 0.0 if gen is train else hs
        fixed = hs * (c.overhead("sync_call") + c.overhead("sync_byte") * received) + remote * c.overhead("push_call")
        features = {**stage.features, "overhead:sync_call": hs, "overhead:sync_byte": hs * float(received)}
        if remote:
            features["overhead:push_call"] = remote
        return _Stage(stage.seconds + fixed, features)

    def _weight_transfer(self, gen: GroupPlan, train: GroupPlan) -> _Stage:
        c = self.coefficients
        f = train.fsdp_degree
        if gen is train:
            if f == 1:
                return _Stage(0.0, {})
            worst = (-1.0, 0.0, 0.0)
            for start in range(0, len(train.devices), f):
                bw_s, lat_s = self._ring_collective(train.devices[start:start + f], f - 1, self.weight_bytes / f)
                t = c.comm * bw_s + c.latency * lat_s
                if t > worst[0]:
                    worst = (t, bw_s, lat_s)
            return _Stage(worst[0], {"comm": worst[1], "latency": worst[2]})
        src = np.array(train.devices)
        dst = np.array(gen.devices)
        bw = self.bw[np.ix_(src, dst)].reshape(-1, f, len(dst))  # (replicas, shard, gen device)
        lat = self.lat[np.ix_(src, dst)].reshape(-1, f, len(dst))
        shard = self.weight_bytes / f / gen.tp
        per = c.comm * shard / bw + c.latency * lat
        best = np.argmin(per, axis=0)  # the replica each shard comes from, per gen device
        shard_t = np.take_along_axis(per, best[None], axis=0)[0]  # (shard, gen device)
        worst_shard = np.argmax(shard_t, axis=0)
        per_dev = shard_t[worst_shard, np.arange(len(dst))]
        inbound = c.comm * self.weight_bytes / gen.tp / self.bw[np.ix_(src, dst)].max(axis=0)
        k = int(np.argmax(np.maximum(per_dev, inbound)))
        if inbound[k] >= per_dev[k]:
            best_bw = float(self.bw[np.ix_(src, dst)].max(axis=0)[k])
            return _Stage(float(inbound[k]), {"comm": self.weight_bytes / gen.tp / best_bw})
        r, s = int(best[worst_shard[k], k]), int(worst_shard[k])
        return _Stage(float(per_dev[k]), {"comm": float(shard / bw[r, s, k]), "latency": float(lat[r, s, k])})

    def _transfer(self, src: np.ndarray, nbytes: np.ndarray, dst: np.ndarray) -> tuple[float, float, float]:
        """(seconds, bandwidth seconds, latency seconds): every source device sends its ``nbytes`` spread evenly over
        ``dst``, all links at once; the slowest pair decides."""
        c = self.coefficients
        bw = self.bw[np.ix_(src, dst)]
        lat = self.lat[np.ix_(src, dst)]
        vol = (nbytes / len(dst))[:, None]
        t = c.comm * vol / bw + c.latency * lat
        i, j = np.unravel_index(int(np.argmax(t)), t.shape)
        return float(t[i, j]), float(vol[i, 0] / bw[i, j]), float(lat[i, j])

    def _redistribute(self, plan: Plan, gen_i: int, shares: np.ndarray | None) -> _Stage:
        gen = plan.groups[gen_i]
        others = [g for i, g in enumerate(plan.groups) if i != gen_i]
        if not others:
            return _Stage(0.0, {})
        src = np.array(gen.devices)
        per_engine = self.traj_bytes * (shares if shares is not None else np.full(gen.engines, 1 / gen.engines))
        nbytes = np.repeat(per_engine / gen.tp, gen.tp)
        worst = (0.0, 0.0, 0.0)
        for g in others:
            worst = max(worst, self._transfer(src, nbytes, np.array(g.devices)))
        seconds, comm, latency = worst
        update = plan.group_of("update")
        result_bytes = self.workload.sequences * self.workload.response_len * 4
        for task, target in (("reference", update), ("values", update)):
            if task not in self.workload.tasks:
                continue
            g = plan.group_of(task)
            if g is target:
                continue
            src_t = np.array(g.devices)
            t, cb, cl = self._transfer(src_t, np.full(len(src_t), result_bytes / len(src_t)), np.array(target.devices))
            seconds, comm, latency = seconds + t, comm + cb, latency + cl
        return _Stage(seconds, {k: v for k, v in (("comm", comm), ("latency", latency)) if v})


def predict_stage_times(cluster: Cluster, workload: Workload, plan: Plan,
                        coefficients: Coefficients | None = None) -> dict[str, float]:
    """Seconds of every stage of :data:`STAGES` for ``plan`` (:meth:`HetCostModel.predict_stage_times`)."""
    return HetCostModel(cluster, workload, coefficients).predict_stage_times(plan)
