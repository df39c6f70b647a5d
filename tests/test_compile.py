"""The trainer compiled (``compile.enable``: every transformer and vision block of the policy, the reference and the
critic, torch.compile with inductor, dynamic shapes), in the modes the eager trainer runs: packed varlen batches of
the video-heavy mixture (the vision tower), shared-prefix packing (the default), PPO's critic, and on 2 ranks
FlexUlysses sharding sequences and vision balancing, under lb_mini.

- compiled equals eager on one process within float32's rounding, and compiled on 2 ranks equals compiled on 1
  rank: per-token log-probs (rollout, old, reference), values, returns, advantages within 1e-5, and each step's
  policy update (at the peak learning rate, with non-zero advantages) within 0.1% of its size (L2);
- after the first step nothing recompiles (``compile/recompiles`` 0).
"""

from __future__ import annotations

import pytest
from train_runs import metrics, run_tiny

from titanrl.rl.dump import load_dumps, max_differences

pytestmark = pytest.mark.slow

COMMON = ["--rl.algorithm=ppo", "--job.steps=3", "--checkpoint.enable=false", "--metrics.dump_tensors",
          "--rl.old_logprobs=recompute", "--rl.minibatches=2", "--rl.global_batch_size=4",
          "--data.mixture=video-heavy", "--lr_scheduler.warmup_steps=0"]  # the peak learning rate from step 1
FIELDS = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "values", "returns", "advantages")


def _update_error(a: dict, b: dict, step: int) -> tuple[float, float]:
    """||update_a - update_b|| and ||update_a|| (L2 over every policy parameter) of step ``step``'s update (params
    after it less before): relative to the update, not elementwise (Adam moves a parameter whose gradient is
    rounding noise by ~lr either way)."""
    diff = size = 0.0
    for name, after in a[step]["params"]["policy"].items():
        ua = after.double() - a[step - 1]["params"]["policy"][name].double()
        ub = b[step]["params"]["policy"][name].double() - b[step - 1]["params"]["policy"][name].double()
        diff, size = diff + ((ua - ub) ** 2).sum().item(), size + (ua ** 2).sum().item()
    return diff ** 0.5, size ** 0.5


def test_compiled_equals_eager_and_two_compiled_ranks_equal_one(run_cache, tmp_path):
    eager = run_tiny(tmp_path / "eager", run_cache, 1, *COMMON)
    one = run_tiny(tmp_path / "one", run_cache, 1, *COMMON, "--compile.enable=true")
    two = run_tiny(tmp_path / "two", run_cache, 2, *COMMON, "--compile.enable=true", "--parallelism.ulysses=flex",
                   "--parallelism.vision_balance=true", "--balance.max_tokens_per_microbatch=48")
    e, c1, c2 = load_dumps(eager), load_dumps(one), load_dumps(two)
    for a, b in ((e, c1), (c1, c2)):
        for step in (1, 2, 3):
            diff = max_differences(a[step], b[step])
            assert set(FIELDS) | {"params/policy", "params/critic"} <= set(diff), diff
            assert all(diff[f] <= 1e-5 for f in FIELDS), (step, diff)
        for step in (2, 3):  # a real update: the peak learning rate, non-zero advantages
            worst, size = _update_error(a, b, step)
            print(f"step {step}: update {size:.2e}, difference {worst:.2e}")
            assert size > 1e-2 and worst <= 1e-3 * size, (step, worst, size)
            assert max(abs(float(x)) for t in a[step]["trajectories"].values() for x in t["advantages"]) > 0.1
    m1, m2 = metrics(one), metrics(two)
    assert m1[1]["compile/recompiles"] > 0 and m2[1]["compile/recompiles"] > 0  # the first step compiles
    assert all(m[s]["compile/recompiles"] == 0 for m in (m1, m2) for s in (2, 3)), (m1, m2)
    assert all(m2[s]["parallel/sharded_sequences"] > 0 for s in (1, 2, 3))  # FlexUlysses sharded, compiled
