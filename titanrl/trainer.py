"""The RL trainer: set-up (assets, model, parallelism, rollout engine, checkpoints) and one
GRPO step, stage by stage, with the per-stage timings of the FlexRL paper's table 1.

One step: the global batch of prompts (identical on every rank) is split across ranks by
estimated cost; each rank prepares its prompts (decode + preprocess + tokenize), samples
``rollout.n`` responses with its own engine, scores them with the reward function, computes
old-policy (and reference) log-probs with titanrl's model, takes ``ppo_epochs`` x
``minibatches`` optimizer steps on the PPO-clip objective, and pushes the new weights into its
engine. Losses are normalised by global token/sequence counts of each minibatch, so the result
does not depend on how prompts were split across ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from titanrl import assets
from titanrl.checkpoint import CallbackState, RNGState, build_checkpoint_manager
from titanrl.config import JobConfig, config_to_dict, save_resolved
from titanrl.console import log_path, say
from titanrl.data.manifest import SampleRecord, read_manifest
from titanrl.data.preprocess import PreparedSample
from titanrl.data.prompt import PromptEncoder
from titanrl.data.shadow import BadSample, Materialized, SampleMeta, build_loader
from titanrl.distributed import (DistInfo, all_gather_objects, all_reduce_max, all_reduce_sum, build_dp_mesh,
                                 build_ulysses_groups, new_world_group)
from titanrl.metrics import MetricsLogger, format_summary
from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, load_hf_weights
from titanrl.optim import build_lr_scheduler, build_optimizer
from titanrl.parallel.balance import karmarkar_karp
from titanrl.parallel.parallelize import CompileOptions, parallelize_qwen2_5_vl
from titanrl.parallel.ulysses import resolve_ulysses
from titanrl.rl.batch import Trajectory, dummy_pack, pack_trajectories
from titanrl.rl.dump import dump_step
from titanrl.rl.grpo import build_policy_loss, count_uniform_groups, group_advantages
from titanrl.rl.exchange import VisionBalancing
from titanrl.rl.slice_loading import StepSlices
from titanrl.rl.stages import StageRunner, build_cost_model
from titanrl.rl.timing import StageTimer, busy_clock, busy_metrics
from titanrl.rl.reward_runner import RewardRunner, reward_metrics, reward_sums
from titanrl.rl.weight_sync import WeightPusher
from titanrl.rollout import RolloutRequest, build_rollout_engine, mm_limits_for, probe_logprobs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
        cfg.validate_world_size(info.world_size)
        if info.is_main:
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            save_resolved(cfg, cfg.run_dir / "config.toml")
        torch.manual_seed(cfg.job.seed)

        self.model_dir = assets.model_dir(cfg, info)
        self.manifest = assets.manifest_path(cfg, info)
        self.records: list[SampleRecord] = read_manifest(self.manifest, check_files=False)
        self.encoder = PromptEncoder.from_pretrained(self.model_dir)
        self.rewards = RewardRunner(cfg.rl.reward, timeout_s=cfg.rl.reward_timeout_s, workers=cfg.rl.reward_workers,
                                    on_error=cfg.rl.on_reward_error)

        self.args = Qwen2_5_VLArgs.from_pretrained(self.model_dir)
        self.param_dtype = _DTYPES[cfg.model.dtype]
        # Ulysses degrees against the model's head counts: an impossible one stops the run here,
        # before any model or engine is built.
        self.ulysses = resolve_ulysses(cfg.parallelism, self.args.text, info.world_size)
        if info.is_main and self.ulysses.message:
            say(f"[titanrl] {self.ulysses.message}")
        mesh = build_dp_mesh(info)
        self.model = self._build_model(mesh, trainable=True)
        self.ref_model = self._build_model(mesh, trainable=False) if cfg.rl.kl_coef > 0 else None
        cost_model = build_cost_model(self.args, cfg.balance.cost_model)
        self.stages = StageRunner(
            args=self.args, rank=info.rank, world=info.world_size, device=info.device, dtype=self.param_dtype,
            method=self.ulysses.method, strategy=cfg.balance.strategy, max_tokens=cfg.balance.max_tokens_per_microbatch,
            reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
            cost_model=cost_model, p_max=self.ulysses.p_max,
            degree=self.ulysses.degree, attn_backend=cfg.model.attn_backend, shared_prefix=cfg.rl.shared_prefix,
            groups=build_ulysses_groups(info.rank, info.world_size, self.ulysses.degrees, info.device)
            if info.distributed else {},
            vision=VisionBalancing(
                enabled=cfg.parallelism.vision_balance and info.distributed, cost_model=cost_model,
                group=new_world_group(info) if cfg.parallelism.vision_balance and info.distributed else None),
        )
        self.policy_loss = build_policy_loss(cfg.rl)
        if cfg.compile.enable and "loss" in cfg.compile.components:
            self.policy_loss = torch.compile(self.policy_loss, backend=cfg.compile.backend, dynamic=cfg.compile.dynamic)
        self.probe_violations = 0
        self.optimizer = build_optimizer(cfg, self.model.parameters())
        self.lr_scheduler = build_lr_scheduler(cfg, self.optimizer)

        self.engine = build_rollout_engine(cfg, self.model_dir, info.rank, mm_limits=mm_limits_for(self.records))
        # The loader (ShadowLoader by default, or the centralized baseline) plans every step's global
        # batch from metadata on every rank and materializes only this rank's prompts, ahead of use.
        self.loader = build_loader(cfg, info, self.model_dir, self.manifest, assign=self.assign_prompts,
                                   encoder=self.encoder)
        self.pusher = WeightPusher(cfg.job.name, self.args, self.model_dir, info, self.param_dtype)
        m = cfg.metrics
        self.metrics = MetricsLogger(
            cfg.run_dir, enabled=info.is_main, jsonl=m.jsonl, tensorboard=m.tensorboard, total_steps=cfg.job.steps,
            progress=m.progress, wandb=m.wandb, wandb_project=m.wandb_project, wandb_mode=m.wandb_mode,
            run_name=cfg.job.name, config=config_to_dict(cfg),
        )
        self.skips = SkipCounter()
        self.step = 0
        self.checkpointer = build_checkpoint_manager(
            cfg,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=CallbackState(self.loader.state_dict, self.loader.load_state_dict),
            extra_states={
                "trainer": CallbackState(lambda: {"step": self.step}, self._load_trainer_state),
                "rng": RNGState(info.rank),
            },
        )
        if cfg.checkpoint.enable and cfg.checkpoint.resume and self.checkpointer.load():
            # The engine started from the initial checkpoint: give it the resumed weights.
            self.pusher.push(self.model, self.engine)
            if info.is_main:
                say(f"[titanrl] resumed from step {self.step}")
        self.first_step = self.step + 1  # of this process (a resumed run starts past 1)
        self.history: list[dict[str, float]] = []  # every step's metrics, for the end-of-run summary

    def _build_model(self, mesh, *, trainable: bool) -> Qwen2_5_VLModel:
        cfg = self.cfg
        model = Qwen2_5_VLModel(self.args)
        load_hf_weights(model, self.model_dir)
        model.set_attention_backend(cfg.model.attn_backend)
        model.to(self.info.device)
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        return parallelize_qwen2_5_vl(
            model,
            dp_mesh=mesh,
            compile_options=CompileOptions(
                enable=trainable and cfg.compile.enable and "model" in cfg.compile.components,
                backend=cfg.compile.backend,
                dynamic=cfg.compile.dynamic,
            ),
            activation_checkpoint=cfg.parallelism.activation_checkpoint if trainable else "none",
            param_dtype=self.param_dtype,
            reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
            ulysses=self.ulysses.method in ("fixed", "flex"),
        )

    # ------------------------------------------------------------------ state

    def _load_trainer_state(self, state: dict) -> None:
        self.step = int(state["step"])

    # ------------------------------------------------------------------ data

    def assign_prompts(self, metas: list[SampleMeta], world: int) -> list[list[int]]:
        """Split a global batch across ranks' engines by estimated cost — prompt tokens with
        every image/video expanded (from file headers) plus the expected responses — with
        Karmarkar-Karp, so one video-heavy rank does not stall the others. Positions in the
        global batch (not the split) decide seeds, groups and minibatches."""
        expected_response = self.cfg.rollout.n * self.cfg.rollout.max_new_tokens
        costs = [m.num_tokens * self.cfg.rollout.n + expected_response for m in metas]
        return [sorted(p) for p in karmarkar_karp(costs, world, equal_size=False)]

    def next_prompts(self) -> list[tuple[int, PreparedSample]]:
        """This rank's (global position, prepared prompt) for the step; bad samples are counted
        and reported (with data.on_bad_sample = "error" the loader raises, naming the sample)."""
        step = self.loader.next_step()
        prompts = []
        for item in step.materialize():
            if isinstance(item, Materialized):
                prompts.append((item.position, item.as_prepared()))
            else:
                assert isinstance(item, BadSample)
                self.skips.add(item.reason)
                say(f"[titanrl] rank {self.info.rank}: skipping sample {item.sample_id!r}: {item.reason}: "
                f"{item.detail}")
        self.data_wait_s = step.wait_s
        self.data_step = step
        return prompts

    # ------------------------------------------------------------------ stages

    def rollout(self, prompts: list[tuple[int, PreparedSample]]) -> list[Trajectory]:
        r = self.cfg.rollout
        # Seeds depend on the step and each prompt's global position, never on the rank that
        # samples it: any world size draws the same responses.
        requests = [
            RolloutRequest.from_prepared(p, self.encoder, key=f"{pos}:{p.record.id}") for pos, p in prompts
        ]
        seed = (r.seed if r.seed is not None else self.cfg.job.seed) * 1_000_003 + self.step
        results = self.engine.generate(
            requests, n=r.n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, seed=seed
        ) if requests else []
        trajs = []
        for (group, prompt), samples in zip(prompts, results):
            for k, s in enumerate(samples):
                text = self.encoder.tokenizer.decode(s.token_ids, skip_special_tokens=True)
                trajs.append(Trajectory(
                    prompt=prompt, group=group, response_index=k, response_ids=np.asarray(s.token_ids, dtype=np.int64),
                    rollout_logprobs=np.asarray(s.logprobs, dtype=np.float32), finish_reason=s.finish_reason,
                    response_text=text,
                ))
        return trajs

    def score(self, trajs: list[Trajectory]) -> None:
        self.reward_results = self.rewards.score([(t.response_text, t.prompt.record) for t in trajs])
        for t, result in zip(trajs, self.reward_results):
            t.reward = result.score
            if result.correct is not None:
                t.extras["correct"] = result.correct
        if trajs:
            adv = group_advantages(
                torch.tensor([t.reward for t in trajs]), torch.tensor([t.group for t in trajs]),
                std_normalize=self.cfg.rl.std_normalize,
            )
            for t, a in zip(trajs, adv.tolist()):
                t.advantage = a

    def compute_logprobs(self, model, attr: str, ids: list[int] | None = None) -> None:
        """``traj.<attr>`` for every trajectory of this rank (or those among the stage ids ``ids``),
        computed wherever the stage plan places its tokens (whole, or sharded across a Ulysses group)."""
        self.stages.logprobs(model, attr, temperature=self.cfg.rollout.temperature, ids=ids)

    @property
    def old_from_first_forward(self) -> bool:
        """rl.old_logprobs = auto with one PPO epoch: the first minibatch's forward is the old policy."""
        return self.cfg.rl.old_logprobs == "auto" and self.cfg.rl.ppo_epochs == 1

    def old_logprob_ids(self) -> list[int]:
        """The stage ids whose old log-probs need their own pass."""
        ids = self.stages.all_ids()
        if not self.old_from_first_forward:
            return ids
        first = set(self.stages.minibatch_ids(0, self.cfg.rl.minibatches))
        return [i for i in ids if i not in first]

    def _loss(self, out, inputs, global_tokens: float, global_seqs: float):
        ref = inputs.fields.get("ref_logprobs")
        # no old log-probs moved: this forward is the old policy's (old_from_first_forward), ratio 1
        old = inputs.fields["old_logprobs"] if "old_logprobs" in inputs.fields else out.logprobs.detach()
        return self.policy_loss(out.logprobs, old, inputs.advantages, inputs.seq_index,
                                inputs.seq_lengths, global_tokens=global_tokens, global_seqs=global_seqs,
                                ref_logp=ref, entropy=out.entropy)

    def update(self) -> dict[str, float]:
        cfg, rl = self.cfg, self.cfg.rl
        fields = ("old_logprobs", "ref_logprobs") if self.ref_model is not None else ("old_logprobs",)
        sums = {"pg_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "grad_norm": 0.0}
        steps = 0
        for epoch in range(rl.ppo_epochs):
            for m in range(rl.minibatches):
                ids = self.stages.minibatch_ids(m, rl.minibatches)
                first = epoch == 0 and m == 0 and self.old_from_first_forward
                use = tuple(f for f in fields if f != "old_logprobs") if first else fields
                for res in self.stages.train_minibatch(self.model, ids, use, self._loss,
                                                       temperature=cfg.rollout.temperature):
                    for k in ("pg_loss", "kl", "clip_fraction", "entropy"):
                        sums[k] += getattr(res, k).item()
                max_norm = cfg.optimizer.max_grad_norm or float("inf")
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
                sums["grad_norm"] += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                steps += 1
        self.lr_scheduler.step()
        reduced = all_reduce_sum(torch.tensor([sums["pg_loss"], sums["kl"], sums["clip_fraction"], sums["entropy"]],
                                              dtype=torch.float64))
        return {
            "loss": reduced[0].item() / steps, "kl": reduced[1].item() / steps,
            "clip_fraction": reduced[2].item() / steps, "entropy": reduced[3].item() / steps,
            "grad_norm": sums["grad_norm"] / steps, "lr": self.lr_scheduler.get_last_lr()[0],
        }

    def probe(self, trajs: list[Trajectory]) -> float:
        """max |vLLM - trainer| log-prob of a fixed response after the push (-1: nothing to probe).
        Every rank runs the trainer forward (FSDP collectives); ranks without data run a dummy."""
        t = trajs[0] if trajs else None
        with torch.no_grad():
            if t is None:
                self.model(dummy_pack(self.args, self.info.device, self.param_dtype).batch)
                return -1.0
            request = RolloutRequest.from_prepared(t.prompt, self.encoder)
            # engines report untempered log-probs
            pack = pack_trajectories([t], self.args, self.info.device, self.param_dtype, temperature=1.0)
            ours = self.model(pack.batch, pack.targets).logprobs.float().cpu()
        theirs = torch.tensor(probe_logprobs(self.engine, request, t.response_ids.tolist()))
        return float((ours - theirs).abs().max()) if len(theirs) else 0.0

    def check_probe(self, diff: float) -> None:
        """Warn when the engine and the trainer disagree beyond ``rollout.probe_tolerance``; stop after
        ``rollout.probe_max_violations`` consecutive violations (the weights in the engine are not the
        ones being trained, or the two compute differently)."""
        r = self.cfg.rollout
        if diff <= r.probe_tolerance:
            self.probe_violations = 0
            return
        self.probe_violations += 1
        if self.info.is_main:
            say(f"[titanrl] warning: step {self.step}: vLLM and trainer log-probs differ by {diff:.3g} "
                  f"(> rollout.probe_tolerance={r.probe_tolerance}), {self.probe_violations} time(s) in a row")
        if r.probe_max_violations and self.probe_violations >= r.probe_max_violations:
            raise RuntimeError(
                f"the weight-sync probe exceeded rollout.probe_tolerance={r.probe_tolerance} in "
                f"{self.probe_violations} consecutive checks (last: {diff:.3g}): the rollout engine does not "
                "compute with the trained weights; raise the tolerance only if the two sides use different "
                "kernels or dtypes on purpose")

    # ------------------------------------------------------------------ step

    def rl_step(self) -> dict[str, float]:
        t_step = time.perf_counter()
        timer = StageTimer(self.info.rank, self.cfg.job.collective_timeout_s, clock=busy_clock(self.info.device))
        with timer("data"):
            prompts = self.next_prompts()
        self.model.eval()
        with timer("rollout"):
            trajs = self.rollout(prompts)
        with timer("reward"):
            self.score(trajs)
            # every rank learns every trajectory's metadata; with slice loading the frames a rank
            # encodes come from the step's preprocessors, not from the prompt's home
            self.stages.begin_step(trajs, StepSlices(self.data_step) if self.cfg.data.slice_loading else None)
        with timer("old_logprob"):
            old_ids = self.old_logprob_ids()
            self.compute_logprobs(self.model, "old_logprobs", old_ids)
        if self.ref_model is not None:
            with timer("ref_logprob"):
                self.compute_logprobs(self.ref_model, "ref_logprobs")
        self.model.train()
        with timer("update"):
            stats = self.update()
        self.model.eval()
        with timer("weight_sync"):
            stats.update(self.pusher.push(self.model, self.engine))
        self.step += 1
        if self.cfg.metrics.dump_tensors:
            dump_step(self.cfg.run_dir, self.step, trajs, {"policy": self.model}, is_main=self.info.is_main)
        probe_every = self.cfg.rollout.probe_every
        if probe_every and self.step % probe_every == 0:
            diff = float(all_reduce_max(self.probe(trajs)))
            stats["probe/logprob_max_diff"] = diff
            self.check_probe(diff)

        # a prompt's group is generated and scored on one rank, so groups can be counted locally
        uniform, groups = count_uniform_groups([t.reward for t in trajs], [t.group for t in trajs])
        local = torch.tensor([
            sum(t.reward for t in trajs), 0.0, float(len(trajs)),  # slot 1 unused: reward_metrics below
            float(sum(t.num_response_tokens for t in trajs)), float(sum(t.num_tokens for t in trajs)),
            float(self.skips.total()), float(uniform), float(groups),
        ], dtype=torch.float64)
        total = all_reduce_sum(local)
        n = max(total[2].item(), 1.0)
        step_time = sum(v for k, v in timer.times.items())
        stats.update(self.stages.metrics())
        # share of trajectories whose old log-probs took a pass of their own (rl.old_logprobs)
        stats["rl/old_logprob_pass_fraction"] = len(old_ids) / max(len(self.stages.all_ids()), 1)
        # every rank's busy seconds per stage: the step time a perfect schedule would reach
        stats.update(busy_metrics(all_gather_objects(timer.busy)))
        stats["step/wall_s"] = all_reduce_max(time.perf_counter() - t_step)
        if self.cfg.data.loader == "shadow":
            stats.update(host_metrics(all_gather_objects(dict(self.data_step.fetch_counts))))
        return {
            "reward/mean": total[0].item() / n,
            **reward_metrics(all_gather_objects(reward_sums(self.reward_results))),  # accuracy, errors, extras
            # groups whose responses all scored the same: no gradient from them this step
            "reward/uniform_group_fraction": total[6].item() / max(total[7].item(), 1.0),
            "response/length_mean": total[3].item() / n,
            **stats,
            "throughput/tokens_per_s": total[4].item() / max(step_time, 1e-9),
            "data/skipped": total[5].item(),
            **{k: all_reduce_max(v) for k, v in timer.times.items()},
        }

    def train(self) -> list[dict[str, float]]:
        history = self.history
        try:
            while self.step < self.cfg.job.steps:
                metrics = self.rl_step()
                history.append(metrics)
                if self.step % self.cfg.metrics.log_freq == 0 or self.step == self.cfg.job.steps:
                    self.metrics.log(self.step, metrics)
                self.checkpointer.save(self.step, last_step=self.step == self.cfg.job.steps)
            self.checkpointer.maybe_wait_for_saving()
            if self.cfg.checkpoint.export_hf:
                self.export_hf(self.cfg.run_dir / "hf")
        except BaseException:
            # the other ranks may be anywhere (in a collective, or failing too): wait for none of them
            self.close(collective=False)
            raise
        self.close()
        return history

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
        return format_summary(self.history, self.first_step, wall_s, places)

    def export_hf(self, outdir) -> None:
        """The trained policy as an HF directory (original Qwen2.5-VL names + tokenizer/processor)
        that transformers and vLLM load."""
        from titanrl.rl.weight_sync import write_hf

        write_hf(self.model, self.args, outdir, dtype=self.param_dtype, writer_rank=self.info.is_main,
                 assets_from=self.model_dir)
        if self.info.is_main:
            say(f"[titanrl] exported the policy to {outdir}")

    def close(self, *, collective: bool = True) -> None:
        self.metrics.close()
        self.checkpointer.close()
        self.loader.close(collective=collective)
        self.engine.close()
        self.pusher.close()


def host_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Where the step's media came from, over ranks (ShadowLoader's fetch counts): whole samples from
    the rank's own host's preprocessor or another host's, slice frames likewise, and how many ranks
    fetched from their own host's preprocessor."""
    def total(key: str) -> float:
        return float(sum(c.get(key, 0.0) for c in per_rank))

    return {
        "data/samples_same_host": total("samples_local"),
        "data/samples_cross_host": total("samples_remote"),
        "data/ranks_fetching_same_host": float(sum(c.get("samples_local", 0.0) > 0 for c in per_rank)),
        "vision/frames_same_host": total("slice_frames_local"),
        "vision/frames_cross_host": total("slice_frames_remote"),
    }

