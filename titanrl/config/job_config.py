"""Typed config sections of a titanrl job; defaults = the tiny CPU run (configs/tiny_cpu.toml).

Why our own dataclasses instead of torchtitan's: every ``torchtitan.config`` module imports torch
(the package ``__init__`` builds ``TORCH_DTYPE_MAP``), and its optimizer / LR-scheduler / checkpoint
configs are nested inside modules that import ``torch.distributed``; the entry point must parse and
validate the config before anything heavy loads. Their fields also only partly fit (SFT-oriented
``TrainingConfig``, ``fsdp_reshard_after_forward`` as a three-way string, no ``dynamic`` for
compile). So we keep torchtitan's *style* -- ``@dataclass(kw_only=True, slots=True)``, one
docstring under each field (the ``--help`` listing reads them) -- and its field names wherever the
meaning is the same (``data_parallel_shard_degree``, ``warmup_steps``, ``decay_type``,
``min_lr_factor``, ``keep_latest_k``, ``async_mode``, ``compile.components``, ...).

Schema rules the loader relies on (checked by tests/test_config.py):
- field types are bool, int, float, str, Literal[str, ...], list[<one of those>], ``X | None``, or
  another config dataclass (a nested TOML table / ``--a.b.c`` key);
- an ``X | None`` field defaults to None, because TOML has no null: a None value is left out of
  the saved TOML and reloading must give None back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from titanrl.config.errors import ConfigError

# "package.module:function" or "path/to/file.py:function" (or a REWARD_BUILTINS name) -- checked for shape
# only; importing it here could pull in torch (titanrl.rl.rewards.load_reward resolves it).
_REWARD_SPEC = re.compile(  # rl.reward's function, rl.env's class
    r"^(?:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"  # package.module:function
    r"|[^:]+\.py:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$"  # path/to/file.py:function
)
# The built-in rewards of titanrl.rl.rewards.BUILTIN_REWARDS (a test keeps the two equal).
REWARD_BUILTINS: tuple[str, ...] = ("math", "choice", "exact", "exact_match_with_format", "first_word")


@dataclass(kw_only=True, slots=True)
class JobRunConfig:
    """[job] Identity, output location and length of the run."""

    name: str = "tiny_cpu"
    """Run name; outputs (logs, metrics, checkpoints) go to <dump_folder>/<name>."""
    dump_folder: str = "./outputs"
    """Root folder for all run outputs."""
    seed: int = 0
    """Global random seed (data order, sampling, init of the tiny model)."""
    steps: int = 300
    """Number of RL steps (one step = rollout + policy update on rl.global_batch_size prompts)."""
    description: str = "Tiny Qwen2.5-VL-shaped model, GRPO on synthetic data, CPU only."
    """Free-text description, kept in the run's saved config (`<run dir>/config.toml`); nothing else reads it."""
    collective_timeout_s: float = 600.0
    """How long a rank waits in one collective (another rank died or hangs) before the run ends with an error
    naming the stage and the rank (gloo); with NCCL, PyTorch's watchdog aborts the rank after this long."""
    preempt_grace_s: float = 25.0
    """Seconds a SIGTERM leaves before the launcher kills (torchrun and SLURM's KillWait: 30, less a margin). On
    SIGTERM the run finishes the current step and saves it when the step's remaining time (from the median step) plus
    the last save's time fit in this; otherwise it abandons the step at once and the last periodic checkpoint
    stands. Either way every process of the run is gone within it."""

    def problems(self) -> list[str]:
        found = []
        if not self.name or "/" in self.name or "\\" in self.name or self.name in (".", ".."):
            found.append(f"job.name must be a plain folder name, got {self.name!r}")
        if self.seed < 0:
            found.append(f"job.seed must be >= 0, got {self.seed}")
        if self.steps < 1:
            found.append(f"job.steps must be >= 1, got {self.steps}")
        if self.collective_timeout_s <= 0:
            found.append(f"job.collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.preempt_grace_s < 0:
            found.append(f"job.preempt_grace_s must be >= 0 (0: abandon the step at once), got {self.preempt_grace_s}")
        return found


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """[model] Which policy model to load and how to run it."""

    path: str = ""
    """Hugging Face checkpoint folder; empty = build a random `flavor` checkpoint in cache_dir."""
    flavor: Literal["tiny", "small", "none"] = "tiny"
    """Size of the generated checkpoint when path is empty; none = no built-in model: the trainer,
    `python -m titanrl.schedule` and `python -m titanrl.memory` refuse an empty path (a config for a real model;
    to plan, a folder holding the model's config.json alone suffices)."""
    cache_dir: str = "~/.cache/titanrl"
    """Cache for generated checkpoints and synthesized data ('~' is expanded)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the policy (its gathered parameters and activations) and the rollout engine's dtype. Below
    float32 the sharded master parameters, gradients and optimizer state stay float32 (FSDP2's mixed precision;
    docs/memory.md)."""
    attn_backend: Literal["sdpa", "flash"] = "sdpa"
    """Attention kernel for packed sequences: sdpa (CPU and GPU) or flash (PyTorch's varlen FlashAttention;
    needs a CUDA GPU and bfloat16)."""
    max_seq_len: int = 512
    """Longest packed sample (prompt with vision tokens + response), in tokens."""
    freeze_vision_tower: bool = False
    """Train the language model only (verl's and EasyR1's freeze_vision_tower): the vision tower (patch embedding,
    blocks, merger) keeps the checkpoint's weights in the policy and the critic; it has no gradients and no optimizer
    state, its forward saves no activations, and after the first weight push the engines get the language model
    only. LoRA without lora.vision freezes it as well. docs/workflow.md"""

    def path_missing(self, tool: str) -> str | None:
        """Why ``tool`` cannot run without model.path (None: it can): model.flavor = 'none' names no built-in model."""
        if self.path or self.flavor != "none":
            return None
        return (f"{tool} needs model.path: this config is for a real model (model.flavor = 'none', no built-in one); "
                "pass --model.path <the model's folder> (to plan with python -m titanrl.schedule or "
                "python -m titanrl.memory, a folder holding its config.json alone suffices)")

    def problems(self) -> list[str]:
        found = []
        if self.max_seq_len < 1:
            found.append(f"model.max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.attn_backend == "flash" and self.dtype != "bfloat16":
            found.append(
                "model.attn_backend='flash' needs model.dtype='bfloat16' "
                f"(flash attention has no float32 kernels), got dtype={self.dtype!r}"
            )
        return found


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """[data] Prompt dataset, media decoding and the loader that feeds rollouts."""

    path: str = ""
    """The prompt dataset: a .jsonl / .json / .parquet file, a folder of them, or a folder written by Hugging Face
    datasets' save_to_disk, in data.format; empty (and data.manifest empty) = synthesize one into model.cache_dir.
    A titanrl JSONL manifest is read in place; any other dataset is imported once into
    <model.cache_dir>/data/imported/ (embedded images extracted to files), every rank reading its own Parquet row
    groups. docs/data.md"""
    manifest: str = ""
    """The older name of data.path (a titanrl JSONL manifest, or any dataset data.path takes); set at most one."""
    format: Literal["auto", "titanrl", "verl", "easyr1", "columns", "chat"] = "auto"
    """Schema of data.path's rows: titanrl (id/source/prompt/media/answer/answer_choices), verl (chat-list prompt,
    images, videos, reward_model.ground_truth, data_source), easyr1 (problem, answer, images, videos), columns
    (data.prompt_key / answer_key / image_key / video_key), chat (messages with the media inline in their parts,
    or with images / videos columns; answer, solution or ground_truth, else a final assistant message); auto =
    told apart by the first row's keys (never columns). docs/data.md"""
    prompt_key: str = "prompt"
    """columns format: the prompt column (a string with <image>/<video> placeholders, or a chat message list)."""
    answer_key: str = "answer"
    """columns format: the answer column (a string)."""
    image_key: str = "images"
    """columns format: the images column (a list of paths, bytes, base64 data URIs or {bytes, path}); a row
    without it has no images."""
    video_key: str = "videos"
    """columns format: the videos column (a list of paths); a row without it has no videos."""
    system_prompt: str = ""
    """columns format: the system message of every row whose prompt has none (empty = no system message)."""
    mixture: Literal["image-heavy", "video-heavy", "only-video", "arithmetic", "zoom"] = "image-heavy"
    """Media mix of the synthesized dataset (ignored when data.path or data.manifest is set); arithmetic = a
    different task on images only: count the squares and add a number, answered in \\boxed{} (for rl.reward =
    "math"); zoom = the colour of a dot too small to read at the first view, for multi-turn runs with
    rl.env = 'titanrl.envs.zoom:ZoomEnv' (configs/examples/zoom_tiny.toml)."""
    synth_format: Literal["titanrl", "verl", "easyr1"] = "titanrl"
    """Schema the synthesized dataset is written in (images embedded as bytes in a Parquet file for verl and
    easyr1), then read back through data.format like any data.path (ignored when data.path or data.manifest is
    set)."""
    num_samples: int = 64
    """Number of samples to synthesize (ignored when data.path or data.manifest is set)."""
    loader: Literal["shadow", "centralized"] = "shadow"
    """shadow = plan from header metadata on every rank, decode ahead on per-node Ray preprocessors,
    fetch asynchronously (docs/shadowloader.md); centralized = rank 0 decodes each batch, then scatters
    (the verl-like baseline)."""
    slice_loading: bool = True
    """FlexUlysses-aware loading: in the log-prob and update stages a rank fetches from the
    preprocessors exactly the frames / images it encodes (uint8, decoded by seeking when no longer
    cached) and patchifies them itself; false = the prompt's home sends float32 patch rows to the
    encoding rank over the trajectory all-to-all (the whole-sample baseline). Needs loader = "shadow"
    (the centralized loader cannot fetch slices)."""
    on_bad_sample: Literal["skip", "error"] = "skip"
    """What to do with a bad sample -- a row data.path's import cannot use (missing key, unreadable image bytes,
    placeholders that do not match the media, a non-string answer; listed in the import folder's import.json), an
    undecodable or over-long sample: skip it (and count it) or stop with an error naming the file, row and key."""
    max_prompt_tokens: int = 256
    """Longest prompt after vision tokens are expanded; longer samples count as bad."""
    video_backend: Literal["pyav", "decord"] = "pyav"
    """Video decoder library."""
    fps: float = 2.0
    """Frames per second sampled from videos (a video given as its frames: from the rate it names, default 2.0;
    docs/data.md)."""
    max_frames: int = 8
    """Upper bound on frames sampled per video."""
    min_pixels: int | None = None
    """Smallest image/frame area after resizing (pixels); unset = the checkpoint's processor config,
    which is what vLLM applies. When set, it overrides both the trainer's and vLLM's preprocessing."""
    max_pixels: int | None = None
    """Largest image/frame area after resizing (pixels); unset = the checkpoint's processor config. When set, it
    overrides both the trainer's and vLLM's preprocessing."""
    num_decode_workers: int = 1
    """Decode threads per node preprocessor (shadow) or on rank 0 (centralized); shadow with 0 decodes
    only when a rank fetches (no decode ahead)."""
    prefetch_batches: int = 2
    """Steps planned and decoded ahead of the one the trainer is computing: shadow on the Ray
    preprocessors; centralized on rank 0, which holds their pixels until it scatters them (0 = none:
    verl's behaviour, decoding on the critical path)."""
    metadata_cache: bool = True
    """Cache header probes in <manifest>.meta.jsonl next to the manifest (keyed by file size and mtime)."""
    fetch_timeout_s: float = 300.0
    """Longest a rank waits for one step's data before failing with an error naming the samples (data.loader =
    'shadow'; 'centralized' ranks wait in rank 0's scatter, up to job.collective_timeout_s)."""
    ray_address: str = ""
    """The Ray cluster (GCS host:port) ShadowLoader places its preprocessors on, one per node; empty = rank 0
    starts a private local instance (one machine only). A cluster with token authentication needs
    RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN) in every rank's environment."""
    ray_object_store_bytes: int = 268_435_456
    """Object store size for the local Ray instance, in bytes (0 = Ray's default); the preprocessors decode
    ahead into at most half of it (2 GiB when 0), with data.ray_address too (the cluster's own store should
    be at least this large)."""

    def problems(self) -> list[str]:
        found = []
        positive = {
            "num_samples": self.num_samples,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_frames": self.max_frames,
        }
        for key in ("min_pixels", "max_pixels"):
            if getattr(self, key) is not None:
                positive[key] = getattr(self, key)
        found += [f"data.{k} must be >= 1, got {v}" for k, v in positive.items() if v < 1]
        non_negative = {
            "num_decode_workers": self.num_decode_workers,
            "prefetch_batches": self.prefetch_batches,
            "ray_object_store_bytes": self.ray_object_store_bytes,
        }
        found += [f"data.{k} must be >= 0, got {v}" for k, v in non_negative.items() if v < 0]
        if self.path and self.manifest:
            found.append(f"data.path ({self.path!r}) and data.manifest ({self.manifest!r}) name the same setting: "
                         "set only data.path")
        if self.format == "columns":
            found += [f"data.{k} must not be empty with data.format='columns'"
                      for k in ("prompt_key", "answer_key") if not getattr(self, k)]
        if self.fps <= 0:
            found.append(f"data.fps must be > 0, got {self.fps}")
        if self.fetch_timeout_s <= 0:
            found.append(f"data.fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")
        if self.min_pixels is not None and self.max_pixels is not None and self.max_pixels < self.min_pixels:
            found.append(
                f"data.max_pixels ({self.max_pixels}) must be >= "
                f"data.min_pixels ({self.min_pixels})"
            )
        return found


@dataclass(kw_only=True, slots=True)
class ParallelismConfig:
    """[parallelism] How the policy is sharded over ranks for training."""

    data_parallel_shard_degree: int = -1
    """FSDP shard degree; -1 = all ranks, except under balance.strategy='odc' on several machines: the ranks of
    one machine. Below the ranks (odc only): hybrid sharding, parameters, gradients and optimizer state sharded
    over each group of this many consecutive ranks (one machine's), replicated across the groups, whose
    gradients are summed once per minibatch (docs/balance.md, "odc")."""
    ulysses: Literal["none", "fixed", "flex"] = "none"
    """Ulysses sequence parallelism of the log-prob and update stages: none = every trajectory whole on
    the rank that generated it; fixed = every trajectory split over ulysses_degree ranks; flex =
    FlexUlysses, a degree per trajectory (1 .. p_max) from the cost model, nested groups, trajectories
    moved between ranks to balance balance.cost_model per rank (docs/flex_ulysses.md)."""
    ulysses_degree: int = 1
    """Ulysses group size when ulysses = 'fixed': a power of two dividing the ranks, with at least one query head
    per member (heads that do not divide evenly are split unevenly)."""
    p_max: int | None = None
    """Largest Ulysses group FlexUlysses may form when ulysses = 'flex': a power of two <= the number of ranks
    (lowered, with a message, to what the model's head counts allow); unset = the largest power of two <= min(4,
    ranks)."""
    activation_checkpoint: Literal["none", "full"] = "none"
    """Activation checkpointing of the policy's transformer blocks (vision and decoder): full = keep only each
    block's input and recompute the block in backward (under Ulysses the recomputation re-issues the block's
    all-to-alls in forward order). Selective (op-level) checkpointing is planned."""
    fsdp_reshard_after_forward: bool = True
    """Free each transformer block's and the vision tower's gathered parameters after forward (less memory, one
    more all-gather in backward). The root's own parameters (embedding, output head) stay gathered until their
    backward either way, and are freed at the end of a stage without backward."""
    vision_balance: bool = False
    """Vision-tower balancing (FlexRL sec. 3.3) in the log-prob and update stages: the images and video temporal
    patches the ranks' tokens use are spread over the ranks by vision cost (each encoded once, also when several
    ranks use it), each rank encodes only its share, and the embeddings go with one all-to-all to the ranks holding
    their placeholder tokens (gradients come back the same way). Under balance.strategy = 'native' / 'lb_micro' this
    happens per wave; under 'lb_mini' once per minibatch (and log-prob stage), in a vision pass before the rank's
    microbatches, whose gradients go back through it in the rank's reducing microbatch. false = every rank encodes
    the media its own tokens use (under 'lb_mini' too once per minibatch, however its responses were spread)."""

    def problems(self) -> list[str]:
        found = []
        if self.data_parallel_shard_degree == 0 or self.data_parallel_shard_degree < -1:
            found.append(
                "parallelism.data_parallel_shard_degree must be -1 (all ranks) or >= 1, "
                f"got {self.data_parallel_shard_degree}"
            )
        if self.ulysses_degree < 1 or self.ulysses_degree & (self.ulysses_degree - 1):
            found.append(f"parallelism.ulysses_degree must be a power of two >= 1, got {self.ulysses_degree}")
        elif self.ulysses != "fixed" and self.ulysses_degree != 1:
            found.append(
                f"parallelism.ulysses_degree={self.ulysses_degree} only means something with "
                f"parallelism.ulysses='fixed' (it is {self.ulysses!r})"
            )
        if self.p_max is not None and (self.p_max < 1 or self.p_max & (self.p_max - 1)):
            found.append(f"parallelism.p_max must be a power of two >= 1, got {self.p_max}")
        return found


@dataclass(kw_only=True, slots=True)
class BalanceConfig:
    """[balance] How rollout sequences are packed into microbatches across ranks."""

    strategy: Literal["lb_mini", "odc", "lb_micro", "native", "bucketing"] = "lb_mini"
    """How the log-prob and update stages spread trajectories over ranks and synchronise them (ODC paper):
    lb_mini = Karmarkar-Karp per minibatch with unequal microbatch counts per rank, parameters gathered once and
    gradients reduced once per minibatch (holds full parameters and unsharded gradients during the minibatch);
    odc = lb_mini's plan with ODC's on-demand communication: FSDP's memory (each unit gathered only while it runs,
    from the owners' shared memory, its gradient scatter-accumulated into the owners' buffers), one barrier per
    minibatch (CPU ranks only: refused on CUDA, whose symmetric-memory path is not built; on several machines by
    hybrid sharding over each machine's ranks; colocated placement only);
    lb_micro = balanced across ranks, equal microbatch counts, FSDP collectives per layer of every microbatch
    (less memory); native = every trajectory stays on the rank that generated it, ranks padded to the largest
    microbatch count (the baseline; only with parallelism.ulysses = 'none'); bucketing = the FlexRL paper's veRL
    baseline: whole trajectories dealt to ranks in equal counts per wave by Karmarkar-Karp on verl's workload
    estimate, waves synchronised like lb_micro (only with parallelism.ulysses = 'none'). docs/balance.md"""
    max_tokens_per_microbatch: int = 2048
    """Token budget of one rank's share of a microbatch (a wave); a trajectory longer than it even at the
    highest allowed Ulysses degree runs alone, over the budget (reported as parallel/over_budget)."""
    cost_model: Literal["flops", "tokens"] = "flops"
    """Per-trajectory cost the balancers and FlexUlysses planner use: this model's FLOPs (attention quadratic in
    the length, linear layers, vision tower per patch) or the token count (the vision tower's: its patches)."""
    rank_speeds: list[float] = field(default_factory=list)
    """Relative speed of each rank, one number per rank in rank order (e.g. [1, 1, 0.5, 0.5]); empty = all
    equal. Unequal speeds give each rank work in proportion to its speed (HetRL sec. 4.2): the rollout prompts
    per engine (an engine over several ranks: their sum), the coordinator's hand-over to the training ranks,
    the log-prob and update stages' split across ranks (the latest finish load / speed minimised instead of
    Karmarkar-Karp; sample counts then differ) and, with parallelism.vision_balance, the vision tower's units.
    balance.strategy = 'native' keeps trajectories where they were generated (only the rollout split then
    follows speeds); fixed Ulysses and FlexUlysses place sequences so that the latest finish is earliest, a
    Ulysses group running at its slowest member's speed. `python -m titanrl.schedule` writes them from a profile
    (docs/hetrl.md)."""
    calibrate: bool = False
    """Fit the cost model to this run: after every step, each training rank's measured busy seconds of the
    log-prob and update stages against the attention and linear work the plan gave it (last 8 steps, non-negative
    least squares: CostModel.fit; on ranks of unequal balance.rank_speeds each term over the speed it ran at, a
    Ulysses group's slowest member's) refit the model's two
    LLM coefficients, and the Karmarkar-Karp and FlexUlysses planners use the fitted model from the next step (the
    vision tower's balancing keeps balance.cost_model's vision term). Metrics cost/predicted_s and
    cost/measured_s (the busiest rank's seconds as the fitted model predicted them before the step, and as
    measured), cost/error (mean relative error per rank), cost/attention_coef, cost/linear_coef. The plans then
    depend on measured times: runs are not bit-reproducible."""
    profile_speeds: bool = False
    """Measure the ranks at start-up instead (titanrl.profile: each rank's matmul throughput in model.dtype, all
    ranks timed at once, ~2 s) and balance by the measured speeds as balance.rank_speeds does; speeds within 10%
    of each other count as equal. Written to <run dir>/profile.json. Several ranks only (one rank has nothing
    to balance: nothing is measured). The plans then depend on a measurement:
    two runs are not bit-identical unless the speeds come out the same (set balance.rank_speeds for that)."""

    def problems(self) -> list[str]:
        if self.max_tokens_per_microbatch < 1:
            return [
                "balance.max_tokens_per_microbatch must be >= 1, "
                f"got {self.max_tokens_per_microbatch}"
            ]
        bad = [x for x in self.rank_speeds if not (isinstance(x, (int, float)) and x > 0 and x < float("inf"))]
        if bad:
            return [f"balance.rank_speeds must be positive numbers, got {bad[0]!r}"]
        return []

    def speeds(self) -> list[float] | None:
        """The rank speeds when they differ (None: every rank equally fast)."""
        return [float(x) for x in self.rank_speeds] if len(set(self.rank_speeds)) > 1 else None


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """[rollout] Response generation for the prompts of each step."""

    engine: Literal["vllm", "hf"] = "vllm"
    """Generation engine: vllm (one in-process vLLM engine per rank, weights pushed in place) or hf
    (plain transformers generate: the benchmark baseline; its video positions follow transformers'
    rule, not the trainer's, so do not train on video with it)."""
    n: int = 8
    """Responses sampled per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    max_new_tokens: int = 2
    """Longest response, in tokens (the tiny default's answer is one word; raise it for real tasks)."""
    tokens_per_update: int = 0
    """Partial rollouts: the most tokens a response gets per step (0 = all of rollout.max_new_tokens at once). A
    response still unfinished is continued in the next step's generation with the weights of the update between
    (its prompt group waits: it is trained when all its responses have finished), instead of being cut or thrown
    away; every token records the policy version that sampled it. A response then spans up to
    ceil(max_new_tokens / tokens_per_update) steps, whose extra steps count against workflow.max_staleness.
    Multi-turn (rollout.max_turns > 1): the most tokens a trajectory samples per step over its turns; one that runs
    out waits where it stands (mid-turn, or before its next turn, its environment with it) and spans up to
    ceil(max_turns x max_new_tokens / tokens_per_update) steps."""
    max_turns: int = 1
    """Turns per trajectory (1 = one response per sample). Above 1, after each turn the environment rl.env reads the
    response and may answer with text and images, appended as a user message; the policy continues from the whole
    context, up to this many turns (each up to rollout.max_new_tokens), until the environment says done.
    Observation tokens are context: never scored, trained or probed (docs/multiturn.md)."""
    max_turn_images: int = 1
    """Most images one observation may carry (rollout.max_turns > 1): the engine is built with room for the
    prompt's media plus this many per turn; an observation with more is an environment error (counted)."""
    kv_cache_bytes: int = 268_435_456
    """KV cache memory reserved by the vllm engine of each rank, in bytes."""
    sleep: Literal["auto", "on", "off"] = "auto"
    """Whether the engine gives its device memory back while the training stages run: after each generation it
    sleeps (vllm: vLLM's sleep mode, level 1: its weights to host memory, its KV cache discarded; hf: its weights
    to host memory) and wakes for the next call (generate, the probe, the weight push: vllm wakes to load the new
    weights, hf loads them into its host copy). auto = on where that frees anything: the engine on a CUDA device
    beside the training (workflow.placement = colocated); off otherwise. on = the same, and a run where it frees
    nothing is refused (the CPU, whose memory the training shares; the disaggregated placement, whose rollout ranks
    do not train). off = the engine stays resident. The memory planner counts a sleeping engine's terms in the
    rollout phase only. Not yet run on a GPU."""
    num_threads: int = 0
    """CPU threads the engine computes with while it runs (0 = the process's torch setting; under
    torchrun with several ranks per machine that is OMP_NUM_THREADS, 1 unless set)."""
    enforce_eager: bool = True
    """Disable CUDA graphs in vllm (faster start, slower decode; required on CPU)."""
    probe_every: int = 1
    """Steps between weight-sync checks comparing engine and trainer log-probs (0 = never)."""
    probe_tolerance: float = 0.001
    """Largest allowed max |log-prob difference| between engine and trainer in a weight-sync check; above it
    the run warns with the numbers."""
    probe_max_violations: int = 3
    """Consecutive weight-sync checks over probe_tolerance after which the run stops with an error
    (0 = only warn)."""
    seed: int | None = None
    """Sampling seed of the engine; none = derived from job.seed."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism: one engine spans this many ranks of one machine, and generation runs
    data-parallel over the engines. Colocated: the engine runs inside those ranks' processes (vLLM's external
    launcher, a worker on each rank's device); each rank still generates its own prompts, the block's prompts in one
    engine call. Disaggregated: the engine's workers are vLLM's own processes on the devices of that many rollout
    ranks, and the block's first rank generates for them (workflow.rollout_ranks / tensor_parallel_size engines).
    Needs rollout.engine = 'vllm'."""

    def problems(self) -> list[str]:
        found = []
        if self.tensor_parallel_size < 1:
            found.append(f"rollout.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.n < 1:
            found.append(f"rollout.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            found.append(f"rollout.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            found.append(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            found.append(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_turns < 1:
            found.append(f"rollout.max_turns must be >= 1 (1 = single turn), got {self.max_turns}")
        if self.max_turn_images < 0:
            found.append(f"rollout.max_turn_images must be >= 0, got {self.max_turn_images}")
        if self.kv_cache_bytes < 1:
            found.append(f"rollout.kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.num_threads < 0:
            found.append(f"rollout.num_threads must be >= 0 (0 = process default), got {self.num_threads}")
        if self.probe_every < 0:
            found.append(f"rollout.probe_every must be >= 0 (0 = never), got {self.probe_every}")
        if self.probe_tolerance <= 0:
            found.append(f"rollout.probe_tolerance must be > 0, got {self.probe_tolerance}")
        if self.probe_max_violations < 0:
            found.append(f"rollout.probe_max_violations must be >= 0 (0 = only warn), got {self.probe_max_violations}")
        return found


@dataclass(kw_only=True, slots=True)
class RLConfig:
    """[rl] The RL objective: algorithm, reward, batch sizes and loss terms."""

    algorithm: Literal["grpo", "ppo"] = "grpo"
    """The built-in workflow (docs/workflow.md): grpo = group-relative advantages with the PPO-clip objective;
    ppo = a learned critic ([critic]), per-token GAE advantages (rl.gamma, rl.lam) whitened over the step, the
    PPO-clip objective, and the critic trained with a clipped value loss (rl.value_clip)."""
    advantage: Literal["auto", "grpo", "rloo", "reinforce++", "gae"] = "auto"
    """How a response's advantage is computed. grpo = its reward less its prompt group's mean (/ the group's std with
    rl.std_normalize; Shao et al. 2024, eq. 3); rloo = its reward less the mean of the group's *other* responses
    (REINFORCE leave-one-out, Ahmadian et al. 2024, eq. 6); reinforce++ = per token, the reward less rl.kl_coef x
    the KL to the reference summed from that token to the end, normalised over the whole step's tokens (Hu 2025,
    REINFORCE++, eq. 2-4: the KL is in the reward, not the loss; the old log-probs are then computed before the
    update whatever rl.old_logprobs says); gae = per-token GAE from the critic (rl.algorithm = ppo only). auto = gae
    with rl.algorithm = ppo, else grpo."""
    policy_loss: Literal["ppo_clip", "gspo", "cispo", "sapo"] = "ppo_clip"
    """The policy objective. ppo_clip = the per-token clipped ratio (Schulman et al. 2017; clip_low / clip_high);
    gspo = a sequence-level ratio, the geometric mean of the response's token ratios, clipped per response (Zheng
    et al. 2025, eq. 5-7; the paper's clip range is 3e-4 / 4e-4, set with rl.clip_low / rl.clip_high; a response
    Ulysses splits over ranks has its parts' sums added up by one all-reduce per sharded group); cispo = the clipped ratio as a detached weight on each
    token's log-prob gradient, so no token's gradient is dropped (MiniMax-M1, Chen et al. 2025, eq. 4); sapo = a
    smooth gate in place of the clip, per token (4 / tau) sigmoid(tau (r - 1)) A with tau = rl.sapo_tau_pos for
    positive advantages and rl.sapo_tau_neg for negative ones (Gao et al. 2025, Soft Adaptive Policy Optimization;
    rl.clip_low / rl.clip_high unused)."""
    sapo_tau_pos: float = 1.0
    """SAPO's gate temperature for tokens of positive advantage (larger: the gradient fades sooner as the ratio
    leaves 1)."""
    sapo_tau_neg: float = 1.05
    """SAPO's gate temperature for tokens of negative advantage (above rl.sapo_tau_pos: those fade sooner)."""
    gamma: float = 1.0
    """PPO: discount of the per-token rewards (the reward arrives at a response's last token)."""
    lam: float = 0.95
    """PPO: GAE's lambda."""
    value_clip: float = 0.5
    """PPO: the critic's new values are clipped to old value +- value_clip in the clipped value loss."""
    reward: str = "titanrl.rl.rewards:exact_match_with_format"
    """Reward function: a built-in (math = math-verify equivalence, choice = multiple-choice letter or option,
    exact = normalised string equality, first_word = the first word equals the answer, exact_match_with_format = the
    synthetic colour task), 'package.module:function'
    or 'path/to/file.py:function', loaded when training starts. It returns a float score, or a dict with 'score',
    optionally 'correct' (reward/accuracy is its mean; absent when the reward gives none) and other numbers (each
    logged as reward/<name>). docs/data.md#rewards"""
    env: str = ""
    """Multi-turn environment (rollout.max_turns > 1): 'path/to/file.py:ClassName' or 'module:ClassName',
    constructed once per trajectory as ClassName(record) (the sample's record, media paths absolute); its
    step(response) returns {'observation': str or None, 'images': [H x W x 3 uint8 arrays], 'done': bool} and
    optionally 'reward' (then the trajectory's reward, in place of rl.reward's score). A step that raises or returns
    anything else ends that trajectory with reward 0, counted in rollout/env_errors (rl.on_reward_error = 'error':
    the run stops naming the sample). Built in: titanrl.envs.zoom:ZoomEnv. It runs in the rank's process.
    docs/multiturn.md"""
    env_timeout_s: float = 30.0
    """Longest an environment's constructor or one step may run, in seconds; then it counts as failed (its
    trajectory scores 0, rl.on_reward_error) and is abandoned (its thread cannot be stopped; it no longer holds the
    run)."""
    reward_timeout_s: float = 10.0
    """Longest one reward call may run, in seconds; then its worker process is killed and replaced and the call
    counts as failed (rl.on_reward_error). Only enforced with rl.reward_workers >= 1."""
    reward_workers: int = 1
    """Worker processes per rank that run the reward calls (spawned at start-up); 0 = call the reward in the
    trainer's process, with no time limit."""
    on_reward_error: Literal["zero", "error"] = "zero"
    """A reward call that raises, times out or returns a non-finite or malformed value: zero = score 0 (correct 0),
    counted in reward/errors; error = stop with an error naming the sample."""
    max_error_steps: int = 3
    """With on_reward_error = zero: stop the run, naming the first error, once every reward call has failed in this
    many consecutive steps (a reward that cannot work, not a bad sample); 0 = never stop for that."""
    global_batch_size: int = 32
    """Prompts per RL step, over all ranks (sequences per step = global_batch_size * rollout.n)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    minibatches: int = 1
    """Optimizer steps per epoch; the step's prompts are split into this many minibatches."""
    old_logprobs: Literal["auto", "recompute"] = "auto"
    """Where the PPO ratio's old-policy log-probs come from. auto = with ppo_epochs = 1, the first minibatch's
    update forward runs the old policy itself, so its old log-probs are that forward's (detached) and the
    old-log-prob pass covers only the other minibatches (none with minibatches = 1); with ppo_epochs > 1,
    rl.advantage = 'reinforce++' or lora.dropout > 0 (the update's forward is not the old policy's) the pass
    covers every trajectory. recompute = a separate pass over every trajectory (the usual way; the same numbers up
    to float rounding)."""
    shared_prefix: bool = True
    """Shared-prefix packing in the log-prob and update stages: a prompt (its image and video tokens included) is
    computed once, followed by the responses that share it; each response attends to the prompt and to itself,
    never to a sibling, so log-probs, loss and gradients equal the unshared computation. A group larger than a
    rank's budget (or, without sequence parallelism, than an even share of the stage) is split into sub-groups
    that each carry the prompt. false = every trajectory packed whole, its prompt repeated per response. The step
    line reports train/tokens_computed against train/tokens_represented."""
    clip_low: float = 0.2
    """Lower ratio clip: ratios below 1 - clip_low are clipped."""
    clip_high: float = 0.2
    """Upper ratio clip: ratios above 1 + clip_high are clipped (> clip_low = DAPO clip-higher)."""
    kl_coef: float = 0.001
    """Weight of the KL penalty to the reference model (0 = no reference model is loaded)."""
    ref_offload: bool = False
    """Keep the reference model's FSDP shards in host memory (FSDP2's ``CPUOffloadPolicy``, pinned on CUDA): each
    unit is copied to the device and all-gathered for its forward, so the reference holds no device memory at rest
    (4 N / dp bytes per GPU freed), at one host-to-device copy of its weights per reference pass. Log-probs are
    those of the resident reference. A one-process run puts its models on a one-rank FSDP mesh. Needs
    kl_coef > 0. On a CPU machine the shards are in host memory either way: it runs, and frees nothing."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator: k1 = log-ratio, k3 = unbiased low-variance (Schulman). With rl.advantage = 'reinforce++'
    the penalty is k1 in the reward, and this estimator only sets the logged KL."""
    std_normalize: bool = False
    """Divide advantages by the group reward std (GRPO); false = mean-centering only (Dr. GRPO). With
    it, a group whose only scored difference is small (one response earned a 0.1 format bonus) gets
    advantages as large as one whose responses differ in correctness."""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How per-token losses are reduced to one number."""
    entropy_coef: float = 0.02
    """Weight of the entropy bonus."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), in tokens: a response of L generated tokens, L past
    rollout.max_new_tokens - overlong_buffer, loses rl.overlong_penalty x (L - (max_new_tokens - overlong_buffer)) /
    overlong_buffer of its reward, the whole rl.overlong_penalty at rollout.max_new_tokens. 0 = off. Multi-turn
    (rollout.max_turns > 1: max_new_tokens bounds each turn): L is the trajectory's longest turn. The step's mean is
    reward/overlong_penalty (reward/mean includes it; reward/accuracy does not)."""
    overlong_penalty: float = 1.0
    """The reward a response of rollout.max_new_tokens tokens loses under rl.overlong_buffer."""
    mask_truncated: bool = False
    """DAPO's overlong filtering (AReaL's mask_no_eos_with_zero): responses the engine cut at rollout.max_new_tokens
    (finish reason 'length'; multi-turn: the last turn's) take no part in the policy update - no loss term, no token
    in its normalisers - while still counting in their group's advantages and in the reward metrics; a minibatch
    left with none makes no optimizer step. train/masked_truncated counts them; response/truncated_fraction (every
    run) is their share of the step's responses."""
    behaviour_weight_cap: float = 2.0
    """workflow.mode = async and partial rollouts (rollout.tokens_per_update; off-policy correction, the decoupled
    PPO objective): the clipped ratio is taken
    against the proximal policy (the policy before this step's update: the old log-probs) and each token's
    policy-gradient term is weighted by the truncated importance weight min(pi_prox / pi_behaviour, cap), where
    pi_behaviour is the rollout engine's log-prob of the token (the policy version that generated it). 0 = no
    weight (the proximal policy is treated as the behaviour one). Synchronous runs without partial rollouts use it
    only with rl.behaviour_weight = always."""
    behaviour_weight: Literal["off_policy", "always"] = "off_policy"
    """Which runs weight each token by min(pi_prox / pi_behaviour, rl.behaviour_weight_cap) (above). off_policy =
    asynchronous runs and partial rollouts, whose tokens came from older weights; always = every run, synchronous
    ones too, where it corrects what differs between the distribution the engine sampled from and the trainer's
    with the same weights: the engine's kernels and rounding (vLLM's bfloat16 kernels are not the trainer's), its
    rollout.top_p (the nucleus the tokens were drawn from; the trainer's log-probs are of the whole tempered
    distribution) - truncated importance sampling (Yao et al. 2025; verl's rollout_is = token). For rl.policy_loss =
    gspo the weight is one per response, min((pi_prox(y) / pi_behaviour(y)) ^ (1 / |y|), cap), the same
    length-normalised ratio as GSPO's own. probe/logprob_max_diff (rollout.probe_every) measures the dtype and
    kernel part."""

    def problems(self) -> list[str]:
        found = []
        if self.behaviour_weight_cap < 0 or (0 < self.behaviour_weight_cap < 1):
            found.append(f"rl.behaviour_weight_cap must be 0 (off) or >= 1 (a cap below 1 shrinks on-policy "
                         f"tokens too), got {self.behaviour_weight_cap}")
        if self.sapo_tau_pos <= 0 or self.sapo_tau_neg <= 0:
            found.append(f"rl.sapo_tau_pos and rl.sapo_tau_neg must be > 0, got {self.sapo_tau_pos} and "
                         f"{self.sapo_tau_neg}")
        if self.overlong_buffer < 0:
            found.append(f"rl.overlong_buffer must be >= 0 (0 = off), got {self.overlong_buffer}")
        if self.overlong_penalty < 0:
            found.append(f"rl.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        if self.behaviour_weight == "always" and self.behaviour_weight_cap == 0:
            found.append("rl.behaviour_weight = always weights every token by the cap rl.behaviour_weight_cap, which "
                         "is 0 (off): set rl.behaviour_weight_cap >= 1 (2 is the default)")
        if self.reward not in REWARD_BUILTINS and not _REWARD_SPEC.match(self.reward):
            found.append(
                f"rl.reward must be a built-in ({', '.join(REWARD_BUILTINS)}), 'package.module:function' or "
                "'path/to/file.py:function', "
                f"got {self.reward!r}"
            )
        if self.env and not _REWARD_SPEC.match(self.env):
            found.append(f"rl.env must be 'package.module:ClassName' or 'path/to/file.py:ClassName', got {self.env!r}")
        if self.advantage == "gae" and self.algorithm != "ppo":
            found.append("rl.advantage = gae needs the critic of rl.algorithm = ppo")
        if self.advantage == "reinforce++" and self.policy_loss == "gspo":
            found.append("rl.advantage = reinforce++ gives every token its own advantage; rl.policy_loss = gspo weighs "
                         "whole responses by one advantage each (use ppo_clip, cispo or sapo)")
        if self.algorithm == "ppo" and self.advantage not in ("auto", "gae"):
            found.append(f"rl.algorithm = ppo trains a critic for GAE advantages; rl.advantage = {self.advantage} would "
                         "not use it (set rl.algorithm = grpo)")
        if self.policy_loss == "gspo" and self.algorithm == "ppo":
            found.append("rl.policy_loss = gspo weighs whole responses by one advantage each; PPO's GAE advantages "
                         "are per token (use ppo_clip, cispo or sapo)")
        if self.max_error_steps < 0:
            found.append(f"rl.max_error_steps must be >= 0 (0 = never stop), got {self.max_error_steps}")
        if self.env_timeout_s <= 0:
            found.append(f"rl.env_timeout_s must be > 0, got {self.env_timeout_s}")
        if self.reward_timeout_s <= 0:
            found.append(f"rl.reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        if self.reward_workers < 0:
            found.append(f"rl.reward_workers must be >= 0 (0 = in the trainer's process), got {self.reward_workers}")
        if self.global_batch_size < 1:
            found.append(f"rl.global_batch_size must be >= 1, got {self.global_batch_size}")
        if self.ppo_epochs < 1:
            found.append(f"rl.ppo_epochs must be >= 1, got {self.ppo_epochs}")
        if self.minibatches < 1:
            found.append(f"rl.minibatches must be >= 1, got {self.minibatches}")
        elif self.global_batch_size >= 1 and self.global_batch_size % self.minibatches:
            found.append(
                f"rl.global_batch_size ({self.global_batch_size}) must be divisible by "
                f"rl.minibatches ({self.minibatches}): each minibatch holds whole prompt groups"
            )
        if not 0 < self.clip_low < 1:
            found.append(f"rl.clip_low must be in (0, 1), got {self.clip_low}")
        if self.clip_high <= 0:
            found.append(f"rl.clip_high must be > 0, got {self.clip_high}")
        if self.kl_coef < 0:
            found.append(f"rl.kl_coef must be >= 0, got {self.kl_coef}")
        if self.ref_offload and self.kl_coef == 0:
            found.append("rl.ref_offload = true but rl.kl_coef = 0: no reference model is loaded, there is nothing "
                         "to offload")
        if self.entropy_coef < 0:
            found.append(f"rl.entropy_coef must be >= 0, got {self.entropy_coef}")
        if not 0 <= self.gamma <= 1:
            found.append(f"rl.gamma must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            found.append(f"rl.lam must be in [0, 1], got {self.lam}")
        if self.value_clip <= 0:
            found.append(f"rl.value_clip must be > 0, got {self.value_clip}")
        return found


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """[optimizer] Policy optimizer."""

    name: Literal["AdamW"] = "AdamW"
    """Optimizer class."""
    lr: float = 1e-3
    """Peak learning rate (reached after lr_scheduler.warmup_steps). A resume keeps the checkpoint's peak and its
    position in the schedule; the schedule's shape (lr_scheduler.*, and job.steps where decay_steps is unset),
    betas, eps, weight_decay and implementation are this config's."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam (beta1, beta2)."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 = no clipping)."""
    implementation: Literal["foreach", "fused", "for-loop"] = "foreach"
    """torch.optim.AdamW's kernel, for the policy and the critic: "foreach" (multi-tensor, the kernel every
    benchmark report measured), "fused" (one kernel over all parameters, torchtitan's default; fewer dispatches
    per optimizer step, under 1% of an RL step on this project's CPU runs) or "for-loop" (one parameter at a
    time). The same update up to float rounding; a checkpoint saved with one loads into another."""

    def problems(self) -> list[str]:
        found = []
        if self.lr <= 0:
            found.append(f"optimizer.lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            found.append(f"optimizer.betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0:
            found.append(f"optimizer.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            found.append(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm < 0:
            found.append(
                f"optimizer.max_grad_norm must be >= 0 (0 = no clipping), got {self.max_grad_norm}"
            )
        return found


@dataclass(kw_only=True, slots=True)
class LRSchedulerConfig:
    """[lr_scheduler] Learning-rate schedule; lengths count RL steps, not optimizer steps."""

    warmup_steps: int = 40
    """Linear warmup length, in RL steps."""
    decay_type: Literal["linear", "cosine", "constant"] = "cosine"
    """Shape of the schedule after warmup."""
    decay_steps: int | None = None
    """Length of the decay, in RL steps; none = until job.steps."""
    min_lr_factor: float = 0.1
    """Final learning rate as a fraction of optimizer.lr (unused with decay_type = 'constant')."""

    def problems(self) -> list[str]:
        found = []
        if self.warmup_steps < 0:
            found.append(f"lr_scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None and self.decay_steps < 1:
            found.append(
                f"lr_scheduler.decay_steps must be >= 1 or none, got {self.decay_steps}"
            )
        if not 0 <= self.min_lr_factor <= 1:
            found.append(f"lr_scheduler.min_lr_factor must be in [0, 1], got {self.min_lr_factor}")
        return found


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """[checkpoint] Distributed checkpoints of policy, optimizer, scheduler and data state."""

    enable: bool = True
    """Save checkpoints."""
    folder: str = "checkpoint"
    """Checkpoint folder: relative to <job.dump_folder>/<job.name>, or an absolute path."""
    interval: int = 2
    """Save every this many RL steps (and at the last step)."""
    resume: bool = True
    """Resume from the latest checkpoint in folder if there is one."""
    keep_latest_k: int = 2
    """Checkpoints kept on disk (0 = keep all; otherwise >= 2: the newest may still be being written)."""
    export_hf: bool = False
    """Also write the final policy as a Hugging Face checkpoint."""
    async_mode: Literal["disabled", "async"] = "disabled"
    """disabled = blocking save; async = save in the background while training continues."""

    def problems(self) -> list[str]:
        found = []
        if not self.folder:
            found.append("checkpoint.folder must not be empty")
        if self.interval < 1:
            found.append(f"checkpoint.interval must be > 0, got {self.interval}")
        if self.keep_latest_k < 0 or self.keep_latest_k == 1:
            # torchtitan's CheckpointManager refuses 1 (it would delete the only complete checkpoint
            # while the newest is being written); say so before start-up, not after it
            found.append(
                f"checkpoint.keep_latest_k must be 0 (keep all) or >= 2, got {self.keep_latest_k}"
            )
        return found


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """[metrics] Where and how often metrics are reported."""

    log_freq: int = 1
    """Report metrics (console line, metrics.jsonl, TensorBoard / W&B) every this many RL steps, and at the last
    step."""
    jsonl: bool = True
    """Append metrics to <job.dump_folder>/<job.name>/metrics.jsonl."""
    tensorboard: bool = False
    """Write TensorBoard event files."""
    wandb: bool = False
    """Log to Weights & Biases."""
    wandb_project: str = "titanrl"
    """W&B project name."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """W&B mode; offline needs no network (sync later with `wandb sync`)."""
    busy_clock: Literal["cpu", "runnable"] = "cpu"
    """What a rank's busy seconds (busy/*, balance/busy_ratio/*, step/limit_s) count on CPU: cpu = its process's
    CPU time (ranks time-sharing cores are each charged only their own work); runnable = CPU time plus the time
    its threads waited for a core (Linux schedstat), so a rank slowed by sharing its core with other work is
    charged the time its work took, as a slower device would be (docs/hetrl.md). Time blocked in collectives
    counts in neither. On CUDA busy time is device time either way."""
    progress: Literal["bar", "line", "none"] = "bar"
    """Console progress: one line per logged step with a progress bar in front, the line alone, or nothing."""
    dump_tensors: bool = False
    """Write each step's per-token tensors of every trajectory (rollout, old and reference log-probs, values,
    advantages) and the policy's full parameters to <job.dump_folder>/<job.name>/tensors/step<N>.pt, for comparing
    what two runs computed (world sizes, placements). It gathers the whole model on rank 0 every step: for debugging
    and tests on small models."""
    verbose: bool = False
    """Show third-party output (vLLM, Ray, torch warnings) and full tracebacks on the console. When false it goes,
    with titanrl's own lines, to <job.dump_folder>/<job.name>/logs/rank<N>.log, and the console shows only
    titanrl's messages, the step lines and the end-of-run summary."""

    def problems(self) -> list[str]:
        found = []
        if self.log_freq < 1:
            found.append(f"metrics.log_freq must be >= 1, got {self.log_freq}")
        if self.wandb and not self.wandb_project:
            found.append("metrics.wandb_project must be set when metrics.wandb is true")
        return found


@dataclass(kw_only=True, slots=True)
class CompileConfig:
    """[compile] torch.compile of training components."""

    enable: bool = False
    """Compile the components below (the policy's, the reference's and the critic's blocks; the sdpa backend's
    attention loop stays eager, the flash backend's kernel is in the graph). ``compile/recompiles`` counts the frames
    compiled per step: the first steps compile, then 0. On the CPU configs it is not faster (benchmarks/compile.md)."""
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile backend."""
    components: list[Literal["model", "loss"]] = field(default_factory=lambda: ["model"])
    """What to compile: 'model' = each transformer block (under Ulysses the attention all-to-alls stay outside
    the compiled graphs); 'loss' = the policy loss (rl.policy_loss, whichever it is; the critic's value loss is
    not compiled)."""
    dynamic: bool = True
    """Compile with dynamic shapes (packed lengths and image grids change every step)."""

    def problems(self) -> list[str]:
        found = []
        if self.enable and not self.components:
            found.append("compile.components must not be empty when compile.enable is true")
        if len(set(self.components)) != len(self.components):
            found.append(f"compile.components has duplicates: {self.components}")
        return found


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """[critic] The value model of rl.algorithm = 'ppo': the policy's architecture with a scalar head, sharded,
    balanced and sequence-parallel like the policy; its own AdamW (optimizer.betas / eps / weight_decay /
    max_grad_norm) and LR schedule (lr_scheduler's shape with its own warmup), saved and resumed with the run."""

    path: str = ""
    """Initial critic: an HF folder of a Qwen2.5-VL checkpoint; empty = the policy's checkpoint, value head at 0.
    (titanrl's own checkpoints hold the critic in DCP and resume it; nothing exports it as an HF folder.)"""
    lr: float = 1e-3
    """Peak learning rate of the critic."""
    warmup_steps: int = 0
    """Linear warmup of the critic's learning rate, in RL steps."""

    def problems(self) -> list[str]:
        found = []
        if self.lr <= 0:
            found.append(f"critic.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            found.append(f"critic.warmup_steps must be >= 0, got {self.warmup_steps}")
        return found


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """[eval] Evaluation during training: held-out prompts generated on every rank's rollout engine (the prompts
    split over the engines by estimated cost, as a training batch), scored with rl.reward, logged as eval/* in the
    step's record, one console line each, and each response in <run dir>/eval/step-<N>.jsonl. docs/workflow.md"""

    path: str = ""
    """The held-out prompts: anything data.path takes, read with data.format and its keys. Empty: with synthesized
    data (no data.path), a held-out set of the same generator (data.mixture) from a seed stream the training set
    never uses, so never a training sample; with data.path set, evaluation needs eval.path."""
    every: int = 0
    """Evaluate after every this many steps (0 = never during training). An evaluation is logged with its step,
    before that step's checkpoint, so a resumed run does not repeat one it logged."""
    before_train: bool = False
    """Also evaluate the initial weights, logged as step 0 (not on a resumed run)."""
    n: int = 1
    """Responses per prompt; eval/pass@n (a prompt passes when any response is correct) is logged when > 1."""
    temperature: float = 0.0
    """Sampling temperature (0 = greedy; top_p 1). Every evaluation draws with the same seed (job.seed), so two
    evaluations differ only by the weights."""
    max_prompts: int = 0
    """Prompts per evaluation: the first this many usable samples of eval.path (0 = all of them). On synthesized
    data, the held-out set's size (0 = a quarter of data.num_samples, at least 8)."""

    @property
    def enabled(self) -> bool:
        return self.every > 0 or self.before_train

    def problems(self) -> list[str]:
        found = [f"eval.{k} must be >= 0, got {v}" for k, v in (("every", self.every),
                                                                 ("max_prompts", self.max_prompts)) if v < 0]
        if self.n < 1:
            found.append(f"eval.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            found.append(f"eval.temperature must be >= 0, got {self.temperature}")
        if self.n > 1 and self.temperature == 0:
            found.append(f"eval.n = {self.n} with eval.temperature = 0 draws {self.n} identical greedy responses per "
                         "prompt: set eval.temperature > 0 (pass@n), or eval.n = 1")
        if self.path and not self.enabled:
            found.append(f"eval.path = {self.path!r} is never evaluated: set eval.every > 0 and/or "
                         "eval.before_train = true")
        return found


@dataclass(kw_only=True, slots=True)
class NodeConfig:
    """One [[workflow.nodes]] entry: a node added to the built-in workflow, or - with the id of one of its
    nodes - a change of that node (the fields given replace the built-in's; unset fields keep them)."""

    id: str = ""
    """Node id, unique in the workflow; other nodes name it in their inputs."""
    role: Literal["actor", "critic", "reference", "reward", "none"] | None = None
    """Whose model or function the node uses (unset: 'none' for a new node, the built-in's otherwise)."""
    type: Literal["generate", "inference", "train", "compute"] | None = None
    """What the node does: generate (rollout engine), inference / train (a model stage), compute (plain Python
    on this rank's trajectories; unset: 'compute' for a new node)."""
    function: str = ""
    """A built-in node function's name, 'package.module:function' or 'path/to/file.py:function' (relative to the
    working directory); it is called as function(batch, ctx) on every rank of its placement and returns the
    batch its consumers see (docs/workflow.md)."""
    inputs: list[str] | None = None
    """Ids of the nodes whose output this node reads (their trajectories, joined); unset keeps the built-in's."""
    placement: str = ""
    """Named rank group the node runs on: 'all' (every rank), 'rollout' (the ranks that generate) or 'train' (the
    ranks that hold the models); under workflow.placement = colocated all three are every rank. Empty: the
    built-in's, or for a new node the group of its first input ('all' without inputs)."""


@dataclass(kw_only=True, slots=True)
class WorkflowConfig:
    """[workflow] The RL step as a DAG of nodes that every rank runs (docs/workflow.md): the built-in graph of
    rl.algorithm with nodes added or changed, and where its rank groups are."""

    placement: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: every node on every rank (the 'rollout' and 'train' groups are all ranks). disaggregated:
    generation and the reward on the first workflow.rollout_ranks ranks (each with its rollout engine, in a
    child process of its own), the models and their stages on the others (FSDP over those only); trajectories
    move between the two groups rank to rank and the weights go from the training ranks' shards to the engines."""
    rollout_ranks: int = 0
    """Ranks that generate under workflow.placement = disaggregated (the first ones; at least one rank must be
    left to train); 0 with colocated."""
    mode: Literal["sync", "async"] = "sync"
    """sync: every step generates its batch with the weights of the previous step's update. async (needs
    workflow.placement = disaggregated): the rollout ranks run workflow.max_staleness batches ahead: while the
    training ranks train step t, the rollout ranks generate the batch of step t + max_staleness with the weights
    of update t - 1, so each side works while the other does (docs/workflow.md#async). The schedule is fixed by
    max_staleness, not by timing: runs are reproducible and resume exactly; the policy loss corrects for the
    lag (rl.behaviour_weight_cap)."""
    max_staleness: int = 1
    """The most policy versions a trained token may lag the policy it trains. workflow.mode = async: the rollout
    ranks run max_staleness batches ahead (the batch of step t is generated by the weights of update
    t - 1 - max_staleness; 0 = no lead: the synchronous schedule, with the off-policy correction), less the extra
    steps a partial rollout may span (rollout.tokens_per_update); each batch in flight is held on the rollout ranks
    until it is trained (and saved in checkpoints). Synchronous runs use it only to bound partial rollouts."""
    nodes: list[NodeConfig] = field(default_factory=list)
    """Nodes added to the built-in workflow, or changes of its nodes (same id): [[workflow.nodes]] tables."""

    def problems(self) -> list[str]:
        # the graph depends on other sections (rl.kl_coef): JobConfig.problems checks it
        if self.max_staleness < 0:
            return [f"workflow.max_staleness must be >= 0, got {self.max_staleness}"]
        if self.mode == "async" and self.placement != "disaggregated":
            return ["workflow.mode = 'async' overlaps generation with training on different ranks: it needs "
                    "workflow.placement = 'disaggregated' (colocated, one rank generates and trains in turn, so "
                    "nothing can run ahead)"]
        if self.placement == "disaggregated" and self.rollout_ranks < 1:
            return ["workflow.placement = 'disaggregated' needs workflow.rollout_ranks >= 1 (the first ranks "
                    "generate, the others train)"]
        if self.placement == "colocated" and self.rollout_ranks:
            return [f"workflow.rollout_ranks = {self.rollout_ranks} needs workflow.placement = 'disaggregated' "
                    "(colocated: every rank generates and trains)"]
        return []

    def training_ranks(self, world_size: int) -> int:
        """How many ranks hold the models: all, or those after the rollout ranks."""
        return world_size - self.rollout_ranks if self.placement == "disaggregated" else world_size


# [lora]'s module names (HF's, as PEFT's target_modules / modules_to_save; titanrl.models.lora maps them to the model)
LORA_TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TOWER_ATTENTION = ("qkv", "proj")  # the vision blocks' attention projections, adapted with lora.vision
LORA_FULL_MODULES = ("lm_head", "embed_tokens", "norm")


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """[lora] Low-rank adapters on the policy (LoRA): the base weights frozen in model.dtype (no float32 master, no
    gradients, no optimizer state), only the adapters trained, under FSDP2 like a full model. The reference
    log-probs are the same model with its adapters off (no second copy of the base); the engines get the merged
    weights; checkpoints hold the adapters; checkpoint.export_hf writes the merged model and the adapters in PEFT's
    layout (hf/adapter). docs/workflow.md"""

    rank: int = 0
    """Rank r of each adapter (0 = off: the whole policy trains)."""
    alpha: float = 16.0
    """Scale numerator: an adapter adds (alpha / rank) B A x."""
    dropout: float = 0.0
    """Dropout on an adapter's input, in the update's forward only (the log-prob stages run without it)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TEXT_TARGETS))
    """Which linear layers of the language model's decoder layers get adapters (HF module names, as PEFT's
    target_modules)."""
    vision: bool = False
    """Also the vision tower's blocks: their attention (qkv, proj) and the MLP projections among lora.targets; false:
    the tower stays frozen."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters, in float32 (PEFT's modules_to_save): lm_head, embed_tokens, norm
    (the final norm). A frozen output head and final norm bound every logit, so a base whose head was never trained
    (the random-init tiny model) needs ["lm_head", "norm"] to learn at all (benchmarks/learning_curve_lora.md). With
    rl.kl_coef > 0 the reference is the policy with its adapters off and these modules' base values (kept at start)
    copied in for its forward, as PEFT's disable_adapter uses the original modules."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def problems(self) -> list[str]:
        known = LORA_TEXT_TARGETS + LORA_TOWER_ATTENTION
        found = []
        if self.rank < 0:
            found.append(f"lora.rank must be >= 0, got {self.rank}")
        if self.alpha <= 0:
            found.append(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            found.append(f"lora.dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in known]
        if unknown:
            found.append(f"lora.targets: unknown module names {unknown}; known: {list(known)}")
        unknown = [m for m in self.modules_to_save if m not in LORA_FULL_MODULES]
        if unknown:
            found.append(f"lora.modules_to_save: unknown modules {unknown}; known: {list(LORA_FULL_MODULES)}")
        if self.rank > 0 and not self.vision and not set(self.targets) & set(LORA_TEXT_TARGETS):
            found.append(f"lora.rank > 0 with lora.targets = {self.targets} and lora.vision = false adapts nothing "
                         f"(the decoder layers' projections are {list(LORA_TEXT_TARGETS)}; qkv and proj are the "
                         "vision blocks': set lora.vision = true)")
        return found


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """The complete, typed configuration of one titanrl job."""

    job: JobRunConfig = field(default_factory=JobRunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)

    @property
    def run_dir(self) -> Path:
        """<job.dump_folder>/<job.name>: where this run writes everything."""
        return Path(self.job.dump_folder).expanduser() / self.job.name

    @property
    def checkpoint_dir(self) -> Path:
        """Absolute checkpoint.folder is used as is; a relative one lives under run_dir."""
        return self.run_dir / Path(self.checkpoint.folder).expanduser()

    @property
    def cache_dir(self) -> Path:
        return Path(self.model.cache_dir).expanduser()

    @property
    def one_rank_fsdp(self) -> bool:
        """One process runs FSDP2 on a one-rank mesh when something needs it: mixed precision (``model.dtype``
        below float32, the rule of many ranks) or the reference model's offload (``rl.ref_offload``)."""
        return self.model.dtype != "float32" or self.rl.ref_offload

    def update_spans(self) -> int:
        """The most steps one response's generation spans (partial rollouts: rollout.tokens_per_update; multi-turn:
        over every turn's tokens)."""
        per = self.rollout.tokens_per_update
        return -(-self.rollout.max_new_tokens * self.rollout.max_turns // per) if per > 0 else 1

    def async_lead(self) -> int:
        """How many batches the rollout ranks generate ahead (0: synchronous): workflow.max_staleness less the
        extra steps a partial rollout may span, so no trained token lags more than max_staleness versions."""
        if self.workflow.mode != "async":
            return 0
        return self.workflow.max_staleness - (self.update_spans() - 1)

    def problems(self) -> list[str]:
        """Every validation problem, section checks first, then checks across sections."""
        found: list[str] = []
        for section in (
            self.job, self.model, self.data, self.parallelism, self.balance, self.rollout,
            self.rl, self.optimizer, self.lr_scheduler, self.checkpoint, self.metrics,
            self.compile, self.critic, self.eval, self.lora, self.workflow,
        ):  # fmt: skip
            found += section.problems()
        from titanrl.config.checks import cross_section_problems

        return found + cross_section_problems(self)

    def validate(self) -> None:
        """Raise one ConfigError listing every problem (a user fixes them all in one go)."""
        _raise_problems(self.problems())

    def engine_sleeps(self, device: str) -> bool:
        """Whether the rollout engine sleeps between generations (rollout.sleep) when it runs on ``device``
        ("cpu" / "cuda"); ConfigError for rollout.sleep = 'on' where sleeping frees nothing."""
        mode = self.rollout.sleep
        if mode == "off" or self.workflow.placement != "colocated":
            return False
        if device != "cuda":
            if mode == "on":
                raise ConfigError(
                    f"rollout.sleep = 'on' gives the engine's device memory to the training stages between "
                    f"generations, but the engine runs on the {device} here, whose memory the training already "
                    "shares: nothing to give back (vLLM's CPU platform has no sleep mode either); set rollout.sleep "
                    "= 'auto' or 'off'")
            return False
        return True

    def data_parallel_degree(self, world_size: int) -> int:
        """The FSDP degree this config gives on ``world_size`` ranks."""
        degree = self.parallelism.data_parallel_shard_degree
        return world_size if degree == -1 else degree

    def validate_world_size(self, world_size: int) -> None:
        """Checks that need the number of ranks, for the trainer to call once it knows it (``config.checks``)."""
        from titanrl.config.checks import world_size_problems

        _raise_problems(world_size_problems(self, world_size))


def _raise_problems(found: list[str]) -> None:
    if len(found) == 1:
        raise ConfigError(found[0])
    if found:
        raise ConfigError("\n  - ".join([f"{len(found)} problems:", *found]))
