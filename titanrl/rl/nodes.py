"""The built-in workflow nodes: each is ``fn(batch, ctx) -> StepBatch | None`` and holds one stage's mechanics.

``ctx`` is the run's set-up (``titanrl.trainer.Trainer``): the config, the models, the rollout engine, the
loader, the stage runner. ``batch`` is this rank's share of the step (``titanrl.workflow.executor.StepBatch``).

- ``load_prompts``: the loader's step (planned on every rank from metadata) and this rank's prepared prompts;
- ``generate``: ``rollout.n`` responses per prompt from the rank's engine, seeded by global position;
- ``score``: the reward of every response (on the rank that generated it);
- ``group_advantages``: GRPO advantages per prompt group (a group is generated and scored on one rank);
- ``old_logprobs`` / ``ref_logprobs``: per-token log-probs of the policy / the reference wherever the stage plan
  places the tokens (the model stages first learn every trajectory's metadata: ``stage_inputs``);
- ``train_actor``: ``ppo_epochs`` x ``minibatches`` optimizer steps on the PPO-clip objective;
- ``push_weights``: the new weights into the engines, and the probe every ``rollout.probe_every`` steps.
"""

from __future__ import annotations

import numpy as np
import torch

from titanrl.console import say
from titanrl.data.shadow import BadSample, Materialized
from titanrl.distributed import all_reduce_max, all_reduce_sum
from titanrl.rl.batch import Trajectory, dummy_pack, pack_trajectories
from titanrl.rl.grpo import group_advantages as grpo_advantages
from titanrl.rl.rewards import exact_match
from titanrl.rl.slice_loading import StepSlices
from titanrl.rollout import RolloutRequest, probe_logprobs


# ---------------------------------------------------------------------------------- data, rollout, reward

def load_prompts(batch, ctx):
    """This rank's (global position, prepared prompt) pairs of the step; bad samples are counted and reported
    (with data.on_bad_sample = "error" the loader raises, naming the sample)."""
    step = ctx.loader.next_step()
    for item in step.materialize():
        if isinstance(item, Materialized):
            batch.prompts.append((item.position, item.as_prepared()))
        else:
            assert isinstance(item, BadSample)
            ctx.skips.add(item.reason)
            say(f"[titanrl] rank {ctx.info.rank}: skipping sample {item.sample_id!r}: {item.reason}: {item.detail}")
    batch.media = step
    ctx.model.eval()


def generate(batch, ctx):
    r = ctx.cfg.rollout
    # Seeds depend on the step and each prompt's global position, never on the rank that samples it: any
    # world size draws the same responses.
    requests = [RolloutRequest.from_prepared(p, ctx.encoder, key=f"{pos}:{p.record.id}") for pos, p in batch.prompts]
    seed = (r.seed if r.seed is not None else ctx.cfg.job.seed) * 1_000_003 + ctx.step
    results = ctx.engine.generate(
        requests, n=r.n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, seed=seed
    ) if requests else []
    for (group, prompt), samples in zip(batch.prompts, results):
        for k, s in enumerate(samples):
            text = ctx.encoder.tokenizer.decode(s.token_ids, skip_special_tokens=True)
            batch.trajectories.append(Trajectory(
                prompt=prompt, group=group, response_index=k, response_ids=np.asarray(s.token_ids, dtype=np.int64),
                rollout_logprobs=np.asarray(s.logprobs, dtype=np.float32), finish_reason=s.finish_reason,
                response_text=text,
            ))


def score(batch, ctx):
    for t in batch.trajectories:
        t.reward = float(ctx.reward_fn(t.response_text, t.prompt.record))
        t.extras["correct"] = exact_match(t.response_text, t.prompt.record)


def group_advantages(batch, ctx):
    trajs = batch.trajectories
    if trajs:
        adv = grpo_advantages(torch.tensor([t.reward for t in trajs]), torch.tensor([t.group for t in trajs]),
                              std_normalize=ctx.cfg.rl.std_normalize)
        for t, a in zip(trajs, adv.tolist()):
            t.advantage = a


# ---------------------------------------------------------------------------------- model stages

def stage_inputs(batch, ctx) -> None:
    """Before the first model stage over these trajectories: every rank learns every trajectory's metadata (one
    all-gather); with slice-aware loading the frames a rank encodes come from the step's preprocessors through
    ``batch.media``, not from the prompt's home (the data coordinator's part of the model stages)."""
    key = (batch.step, tuple((t.group, t.response_index) for t in batch.trajectories))
    if getattr(ctx, "_stage_key", None) == key:
        return
    slices = StepSlices(batch.media) if ctx.cfg.data.slice_loading else None
    ctx.stages.begin_step(batch.trajectories, slices)
    ctx._stage_key = key


def old_from_first_forward(cfg) -> bool:
    """rl.old_logprobs = auto with one PPO epoch: the first minibatch's forward is the old policy."""
    return cfg.rl.old_logprobs == "auto" and cfg.rl.ppo_epochs == 1


def old_logprobs(batch, ctx):
    stage_inputs(batch, ctx)
    ids = ctx.stages.all_ids()
    if old_from_first_forward(ctx.cfg):
        first = set(ctx.stages.minibatch_ids(0, ctx.cfg.rl.minibatches))
        ids = [i for i in ids if i not in first]
    ctx.stages.logprobs(ctx.model, "old_logprobs", temperature=ctx.cfg.rollout.temperature, ids=ids)
    # share of trajectories whose old log-probs took a pass of their own (rl.old_logprobs)
    batch.metrics["rl/old_logprob_pass_fraction"] = len(ids) / max(len(ctx.stages.all_ids()), 1)


