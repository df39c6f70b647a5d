"""The built-in workflow nodes: each is ``fn(batch, ctx) -> StepBatch | None`` and holds one stage's mechanics.

``ctx`` is what nodes use of the run's set-up (``titanrl.workflow.context.NodeContext``): the config, the models,
the rollout engine, the loader, the stage runner, and ``ctx.state``, what they carry from step to step. ``batch`` is this rank's share of the step (``titanrl.workflow.executor.StepBatch``).

- ``load_prompts``: the loader's step (planned on every rank from metadata) and this rank's prepared prompts;
- ``generate``: ``rollout.n`` responses per prompt from the rank's engine, seeded by global position; then the
  engine sleeps (``rollout.sleep``: a no-op where it is off) until its next call;
- ``score``: the reward of every response (on the rank that generated it);
- ``group_advantages``: GRPO advantages per prompt group (a group is generated and scored on one rank);
- ``old_logprobs`` / ``ref_logprobs``: per-token log-probs of the policy / the reference wherever the stage plan
  places the tokens (the model stages first learn every trajectory's metadata: ``stage_inputs``);
- ``train_actor``: ``ppo_epochs`` x ``minibatches`` optimizer steps on the PPO-clip objective;
- ``push_weights``: the new weights into the engines, and the probe every ``rollout.probe_every`` steps;
- PPO: ``critic_values`` (the critic's value of the state before each response token), ``gae_advantages``
  (per-token GAE advantages, whitened over the step, and returns) and ``train_critic`` (the clipped value loss).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import torch

from titanrl.console import say
from titanrl.data.shadow import BadSample, Materialized
from titanrl.distributed import all_gather_objects, all_reduce_max, all_reduce_sum
from titanrl.models.lora import adapters_disabled
from titanrl.parallel.odc import forward_scope
from titanrl.parallel.odc_comm import attached
from titanrl.parallel.ulysses import sum_over_members
from titanrl.rl.batch import Trajectory, dummy_pack, pack_trajectories
from titanrl.rl.grpo import ValueLossOutput, aggregate
from titanrl.rl.grpo import group_advantages as grpo_advantages
from titanrl.rl.grpo import rloo_advantages
from titanrl.rl.rewards import overlong_penalty
from titanrl.rl.slice_loading import StepSlices
from titanrl.rl.turns import rollout_turns, trajectory_score
from titanrl.rollout import RolloutRequest


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
    if ctx.model is not None:
        ctx.model.eval()


def generate(batch, ctx):
    r = ctx.cfg.rollout
    # Seeds depend on the batch's step and each prompt's global position, never on the rank that samples it
    # (any world size draws the same responses) nor on when it is generated (asynchronous runs generate ahead).
    requests = [RolloutRequest.from_prepared(p, ctx.encoder, key=f"{pos}:{p.record.id}") for pos, p in batch.prompts]
    sampling = dict(temperature=r.temperature, top_p=r.top_p,
                    seed=(r.seed if r.seed is not None else ctx.cfg.job.seed) * 1_000_003 + batch.step)
    budget = min(r.tokens_per_update or r.max_new_tokens, r.max_new_tokens)
    if ctx.turns is not None:  # multi-turn: the environment answers each turn (titanrl.rl.turns)
        carried = _carried(ctx) if r.tokens_per_update else {}
        episodes, stats = rollout_turns(ctx.engine, ctx.encoder, ctx.turns, batch.prompts, requests, n=r.n,
                                        max_new_tokens=r.max_new_tokens, sampling=sampling, version=ctx.step,
                                        budget=r.tokens_per_update or None,
                                        carried=[e for es in carried.values() for e in es if not e.done])
        if ctx.engine is not None:
            ctx.engine.sleep()
        if r.tokens_per_update:  # the groups whose episodes have all ended are trained; the others wait
            episodes = _keep_unfinished({**carried, **episodes}, carried, batch, ctx, lambda e: e.done)
        trajs = [e.traj for es in episodes.values() for e in es]  # texts: each one's last turn
        stats.count(trajs)
        _turn_metrics(batch, stats)
        batch.trajectories += trajs
        return
    # (an engine over several ranks runs their prompts together: every rank of it calls, with prompts or none)
    results = ctx.engine.generate(requests, n=r.n, max_new_tokens=budget, **sampling) if ctx.engine is not None else []
    groups = {}
    for (group, prompt), samples in zip(batch.prompts, results):
        # the engine holds the weights of the updates done so far: that is every token's version
        groups[group] = [Trajectory(
            prompt=prompt, group=group, response_index=k, response_ids=np.asarray(s.token_ids, dtype=np.int64),
            rollout_logprobs=np.asarray(s.logprobs, dtype=np.float32), finish_reason=s.finish_reason,
            version=ctx.step, token_versions=np.full(len(s.token_ids), ctx.step, dtype=np.int32),
        ) for k, s in enumerate(samples)]
    if r.tokens_per_update:
        groups = continue_partial(groups, batch, ctx, sampling, budget)
    if ctx.engine is not None:  # rollout.sleep: its device memory to the training stages until its next call
        ctx.engine.sleep()
    for trajs in groups.values():
        for t in trajs:
            t.response_text = ctx.encoder.tokenizer.decode(t.response_ids.tolist(), skip_special_tokens=True)
            batch.trajectories.append(t)


def _turn_metrics(batch, stats) -> None:
    """The step's multi-turn counts over the ranks that generated (``rollout/*``). Each trajectory whose
    environment failed carries its message (``extras["env_error"]``): the step's metrics print the run's first."""
    sums = all_reduce_sum(torch.tensor(stats.metrics(), dtype=torch.float64), group=batch.group).tolist()
    longest = all_reduce_max(float(stats.context_tokens_max), group=batch.group)
    trajs, turns, calls, images, errors, continued, cached = sums
    batch.metrics.update({"rollout/turns_mean": turns / max(trajs, 1), "rollout/tool_calls": calls,
                          "rollout/images_per_trajectory": images / max(trajs, 1), "rollout/env_errors": errors,
                          "rollout/context_tokens_max": float(longest)})
    if continued:  # the share of the later turns' contexts the engine did not compute again (vLLM's prefix cache)
        batch.metrics["rollout/turn_prefix_cached"] = cached / continued
    for k, seconds in enumerate(stats.turn_seconds):  # the slowest generating rank's engine call of each turn
        batch.metrics[f"rollout/turn{k + 1}_s"] = all_reduce_max(seconds, group=batch.group)


def _finished(t, max_new_tokens: int) -> bool:
    return t.finish_reason == "stop" or len(t.response_ids) >= max_new_tokens


def continue_partial(fresh: dict, batch, ctx, sampling: dict, budget: int) -> dict:
    """Partial rollouts: the unfinished responses of the groups earlier steps left (``ctx.state.partial_rollouts``)
    continue with the engine's current weights, up to ``budget`` more tokens each; returns the groups whose
    responses have all finished (trained this step) and keeps the others for the next step (``_carried``: under
    new ids). Multi-turn: ``titanrl.rl.turns.rollout_turns`` continues them."""
    max_new = ctx.cfg.rollout.max_new_tokens
    carried = _carried(ctx)
    todo = [t for trajs in carried.values() for t in trajs if not _finished(t, max_new)]
    requests = [replace(RolloutRequest.from_prepared(t.prompt, ctx.encoder,
                                                     key=f"c{t.group}:{t.prompt.record.id}:{t.response_index}"),
                        response_prefix=tuple(int(x) for x in t.response_ids)) for t in todo]
    # one call, each response up to what it has left (every rank of an engine over several ranks calls, with its own
    # or none)
    limits = [min(budget, max_new - len(t.response_ids)) for t in todo]
    if ctx.engine is not None:
        for t, (s,) in zip(todo, ctx.engine.generate(requests, n=1, max_new_tokens=limits, **sampling)):
            t.response_ids = np.concatenate([t.response_ids, np.asarray(s.token_ids, dtype=np.int64)])
            t.rollout_logprobs = np.concatenate([t.rollout_logprobs, np.asarray(s.logprobs, dtype=np.float32)])
            t.token_versions = np.concatenate([t.token_versions, np.full(len(s.token_ids), ctx.step, dtype=np.int32)])
            t.finish_reason = s.finish_reason
    return _keep_unfinished({**carried, **fresh}, carried, batch, ctx, lambda t: _finished(t, max_new))


def _carried(ctx) -> dict:
    """The groups earlier steps left unfinished (``ctx.state.partial_rollouts``: trajectories, or multi-turn
    episodes), each under a new id in this step's batch (its id plus the global batch size: the same minibatch,
    since the batch size is a multiple of the minibatch count)."""
    size = ctx.cfg.rl.global_batch_size
    carried = {}
    for group, items in sorted(ctx.state.partial_rollouts.items()):
        for item in items:
            getattr(item, "traj", item).group = group + size
        carried[group + size] = items
    return carried


def _keep_unfinished(groups: dict, carried: dict, batch, ctx, finished) -> dict:
    """The groups whose items have all ``finished`` (trained this step); the others stay in
    ``ctx.state.partial_rollouts`` for the next step."""
    ready = {g: items for g, items in groups.items() if all(finished(i) for i in items)}
    ctx.state.partial_rollouts = {g: items for g, items in groups.items() if g not in ready}
    continued = sum(len(items) for g, items in ready.items() if g in carried)
    totals = all_reduce_sum(torch.tensor([continued, len(ctx.state.partial_rollouts)], dtype=torch.float64),
                            group=batch.group)
    batch.metrics["rollout/continued_responses"] = totals[0].item()  # trained responses begun in earlier steps
    batch.metrics["rollout/unfinished_groups"] = totals[1].item()  # groups left for the next step
    return ready


def score(batch, ctx):
    """``rl.reward`` on every response, in ``ctx.rewards``' worker processes (``titanrl.rl.reward_runner``): the
    score is ``t.reward`` (less rl.overlong_buffer's punishment); the whole result (correct, extras, error) is
    ``t.extras["reward"]`` for the metrics."""
    trajs = batch.trajectories
    rl, budget = ctx.cfg.rl, ctx.cfg.rollout.max_new_tokens
    results = ctx.rewards.score([(t.response_text, t.prompt.record) for t in trajs])
    for t, result in zip(trajs, results):
        t.reward = trajectory_score(t.extras, result.score)  # multi-turn: the environment's reward, or 0 if it failed
        t.extras["reward"] = result
        if rl.overlong_buffer:
            # multi-turn: each turn ends at max_new_tokens; the trajectory is punished as its longest turn
            t.extras["overlong_penalty"] = overlong_penalty(t.longest_turn, budget, rl.overlong_buffer,
                                                            rl.overlong_penalty)
            t.reward += t.extras["overlong_penalty"]


def group_advantages(batch, ctx):
    """Each response's advantage from its prompt group's rewards (rl.advantage: grpo, or rloo)."""
    trajs = batch.trajectories
    if trajs:
        rewards, groups = torch.tensor([t.reward for t in trajs]), torch.tensor([t.group for t in trajs])
        adv = (rloo_advantages(rewards, groups) if ctx.cfg.rl.advantage == "rloo"
               else grpo_advantages(rewards, groups, std_normalize=ctx.cfg.rl.std_normalize))
        for t, a in zip(trajs, adv.tolist()):
            t.advantage = a


# ---------------------------------------------------------------------------------- model stages

def stage_inputs(batch, ctx) -> None:
    """Before the first model stage over these trajectories: every rank learns every trajectory's metadata (one
    all-gather); with slice-aware loading the frames a rank encodes come from the step's preprocessors through
    ``batch.media``, not from the prompt's home (the data coordinator's part of the model stages)."""
    key = (batch.step, tuple((t.group, t.response_index) for t in batch.trajectories))
    if ctx.state.stage_key == key:
        return
    slices = StepSlices(batch.media) if ctx.cfg.data.slice_loading else None
    ctx.stages.begin_step(batch.trajectories, slices)
    ctx.state.stage_key = key


def old_from_first_forward(cfg) -> bool:
    """rl.old_logprobs = auto with one PPO epoch: the first minibatch's forward is the old policy (not with
    REINFORCE++, whose advantages need every old log-prob before the update; not with LoRA dropout, which the
    update's forward applies and the old policy's log-probs do not)."""
    return (cfg.rl.old_logprobs == "auto" and cfg.rl.ppo_epochs == 1 and cfg.rl.advantage != "reinforce++"
            and not (cfg.lora.enabled and cfg.lora.dropout > 0))


def per_token_advantages(cfg) -> bool:
    """Whether the advantages are per token (PPO's GAE, REINFORCE++), not one per response."""
    return cfg.rl.algorithm == "ppo" or cfg.rl.advantage == "reinforce++"


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
    # LoRA: the reference is the policy with its adapters off, lora.modules_to_save's base values swapped in (a
    # model without adapters runs as it is); under odc no rank may be reading another's shards meanwhile
    comm = attached(ctx.ref_model) if ctx.ref_model is not None else None
    quiesce = (lambda: torch.distributed.barrier(group=comm.pg)) if comm is not None else None
    with adapters_disabled(ctx.ref_model, quiesce=quiesce):
        ctx.stages.logprobs(ctx.ref_model, "ref_logprobs", temperature=ctx.cfg.rollout.temperature)


def _loss(ctx):
    per_response = ctx.cfg.rl.policy_loss == "gspo"  # one ratio per response: split ones need their parts' sums

    def loss(out, inputs, global_tokens: float, global_seqs: float):
        ref = inputs.fields.get("ref_logprobs")
        # no old log-probs moved: this forward is the old policy's (old_from_first_forward), ratio 1
        old = inputs.fields["old_logprobs"] if "old_logprobs" in inputs.fields else out.logprobs.detach()
        # PPO: per-token GAE advantages; GRPO: the response's advantage on each of its tokens
        adv = inputs.fields["advantages"] if "advantages" in inputs.fields else inputs.advantages
        split = {}
        if per_response and inputs.sharded_responses:
            split["response_sums"] = functools.partial(sum_over_members, spans=inputs.sharded_responses)
        return ctx.policy_loss(out.logprobs, old, adv, inputs.seq_index, inputs.seq_lengths,
                               global_tokens=global_tokens, global_seqs=global_seqs, ref_logp=ref,
                               entropy=out.entropy, behaviour_logp=inputs.fields.get("rollout_logprobs"), **split)
    return loss


def train_actor(batch, ctx):
    stage_inputs(batch, ctx)
    cfg, rl = ctx.cfg, ctx.cfg.rl
    ctx.model.train()
    fields = ("old_logprobs", "ref_logprobs") if ctx.ref_model is not None else ("old_logprobs",)
    if per_token_advantages(cfg):
        fields += ("advantages",)
    if ctx.behaviour_weighted:  # the behaviour policy's log-probs (the engine's) for the decoupled objective
        fields += ("rollout_logprobs",)
    sums = {"pg_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "grad_norm": 0.0,
            "behaviour_weight": 0.0, "behaviour_truncated": 0.0}
    steps = 0
    loss_fn = _loss(ctx)
    for epoch in range(rl.ppo_epochs):
        for m in range(rl.minibatches):
            # rl.mask_truncated: the responses the engine cut take no part (every rank drops the same ones)
            ids = ctx.stages.minibatch_ids(m, rl.minibatches, truncated=not rl.mask_truncated)
            if not ids:  # every response of the minibatch was cut: no gradient, no optimizer step
                continue
            first = epoch == 0 and m == 0 and old_from_first_forward(cfg)
            use = tuple(f for f in fields if f != "old_logprobs") if first else fields
            for res in ctx.stages.train_minibatch(ctx.model, ids, use, loss_fn, temperature=cfg.rollout.temperature):
                for k in ("pg_loss", "kl", "clip_fraction", "entropy", "behaviour_weight", "behaviour_truncated"):
                    if getattr(res, k) is not None:
                        sums[k] += getattr(res, k).item()
            max_norm = cfg.optimizer.max_grad_norm or float("inf")
            norm = torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), max_norm)
            sums["grad_norm"] += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            ctx.optimizer.step()
            ctx.optimizer.zero_grad(set_to_none=True)
            steps += 1
    ctx.lr_scheduler.step()
    reduced = all_reduce_sum(torch.tensor([sums["pg_loss"], sums["kl"], sums["clip_fraction"], sums["entropy"],
                                           sums["behaviour_weight"], sums["behaviour_truncated"]],
                                          dtype=torch.float64), group=batch.group)
    ctx.model.eval()
    trained, steps = steps > 0, max(steps, 1)
    batch.metrics.update({
        "loss": reduced[0].item() / steps, "kl": reduced[1].item() / steps,
        "clip_fraction": reduced[2].item() / steps, "entropy": reduced[3].item() / steps,
        "grad_norm": sums["grad_norm"] / steps, "lr": ctx.lr_scheduler.get_last_lr()[0],
    })
    if rl.mask_truncated:
        batch.metrics["train/masked_truncated"] = float(sum(m.truncated for m in ctx.stages.metas))
    if ctx.behaviour_weighted and trained:  # the truncated importance weights' mean, the share at the cap (gspo:
        # responses); none where rl.mask_truncated left no minibatch to train
        batch.metrics["rl/behaviour_weight_mean"] = reduced[4].item() / steps
        batch.metrics["rl/behaviour_weight_truncated"] = reduced[5].item() / steps


