"""Run under torchrun: ShadowLoader vs the centralized baseline on N ranks sharing one local Ray.

Phases, all ranks together:
1. ``data.ray_address`` pointing at a closed port: every rank must fail fast with an error naming it.
2. The centralized and the shadow loader over the same data: every rank plans the same batches, and
   the tensors each rank materializes are bit-identical between the two loaders.
3. Tear-down: after ``close()`` none of the Ray processes that rank 0 saw is alive.

Each rank writes ``<out>/rank<r>.json``; tests/test_shadow_dist.py checks them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from shadow_common import assert_same_sample, job_config  # noqa: E402

import torch.distributed as dist  # noqa: E402

from titanrl.data.shadow import BadSample, DataUnavailableError, build_loader  # noqa: E402
from titanrl.distributed import init_distributed  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_process_pids() -> list[int]:
    """Every process of this node's Ray instance: the head's daemons, and the raylet's descendants."""
    import psutil
    import ray

    node = ray._private.worker._global_node
    pids = {p.process.pid for procs in node.all_processes.values() for p in procs}
    for pid in list(pids):
        try:
            pids |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return sorted(pids)


def is_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    info = init_distributed()
    out: dict = {"rank": info.rank}

    # 1. an unreachable Ray
    port = free_port() if info.rank == 0 else 0
    box = [port]
    dist.broadcast_object_list(box)
    t0 = time.monotonic()
    try:
        build_loader(job_config(f"--data.ray_address=127.0.0.1:{box[0]}"), info, args.ckpt, args.manifest)
        out["bad_address"] = "no error"
    except DataUnavailableError as error:
        out["bad_address"] = str(error)
    out["bad_address_s"] = time.monotonic() - t0

    # 2. both loaders, same plan, same tensors
    cfg = job_config("--rl.global_batch_size=6")
    central = build_loader(job_config("--data.loader=centralized", "--data.slice_loading=false", "--rl.global_batch_size=6"), info,
                           args.ckpt, args.manifest)
    shadow = build_loader(cfg, info, args.ckpt, args.manifest)
    out["address"] = shadow.session.address
    out["owns_instance"] = shadow.session.owns_instance
    out["connected_here"] = shadow.session.connected_here
    out["preprocessors"] = len(shadow.session.handles)
    signatures, compared, bad = [], 0, 0
    for _ in range(args.steps):
        s_step, c_step = shadow.next_step(), central.next_step()
        assert s_step.assignment == c_step.assignment
        signatures.append([repr(m.signature()) for m in s_step.metas])
        got, want = s_step.materialize(), c_step.materialize()
        assert [r.position for r in got] == s_step.mine
        for a, b in zip(got, want):
            assert_same_sample(a, b)
            compared += 1
            bad += isinstance(a, BadSample)
    out["signatures"] = signatures
    out["compared"], out["bad"] = compared, bad
    out["ray_pids"] = ray_process_pids() if info.rank == 0 else []

    # 3. tear-down
    central.close()
    shadow.close()
    if info.rank == 0:
        deadline = time.monotonic() + 20
        alive = out["ray_pids"]
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if is_alive(p)]
            time.sleep(0.2)
        out["alive_after_close"] = alive
    Path(args.out, f"rank{info.rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
