"""The trainer compiled (``compile.enable``: every transformer and vision block of the policy, the reference and the
critic, torch.compile with inductor, dynamic shapes), in the modes the eager trainer runs: packed varlen batches of
the video-heavy mixture (the vision tower), shared-prefix packing (the default), PPO's critic, and on 2 ranks
FlexUlysses sharding sequences and vision balancing, under lb_mini.

- compiled on 2 ranks (FlexUlysses sharding, vision balancing) equals eager on one process within float32's
  rounding: per-token log-probs (rollout, old, reference), values, returns, advantages within 1e-5, and each step's
  policy and critic update (at the peak learning rate, with non-zero advantages) within 0.1% of its size (L2:
  inductor's fused kernels round differently from eager; ``train_runs.assert_same_computation``);
- after the first step nothing recompiles (``compile/recompiles`` 0).
"""

from __future__ import annotations

import pytest
from train_runs import PPO_REFERENCE, assert_same_computation, metrics, ppo_reference_run, run_tiny

pytestmark = pytest.mark.slow

COMMON = PPO_REFERENCE  # PPO on the video mixture, non-zero advantages at the peak learning rate from step 1
FIELDS = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "values", "returns", "advantages")


def test_two_compiled_ranks_equal_one_eager_process(run_cache, tmp_path):
    eager = ppo_reference_run(run_cache)  # the shared one-process eager run
    two = run_tiny(tmp_path / "two", run_cache, 2, *COMMON, "--compile.enable=true", "--parallelism.ulysses=flex",
                   "--parallelism.vision_balance=true", "--balance.max_tokens_per_microbatch=48")
    seen = assert_same_computation(eager, two, fields=FIELDS, update_rtol=1e-3, steps=3)
    assert set(FIELDS) | {"update/policy", "update/critic"} <= set(seen), seen
    m2 = metrics(two)
    assert m2[1]["compile/recompiles"] > 0  # the first step compiles
    assert all(m2[s]["compile/recompiles"] == 0 for s in (2, 3)), m2
    assert all(m2[s]["parallel/sharded_sequences"] > 0 for s in (1, 2, 3))  # FlexUlysses sharded, compiled
