"""ShadowLoader without Ray: metadata, cache, placeholders, planning, resume, the preprocessor core and
the centralized baseline. (Ray and multi-rank: tests/test_shadow_ray.py, tests/test_shadow_dist.py.)"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from shadow_common import BAD_SAMPLES, TEXT_ONLY, assert_same_sample, job_config, make_dataset  # noqa: E402

from titanrl.data.manifest import read_manifest  # noqa: E402
from titanrl.data.preprocess import MediaSettings, prepare_sample  # noqa: E402
from titanrl.data.prompt import PromptEncoder  # noqa: E402
from titanrl.data.shadow import (  # noqa: E402
    BadSample,
    BadSampleError,
    CentralizedLoader,
    Materialized,
    PixelPlaceholder,
    ProxyLoader,
    assign_balanced,
    assign_round_robin,
    epoch_permutation,
    load_metadata,
    placeholders_for_token_range,
)
from titanrl.data.shadow.comm import Comm  # noqa: E402
from titanrl.data.shadow.metadata import cache_path_for  # noqa: E402
from titanrl.data.shadow.placeholder import media_token_offsets  # noqa: E402
from titanrl.data.shadow.plan import check_assignment, consumers_of, route_samples  # noqa: E402
from titanrl.data.shadow.preprocessor import DecodeTask, PreprocessorCore  # noqa: E402
from titanrl.models.qwen2_5_vl.positions import VisionGrid  # noqa: E402


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("shadow_data"), num_samples=11)  # + text-only + 4 bad = 16


@pytest.fixture(scope="module")
def encoder(tiny_ckpt) -> PromptEncoder:
    return PromptEncoder.from_pretrained(tiny_ckpt)


@pytest.fixture(scope="module")
def settings(tiny_ckpt) -> MediaSettings:
    return MediaSettings.from_checkpoint(tiny_ckpt, fps=2.0, max_frames=8)


@pytest.fixture(scope="module")
def table(dataset, settings, encoder):
    return load_metadata(dataset, settings, encoder, max_prompt_tokens=256)


# ------------------------------------------------------------------------------------ metadata


def test_metadata_equals_what_decoding_gives(dataset, table, settings, encoder):
    # a truncated stream has a valid header: only decoding finds it
    good = [m for m in table.metas if m.problem is None and m.sample_id != "nextqa-truncated"]
    assert len(good) == 12 and len(table.metas) == 12 + len(BAD_SAMPLES)
    assert next(m for m in good if m.sample_id == TEXT_ONLY).media == ()
    for meta in good:
        prepared = prepare_sample(meta.record, dataset.parent, encoder, settings)
        assert meta.grids == prepared.grids
        assert np.array_equal(meta.prompt_ids, prepared.prompt_ids) and meta.num_tokens == len(prepared.prompt_ids)
        if meta.media:
            assert prepared.pixel_values.shape == (meta.num_patches, meta.patch_dim)
        for mm, dm in zip(meta.media, prepared.media):
            assert mm.sampled_frames == dm.frames.shape[0] and (mm.height, mm.width) == dm.frames.shape[1:3]
            assert mm.sampled_fps == dm.sampled_fps
        assert [p.shape for p in meta.placeholders] == [(g.num_patches, meta.patch_dim) for g in meta.grids]


def test_bad_samples_are_classified_from_headers(table):
    problems = {m.sample_id: m.problem.kind for m in table.metas if m.problem}
    assert problems == {k: v for k, v in BAD_SAMPLES.items() if k != "nextqa-truncated"}
    missing = next(m for m in table.metas if m.sample_id == "geo3k-missing")
    assert "missing.png" in missing.problem.detail and "does not exist" in missing.problem.detail


def test_too_long_prompts_are_flagged(dataset, settings, encoder):
    t = load_metadata(dataset, settings, encoder, max_prompt_tokens=60, use_cache=False)
    long = [m for m in t.metas if m.problem and m.problem.kind == "too_long"]
    assert long and all(m.num_tokens > 60 and "data.max_prompt_tokens=60" in m.problem.detail for m in long)


def test_metadata_cache_skips_probes_and_notices_changes(tmp_path, settings, encoder):
    manifest = make_dataset(tmp_path, num_samples=6, mixture="image-heavy", with_bad=False)
    first = load_metadata(manifest, settings, encoder)
    assert first.stats.probes == 6 and first.stats.cache_hits == 0 and cache_path_for(manifest).is_file()
    second = load_metadata(manifest, settings, encoder)
    assert second.stats.probes == 0 and second.stats.cache_hits == 6
    assert [m.signature() for m in first.metas] == [m.signature() for m in second.metas]
    # a file that changes (size/mtime) is probed again
    path = manifest.parent / read_manifest(manifest)[0].media[0].path
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10_000_000_000))
    third = load_metadata(manifest, settings, encoder)
    assert third.stats.probes == 1 and third.stats.cache_hits == 5
    # a damaged cache is rebuilt, not trusted
    cache_path_for(manifest).write_text("{not json\n")
    assert load_metadata(manifest, settings, encoder).stats.probes == 6


# ------------------------------------------------------------------------------------ placeholders


def test_placeholder_slicing():
    grid = VisionGrid(4, 6, 8, is_video=True, second_per_grid=1.0)  # 8 frames, 48 rows per group
    ph = PixelPlaceholder.whole(3, 1, "v", 0, grid, 1176)
    assert ph.shape == (192, 1176) and ph.meta.device.type == "meta" and ph.meta.shape == (192, 1176)
    f = ph.frames(2, 6)
    assert (f.row_start, f.row_stop) == (48, 144) and f.frame_span() == (2, 6) and f.group_span() == (1, 3)
    t = ph.tokens(10, 20)  # 4 rows per token
    assert (t.row_start, t.row_stop) == (40, 80) and t.group_span() == (0, 2) and t.frame_span() == (0, 4)
    assert t.rows(4, 8).row_start == 44 and t.rows(4, 8).num_tokens == 1
    with pytest.raises(ValueError):
        ph.frames(1, 4)  # not on a temporal-patch boundary
    with pytest.raises(IndexError):
        ph.tokens(40, 49)
    image = PixelPlaceholder.whole(0, 0, "i", 1, VisionGrid(1, 4, 4), 1176)
    assert image.frames(0, 1).shape == (16, 1176) and image.tokens(1, 3).frame_span() == (0, 1)


def test_token_range_maps_to_media_rows(table):
    meta = next(m for m in table.metas if m.problem is None and m.media and m.media[0].kind == "video")
    offsets = media_token_offsets(meta.pad_positions, [m.tokens for m in meta.media])
    assert offsets == meta.token_offsets
    ids, first, n = meta.prompt_ids, offsets[0], meta.media[0].tokens
    pad = ids[first]
    assert ids[first - 1] != pad and (ids[first:first + n] == pad).all() and ids[first + n] != pad
    cut = meta.placeholders_for_tokens(first + 3, first + n + 5)
    assert len(cut) == 1 and cut[0].row_start == 3 * 4 and cut[0].row_stop == n * 4
    assert placeholders_for_token_range(meta.placeholders, offsets, 0, first) == []


# ------------------------------------------------------------------------------------ planning


def test_proxy_loader_is_deterministic_and_follows_the_epoch_permutation(table):
    a, b = ProxyLoader(table, 5, seed=3), ProxyLoader(table, 5, seed=3)
    n = len(table)
    expected = np.concatenate([epoch_permutation(n, 3, e) for e in range(3)])
    got = []
    for step in range(7):  # 35 samples: crosses two epoch boundaries (n = 16)
        sa, ma, _ = a.next_batch()
        _, mb, _ = b.next_batch()
        assert sa == step and [m.signature() for m in ma] == [m.signature() for m in mb]
        got += [(m.epoch, m.index) for m in ma]
    flat = [(e, int(i)) for e in range(3) for i in epoch_permutation(n, 3, e)]
    assert got == flat[:35] and [i for _, i in got] == expected[:35].tolist()


@pytest.mark.parametrize("stop_after", [1, 3, 4])  # mid-epoch, and exactly at an epoch boundary (16 = 4 x 4)
def test_proxy_loader_resumes_exactly(table, stop_after):
    straight = ProxyLoader(table, 4, seed=0)
    sequence = [[m.key for m in straight.next_batch()[1]] for _ in range(8)]
    first = ProxyLoader(table, 4, seed=0)
    for _ in range(stop_after):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = ProxyLoader(table, 4, seed=0)
    resumed.load_state_dict(state)
    assert [[m.key for m in resumed.next_batch()[1]] for _ in range(8 - stop_after)] == sequence[stop_after:]
    with pytest.raises(ValueError, match="global_batch_size"):
        ProxyLoader(table, 3, seed=0).load_state_dict(state)


def test_assignments(table):
    metas = ProxyLoader(table, 8, seed=0).next_batch()[1]
    for fn in (assign_balanced, assign_round_robin):
        parts = check_assignment(fn(metas, 3), len(metas), 3)
        assert sorted(p for part in parts for p in part) == list(range(8))
    assert assign_round_robin(metas, 3)[1] == [1, 4, 7]
    costs = [sum(metas[p].num_tokens for p in part if metas[p].problem is None) for part in assign_balanced(metas, 2)]
    single = sorted((m.num_tokens for m in metas if m.problem is None), reverse=True)
    assert max(costs) - min(costs) <= single[0]  # greedy LPT bound
    with pytest.raises(ValueError):
        check_assignment([[0, 9]], 8, 1)


def test_routing_is_least_loaded_and_prefers_the_consumers_node(table):
    from titanrl.data.shadow.plan import decode_cost

    metas = [m for m in table.metas if m.problem is None and m.media]
    # one node, two preprocessors: least-loaded by decode cost
    consumers = consumers_of(assign_round_robin(metas, 4), len(metas))
    routes = route_samples(metas, consumers, ["n0", "n0"], ["n0"] * 4)
    loads = [0.0, 0.0]
    for r, m in zip(routes, metas):
        loads[r.preprocessor] += decode_cost(m)
    assert max(loads) - min(loads) <= max(decode_cost(m) for m in metas)
    # two nodes consuming the same mix (distinct costs): every sample is decoded on its consumer's node
    distinct = list({decode_cost(m): m for m in metas}.values())
    twice = distinct + distinct
    consumers = [[0]] * len(distinct) + [[2]] * len(distinct)
    routes = route_samples(twice, consumers, ["n0", "n1"], ["n0", "n0", "n1", "n1"])
    assert [r.preprocessor for r in routes] == [0] * len(distinct) + [1] * len(distinct)
    # bad samples and unconsumed ones are not routed
    bad = [m for m in table.metas if m.problem is not None]
    assert route_samples(bad + metas[:1], [[0]] * len(bad) + [[]], ["n0"], ["n0"]) == [None] * (len(bad) + 1)


# ------------------------------------------------------------------------------------ preprocessor core


def _tasks(table, step=0, consumers=1):
    return {m.sample_id: DecodeTask(f"{step}:{i}:{m.sample_id}", step, m.record, consumers)
            for i, m in enumerate(table.metas)}


def test_preprocessor_core_decodes_serves_and_evicts(dataset, table, settings):
    tasks = _tasks(table, consumers=2)
    core = PreprocessorCore(str(dataset.parent), settings, num_threads=2, cache_bytes=1 << 30)
    good = [m for m in table.metas if m.problem is None][:4]
    assert core.prefetch([tasks[m.sample_id] for m in good]) == 4
    assert core.prefetch([tasks[good[0].sample_id]]) == 0  # idempotent
    results = {}
    threads = [threading.Thread(target=lambda m=m: results.setdefault(m.sample_id, core.fetch(tasks[m.sample_id])))
               for m in good]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for m in good:
        reply = results[m.sample_id]
        assert reply.ok and [p.data.shape[0] for p in reply.media] == [mm.sampled_frames for mm in m.media]
    stats = core.get_stats()
    assert stats["decoded"] == 4 and stats["entries"] == 4  # one consumer of two has fetched
    core.release([tasks[m.sample_id].key for m in good])
    assert core.get_stats()["entries"] == 0 and core.get_stats()["cached_bytes"] == 0
    # an unknown (evicted / restarted) key is decoded on demand: a frame range alone (nothing cached,
    # only frames up to the range's end decoded), a whole fetch whole (and cached); a range of a cached
    # sample is served without decoding
    video = next(m for m in good if m.media[0].kind == "video")
    part = core.fetch(tasks[video.sample_id], {0: (2, 4)}, consume=False)
    assert core.get_stats()["entries"] == 0 and core.get_stats()["range_decodes"] == 1
    whole = core.fetch(tasks[video.sample_id], consume=False)
    assert part.media[0].frame_start == 2 and np.array_equal(part.media[0].data, whole.media[0].data[2:4])
    head = core.fetch(DecodeTask("head", 0, video.record, 1), {0: (0, 2)}, consume=False)  # an unknown key
    assert 0 < head.decoded_frames < whole.decoded_frames  # decoding stops after the range
    assert 0 < part.decoded_frames <= whole.decoded_frames
    assert core.get_stats()["on_demand"] == 3
    cached = core.fetch(tasks[video.sample_id], {0: (2, 4)}, consume=False)
    assert cached.decoded_frames == 0 and np.array_equal(cached.media[0].data, part.media[0].data)
    # a file that fails to decode is an error reply naming it, not an exception
    truncated = core.fetch(tasks["nextqa-truncated"])
    assert not truncated.ok and truncated.error_kind == "corrupt" and "truncated.mp4" in truncated.error_detail
    core.close()


def test_preprocessor_core_bounds_decode_ahead(dataset, table, settings):
    tasks = _tasks(table)
    good = [m for m in table.metas if m.problem is None and m.media and m.media[0].kind == "video"][:4]
    core = PreprocessorCore(str(dataset.parent), settings, num_threads=1, cache_bytes=1, stall_s=60.0)
    core.prefetch([tasks[m.sample_id] for m in good])
    time.sleep(1.0)
    assert core.get_stats()["decoded"] == 1  # over budget after one: the rest wait for releases
    core.release([tasks[good[0].sample_id].key])
    deadline = time.monotonic() + 20
    while core.get_stats()["decoded"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert core.get_stats()["decoded"] == 2
    core.close()


_CRASHING_PROCESS = r"""
import pickle, sys, threading, time, json
from pathlib import Path
from titanrl.data.shadow.preprocessor import DecodeTask, PreprocessorCore
manifest_dir, settings_file, journal, mode, first, then = sys.argv[1:7]
settings, records = pickle.loads(Path(settings_file).read_bytes())
core = PreprocessorCore(manifest_dir, settings, num_threads=0, journal_path=journal)
fetch = lambda sid: core.fetch(DecodeTask("0:0:" + sid, 0, records[sid], 1))
if mode == "concurrent":  # the crash happens while the first sample is decoding too
    threading.Thread(target=fetch, args=(first,), daemon=True).start()
    while first not in json.loads(Path(journal).read_text())["in_flight"]:
        time.sleep(0.001)
