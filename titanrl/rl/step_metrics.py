"""The step line's numbers: what the nodes reported, reduced over ranks (collective: every rank calls it)."""

from __future__ import annotations

import torch

from titanrl.distributed import all_gather_objects, all_reduce_max, all_reduce_sum
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


def step_metrics(ctx, buffer, timer, wall_s: float) -> dict[str, float]:
    """``buffer``: the step's node outputs on this rank; ``timer``: its StageTimer; ``wall_s``: the step so far."""
    scored = buffer.outputs["reward"] if "reward" in buffer.outputs else None
    trajs = scored.trajectories if scored is not None else []
    stats: dict[str, float] = {}
    for out in buffer.outputs.values():  # what nodes reported (the same dict object flows through a step)
        stats.update(out.metrics)
    # a prompt's group is generated and scored on one rank, so groups can be counted locally
    uniform, groups = count_uniform_groups([t.reward for t in trajs], [t.group for t in trajs])
    local = torch.tensor([
        sum(t.reward for t in trajs), 0.0, float(len(trajs)),  # slot 1 unused (reward_metrics)
        float(sum(t.num_response_tokens for t in trajs)), float(sum(t.num_tokens for t in trajs)),
        float(ctx.skips.total()), float(uniform), float(groups),
    ], dtype=torch.float64)
    total = all_reduce_sum(local)
    n = max(total[2].item(), 1.0)
    step_time = sum(v for k, v in timer.times.items())
    stats.update(ctx.stages.metrics())
    # every rank's busy seconds per stage: the step time a perfect schedule would reach
    stats.update(busy_metrics(all_gather_objects(timer.busy)))
    stats["step/wall_s"] = all_reduce_max(wall_s)
    media = scored.media if scored is not None else None
    if ctx.cfg.data.loader == "shadow":
        stats.update(host_metrics(all_gather_objects(dict(media.fetch_counts) if media is not None else {})))
    return {
        "reward/mean": total[0].item() / n,
        # reward/accuracy (where the reward says what is correct), reward/errors, reward/<extra>
        **reward_metrics(all_gather_objects(reward_sums(t.extras["reward"] for t in trajs))),
        # groups whose responses all scored the same: no gradient from them this step
        "reward/uniform_group_fraction": total[6].item() / max(total[7].item(), 1.0),
        "response/length_mean": total[3].item() / n,
        **stats,
        "throughput/tokens_per_s": total[4].item() / max(step_time, 1e-9),
        "data/skipped": total[5].item(),
        **{k: all_reduce_max(v) for k, v in timer.times.items()},
    }
