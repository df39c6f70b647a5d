"""2 ranks: rank 1 hangs inside the 'update' stage; rank 0's collective there must end with an error
naming the stage, the rank and the timeout, within about the timeout (not a silent hang).

    torchrun --nproc-per-node 2 tests/dist/collective_timeout.py TIMEOUT_S HANG_S
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from titanrl.console import report_exception
from titanrl.distributed import init_distributed
from titanrl.rl.timing import StageTimer

timeout_s, hang_s = float(sys.argv[1]), float(sys.argv[2])
# start-up gets a generous timeout (on a loaded 2-core machine one rank can reach the rendezvous seconds
# after the other), then every collective the short one - torchtitan's init / train timeout split
info = init_distributed(120.0)
dist.barrier()
dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
timer = StageTimer(info.rank, timeout_s)
code = 0
t0 = time.perf_counter()
try:
    with timer("rollout"):
        dist.all_reduce(torch.ones(1))  # a healthy stage first
    with timer("update"):
        if info.rank == 1:
            time.sleep(hang_s)
        dist.all_reduce(torch.ones(1))
except Exception as err:  # what titanrl.train does with an error
    report_exception(err, rank=info.rank, expected=True, verbose=False)
    print(f"rank {info.rank} ended after {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    code = 1
sys.exit(code)