# ---------------------------------------------------------------------------------- weights

def push_weights(batch, ctx):
    """Every rank: the trained weights into every engine, then (every ``rollout.probe_every`` steps) the probe."""
    batch.metrics.update(ctx.pusher.push(ctx.model, ctx.engine))
    probe_every = ctx.cfg.rollout.probe_every
    if probe_every and (ctx.step + 1) % probe_every == 0:
        diff = float(all_reduce_max(probe(batch.trajectories, ctx)))
        batch.metrics["probe/logprob_max_diff"] = diff
        check_probe(diff, ctx)


def probe(trajs, ctx) -> float:
    """max |engine - trainer| log-prob after the push over a fixed response per training rank (its first; -1:
    nothing to probe). The training ranks run the trainer's forward (FSDP collectives; a rank without data runs
    a dummy); every rank learns the probes (one all-gather) and the generating ranks score them with their
    engines, each its share (colocated: its own)."""
    item = None
    if ctx.model is not None:
        t = trajs[0] if trajs else None
        with torch.no_grad(), forward_scope(ctx.model):
            if t is None:
                ctx.model(dummy_pack(ctx.args, ctx.info.device, ctx.param_dtype).batch)
            else:
                # engines report untempered log-probs
                pack = pack_trajectories([t], ctx.args, ctx.info.device, ctx.param_dtype, temperature=1.0)
                ours = ctx.model(pack.batch, pack.targets).logprobs.float().cpu()
                # (multi-turn: the whole context; the engine scores every response token, ours are the generated)
                keep = None if t.generated is None else np.flatnonzero(t.generated)
                item = (t.request(ctx.encoder), t.response_ids.tolist(), ours, keep)
    if not ctx.placement.disaggregated:
        items = [item]
    else:
        every = all_gather_objects(item)
        engines = ctx.placement.engines
        share = engines.index(ctx.info.rank) if ctx.engine is not None else -1
        items = [every[r] for i, r in enumerate(ctx.placement.train) if i % len(engines) == share]
    items = [it for it in items if it is not None]
    if ctx.engine is None:
        return -1.0
    # one engine call (an engine over several ranks scores their probes together: every rank of it calls)
    scored = ctx.engine.score_many([(request, response_ids) for request, response_ids, _, _ in items])
    diffs = [float((ours - torch.tensor(theirs if keep is None else np.asarray(theirs)[keep])).abs().max())
             if len(theirs) else 0.0 for (_, _, ours, keep), theirs in zip(items, scored)]
    return max(diffs, default=-1.0)


