"""ShadowLoader on a real (local, loopback) Ray, one process: equality with the centralized baseline,
bad samples, resume, slices, and a preprocessor that dies. One Ray instance for the whole module."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from shadow_common import BAD_SAMPLES, assert_same_sample, job_config, make_dataset  # noqa: E402

from titanrl.data.shadow import BadSample, BadSampleError, CentralizedLoader, DataUnavailableError  # noqa: E402
from titanrl.data.shadow import Materialized, ShadowLoader, build_loader  # noqa: E402
from titanrl.data.shadow.comm import Comm  # noqa: E402
from titanrl.distributed import DistInfo  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    # frames mapped from the object store are read-only; vision.py copies them (the materializer
    # silences this warning outside pytest, which resets warning filters per test)
    pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"),
]
STEPS = 4  # 4 x 4 = the 16 samples of one epoch: every bad sample comes up
INFO = DistInfo(0, 1, 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def ray_session():
    """A private instance in this process. Its start sets Ray's variables in this process's environment (loopback
    servers, a token): they are put back after, so that nothing started later from this process inherits them."""
    import os

    from titanrl.data.shadow import ray_runtime

    saved = dict(os.environ)
    session = ray_runtime.connect("", 256 << 20, Comm(), local_world_size=1)
    yield session
    ray_runtime.shutdown(session, Comm())
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("shadow_ray_data"), num_samples=11)  # + 5 = 16


@pytest.fixture(scope="module")
def reference(tiny_ckpt, dataset) -> list[list]:
    """What the centralized baseline gives for steps 0..STEPS-1 (world of one)."""
    loader = build_loader(job_config("--data.loader=centralized", "--data.slice_loading=false"), INFO, tiny_ckpt, dataset)
    assert isinstance(loader, CentralizedLoader)
    out = [loader.next_step().materialize() for _ in range(STEPS)]
    loader.close()
    return out


def shadow(tiny_ckpt, dataset, *overrides: str) -> ShadowLoader:
    loader = build_loader(job_config(*overrides), INFO, tiny_ckpt, dataset)
    assert isinstance(loader, ShadowLoader)
    return loader


def test_shadow_equals_centralized_resumes_and_slices(ray_session, tiny_ckpt, dataset, reference):
    loader = shadow(tiny_ckpt, dataset)
    try:
        state = None
        for step_index in range(STEPS):
            if step_index == 2:
                state = json.loads(json.dumps(loader.state_dict()))  # a checkpoint mid-epoch
            step = loader.next_step()
            assert step.step == step_index
            time.sleep(0.2)  # "compute": step t+1 decodes meanwhile
            got = step.materialize()
            assert len(got) == len(reference[step_index])
            for a, b in zip(got, reference[step_index]):
                assert_same_sample(a, b)
            assert {r.sample_id for r in got if isinstance(r, BadSample)} <= set(BAD_SAMPLES)
            # slice-aware fetch: a frame range of a video and a token range of any sample equal the
            # corresponding rows of the whole tensor
            for res in got:
                if not isinstance(res, Materialized) or not res.grids:
                    continue  # bad, or text only
                ph = res.meta.placeholders[0]
                cuts = [ph.tokens(1, min(3, ph.num_tokens))]
                if res.grids[0].is_video and res.grids[0].t >= 2:
                    cuts.append(ph.frames(2, 4))
                for cut, rows in zip(cuts, step.fetch_slices(cuts)):
                    assert rows.tobytes() == res.pixel_values[cut.row_start:cut.row_stop].tobytes()
        bad_seen = {r.sample_id: r.reason for step in reference for r in step if isinstance(r, BadSample)}
        assert bad_seen == BAD_SAMPLES  # the truncated video too, found only when decoded
        stats = loader.preprocessor_stats()[0]
        assert stats["decoded"] >= 12 and stats["failed"] >= 1  # 11 good + the truncated video

        # resume from the mid-epoch checkpoint in a fresh loader: the same samples, the same tensors
        loader.close()
        loader = shadow(tiny_ckpt, dataset)
        loader.load_state_dict(state)
        for step_index in (2, 3):
            step = loader.next_step()
            assert step.step == step_index
            for a, b in zip(step.materialize(), reference[step_index]):
                assert_same_sample(a, b)

        # error mode names the bad sample
        loader.load_state_dict(state)
        loader.on_bad_sample = "error"
        with pytest.raises(BadSampleError, match="|".join(BAD_SAMPLES)):
            for _ in range(2):
                loader.next_step().materialize()
    finally:
        loader.close()


def test_a_dying_preprocessor_is_restarted_and_its_samples_redecoded(ray_session, tiny_ckpt, dataset, reference):
    import threading

    import ray

    loader = shadow(tiny_ckpt, dataset, "--data.num_decode_workers=1", "--data.prefetch_batches=1")
    try:
        handle = loader.session.handles[0]
        pid = ray.get(handle.ping.remote())
        start = loader.state_dict()
        # Hold this rank's background fetches back, so the kill below lands between decode and fetch.
        gate = threading.Event()
        loader._executor.submit(gate.wait, 120)
        try:
            step = loader.next_step()  # steps 0 and 1 go to the preprocessor
            routed = sum(1 for m in step.metas if m.problem is None)
            deadline = time.monotonic() + 60
            while ray.get(handle.get_stats.remote())["decoded"] < routed and time.monotonic() < deadline:
                time.sleep(0.05)
            ray.kill(handle, no_restart=False)  # dies with its decoded cache; Ray restarts it empty
        finally:
            gate.set()
        for step_index in range(STEPS):
            if step_index:
                step = loader.next_step()
            for a, b in zip(step.materialize(), reference[step_index]):
                assert_same_sample(a, b)
        assert ray.get(handle.ping.remote()) != pid  # a new process
        # what died with the old process was decoded again by the new one when a fetch asked for it (on demand; a
        # fetch or prefetch in flight at the kill is retried by Ray and may decode some of step 0 first, so not
        # necessarily all `routed` of them on demand: 3 of 4 in one suite run)
        stats = ray.get(handle.get_stats.remote())
        assert stats["on_demand"] >= 1 and stats["decoded"] >= routed, (stats, routed)
        # a preprocessor that is gone for good is a clear error, not a hang
        ray.kill(handle, no_restart=True)
        loader.load_state_dict(start)  # replan: the fetches now go to the dead actor
        t0 = time.monotonic()
        with pytest.raises(DataUnavailableError, match="preprocessor"):
            loader.next_step().materialize()
        assert time.monotonic() - t0 < 30
    finally:
        loader.close()


def test_cluster_address_places_a_preprocessor_on_every_node(ray_session, tiny_ckpt, dataset, reference):
    import ray

    loader = shadow(tiny_ckpt, dataset, f"--data.ray_address={ray_session.address}")
    try:
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        assert not loader.session.local and not loader.session.owns_instance
        assert [p.node_id for p in loader.session.preprocessors] == nodes
        for a, b in zip(loader.next_step().materialize(), reference[0]):
            assert_same_sample(a, b)
    finally:
        loader.close()
    assert ray.is_initialized()  # a cluster it joined is left running


def test_slice_loading_each_encoder_loads_exactly_its_frames(ray_session, tiny_ckpt, dataset):
    """Slice-aware loading with a real vision plan: 4 ranks (their StepSlices, sharing this node's
    preprocessor as ranks of one node do) each need a random part of every video's frames; the plan
    names who encodes what, and each rank loads exactly its runs' frames - the union over ranks is
    every needed frame exactly once - with rows bit-equal to the whole sample's, and nothing decoded
    while the step's samples are cached. Once the step is released a slice is decoded alone: fewer
    frames than the whole clip when the range is early."""
    from titanrl.parallel.cost_model import CostModel
    from titanrl.parallel.vision_plan import FrameRun, ItemShape, plan_wave_vision, runs_of
    from titanrl.rl.slice_loading import StepSlices

    world = 4
    loader = shadow(tiny_ckpt, dataset, "--rl.global_batch_size=6")
    try:
        step = loader.next_step()
        whole = {r.position: r for r in step.materialize() if isinstance(r, Materialized)}
        shapes, needs = {}, [dict() for _ in range(world)]
        rng = np.random.default_rng(0)
        for pos, res in whole.items():
            for item, grid in enumerate(res.grids):
                shapes[(pos, item)] = ItemShape(grid.h * grid.w, grid.h * grid.w // 4, not grid.is_video)
                for r in rng.choice(world, size=int(rng.integers(1, world + 1)), replace=False):
                    f0 = int(rng.integers(0, grid.t))
                    needs[r].setdefault((pos, item), set()).update(range(f0, int(rng.integers(f0 + 1, grid.t + 1))))
        needs = [runs_of(n) if n else [] for n in needs]
        assert any(s.is_image is False for s in shapes.values())
        plan = plan_wave_vision(needs, shapes, CostModel(), eligible=[True] * world)
        loaded = []
        for r in range(world):
            slices = StepSlices(step)
            rows = slices.rows(plan.encode[r], lambda run: None)  # as if no prompt were this rank's
            expected_frames = 0
            for run, got in zip(plan.encode[r], rows):
                res, meta = whole[run.group], step.metas[run.group].media[run.item]
                ph = res.meta.placeholders[run.item].temporal(run.f0, run.f1)
                offset = sum(g.num_patches for g in res.grids[:run.item])
                want = res.pixel_values[offset + ph.row_start: offset + ph.row_stop]
                assert got.tobytes() == want.tobytes(), run
                expected_frames += (min(run.f1 * 2, meta.sampled_frames) - run.f0 * 2) if meta.kind == "video" else 1
                loaded += [(run.group, run.item, f) for f in range(run.f0, run.f1)]
            assert slices.stats.frames_fetched == expected_frames  # its runs, nothing more
            assert slices.stats.frames_decoded == 0  # served from the cache of the homes' fetch
            assert slices.stats.frames_local == 0
        needed = {(run.group, run.item, f) for runs in needs for run in runs for f in range(run.f0, run.f1)}
        assert len(loaded) == len(set(loaded)) and set(loaded) == needed

        # released (the next step began): an early slice of a video is decoded alone, by seeking. The
        # release is fire-and-forget to a threaded actor, so a fetch may overtake it (and still be served,
        # from the cache); wait for it here to test the decode path.
        import ray

        ray.get(loader._release(loader._held[-1]))  # the step handed out last
        loader.next_step()
        pos, item = next(k for k, s in shapes.items() if not s.is_image and whole[k[0]].grids[k[1]].t >= 2)
        late = StepSlices(step)
        got = late.rows([FrameRun(pos, item, 0, 1)], lambda run: None)[0]
        offset = sum(g.num_patches for g in whole[pos].grids[:item])
        assert got.tobytes() == whole[pos].pixel_values[offset:offset + got.shape[0]].tobytes()
        clip = step.metas[pos].media[item]
        assert 0 < late.stats.frames_decoded < clip.last_frame_index + 1  # what the whole clip decodes
    finally:
        loader.close()


_CONNECT = """
import sys
from titanrl.data.shadow import ray_runtime
from titanrl.data.shadow.comm import Comm
ray_runtime.connect(sys.argv[1], 256 << 20, Comm(), local_world_size=1)
"""


def test_a_driver_without_the_clusters_token_is_told_to_set_it(tmp_path):
    """A cluster with token authentication (what `ray start --head` starts when ~/.ray/auth_token holds a token)
    and a rank whose environment does not enable it: the error names RAY_AUTH_MODE and the token, not only
    "failed to connect"."""
    import os
    import subprocess

    from train_runs import ray_cluster

    cluster = ray_cluster()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    proc = subprocess.run([sys.executable, "-c", _CONNECT, cluster.address], env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("titanrl.data.shadow.types.DataUnavailableError: rank 0 could not start or join Ray"), last
    assert "RAY_AUTH_MODE=token" in last and "RAY_AUTH_TOKEN" in last, last
