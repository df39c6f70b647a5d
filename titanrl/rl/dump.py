"""``metrics.dump_tensors``: each step's per-token tensors of every trajectory and the full parameters, to
``<run dir>/tensors/step<N>.pt``, so that two runs (world sizes, placements, versions of titanrl) can be
compared on what they computed rather than on step statistics.

Per trajectory, keyed ``(group, response_index)`` (global batch position of the prompt, order of the
response among its prompt's samples - the same on any number of ranks): the response ids, the rollout
engine's log-probs, reward, advantages and every per-token tensor a stage wrote (old / reference
log-probs, values, returns). Parameters: every entry of each dumped model's state dict, unsharded (a
collective every rank of the model's group joins), after the step's optimizer steps. Rank 0 writes.
It gathers the whole model on one rank: for debugging and tests on small models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from titanrl.distributed import all_gather_objects

PER_TOKEN = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "values", "returns", "advantages")


def trajectory_record(t) -> dict:
    rec = {"response_ids": np.asarray(t.response_ids).copy(), "reward": float(t.reward),
           "advantage": float(t.advantage)}
    if getattr(t, "token_versions", None) is not None:
        rec["token_versions"] = np.asarray(t.token_versions).copy()
    if getattr(t, "generated", None) is not None:  # multi-turn: which tokens the policy sampled
        rec["generated"] = np.asarray(t.generated).copy()
    for name in PER_TOKEN:
        value = getattr(t, name, None)
        if value is not None:
            rec[name] = (value.detach().float().cpu().numpy() if isinstance(value, torch.Tensor)
                         else np.asarray(value, dtype=np.float32)).copy()
    return rec


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from titanrl.rl.weight_sync import gather_full_state

    return {name: tensor.float().cpu().clone() for name, tensor in gather_full_state(model, None)}


def dump_step(run_dir: Path, step: int, trajs: Sequence, models: dict[str, torch.nn.Module], *, is_main: bool,
              group=None) -> None:
    """Collective over ``group`` (every rank of the models' group calls it)."""
    mine = {(int(t.group), int(t.response_index)): trajectory_record(t) for t in trajs}
    every = all_gather_objects(mine, group=group)
    params = {name: full_state(m) for name, m in models.items()}
    if is_main:
        out = Path(run_dir) / "tensors"
        out.mkdir(parents=True, exist_ok=True)
        merged = {k: v for part in every for k, v in part.items()}
        torch.save({"step": step, "trajectories": merged, "params": params}, out / f"step{step}.pt")


def load_dumps(run_dir: Path) -> dict[int, dict]:
    """step -> what ``dump_step`` wrote for it."""
    out = {}
    for f in sorted((Path(run_dir) / "tensors").glob("step*.pt")):
        d = torch.load(f, weights_only=False)
        out[int(d["step"])] = d
    return out


def max_differences(a: dict, b: dict, fields: Sequence[str] = PER_TOKEN) -> dict[str, float]:
    """Largest absolute difference of each per-token field over the trajectories both steps hold (and
    ``params/<model>`` over every parameter); a key one side lacks, or different response ids, is an error."""
    ta, tb = a["trajectories"], b["trajectories"]
    if set(ta) != set(tb):
        raise AssertionError(f"different trajectories: {sorted(set(ta) ^ set(tb))[:8]}")
    out: dict[str, float] = {}
    for key in ta:
        if not np.array_equal(ta[key]["response_ids"], tb[key]["response_ids"]):
            raise AssertionError(f"trajectory {key}: different responses {ta[key]['response_ids']} vs "
                                 f"{tb[key]['response_ids']}")
        for f in fields:
            if (f in ta[key]) != (f in tb[key]):
                raise AssertionError(f"trajectory {key}: {f} on one side only")
            if f in ta[key]:
                out[f] = max(out.get(f, 0.0), float(np.abs(ta[key][f] - tb[key][f]).max(initial=0.0)))
    for model in set(a["params"]) | set(b["params"]):
        pa, pb = a["params"].get(model, {}), b["params"].get(model, {})
        if set(pa) != set(pb):
            raise AssertionError(f"{model}: different parameters {sorted(set(pa) ^ set(pb))[:8]}")
        out[f"params/{model}"] = max((float((pa[k] - pb[k]).abs().max()) for k in pa), default=0.0)
    return out