def check_probe(diff: float, ctx) -> None:
    """Warn when the engine and the trainer disagree beyond ``rollout.probe_tolerance``; stop after
    ``rollout.probe_max_violations`` consecutive violations (the weights in the engine are not the ones being
    trained, or the two compute differently)."""
    r = ctx.cfg.rollout
    if diff <= r.probe_tolerance:
        ctx.state.probe_violations = 0
        return
    ctx.state.probe_violations += 1
    if ctx.info.is_main:
        engine = {"vllm": "vLLM", "hf": "hf engine"}.get(r.engine, r.engine)
        say(f"[titanrl] warning: step {ctx.step + 1}: {engine} and trainer log-probs differ by {diff:.3g} "
            f"(> rollout.probe_tolerance={r.probe_tolerance}), {ctx.state.probe_violations} time(s) in a row")
    if r.probe_max_violations and ctx.state.probe_violations >= r.probe_max_violations:
        raise RuntimeError(
            f"the weight-sync probe exceeded rollout.probe_tolerance={r.probe_tolerance} in "
            f"{ctx.state.probe_violations} consecutive checks (last: {diff:.3g}): the rollout engine does not "
            "compute with the trained weights; raise the tolerance only if the two sides use different "
            "kernels or dtypes on purpose")


# ---------------------------------------------------------------------------------- PPO: the critic

