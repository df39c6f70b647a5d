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
    assert engine_launch(0, 0, 2, 1, "cpu", process_group=True, own_process=True).visible_devices == ()


def test_one_process_without_a_group_runs_vllm_in_process_on_device_0():
    launch = engine_launch(0, 0, 1, 1, "cuda", process_group=False)
    assert (launch.backend, launch.device) == ("uni", "cuda:0")
    with pytest.raises(ValueError, match="process group"):
        engine_launch(0, 0, 1, 2, "cpu", process_group=False)
