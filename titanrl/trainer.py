"""The RL trainer: the run's set-up (assets, models, parallelism, rollout engine, loader, checkpoints) and the
loop over steps. A step is the workflow ``workflow.name`` (``titanrl.workflow``): an executor every rank runs
calls the node functions (``titanrl.rl.nodes``), which hold the stages' mechanics; the trainer holds none.
It is also the ``ctx`` the node functions receive: what they use of the set-up (models, engine, loader,
stage runner, optimizer) is its attributes.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from titanrl import assets, memory
from titanrl.checkpoint import (CallbackState, ModelState, OptimizerState, RNGState, SchedulerState,
                                build_checkpoint_manager, named_checkpoint_errors, remove_incomplete)
from titanrl.config import ConfigError, JobConfig, config_to_dict, save_resolved
from titanrl.console import log_path, say
from titanrl.data.manifest import SampleRecord, read_manifest
from titanrl.data.prompt import PromptEncoder
from titanrl.data.shadow import SampleMeta, build_loader
from titanrl.distributed import (DistInfo, all_reduce_max, block_group, build_dp_mesh, build_ulysses_groups,
                                 machine_of_ranks, new_group)
from titanrl.metrics import MetricsLogger, format_summary
from titanrl.models.lora import AdapterCheckpoint, keep_base
from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel
from titanrl.optim import build_lr_scheduler, build_optimizer
from titanrl.parallel.balance import balance_ranks
from titanrl.parallel.odc_comm import odc_comm
from titanrl.parallel.parallelize import CompileOptions, build_parallel_model
from titanrl.parallel.ulysses import resolve_ulysses
from titanrl.rl.dump import dump_step
from titanrl.envs import EnvError, load_env
from titanrl.rl.error_watch import ErrorWatch
from titanrl.rl.turns import TurnSetup
from titanrl.rl.evaluation import Evaluator
from titanrl.parallel.vision_plan import VisionBalancing
from titanrl.rl.grpo import behaviour_weighted, build_policy_loss
from titanrl.rl.reward_runner import RewardRunner
from titanrl.rl.stages import StageRunner, build_cost_model
from titanrl.rl.step_metrics import step_metrics
from titanrl.rl.timing import BusyClock, StageTimer
from titanrl.rl.weight_sync import WeightPusher
from titanrl.rollout import build_rollout_engine, mm_limits_for
from titanrl.rollout.launch import engine_launch
from titanrl.run_lock import hold as hold_run_dir
from titanrl.workflow.abort import RunControl
from titanrl.workflow.context import NodeContext, RunState
from titanrl.workflow.coordinator import redistribute
from titanrl.workflow.executor import Executor
from titanrl.workflow.functions import bind as bind_functions
from titanrl.workflow.graph import resolve as resolve_workflow
from titanrl.workflow.placement import plan_placement

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far (a first compile or a recompile each)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


@dataclass
class SkipCounter:
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def total(self) -> int:
        return sum(self.counts.values())


class Trainer:
    def __init__(self, cfg: JobConfig, info: DistInfo) -> None:
        self.cfg = cfg
        self.info = info
        self.state = RunState()  # steps done, unfinished groups, probe streak: shared with the nodes
        # every resource is released on its own (engine, loader and Ray, shared memory), also when set-up
        # fails half way: each one pushes its close here as soon as it exists
        self._resources = contextlib.ExitStack()
        try:
            self._setup(cfg, info)
        except BaseException as err:
            # the other ranks may be anywhere in their set-up: tell them, and wait for none of them
            if hasattr(self, "control"):
                self.control.announce(str(err).splitlines()[0] if str(err) else type(err).__name__)
            self._close_collective = False
            self._resources.close()
            raise

    def _setup(self, cfg: JobConfig, info: DistInfo) -> None:
        cfg.validate_world_size(info.world_size)
        self.engine_sleeps = cfg.engine_sleeps(info.device.type)  # rollout.sleep: refused here where it frees nothing
        # the step as a workflow: checked, and its functions found, before anything heavy is built
        self.workflow = resolve_workflow(cfg)
        self.placement = plan_placement(cfg.workflow.placement, info.world_size, cfg.workflow.rollout_ranks,
                                        cfg.rollout.tensor_parallel_size)
        # relative rank speeds (balance.rank_speeds; None: equal): work in proportion on every split across ranks
        self.rank_speeds = cfg.balance.speeds()
        if info.is_main:
            say(f"[titanrl] workflow ({cfg.rl.algorithm}, {self.placement.describe()}; node [role/type on ranks] = "
                "function(inputs)):\n" + self.workflow.describe())
        # this rank's parts: it generates (engine, rewards) and/or holds the models (everything else)
        self.generates = info.rank in self.placement.rollout
        self.trains = info.rank in self.placement.train
        # the rank groups' own process groups (disaggregated; colocated every group is the default one, None)
        timeout = cfg.job.collective_timeout_s
        process_groups = ({"rollout": new_group(self.placement.rollout, timeout),
                           "train": new_group(self.placement.train, timeout)} if self.placement.disaggregated else {})
        self.train_group = process_groups.get("train")
        # asynchronous: the producing nodes (data, rollout, reward) run workflow.max_staleness batches ahead
        # (less the extra steps partial rollouts may span: JobConfig.async_lead)
        lead = cfg.async_lead()
        self.executor = Executor(self.workflow, bind_functions(self.workflow), info.rank, self.placement.groups(),
                                 move=self._move, process_groups=process_groups, lead=lead)
        self.train_info = DistInfo(self.placement.train_rank(info.rank), len(self.placement.train), info.local_rank,
                                   info.device)
        # FSDP's shard groups: all training ranks, or under odc each machine's ranks (hybrid sharding)
        machines = machine_of_ranks(info) if cfg.balance.strategy == "odc" else [0] * info.world_size
        self.dp_shard = memory.fsdp_shard_degree(cfg, [machines[r] for r in self.placement.train],
                                                 disaggregated=self.placement.disaggregated)
        if info.is_main and self.dp_shard < len(self.placement.train):
            say(f"[titanrl] odc with hybrid sharding: the models sharded over groups of {self.dp_shard} rank(s), each "
                f"within a machine, {len(self.placement.train) // self.dp_shard} replicas whose gradients are summed "
                "once per minibatch")
        self.control = RunControl(info.rank)
        self._resources.callback(self.control.close)
        if info.is_main:
            # held until the trainer closes or this process ends (a later run checks it first: titanrl.run_lock)
            self._resources.callback(hold_run_dir(cfg.run_dir).close)
            save_resolved(cfg, cfg.run_dir / "config.toml")
        if cfg.balance.profile_speeds and info.world_size > 1:
            self.rank_speeds = self._profile_speeds(cfg, info)
        torch.manual_seed(cfg.job.seed)

        # prepared once per group of ranks sharing model.cache_dir (each machine, when their caches are local)
        self.cache = assets.cache_group(cfg, info)
        self.model_dir = assets.model_dir(cfg, info, self.cache)
        self.manifest = assets.manifest_path(cfg, info, self.cache)
        if cfg.checkpoint.enable and info.world_size > 1:
            _check_shared_checkpoints(cfg, info)
        self.records: list[SampleRecord] = read_manifest(self.manifest, check_files=False)
        # [eval]: the held-out prompts (the engines take as many media per prompt as either set holds)
        self.eval_manifest = assets.eval_manifest_path(cfg, info, self.cache) if cfg.eval.enabled else None
        held_out = read_manifest(self.eval_manifest, check_files=False) if self.eval_manifest else []
        self.encoder = PromptEncoder.from_pretrained(self.model_dir)
        self.rewards = (RewardRunner(cfg.rl.reward, timeout_s=cfg.rl.reward_timeout_s, workers=cfg.rl.reward_workers,
                                     on_error=cfg.rl.on_reward_error) if self.generates else None)
        if self.rewards is not None:
            self._resources.callback(self.rewards.close)

        self.args = Qwen2_5_VLArgs.from_pretrained(self.model_dir)
        self.param_dtype = _DTYPES[cfg.model.dtype]
        # the memory plan (titanrl.memory), before any model is built: on a GPU a config predicted not to fit is
        # refused, naming the largest term and the fixes; on CPU the prediction (an upper bound: full microbatches
        # of the longest samples, benchmarks/memory.md) only warns
        tinfo = self.train_info
        if info.rank in self.placement.train:
            self.memory_plan = memory.predict(cfg, self.args, tinfo.world_size, device=info.device.type,
                                              shard=self.dp_shard)
        else:  # a rank that only generates
            self.memory_plan = memory.predict_rollout_rank(cfg, self.args, len(self.placement.rollout),
                                                           device=info.device.type)
        capacity = memory.device_capacity_bytes(str(info.device), int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                                     info.world_size)))
        try:
            memory.check_fits(self.memory_plan, capacity, cfg)
        except ConfigError as err:
            if info.device.type == "cuda":
                raise
            if info.is_main:
                say(f"[titanrl] warning: {err}")
        # Ulysses degrees against the model's head counts: an impossible one stops the run here,
        # before any model or engine is built.
        self.ulysses = resolve_ulysses(cfg.parallelism, self.args.text, tinfo.world_size)
        if info.is_main and self.ulysses.message:
            say(f"[titanrl] {self.ulysses.message}")
        # model.dtype below float32 on one process: FSDP2 on a one-rank mesh, the same mixed-precision rule as on
        # many ranks (float32 parameters and gradients, compute and the weight push in model.dtype)
        # (disaggregated: a mesh of the training ranks over their group; the others build no model)
        mesh = build_dp_mesh(info, one_rank=cfg.one_rank_fsdp, ranks=self.placement.train,
                             group=self.train_group, shard=self.dp_shard)
        self.model = self.ref_model = self.critic = self.stages = None
        if self.trains:
            self.model = self._build_model(mesh, trainable=True, lora=cfg.lora if cfg.lora.enabled else None)
            # the reference: with LoRA, the policy itself run with its adapters off and the base values of what
            # lora.modules_to_save trains in full (kept now, before any training or checkpoint load) swapped in
            # (rl.nodes.ref_logprobs)
            if cfg.rl.kl_coef > 0 and cfg.lora.enabled and cfg.lora.modules_to_save:
                keep_base(self.model, cfg.lora.modules_to_save)
            self.ref_model = (None if cfg.rl.kl_coef == 0 else self.model if cfg.lora.enabled else
                              self._build_model(mesh, trainable=False, offload=cfg.rl.ref_offload))
            # PPO's critic: the policy's network with a value head, sharded and compiled like it
            self.critic = (self._build_model(mesh, trainable=True, value_head=True, path=cfg.critic.path or None)
                           if cfg.rl.algorithm == "ppo" else None)
        if self.trains and cfg.balance.strategy == "odc":
            # the shards' shared memory, mapped by every training rank now (collective): a job that spans machines
            # or runs on CUDA is refused here, before the first rollout
            for m in dict.fromkeys(m for m in (self.model, self.ref_model, self.critic) if m is not None):
                odc_comm(m)
        cost_model = build_cost_model(self.args, cfg.balance.cost_model)
        train_speeds = tuple(self.rank_speeds[r] for r in self.placement.train) if self.rank_speeds else None
        # process groups are made by every rank of the job, also those outside the training group
        ulysses_groups = (build_ulysses_groups(tinfo.rank, tinfo.world_size, self.ulysses.degrees, info.device,
                                               timeout_s=timeout, ranks=self.placement.train)
                          if tinfo.world_size > 1 else {})
        vision_balance = cfg.parallelism.vision_balance and tinfo.world_size > 1
        vision_group = new_group(self.placement.train, timeout) if vision_balance else None
        self.stages = StageRunner(
            args=self.args, rank=tinfo.rank, world=tinfo.world_size, device=info.device, dtype=self.param_dtype,
            # bucketing: verl's whole-sequence dealing, waves synchronised like lb_micro
            method="bucketing" if cfg.balance.strategy == "bucketing" else self.ulysses.method,
            strategy="lb_micro" if cfg.balance.strategy == "bucketing" else cfg.balance.strategy,
            max_tokens=cfg.balance.max_tokens_per_microbatch,
            reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
            cost_model=cost_model, p_max=self.ulysses.p_max,
            degree=self.ulysses.degree, attn_backend=cfg.model.attn_backend, shared_prefix=cfg.rl.shared_prefix,
            groups=ulysses_groups, process_group=self.train_group, speeds=train_speeds,
            busy_clock=cfg.metrics.busy_clock, calibrate=cfg.balance.calibrate,
            vision=VisionBalancing(enabled=vision_balance, cost_model=cost_model, group=vision_group,
                                   speeds=train_speeds),
        ) if self.trains else None
        # the decoupled objective against the rollout engine's log-probs (rl.behaviour_weight): asynchronous runs and
        # partial rollouts, whose tokens come from earlier weights, or every run
        self.behaviour_weighted = behaviour_weighted(cfg)
        self.policy_loss = build_policy_loss(cfg.rl, weighted=self.behaviour_weighted)
        if cfg.compile.enable and "loss" in cfg.compile.components:
            self.policy_loss = torch.compile(self.policy_loss, backend=cfg.compile.backend, dynamic=cfg.compile.dynamic)
        # LoRA: the adapters only (the frozen base has no gradient and no optimizer state); likewise a frozen tower
        self.optimizer = (build_optimizer(cfg, [p for p in self.model.parameters() if p.requires_grad])
                          if self.trains else None)
        self.lr_scheduler = build_lr_scheduler(cfg, self.optimizer) if self.trains else None
        critic_states = {}
        if self.critic is not None:
            self.critic_optimizer = build_optimizer(cfg, [p for p in self.critic.parameters() if p.requires_grad],
                                                    lr=cfg.critic.lr)
            self.critic_lr_scheduler = build_lr_scheduler(cfg, self.critic_optimizer,
                                                          warmup_steps=cfg.critic.warmup_steps)
            critic_states = {"critic": ModelState(self.critic),
                             "critic_optimizer": OptimizerState(self.critic, self.critic_optimizer),
                             "critic_lr_scheduler": SchedulerState(self.critic_lr_scheduler)}

        # where each engine runs (titanrl.rollout.launch): colocated in the ranks' processes, each on its rank's device
        # (vLLM's external launcher; an engine over rollout.tensor_parallel_size ranks shares their process group);
        # disaggregated, vLLM's engine core in a child process of the rollout rank, with a torch.distributed world of
        # its own (in this process it would make groups of the trainer's world, which the training ranks do not join)
        self.engine = None
        tp = cfg.rollout.tensor_parallel_size
        tp_group = (block_group(info.rank, info.world_size, tp, timeout)
                    if not self.placement.disaggregated and cfg.rollout.engine == "vllm" else None)
        if info.rank in self.placement.engines:
            launch = engine_launch(info.rank, info.local_rank, info.world_size, tp, info.device.type,
                                   process_group=dist.is_initialized(), own_process=self.placement.disaggregated,
                                   local_world=int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size)))
            mm_limits = mm_limits_for(self.records + held_out)
            if cfg.rollout.max_turns > 1:  # the observations' images come after the prompt's
                extra = (cfg.rollout.max_turns - 1) * cfg.rollout.max_turn_images
                mm_limits = {**mm_limits, "image": mm_limits.get("image", 0) + extra}
            self.engine = build_rollout_engine(cfg, self.model_dir, info.rank, mm_limits=mm_limits, launch=launch,
                                               tp_group=tp_group, sleep=self.engine_sleeps)
            # the trainer's close ends its process: no garbage collection of vLLM's heap
            self._resources.callback(self.engine.close, collect=False)
            print(f"[titanrl] rank {info.rank} engine layout: {getattr(self.engine, 'layout', None)}", flush=True)
        # The loader (ShadowLoader by default, or the centralized baseline) plans every step's global
        # batch from metadata on every rank and materializes only this rank's prompts, ahead of use.
        self.loader = build_loader(cfg, info, self.model_dir, self.manifest, assign=self.assign_prompts,
                                   encoder=self.encoder, cache=self.cache)
        self._resources.callback(lambda: self.loader.close(collective=self._close_collective))
        self.turns = self._turn_setup(cfg) if cfg.rollout.max_turns > 1 else None  # multi-turn rollouts
        self.evaluator = self._build_evaluator(cfg, info) if cfg.eval.enabled else None
        self.pusher = WeightPusher(self.args, info, self.param_dtype, placement=self.placement, timeout_s=timeout)
        self._resources.callback(self.pusher.close)
        self.errors = ErrorWatch(cfg.rl.max_error_steps, cfg.rl.reward, is_main=info.is_main, say=say)
        m = cfg.metrics
        self.metrics = MetricsLogger(
            cfg.run_dir, enabled=info.is_main, jsonl=m.jsonl, tensorboard=m.tensorboard, total_steps=cfg.job.steps,
            progress=m.progress, wandb=m.wandb, wandb_project=m.wandb_project, wandb_mode=m.wandb_mode,
            run_name=cfg.job.name, config=config_to_dict(cfg),
        )
        self._resources.callback(self.metrics.close)
        self.skips = SkipCounter()
        # a rank without models saves and restores its loader and RNG state only
        self.checkpointer = build_checkpoint_manager(
            cfg,
            model=self.model,
            # LoRA: a checkpoint holds the adapters (the base is model.path's)
            model_view=AdapterCheckpoint(self.model) if cfg.lora.enabled and self.model is not None else None,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=CallbackState(self._loader_state, self.loader.load_state_dict),
            extra_states={
                "trainer": CallbackState(lambda: {"step": self.step}, self._load_trainer_state),
                "rng": RNGState(info.rank),
                # asynchronous: the batches generated ahead and not yet trained, per rank
                "in_flight": CallbackState(self._in_flight_state, self._load_in_flight),
                **critic_states,
            },
        )
        self._resources.callback(self.checkpointer.close)
        self._saved_in_flight: dict = {}
        if info.is_main and cfg.checkpoint.enable:
            for folder in remove_incomplete(cfg.checkpoint_dir):
                say(f"[titanrl] removed {folder}: a checkpoint save cut off before it finished (no .metadata)")
        with named_checkpoint_errors("load", cfg.checkpoint_dir):
            resumed = cfg.checkpoint.enable and cfg.checkpoint.resume and self.checkpointer.load()
        if resumed:
            self._restore_in_flight()
            # The engine started from the initial checkpoint: give it the resumed weights.
            self.pusher.push(self.model, self.engine)
            if info.is_main:
                say(f"[titanrl] resumed from step {self.step}")
        self.first_step = self.step + 1  # of this process (a resumed run starts past 1)
        # what the workflow's nodes see of all this (titanrl.workflow.context)
        self.node_ctx = NodeContext(
            cfg=cfg, info=info, placement=self.placement, state=self.state, args=self.args,
            param_dtype=self.param_dtype, generates=self.generates, loader=self.loader, encoder=self.encoder,
            engine=self.engine, rewards=self.rewards, skips=self.skips, pusher=self.pusher, model=self.model,
            ref_model=self.ref_model, critic=self.critic, stages=self.stages, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, critic_optimizer=getattr(self, "critic_optimizer", None),
            critic_lr_scheduler=getattr(self, "critic_lr_scheduler", None), policy_loss=self.policy_loss,
            behaviour_weighted=self.behaviour_weighted, turns=self.turns)
        self.history: list[dict[str, float]] = []  # every step's metrics, for the end-of-run summary
        self.evals: list[tuple[int, dict[str, float]]] = []  # this process's evaluations (step, metrics)
        self._step_seconds: list[float] = []  # wall seconds of this process's steps (SIGTERM's estimate)

    # the run's state across steps lives in one RunState the nodes share (checkpointed from here)
    step = property(lambda self: self.state.step, lambda self, value: setattr(self.state, "step", value))
    partial_rollouts = property(lambda self: self.state.partial_rollouts,
                                lambda self, value: setattr(self.state, "partial_rollouts", value))

    def _turn_setup(self, cfg) -> TurnSetup:
        """Multi-turn rollouts: rl.env's class (loaded now: a missing file or class stops the start with its name),
        the checkpoint's image processing for the observations, and where the records' media paths start."""
        from titanrl.data.shadow.factory import media_settings

        return TurnSetup(make_env=load_env(cfg.rl.env), settings=media_settings(cfg, self.model_dir),
                         manifest_dir=str(Path(self.manifest).parent.resolve()), max_turns=cfg.rollout.max_turns,
                         max_turn_images=cfg.rollout.max_turn_images, max_context_tokens=cfg.model.max_seq_len,
                         strict=cfg.rl.on_reward_error == "error", timeout_s=cfg.rl.env_timeout_s)

    def _build_model(self, mesh, *, trainable: bool, value_head: bool = False, path=None,
                     offload: bool = False, lora=None) -> Qwen2_5_VLModel:
        """Built on the meta device, parallelised, then each rank's shards allocated and read from the checkpoint
        (``build_parallel_model``)."""
        cfg = self.cfg
        return build_parallel_model(
            self.args, path or self.model_dir, device=self.info.device, dp_mesh=mesh, trainable=trainable,
            value_head=value_head, attn_backend=cfg.model.attn_backend, lora=lora, seed=cfg.job.seed,
            freeze_vision=trainable and cfg.model.freeze_vision_tower,
            compile_options=CompileOptions(
                enable=cfg.compile.enable and "model" in cfg.compile.components,  # policy, reference, critic
                backend=cfg.compile.backend,
                dynamic=cfg.compile.dynamic,
            ),
            activation_checkpoint=cfg.parallelism.activation_checkpoint if trainable else "none",
            param_dtype=self.param_dtype,
            reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
            ulysses=self.ulysses.method in ("fixed", "flex"),
            offload=offload,
        )

    def _build_evaluator(self, cfg: JobConfig, info: DistInfo) -> Evaluator:
        """[eval]: the held-out set (``self.eval_manifest``, its metadata probed like the training set's) and this
        rank's engine and reward workers."""
        from titanrl.data.shadow.comm import Comm
        from titanrl.data.shadow.factory import load_table, media_settings

        settings = media_settings(cfg, self.model_dir)
        table = load_table(cfg, self.eval_manifest, settings, self.encoder, Comm.from_torch(),
                           first=self.cache.is_leader)
        e = cfg.eval
        evaluator = Evaluator(
            table=table, settings=settings, encoder=self.encoder, engine=self.engine, rewards=self.rewards,
            assign=self.assign_prompts, rank=info.rank, world=info.world_size, every=e.every, n=e.n,
            temperature=e.temperature, max_prompts=e.max_prompts, max_new_tokens=cfg.rollout.max_new_tokens,
            seed=cfg.job.seed, strict=cfg.data.on_bad_sample == "error",
            out_dir=cfg.run_dir / "eval" if info.is_main else None,
            # multi-turn: the same turns, the environments given the held-out set's media paths
            turns=replace(self.turns, manifest_dir=str(table.manifest_path.parent.resolve())) if self.turns else None)
        if info.is_main:
            when = ", ".join(([f"every {e.every} steps"] if e.every else []) + (["before training"] if e.before_train
                                                                                 else []))
            say(f"[titanrl] eval: {evaluator.describe()}, {when}")
        return evaluator

    def _evaluate(self, step: int) -> tuple[dict[str, float], str]:
        """One evaluation (collective): its metrics and console line."""
        metrics, line = self.evaluator.run(step)
        self.evals.append((step, metrics))
        return metrics, line

    # ------------------------------------------------------------------ state

    def _load_trainer_state(self, state: dict) -> None:
        self.step = int(state["step"])

    def _loader_state(self) -> dict:
        """The loader's position after the last step trained: with batches in flight (asynchronous), where the
        first of them was handed out (a resume hands them out again and takes their trajectories from the
        checkpoint)."""
        first = min(self.executor.in_flight, default=None)
        if first is not None and self.executor.in_flight[first].media is not None:
            return self.executor.in_flight[first].media.resume_state
        return self.loader.state_dict()

    def _in_flight_state(self) -> dict:
        """This rank's batches in flight (asynchronous) and unfinished responses (partial rollouts)."""
        state = {"batches": self.executor.in_flight_state(), "partial": self.partial_rollouts}
        if not (state["batches"] or state["partial"]):
            return {f"rank{self.info.rank}": b""}
        try:
            blob = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            # multi-turn partial rollouts hold unfinished trajectories with their environments between steps
            envs = sorted({type(e.env).__qualname__ for es in self.partial_rollouts.values() for e in es
                           if getattr(e, "env", None) is not None})
            if not envs:
                raise
            raise EnvError(f"the unfinished trajectories of partial rollouts (rollout.tokens_per_update) cannot be "
                           f"saved in the checkpoint with their environments ({', '.join(envs)}): "
                           f"{type(err).__name__}: {err}. Make rl.env's class picklable, or set checkpoint.enable = "
                           "false or rollout.tokens_per_update = 0") from err
        return {f"rank{self.info.rank}": blob}

    def _load_in_flight(self, state: dict) -> None:
        blob = state.get(f"rank{self.info.rank}", b"")
        try:
            saved = pickle.loads(blob) if blob else {}
        except (ImportError, AttributeError) as err:  # an environment class (rl.env) this run does not load
            raise ConfigError(f"the checkpoint's batches in flight and unfinished partial rollouts cannot be read: "
                              f"{type(err).__name__}: {err}. It was saved with other settings (rl.env, "
                              "rollout.max_turns): resume with those, or start afresh (checkpoint.resume = false, or "
                              "another job.dump_folder)") from err
        self._saved_in_flight = saved.get("batches", {})
        self.partial_rollouts = saved.get("partial", {}) if self.cfg.rollout.tokens_per_update else {}
        items = [i for group in self.partial_rollouts.values() for i in group]
        if items and hasattr(items[0], "env") != (self.cfg.rollout.max_turns > 1):
            saved_as = "multi-turn trajectories" if hasattr(items[0], "env") else "single-turn responses"
            raise ConfigError(f"the checkpoint's unfinished partial rollouts are {saved_as}, but this run has "
                              f"rollout.max_turns = {self.cfg.rollout.max_turns}: resume with the settings it was "
                              "saved with, or start afresh (checkpoint.resume = false, or another job.dump_folder)")

    def _restore_in_flight(self) -> None:
        """After a checkpoint is loaded: the batches that were in flight (the loader hands each out again, for
        its media; the trajectories are the checkpoint's). Those past this run's lead are dropped (the loader
        stays before them: they are generated again with newer weights)."""
        keep = {s: b for s, b in self._saved_in_flight.items() if s < self.step + self.executor.lead}
        media = {s: self.loader.next_step() for s in sorted(keep)}
        self.executor.restore_in_flight(keep, media)
        self._saved_in_flight = {}

    @staticmethod
    def _profile_speeds(cfg: JobConfig, info: DistInfo) -> list[float] | None:
        """balance.profile_speeds: every rank's matmul throughput in the run's dtype, measured on all ranks at once
        (``titanrl.profile``, best of three), as relative speeds; None when they are within 10% of each other."""
        from titanrl.profile import profile_ranks, write_profile

        # the best of three short probes per rank: a rank's throughput only drops below its own from something
        # else running beside it, and start-up work (other processes importing) passes; a rank sharing its core
        # stays slow in all three
        profiles = [profile_ranks(dtype=cfg.model.dtype, device=info.device, seconds=0.5, links=False)
                    for _ in range(3)]
        tflops = [max(p["ranks"][r]["matmul_tflops"] for p in profiles) for r in range(info.world_size)]
        profile = max(profiles, key=lambda p: sum(r["matmul_tflops"] for r in p["ranks"]))
        speeds = [round(t / max(tflops), 3) for t in tflops]
        if info.is_main:
            write_profile(profile, cfg.run_dir / "profile.json")
            say(f"[titanrl] measured rank speeds {speeds} (matmul TFLOP/s {tflops}; {cfg.run_dir / 'profile.json'})"
                + ("; within 10%: balanced as equal" if min(speeds) > 0.9 else ""))
        return speeds if min(speeds) <= 0.9 else None

    # ------------------------------------------------------------------ data

    def assign_prompts(self, metas: list[SampleMeta], world: int, n: int | None = None) -> list[list[int]]:
        """Split a global batch across the generating ranks' engines by estimated cost — prompt
        tokens with every image/video expanded (from file headers) plus the expected responses —
        with Karmarkar-Karp, so one video-heavy rank does not stall the others (ranks that do not
        generate get none). Positions in the global batch (not the split) decide seeds, groups
        and minibatches. Ranks of unequal speed (balance.rank_speeds) get prompts in proportion (an engine
        over tensor-parallel ranks: their summed speed). ``n``: responses per prompt (default rollout.n)."""
        n = self.cfg.rollout.n if n is None else n
        costs = [m.num_tokens * n + n * self.cfg.rollout.max_new_tokens for m in metas]
        generating = list(self.placement.engines)
        tp = self.placement.engine_share
        speeds = ([sum(self.rank_speeds[e + j] for j in range(tp)) for e in generating]
                  if self.rank_speeds else None)
        out: list[list[int]] = [[] for _ in range(world)]
        for r, part in zip(generating, balance_ranks(costs, len(generating), speeds=speeds)):
            out[r] = sorted(part)
        return out

    def _move(self, batch, senders, receivers, buffer):
        """The data coordinator's move between disjoint rank groups (``titanrl.workflow.coordinator``)."""
        every = self.cfg.rollout.probe_every
        return redistribute(batch, senders, receivers, rank=self.info.rank, step=buffer.step, media=buffer.media,
                            device=self.info.device, pixels=not self.cfg.data.slice_loading,
                            probe=bool(every) and (self.step + 1) % every == 0, speeds=self.rank_speeds,
                            carried_from=self.cfg.rl.global_batch_size)  # partial rollouts' ids (rl.nodes._carried)

    # ------------------------------------------------------------------ step

    def rl_step(self) -> dict[str, float]:
        """One RL step: the workflow's nodes in order (``titanrl.workflow``), then the step line's metrics."""
        t_step = time.perf_counter()
        frames = _compiled_frames()
        # busy: this process's CPU time, and its engine's working time where that runs in child processes
        clock = BusyClock(self.info.device, extra=getattr(self.engine, "busy_outside_s", None),
                          kind=self.cfg.metrics.busy_clock)
        timer = StageTimer(self.info.rank, self.cfg.job.collective_timeout_s, clock=clock)
        buffer = self.executor.run_step(self.step, self.node_ctx, timer, last=self.cfg.job.steps)
        self.step += 1
        if self.cfg.metrics.dump_tensors and self.trains:  # the training ranks hold every trajectory once
            trajs = buffer.outputs["reward"].trajectories if "reward" in buffer.outputs else []
            models = {"policy": self.model, **({"critic": self.critic} if self.critic is not None else {})}
            dump_step(self.cfg.run_dir, self.step, trajs, models, is_main=self.train_info.rank == 0,
                      group=self.train_group)
        out, self._step_errors = step_metrics(self.node_ctx, buffer, timer, time.perf_counter() - t_step)
        if self.cfg.compile.enable:  # frames torch.compile compiled in this step, on the rank that compiled most
            out["compile/recompiles"] = all_reduce_max(_compiled_frames() - frames)
        out["memory/predicted_peak_bytes"] = float(self.memory_plan.total)
        out["memory/measured_peak_bytes"] = float(memory.measured_peak_bytes(self.info.device.type))
        return out

    _close_collective = True  # False after a failure: tear-down waits for no other rank

    def train(self) -> list[dict[str, float]]:
        """Steps until job.steps, or until a SIGTERM (then a checkpoint of the step that ends, exit 0). A failure
        tells the other ranks (``titanrl.workflow.abort``) and tears down without waiting for any of them."""
        history = self.history
        self.control.handle_sigterm(self.cfg.job.preempt_grace_s, self._time_to_stop, self._abandon_line)
        self.control.watch(cleanup=lambda: self.close(collective=False))
        self.stopped_by_signal = False
        try:
            if self.evaluator is not None and self.cfg.eval.before_train and self.step == 0:
                evaluation = self._evaluate(0)  # the initial weights: a record of step 0
                self.metrics.log(0, evaluation[0], line=False)
                if self.info.is_main:
                    say(evaluation[1])
            while self.step < self.cfg.job.steps:
                self._step_started = time.monotonic()
                metrics = self.rl_step()
                # after the step's weight push and before its checkpoint, in the step's record
                evaluation = (self._evaluate(self.step) if self.evaluator is not None and self.evaluator.due(self.step)
                              else None)
                self._step_seconds.append(time.monotonic() - self._step_started)
                history.append(metrics)
                if evaluation is not None:
                    metrics.update(evaluation[0])
                final = self.step == self.cfg.job.steps
                if self.step % self.cfg.metrics.log_freq == 0 or final or evaluation is not None:
                    self.metrics.log(self.step, metrics)
                if evaluation is not None and self.info.is_main:
                    say(evaluation[1])
                self.errors.observe(self.step, metrics, self._step_errors)
                stop = self.control.should_stop()
                t_save = time.monotonic()
                self._step_started = None  # between steps: only the save remains
                last = self.step == self.cfg.job.steps or stop
                with named_checkpoint_errors("save", self.cfg.checkpoint_dir):
                    self.checkpointer.save(self.step, last_step=last)
                if self.cfg.checkpoint.enable and (last or self.step % self.cfg.checkpoint.interval == 0):
                    self._save_seconds = time.monotonic() - t_save
                if stop:
                    self.stopped_by_signal = True
                    if self.info.is_main:
                        where = (f"checkpoint at {self.cfg.checkpoint_dir / f'step-{self.step}'}; rerun the command "
                                 "to resume" if self.cfg.checkpoint.enable else "checkpoint.enable=false: nothing saved")
                        say(f"[titanrl] stopped by SIGTERM after step {self.step}: {where}")
                    break
            self.checkpointer.maybe_wait_for_saving()
            if self.cfg.checkpoint.export_hf and not self.stopped_by_signal:
                self.export_hf(self.cfg.run_dir / "hf")
        except BaseException as err:
            # the other ranks may be anywhere (in a collective, or failing too): tell them, wait for none
            self.control.announce(str(err).splitlines()[0] if str(err) else type(err).__name__)
            self.close(collective=False)
            raise
        self.close()
        return history

    _step_started: float | None = None
    _save_seconds: float = 0.0

    def _time_to_stop(self) -> float | None:
        """SIGTERM's question (``job.preempt_grace_s``): seconds the current step still needs (from the median of the
        last steps; None before one has ended) plus its checkpoint's (the last save's)"""
        started = self._step_started
        if started is None:
            return self._save_seconds
        if not self._step_seconds:
            return None
        median = sorted(self._step_seconds[-5:])[len(self._step_seconds[-5:]) // 2]
        return max(median - (time.monotonic() - started), 0.0) + self._save_seconds

    def _abandon_line(self) -> str:
        complete = sorted(int(d.name.removeprefix("step-")) for d in self.cfg.checkpoint_dir.glob("step-*")
                          if (d / ".metadata").is_file() and d.name.removeprefix("step-").isdigit()) \
            if self.cfg.checkpoint.enable and self.cfg.checkpoint_dir.is_dir() else []
        where = (f"the last checkpoint, {self.cfg.checkpoint_dir / f'step-{complete[-1]}'}, stands; rerun the command "
                 "to resume" if complete else "no checkpoint was saved yet")
        return (f"SIGTERM during step {self.step + 1}: abandoned (it would not end and save within "
                f"job.preempt_grace_s={self.cfg.job.preempt_grace_s:g} s); {where}")

    def summary(self, wall_s: float) -> str:
        """What the run reached and where its outputs are (printed by the entry point at the end)."""
        run = self.cfg.run_dir
        places = {}
        if self.cfg.checkpoint.enable:
            places["checkpoint"] = f"{self.cfg.checkpoint_dir} (step {self.step}; rerun the command to resume)"
        if self.cfg.metrics.jsonl:
            places["metrics"] = f"{run / 'metrics.jsonl'} (plots: python -m titanrl.plot {run})"
        if self.cfg.metrics.tensorboard:
            places["tensorboard"] = str(run / "tensorboard")
        if log_path() is not None:
            places["logs"] = f"{log_path().parent}/rank<N>.log"
        if self.cfg.checkpoint.export_hf:
            places["model"] = f"{run / 'hf'} (HF format: transformers and vLLM load it)"
        return format_summary(self.history, self.first_step, wall_s, places, notes=self.errors.summary(),
                              evals=self.evals)

    def export_hf(self, outdir) -> None:
        """The trained policy as an HF directory (original Qwen2.5-VL names + tokenizer/processor)
        that transformers and vLLM load."""
        from titanrl.rl.weight_sync import write_adapters, write_hf

        if self.model is None:  # a rollout rank of a disaggregated placement
            return
        writer = self.train_info.rank == 0
        write_hf(self.model, self.args, outdir, dtype=self.param_dtype, writer_rank=writer,
                 assets_from=self.model_dir)
        lora = self.cfg.lora
        if lora.enabled:  # the adapters too, in PEFT's layout (the merged model above is what engines load)
            write_adapters(self.model, outdir / "adapter", writer_rank=writer, rank=lora.rank, alpha=lora.alpha,
                           dropout=lora.dropout, base=self.cfg.model.path or str(self.model_dir))
        if self.info.is_main:
            say(f"[titanrl] exported the policy to {outdir}" + (f" (merged; its LoRA adapters in {outdir / 'adapter'})"
                                                                  if lora.enabled else ""))

    def close(self, *, collective: bool = True) -> None:
        """Release every resource, each on its own (a failing close does not skip the others)."""
        self._close_collective = collective
        self._resources.close()


def _check_shared_checkpoints(cfg: JobConfig, info: DistInfo) -> None:
    """DCP writes one checkpoint folder that every rank writes its shards to and reads back: refused, with the
    reason, where the machines do not share it (collective)."""
    from titanrl.fs_share import folder_group

    group = folder_group(cfg.checkpoint_dir, info, cfg.job.collective_timeout_s)
    if not group.shared:
        raise ConfigError(
            f"checkpoint.enable needs a checkpoint folder every machine shares: {str(cfg.checkpoint_dir)!r} "
            f"(job.dump_folder, job.name, checkpoint.folder) is seen by {group.describe()} only (rank {info.rank}'s "
            "view), and a checkpoint is one folder every rank writes and reads. Put job.dump_folder (or an absolute "
            "checkpoint.folder) on a shared filesystem, or --checkpoint.enable=false")
