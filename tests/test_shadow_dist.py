"""ShadowLoader under torchrun: ranks share one local Ray, plan identical batches, materialize tensors
bit-identical to the centralized baseline, fail fast on an unreachable Ray, and leave no process behind.

Runs ``tests/dist/shadow_equality.py`` with 2 ranks (the 4-rank comparison is scripts/bench_data.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import fork_launch
import pytest
from train_runs import failure_report

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from shadow_common import make_dataset  # noqa: E402

SCRIPT = Path(__file__).parent / "dist" / "shadow_equality.py"
NPROC = 2


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_shadow_under_torchrun(tmp_path, tiny_ckpt):
    manifest = make_dataset(tmp_path / "data", num_samples=13)  # + text-only + 4 bad = 18 = 3 steps x 6
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC), "--standalone",
           str(SCRIPT), "--ckpt", str(tiny_ckpt), "--manifest", str(manifest), "--out", str(out)]
    proc = fork_launch.run(cmd, env, timeout=420)
    assert proc.returncode == 0, failure_report(proc)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(NPROC)]

    # an unreachable Ray: a clear error on every rank, in seconds
    for r in ranks:
        assert "cannot reach Ray at 127.0.0.1:" in r["bad_address"], r["bad_address"]
        assert r["bad_address_s"] < 15
    # one Ray for all ranks: rank 0 started it, the others joined the same address
    assert len({r["address"] for r in ranks}) == 1 and ranks[0]["address"].startswith("127.0.0.1:")
    assert ranks[0]["owns_instance"] and not any(r["owns_instance"] for r in ranks[1:])
    assert all(r["connected_here"] for r in ranks) and all(r["preprocessors"] == 1 for r in ranks)
    # identical plans on every rank, and every rank compared its samples with the baseline
    assert all(r["signatures"] == ranks[0]["signatures"] for r in ranks)
    assert sum(r["compared"] for r in ranks) == 3 * 6 and sum(r["bad"] for r in ranks) == 4
    # tear-down left nothing behind
    assert ranks[0]["ray_pids"] and ranks[0]["alive_after_close"] == []
    assert not [p for p in ranks[0]["ray_pids"] if _alive(p)]