def critic_values(batch, ctx):
    stage_inputs(batch, ctx)
    ctx.stages.logprobs(ctx.critic, "values", temperature=1.0, output="values")


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Generalised advantage estimates (float64) of responses padded to [N, T] (or one response, [T]), padding
    zero: delta_t = r_t + gamma V_{t+1} - V_t with V after the last token 0, A_t = delta_t + gamma lam A_{t+1}.
    A reverse scan in log2(T) vectorised steps (Hillis-Steele: after the step of shift s, A_t holds the terms
    k < 2s of sum_k (gamma lam)^k delta_{t+k}), not a per-token Python loop."""
    one = values.dim() == 1
    rewards, values = (rewards[None], values[None]) if one else (rewards, values)
    next_values = torch.nn.functional.pad(values[:, 1:], (0, 1))
    adv = rewards + gamma * next_values - values
    c, shift = gamma * lam, 1
    while shift < adv.shape[1]:
        adv = adv + torch.nn.functional.pad((c ** shift) * adv[:, shift:], (0, shift))
        shift *= 2
    return adv[0] if one else adv


def _whitening(total: torch.Tensor, squares: torch.Tensor, count: torch.Tensor):
    """(n, mean, 1 / std) of values from their all-reduced sum, sum of squares and count (the unbiased variance, as
    the usual masked whitening)."""
    n = max(count.item(), 1.0)
    mean = total / n
    var = (squares / n - mean ** 2) * n / max(n - 1.0, 1.0)
    return n, mean, torch.rsqrt(var.clamp(min=0.0) + 1e-8)


def _generated(t, values: torch.Tensor) -> torch.Tensor:
    """A response's per-token ``values`` at the tokens the policy generated (all of them but a multi-turn
    trajectory's observations: the returns run over the policy's own tokens, as if the observations were not there)."""
    gen = getattr(t, "generated", None)
    return values if gen is None else values[torch.from_numpy(np.flatnonzero(gen))]


def _scatter(t, values: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_generated`: a full-length response tensor, 0 at the observations' tokens."""
    gen = getattr(t, "generated", None)
    if gen is None:
        return values
    full = torch.zeros(len(gen), dtype=values.dtype)
    full[torch.from_numpy(np.flatnonzero(gen))] = values
    return full