def ref_logprobs(batch, ctx):
    stage_inputs(batch, ctx)
    ctx.stages.logprobs(ctx.ref_model, "ref_logprobs", temperature=ctx.cfg.rollout.temperature)


def _loss(ctx):
    def loss(out, inputs, global_tokens: float, global_seqs: float):
        ref = inputs.fields.get("ref_logprobs")
        # no old log-probs moved: this forward is the old policy's (old_from_first_forward), ratio 1
        old = inputs.fields["old_logprobs"] if "old_logprobs" in inputs.fields else out.logprobs.detach()
        return ctx.policy_loss(out.logprobs, old, inputs.advantages, inputs.seq_index, inputs.seq_lengths,
                               global_tokens=global_tokens, global_seqs=global_seqs, ref_logp=ref,
                               entropy=out.entropy)
    return loss


def train_actor(batch, ctx):
    stage_inputs(batch, ctx)
    cfg, rl = ctx.cfg, ctx.cfg.rl
    ctx.model.train()
    fields = ("old_logprobs", "ref_logprobs") if ctx.ref_model is not None else ("old_logprobs",)
    sums = {"pg_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    steps = 0
    loss_fn = _loss(ctx)
    for epoch in range(rl.ppo_epochs):
        for m in range(rl.minibatches):
            ids = ctx.stages.minibatch_ids(m, rl.minibatches)
            first = epoch == 0 and m == 0 and old_from_first_forward(cfg)
            use = tuple(f for f in fields if f != "old_logprobs") if first else fields
            for res in ctx.stages.train_minibatch(ctx.model, ids, use, loss_fn, temperature=cfg.rollout.temperature):
                for k in ("pg_loss", "kl", "clip_fraction", "entropy"):
                    sums[k] += getattr(res, k).item()
            max_norm = cfg.optimizer.max_grad_norm or float("inf")
            norm = torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), max_norm)
            sums["grad_norm"] += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            ctx.optimizer.step()
            ctx.optimizer.zero_grad(set_to_none=True)
            steps += 1
    ctx.lr_scheduler.step()
    reduced = all_reduce_sum(torch.tensor([sums["pg_loss"], sums["kl"], sums["clip_fraction"], sums["entropy"]],
                                          dtype=torch.float64))
    ctx.model.eval()
    batch.metrics.update({
        "loss": reduced[0].item() / steps, "kl": reduced[1].item() / steps,
        "clip_fraction": reduced[2].item() / steps, "entropy": reduced[3].item() / steps,
        "grad_norm": sums["grad_norm"] / steps, "lr": ctx.lr_scheduler.get_last_lr()[0],
    })


# ---------------------------------------------------------------------------------- weights

def push_weights(batch, ctx):
    batch.metrics.update(ctx.pusher.push(ctx.model, ctx.engine))
    probe_every = ctx.cfg.rollout.probe_every
    if probe_every and (ctx.step + 1) % probe_every == 0:
        diff = float(all_reduce_max(probe(batch.trajectories, ctx)))
        batch.metrics["probe/logprob_max_diff"] = diff
        check_probe(diff, ctx)


def probe(trajs, ctx) -> float:
    """max |engine - trainer| log-prob of a fixed response after the push (-1: nothing to probe). Every rank runs
    the trainer forward (FSDP collectives); ranks without data run a dummy."""
    t = trajs[0] if trajs else None
    with torch.no_grad():
        if t is None:
            ctx.model(dummy_pack(ctx.args, ctx.info.device, ctx.param_dtype).batch)
            return -1.0
        request = RolloutRequest.from_prepared(t.prompt, ctx.encoder)
        # engines report untempered log-probs
        pack = pack_trajectories([t], ctx.args, ctx.info.device, ctx.param_dtype, temperature=1.0)
        ours = ctx.model(pack.batch, pack.targets).logprobs.float().cpu()
    theirs = torch.tensor(probe_logprobs(ctx.engine, request, t.response_ids.tolist()))
    return float((ours - theirs).abs().max()) if len(theirs) else 0.0


def check_probe(diff: float, ctx) -> None:
    """Warn when the engine and the trainer disagree beyond ``rollout.probe_tolerance``; stop after
    ``rollout.probe_max_violations`` consecutive violations (the weights in the engine are not the ones being
    trained, or the two compute differently)."""
    r = ctx.cfg.rollout
    if diff <= r.probe_tolerance:
        ctx.probe_violations = 0
        return
    ctx.probe_violations += 1
    if ctx.info.is_main:
        say(f"[titanrl] warning: step {ctx.step + 1}: vLLM and trainer log-probs differ by {diff:.3g} "
            f"(> rollout.probe_tolerance={r.probe_tolerance}), {ctx.probe_violations} time(s) in a row")
    if r.probe_max_violations and ctx.probe_violations >= r.probe_max_violations:
        raise RuntimeError(
            f"the weight-sync probe exceeded rollout.probe_tolerance={r.probe_tolerance} in "
            f"{ctx.probe_violations} consecutive checks (last: {diff:.3g}): the rollout engine does not "
            "compute with the trained weights; raise the tolerance only if the two sides use different "
            "kernels or dtypes on purpose")
