"""The step line's numbers: what the nodes reported, reduced over ranks (collective: every rank calls it)."""

from __future__ import annotations


import torch

from titanrl.distributed import all_gather_objects, all_reduce_max, all_reduce_sum
from titanrl.metrics import source_key
from titanrl.rl.grpo import count_uniform_groups
from titanrl.rl.reward_runner import reward_metrics, reward_sums
from titanrl.rl.timing import busy_metrics


def host_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Where the step's media came from, over ranks (ShadowLoader's fetch counts): whole samples from the rank's
    own host's preprocessor or another host's, slice frames likewise, and how many ranks fetched from their own
    host's preprocessor."""
    def total(key: str) -> float:
        return float(sum(c.get(key, 0.0) for c in per_rank))

    return {
        "data/samples_same_host": total("samples_local"),
        "data/samples_cross_host": total("samples_remote"),
        "data/ranks_fetching_same_host": float(sum(c.get("samples_local", 0.0) > 0 for c in per_rank)),
        "vision/frames_same_host": total("slice_frames_local"),
        "vision/frames_cross_host": total("slice_frames_remote"),
    }


def source_sums(trajs) -> dict[str, list[float]]:
    """Per sample source (the dataset's ``source`` / ``data_source``): [responses, reward sum, correct sum,
    responses that say what is correct] on this rank."""
    out: dict[str, list[float]] = {}
    for t in trajs:
        acc = out.setdefault(t.prompt.record.source, [0.0, 0.0, 0.0, 0.0])
        result = t.extras.get("reward")
        acc[0] += 1
        acc[1] += t.reward
        if result is not None and result.correct is not None:
            acc[2] += result.correct
            acc[3] += 1
    return out


def tool_sums(trajs) -> list[float]:
    """Multi-turn runs, on this rank: [responses whose policy called the environment (more than one turn), correct
    among them, responses answered at once, correct among them] (responses whose reward says what is correct)."""
    out = [0.0, 0.0, 0.0, 0.0]
    for t in trajs:
        result = t.extras.get("reward")
        if result is not None and result.correct is not None:
            k = 0 if t.turns > 1 else 2
            out[k] += 1
            out[k + 1] += result.correct
    return out


def tool_metrics(per_rank: list[list[float]]) -> dict[str, float]:
    """``reward/accuracy_with_tool`` and ``reward/accuracy_without_tool`` (where there were such responses): whether
    looking again pays, from every rank's ``tool_sums``."""
    n_tool, c_tool, n_direct, c_direct = (sum(x) for x in zip(*per_rank))
    out = {"reward/tool_share": n_tool / max(n_tool + n_direct, 1.0)}
    if n_tool:
        out["reward/accuracy_with_tool"] = c_tool / n_tool
    if n_direct:
        out["reward/accuracy_without_tool"] = c_direct / n_direct
    return out