def gae_advantages(batch, ctx):
    """Per-token advantages and returns of every response from its reward (at its last token) and the critic's
    values; the advantages are whitened over every response token of the step (all ranks: one all-reduce). A
    multi-turn response's are computed over its generated tokens alone (0 at its observations, never scored)."""
    rl = ctx.cfg.rl
    own = [_generated(t, t.values.double()) for t in batch.trajectories]
    lengths = [v.numel() for v in own]
    width = max(lengths, default=0)
    values = torch.zeros(len(lengths), width, dtype=torch.float64)
    rewards = torch.zeros_like(values)
    for i, (t, v, n) in enumerate(zip(batch.trajectories, own, lengths)):
        values[i, :n] = v
        if n:
            rewards[i, n - 1] = t.reward
    advantages = gae(rewards, values, rl.gamma, rl.lam)  # every response of the rank at once
    raw, returns = [], []
    for i, (t, n) in enumerate(zip(batch.trajectories, lengths)):
        adv = advantages[i, :n]
        returns.append(adv + values[i, :n])
        t.returns = _scatter(t, returns[-1]).float()
        raw.append(adv)
    flat = torch.cat(raw) if raw else torch.zeros(0, dtype=torch.float64)
    returns = torch.cat(returns) if raw else flat
    values = torch.cat(own) if raw else flat
    err = returns - values
    sums = all_reduce_sum(torch.stack([
        flat.sum(), (flat ** 2).sum(), torch.tensor(float(flat.numel()), dtype=torch.float64),
        returns.sum(), (returns ** 2).sum(), err.sum(), (err ** 2).sum(), values.sum()]), group=batch.group)
    n, mean, scale = _whitening(sums[0], sums[1], sums[2])
    for t, adv in zip(batch.trajectories, raw):
        t.advantages = _scatter(t, (adv - mean) * scale).float()
    var_returns = sums[4] / n - (sums[3] / n) ** 2
    var_err = sums[6] / n - (sums[5] / n) ** 2
    batch.metrics["critic/values_mean"] = (sums[7] / n).item()
    batch.metrics["critic/explained_variance"] = (1.0 - var_err / var_returns).item() if var_returns > 1e-12 else 0.0


