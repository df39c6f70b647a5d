"""The tests' forked launches (``fork_launch``: ranks forked from a server that imported vLLM, transformers and
torch's compiler once) compute what a fresh ``torchrun`` computes, bit for bit."""

from __future__ import annotations

import sys

import pytest
from train_runs import SIGNAL, metrics, run, train_cmd

import fork_launch
from titanrl.rl.dump import load_dumps, max_differences


def test_split_reads_the_commands_it_can_fork():
    py = sys.executable
    assert fork_launch.split([py, "-m", "titanrl.train", "--config", "c.toml"]) == (None, "titanrl.train",
                                                                                    ["--config", "c.toml"])
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert fork_launch.split([*torchrun, "-m", "titanrl.train", "--x=1"]) == (torchrun[3:] + ["-m"], "titanrl.train",
                                                                             ["--x=1"])
    assert fork_launch.split([*torchrun, "dist/step.py", "--out", "o"]) == (torchrun[3:], "dist/step.py",
                                                                           ["--out", "o"])
    assert fork_launch.split([py, "dist/step.py", "--out"]) == (None, "dist/step.py", ["--out"])
    assert fork_launch.split([py, "-c", "print(1)"]) is None
    assert fork_launch.split(["torchrun", "-m", "titanrl.train"]) is None


@pytest.mark.slow
def test_a_forked_run_equals_a_fresh_torchrun(run_cache, tmp_path):
    common = ["--job.steps=2", "--checkpoint.enable=false", "--metrics.dump_tensors", "--rl.old_logprobs=recompute",
              "--rl.minibatches=2", "--rl.global_batch_size=4", "--data.mixture=video-heavy", *SIGNAL]
    run(train_cmd(tmp_path / "forked", run_cache, *common, nproc=2))
    run(train_cmd(tmp_path / "fresh", run_cache, *common, nproc=2), fresh=True)
    a, b = (load_dumps(tmp_path / name / "tiny_cpu") for name in ("forked", "fresh"))
    ma, mb = (metrics(tmp_path / name / "tiny_cpu") for name in ("forked", "fresh"))
    assert sorted(a) == sorted(b) == [1, 2]
    for step in a:
        diff = max_differences(a[step], b[step])
        assert {"rollout_logprobs", "old_logprobs", "params/policy"} <= set(diff), diff
        assert all(v == 0.0 for v in diff.values()), (step, diff)
        for key in ("loss", "reward/mean", "kl", "entropy", "grad_norm"):
            assert ma[step][key] == mb[step][key], (step, key)
    assert ma[2]["grad_norm"] > 0 and ma[1]["reward/mean"] > 0  # a learning signal