def source_metrics(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    """``source/<name>/responses``, ``source/<name>/reward`` (mean) and, where the reward says what is correct,
    ``source/<name>/accuracy``, from every rank's ``source_sums``."""
    total: dict[str, list[float]] = {}
    for sums in per_rank:
        for name, values in sums.items():
            acc = total.setdefault(name, [0.0, 0.0, 0.0, 0.0])
            for i, v in enumerate(values):
                acc[i] += v
    out = {}
    for name, (n, reward, correct, judged) in sorted(total.items()):
        key = "source/" + source_key(name)
        out[f"{key}/responses"] = n
        out[f"{key}/reward"] = reward / max(n, 1.0)
        if judged:
            out[f"{key}/accuracy"] = correct / judged
    return out


def merge_stats(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """What the nodes reported, over ranks: a node's numbers are reduced over its own group already, so the first
    rank (in rank order) that reports a key gives it (colocated: rank 0 has them all)."""
    out: dict[str, float] = {}
    for stats in per_rank:
        for k, v in stats.items():
            out.setdefault(k, v)
    return out


def step_metrics(ctx, buffer, timer, wall_s: float) -> tuple[dict[str, float], dict[str, str]]:
    """``buffer``: the step's node outputs on this rank; ``timer``: its StageTimer; ``wall_s``: the step so far.
    Returns the step's metrics and, per kind of counted error (``reward``), the step's first one, naming its rank
    and sample (the same on every rank)."""
    scored = buffer.outputs["reward"] if "reward" in buffer.outputs and ctx.generates else None
    trajs = scored.trajectories if scored is not None else []
    stats: dict[str, float] = {}
    for out in buffer.outputs.values():  # what nodes reported (the same dict object flows through a step)
        stats.update(out.metrics)
    if ctx.stages is not None:  # collective over the training ranks
        stats.update(ctx.stages.metrics())
    # a prompt's group is generated and scored on one rank, so groups can be counted locally
    uniform, groups = count_uniform_groups([t.reward for t in trajs], [t.group for t in trajs])
    local = torch.tensor([
        sum(t.reward for t in trajs), float(buffer.bytes_redistributed), float(len(trajs)),
        float(sum(t.num_response_tokens for t in trajs)), float(sum(t.num_tokens for t in trajs)),
        float(ctx.skips.total()), float(uniform), float(groups),
        float(sum(t.finish_reason == "length" for t in trajs)),
        sum(t.extras.get("overlong_penalty", 0.0) for t in trajs),
    ], dtype=torch.float64)
    total = all_reduce_sum(local)
    # one all-gather of what each rank holds: rewards, sources, node numbers, busy and wall-clock seconds
    media = buffer.media
    fetches = dict(media.fetch_counts) if media is not None and ctx.cfg.data.loader == "shadow" else {}
    # how many policy versions each trained response lags the policy it trains (0 synchronous)
    lags = [ctx.step - 1 - t.version for t in trajs]
    failed = next((t.extras["reward"].error for t in trajs if t.extras["reward"].error is not None), None)
    env_failed = next((t.extras["env_error"] for t in trajs if "env_error" in t.extras), None)
    firsts = {kind: f"rank {ctx.info.rank}: {message}" for kind, message in (("reward", failed), ("env", env_failed))
              if message}
    gathered = all_gather_objects((reward_sums(t.extras["reward"] for t in trajs), source_sums(trajs), stats,
                                   timer.busy, timer.times, fetches, (sum(lags), max(lags, default=0)), firsts,
                                   tool_sums(trajs)))
    first_errors: dict[str, str] = {}
    for g in gathered:
        for kind, message in g[7].items():
            first_errors.setdefault(kind, message)
    n = max(total[2].item(), 1.0)
    stats = merge_stats([g[2] for g in gathered])
    # every rank's busy seconds per stage: the step time a perfect schedule would reach
    stats.update(busy_metrics([g[3] for g in gathered]))
    if ctx.placement.disaggregated:  # each group's busy seconds (mean over its ranks): what idles by design
        for name, ranks in (("rollout", ctx.placement.rollout), ("train", ctx.placement.train)):
            stats[f"busy/{name}_ranks_s"] = sum(sum(gathered[r][3].values()) for r in ranks) / len(ranks)
    stats["step/wall_s"] = all_reduce_max(wall_s)
    if ctx.placement.disaggregated:  # and the seconds each group waits for the other
        for name in ("rollout", "train"):
            stats[f"idle/{name}_ranks_s"] = max(stats["step/wall_s"] - stats[f"busy/{name}_ranks_s"], 0.0)
    if ctx.cfg.workflow.mode == "async":
        stats["async/staleness_mean"] = sum(g[6][0] for g in gathered) / n
        stats["async/staleness_max"] = float(max(g[6][1] for g in gathered))
    if ctx.cfg.data.loader == "shadow":
        stats.update(host_metrics([g[5] for g in gathered]))
    times = {k: max(g[4].get(k, 0.0) for g in gathered) for k in dict.fromkeys(k for g in gathered for k in g[4])}
    # colocated: this rank's stages one after another; disaggregated: the step's wall clock
    step_time = stats["step/wall_s"] if ctx.placement.disaggregated else sum(timer.times.values())
    out = {
        "reward/mean": total[0].item() / n,
        "reward/calls": total[2].item(),  # the responses scored (reward/errors of them failed)
        # reward/accuracy (where the reward says what is correct), reward/errors, reward/<extra>
        **reward_metrics([g[0] for g in gathered]),
        **source_metrics([g[1] for g in gathered]),
        **(tool_metrics([g[8] for g in gathered]) if ctx.cfg.rollout.max_turns > 1 else {}),
        # groups whose responses all scored the same: no gradient from them this step
        "reward/uniform_group_fraction": total[6].item() / max(total[7].item(), 1.0),
        "response/length_mean": total[3].item() / n,
        "response/truncated_fraction": total[8].item() / n,  # cut at rollout.max_new_tokens (the last turn's)
        **({"reward/overlong_penalty": total[9].item() / n} if ctx.cfg.rl.overlong_buffer else {}),
        "rollout/tokens": total[4].item(),  # prompt + response tokens of the step's responses
        **stats,
        "throughput/tokens_per_s": total[4].item() / max(step_time, 1e-9),
        "data/skipped": total[5].item(),
        **times,
        # trajectory bytes sent between the rank groups of a disaggregated placement (0 colocated)
        "workflow/bytes_redistributed": total[1].item(),
    }
    return out, first_errors