def reinforce_pp_advantages(batch, ctx):
    """REINFORCE++ (Hu 2025, eq. 2-4): each token's reward is the response's reward at its last token less
    rl.kl_coef x KL_t (k1: old log-prob less the reference's), its advantage the sum of the rewards from that token
    to the end (gamma = 1), normalised by the mean and std over every response token of the step (all ranks)."""
    beta = ctx.cfg.rl.kl_coef
    raw = []
    for t in batch.trajectories:  # (a multi-turn response: over its generated tokens, 0 at its observations)
        old = _generated(t, torch.as_tensor(t.old_logprobs, dtype=torch.float64))
        kl = old - _generated(t, torch.as_tensor(t.ref_logprobs, dtype=torch.float64)) \
            if getattr(t, "ref_logprobs", None) is not None else torch.zeros_like(old)
        rewards = -beta * kl
        if rewards.numel():
            rewards[-1] += t.reward
        raw.append(torch.flip(torch.cumsum(torch.flip(rewards, (0,)), 0), (0,)))  # sum from t to the end
    flat = torch.cat(raw) if raw else torch.zeros(0, dtype=torch.float64)
    sums = all_reduce_sum(torch.stack([flat.sum(), (flat ** 2).sum(), torch.tensor(float(flat.numel()),
                                                                                  dtype=torch.float64)]),
                          group=batch.group)
    n, mean, scale = _whitening(sums[0], sums[1], sums[2])
    for t, adv in zip(batch.trajectories, raw):
        own = ((adv - mean) * scale).float()
        t.advantages = _scatter(t, own)
        t.advantage = float(own.mean()) if own.numel() else 0.0
    batch.metrics["advantage/kl_in_reward_mean"] = (all_reduce_sum(torch.tensor(
        [sum(float(r.sum()) for r in raw) - sum(t.reward for t in batch.trajectories)], dtype=torch.float64),
        group=batch.group)[0] / n).item() if beta else 0.0