elif mode == "sequential":
    print("first ok" if fetch(first).ok else "first failed", flush=True)
fetch(then)
print("no crash")
"""


def test_a_sample_that_kills_the_decoder_is_condemned_and_the_others_decode(dataset, table, settings, tmp_path):
    """The decoder dies for real (SIGSEGV in a child process, as a crash inside FFmpeg would); each next
    preprocessor process on the same journal (what Ray's restart gives) decodes suspects one at a time,
    condemns the sample that was decoding alone, and serves everything else."""
    import pickle
    import signal
    import subprocess

    from titanrl.data.shadow.crash_journal import CrashJournal
    from titanrl.data.shadow.preprocessor import FAULT_DECODE_CRASH_ENV

    good = [m for m in table.metas if m.problem is None and m.media]
    videos = [m for m in good if m.media[0].kind == "video"]
    innocent = max(videos, key=lambda m: sum(g.t * g.h * g.w for g in m.grids))  # the longest decode
    culprit = next(m for m in good if m is not innocent)
    culprit_file = Path(culprit.record.media[0].path).name
    assert culprit_file != Path(innocent.record.media[0].path).name
    records = {m.sample_id: m.record for m in good}
    settings_file = tmp_path / "settings.pkl"
    settings_file.write_bytes(pickle.dumps((settings, records)))
    journal = tmp_path / "journal.json"
    env = {**os.environ, FAULT_DECODE_CRASH_ENV: culprit_file}

    def run(mode: str, first: str, then: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _CRASHING_PROCESS, str(dataset.parent), str(settings_file),
                               str(journal), mode, first, then], env=env, capture_output=True, text=True, timeout=120)

    # 1) the decoder dies with two samples in flight: the journal says both were decoding
    proc = run("concurrent", innocent.sample_id, culprit.sample_id)
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-2000:]
    assert set(json.loads(journal.read_text())["in_flight"]) == {innocent.sample_id, culprit.sample_id}
    # 2) the restarted process decodes each suspect alone: the innocent decodes, the culprit kills it again
    proc = run("sequential", innocent.sample_id, culprit.sample_id)
    assert proc.returncode == -signal.SIGSEGV and "first ok" in proc.stdout, proc.stderr[-2000:]
    assert json.loads(journal.read_text())["in_flight"] == {culprit.sample_id: [str(dataset.parent /
                                                                               culprit.record.media[0].path)]}
    # one death alone is a strike, not a verdict (the process may have been killed from outside): again
    proc = run("alone", "", culprit.sample_id)
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-2000:]
    # 3) the next process condemns it: a named decoder_crash bad sample, never decoded again; the rest decodes
    core = PreprocessorCore(str(dataset.parent), settings, num_threads=0, journal_path=str(journal))
    reply = core.fetch(DecodeTask(f"1:0:{culprit.sample_id}", 1, culprit.record, 1))
    assert reply.error_kind == "decoder_crash" and culprit_file in reply.error_detail
    assert core.get_stats()["restarts"] == 3 and not core._journal.suspects and core._journal.unattributed == 0
    assert all(core.fetch(DecodeTask(f"1:{i}:{m.sample_id}", 1, m.record, 1)).ok for i, m in enumerate(good[1:4]))
    core.close()
    assert not journal.exists()
    # 4) restarts that no decode explains stop after a bound, with a clear error
    from titanrl.data.shadow.crash_journal import MAX_UNATTRIBUTED, PreprocessorCrashLoop

    CrashJournal(journal)
    with pytest.raises(PreprocessorCrashLoop, match="decoding nothing"):
        for _ in range(MAX_UNATTRIBUTED + 1):
            CrashJournal(journal)


# ------------------------------------------------------------------------------------ centralized baseline


def _centralized(table, settings, **kw) -> CentralizedLoader:
    return CentralizedLoader(table, settings, Comm(), global_batch_size=4, seed=0, **kw)


def test_centralized_equals_prepare_sample_and_skips_bad(dataset, table, settings, encoder):
    loader = _centralized(table, settings, num_decode_workers=2)
    seen_bad = set()
    for _ in range(4):  # 16 samples = one epoch: every bad sample shows up once
        step = loader.next_step()
        assert step.mine == sorted(step.mine) and sorted(step.mine) == list(range(4))
        for res in step.materialize():
            if isinstance(res, BadSample):
                assert res.reason == BAD_SAMPLES[res.sample_id]
                seen_bad.add(res.sample_id)
                continue
            assert isinstance(res, Materialized)
            p = prepare_sample(res.record, dataset.parent, encoder, settings)
            from titanrl.data.shadow.types import Materialized as M

            assert_same_sample(res, M(res.position, res.meta, p.prompt_ids, p.grids, p.pixel_values, p.media))
    assert seen_bad == set(BAD_SAMPLES)
    loader.close()


def test_centralized_sends_frames_not_pixels(dataset, table, settings, encoder):
    """Rank 0 scatters decoded uint8 frames only (what verl's driver sends with return_multi_modal_inputs=false);
    each rank builds its own float32 pixel_values, equal to prepare_sample's."""
    from titanrl.data.shadow.centralized import Decoded

    sent = []

    class Recording(Comm):
        def scatter(self, per_rank, src=0):
            sent.extend(x for rank in per_rank for x in rank)
            return super().scatter(per_rank, src)

    loader = CentralizedLoader(table, settings, Recording(), global_batch_size=4, seed=0)
    got = [r for r in loader.next_step().materialize() if isinstance(r, Materialized)]
    loader.close()
    decoded = [x for x in sent if not isinstance(x, BadSample)]
    assert decoded and all(isinstance(x, Decoded) for x in decoded)
    assert all(m.frames.dtype == np.uint8 for x in decoded for m in x.media)
    assert any(r.pixel_values is not None for r in got)
    for res in got:
        p = prepare_sample(res.record, dataset.parent, encoder, settings)
        assert (res.pixel_values is None) == (p.pixel_values is None)
        if p.pixel_values is not None:
            assert res.pixel_values.dtype == np.float32 and np.array_equal(res.pixel_values, p.pixel_values)


def test_centralized_prefetch_decodes_ahead_same_batches_and_resumes(table, settings):
    """data.prefetch_batches for the centralized baseline: rank 0 decodes the next steps while the
    current one computes (their decode has finished before they are materialized), the batches are
    those of the loader without prefetch, and a state saved mid-run resumes at the same step."""
    def ids(results):
        return [(r.sample_id, r.position) if isinstance(r, BadSample) else (r.meta.sample_id, r.position)
                for r in results]

    plain = _centralized(table, settings, num_decode_workers=1)
    ahead = _centralized(table, settings, num_decode_workers=1, prefetch_batches=2)
    state = None
    for i in range(5):
        a, b = plain.next_step(), ahead.next_step()
        planned = list(ahead._planned.values())
        assert [p.step for p in planned] == [b.step + 1, b.step + 2]
        for p in planned:
            p.decoded.result(timeout=60)  # decoded in the background, before anyone asks for it
        assert ids(a.materialize()) == ids(b.materialize()) and a.step == b.step
        if i == 1:
            state = ahead.state_dict()  # resumes at step 2: the first step not handed out
    resumed = _centralized(table, settings, num_decode_workers=1, prefetch_batches=2)
    resumed.load_state_dict(state)
    again = _centralized(table, settings, num_decode_workers=1)
    for _ in range(2):
        again.next_step()
    for step in (2, 3):
        x, y = again.next_step(), resumed.next_step()
        assert x.step == y.step == step and ids(x.materialize()) == ids(y.materialize())
    for loader in (plain, ahead, resumed, again):
        loader.close()


def test_bad_sample_error_mode_names_the_sample(table, settings):
    loader = _centralized(table, settings, on_bad_sample="error")
    with pytest.raises(BadSampleError, match=r"sample '(geo3k|nextqa)-[a-z]+' .*: (missing|corrupt|unsupported)"):
        for _ in range(4):
            loader.next_step().materialize()


def test_config_defaults_select_shadow_and_keep_the_baseline():
    assert job_config().data.loader == "shadow"
    assert job_config("--data.loader=centralized", "--data.slice_loading=false").data.loader == "centralized"
    # the baseline decodes on rank 0 without Ray: a cluster address would do nothing
    from titanrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"data.ray_address='10.0.0.1:6379' is the Ray cluster of ShadowLoader's "
                                          r"preprocessors, but data.loader='centralized'"):
        job_config("--data.loader=centralized", "--data.slice_loading=false", "--data.ray_address=10.0.0.1:6379")
    from titanrl.config import load_config

    tiny = load_config(Path(__file__).parents[1] / "configs" / "tiny_cpu.toml", [])
    assert tiny.data.loader == "shadow" and tiny.data.metadata_cache


def test_unreachable_ray_fails_fast_with_the_address():
    from titanrl.data.shadow.ray_runtime import check_reachable
    from titanrl.data.shadow.types import DataUnavailableError

    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(DataUnavailableError, match=f"127.0.0.1:{port}"):
        check_reachable(f"127.0.0.1:{port}", timeout_s=2.0)
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(DataUnavailableError, match="not supported"):
        check_reachable("ray://head:10001")


def test_driver_attaches_to_the_raylet_on_its_own_host():
    """Ray picks a driver's raylet from the process table; with several raylets visible (hosts sharing a
    PID namespace) the one on this host's own address is named, otherwise Ray's choice stands."""
    from titanrl.data.shadow.ray_runtime import pick_driver_node_ip

    assert pick_driver_node_ip({"10.0.0.1", "10.0.0.2"}, {"127.0.0.1", "10.0.0.2"}) == "10.0.0.2"
    assert pick_driver_node_ip({"10.0.0.1"}, {"127.0.0.1", "10.0.0.2"}) is None  # one raylet: unambiguous
    assert pick_driver_node_ip({"10.0.0.1", "10.0.0.2"}, {"127.0.0.1"}) is None  # none here: Ray decides
    assert pick_driver_node_ip({"10.0.0.1", "10.0.0.2"}, {"10.0.0.1", "10.0.0.2"}) is None  # both here
