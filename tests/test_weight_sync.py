"""The node-local weight-push folder: shared by the local ranks of one job, never by two jobs."""

import os
import subprocess
import sys

PRINT_ROOT = "from titanrl.rl.weight_sync import shm_root; print(shm_root('tiny_cpu'))"


def _root(env: dict) -> str:
    return subprocess.run([sys.executable, "-c", PRINT_ROOT], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_two_plain_jobs_with_one_parent_get_different_folders():
    # two `python -m titanrl.train` started from one shell (or re-parented to init) must not share slots
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    assert _root(env) != _root(env)


def test_local_ranks_of_one_torchrun_job_share_the_folder():
    # the local ranks are children of one elastic agent: here, of this test process
    env = dict(os.environ, LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="none")
    first, second = _root(env), _root(env)
    assert first == second and first.endswith(f"tiny_cpu-none-{os.getpid()}")