def _value_loss(ctx):
    clip = ctx.cfg.rl.value_clip
    mode = ctx.cfg.rl.loss_agg

    def loss(out, inputs, global_tokens: float, global_seqs: float):
        old, ret = inputs.fields["values"], inputs.fields["returns"]
        clipped = old + (out.values - old).clamp(-clip, clip)
        unclipped_err, clipped_err = (out.values - ret) ** 2, (clipped - ret) ** 2
        agg = dict(seq_index=inputs.seq_index, seq_lengths=inputs.seq_lengths, mode=mode,
                   global_tokens=global_tokens, global_seqs=global_seqs)
        value_loss = aggregate(0.5 * torch.maximum(unclipped_err, clipped_err), **agg)
        return ValueLossOutput(value_loss, value_loss.detach(),
                               aggregate((clipped_err > unclipped_err).float(), **agg).detach())
    return loss


def train_critic(batch, ctx):
    stage_inputs(batch, ctx)
    cfg, rl = ctx.cfg, ctx.cfg.rl
    ctx.critic.train()
    sums = torch.zeros(2, dtype=torch.float64)
    grad_norm, steps = 0.0, 0
    loss_fn = _value_loss(ctx)
    for _ in range(rl.ppo_epochs):
        for m in range(rl.minibatches):
            ids = ctx.stages.minibatch_ids(m, rl.minibatches)
            for res in ctx.stages.train_minibatch(ctx.critic, ids, ("values", "returns"), loss_fn, temperature=1.0,
                                                   account=False):
                sums += torch.tensor([res.value_loss.item(), res.clip_fraction.item()], dtype=torch.float64)
            norm = torch.nn.utils.clip_grad_norm_(ctx.critic.parameters(), cfg.optimizer.max_grad_norm or float("inf"))
            grad_norm += float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            ctx.critic_optimizer.step()
            ctx.critic_optimizer.zero_grad(set_to_none=True)
            steps += 1
    ctx.critic_lr_scheduler.step()
    sums = all_reduce_sum(sums, group=batch.group)
    ctx.critic.eval()
    batch.metrics.update({
        "critic/value_loss": sums[0].item() / steps, "critic/value_clip_fraction": sums[1].item() / steps,
        "critic/grad_norm": grad_norm / steps, "critic/lr": ctx.critic_lr_scheduler.get_last_lr()[0],
    })
