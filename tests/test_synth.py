"""The synthetic dataset generator, the manifest format and media decoding/probing."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from titanrl.data import synth, vision
from titanrl.data.manifest import (
    ManifestError,
    MediaEntry,
    SampleRecord,
    media_path,
    read_manifest,
    write_manifest,
)
from titanrl.data.media import (
    MediaError,
    load_image,
    load_video,
    num_frames_to_sample,
    probe_image,
    probe_video,
    sample_frame_indices,
)

NUM_SAMPLES = 80
PALETTE = np.array([synth.COLOURS[name] for name in synth.ANSWER_CHOICES], dtype=np.int64)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny dataset per mixture (about 2 s in all)."""
    root = tmp_path_factory.mktemp("synth")
    return {
        mixture: synth.generate_dataset(root / mixture, mixture, NUM_SAMPLES, seed=7, scale="tiny")
        for mixture in synth.MIXTURES
    }


def dominant_colour(pixels: np.ndarray) -> int:
    """Oracle: the palette colour most saturated pixels are nearest to (the background is grey)."""
    flat = pixels.reshape(-1, 3).astype(np.int64)
    saturated = flat[flat.max(axis=1) - flat.min(axis=1) > 80]
    assert len(saturated) > 0, "no coloured region found"
    nearest = ((saturated[:, None, :] - PALETTE[None]) ** 2).sum(axis=-1).argmin(axis=1)
    return int(np.bincount(nearest, minlength=len(PALETTE)).argmax())


def oracle_answer(record: SampleRecord, frames: np.ndarray) -> str:
    if record.source == "longvila":
        per_frame = np.bincount([dominant_colour(frame) for frame in frames], minlength=len(PALETTE))
        return synth.ANSWER_CHOICES[int(per_frame.argmax())]
    return synth.ANSWER_CHOICES[dominant_colour(frames)]


# ------------------------------------------------------------------------------ generator


@pytest.mark.parametrize("mixture", list(synth.MIXTURES))
def test_manifest_is_valid_and_mixture_counts_follow_the_weights(datasets: dict[str, Path], mixture: str) -> None:
    records = read_manifest(datasets[mixture], check_files=True)
    assert len(records) == NUM_SAMPLES
    assert len({r.id for r in records}) == NUM_SAMPLES
    weights = synth.MIXTURES[mixture]
    counts = {source: sum(r.source == source for r in records) for source in weights}
    for source, weight in weights.items():
        assert abs(counts[source] - NUM_SAMPLES * weight / sum(weights.values())) <= 1, counts
    # Sources are interleaved, not blocked: a prefix of the dataset is a mixture too.
    if mixture != "only-video":
        assert len({r.source for r in records[:16]}) >= 2
    assert {r.answer for r in records} == set(synth.ANSWER_CHOICES)  # every colour is used
    for record in records:
        assert record.answer in record.answer_choices == synth.ANSWER_CHOICES
        assert record.answer == record.answer.lower() and " " not in record.answer
        kind = "image" if record.source == "geo3k" else "video"
        assert [m.kind for m in record.media] == [kind]
        assert record.prompt.count(f"<{kind}>") == 1


def test_source_counts_apportion_exactly() -> None:
    assert synth.source_counts("image-heavy", 80) == {"geo3k": 50, "nextqa": 20, "longvila": 10}
    assert synth.source_counts("video-heavy", 80) == {"geo3k": 10, "nextqa": 20, "longvila": 50}
    assert synth.source_counts("only-video", 80) == {"geo3k": 0, "nextqa": 0, "longvila": 80}
    for n in range(0, 40):
        for mixture in synth.MIXTURES:
            assert sum(synth.source_counts(mixture, n).values()) == n


def test_every_file_decodes_and_the_answer_is_visible(datasets: dict[str, Path]) -> None:
    manifest = datasets["image-heavy"]
    sampling = synth.VIDEO_SAMPLING_BY_SCALE["tiny"]
    for record in read_manifest(manifest):
        path = media_path(manifest, record.media[0])
        if record.media[0].kind == "image":
            pixels = load_image(path)
            assert pixels.dtype == np.uint8 and pixels.shape[2] == 3
            assert probe_image(path) == (pixels.shape[1], pixels.shape[0])
        else:
            info = probe_video(path)
            pixels, loaded_info = load_video(path, fps=sampling.fps, max_frames=sampling.max_frames)
            assert info.codec == "h264" and info.num_frames >= 4
            assert pixels.shape == (len(loaded_info.sampled_indices), info.height, info.width, 3)
            assert len(pixels) % 2 == 0 and len(pixels) <= sampling.max_frames
        assert oracle_answer(record, pixels) == record.answer, record.id


def test_longvila_answer_survives_frame_subsampling(datasets: dict[str, Path]) -> None:
    manifest = datasets["video-heavy"]
    records = [r for r in read_manifest(manifest) if r.source == "longvila"][:12]
    for record in records:
        for max_frames in (8, 14, 32):
            frames, _ = load_video(media_path(manifest, record.media[0]), max_frames=max_frames)
            assert oracle_answer(record, frames) == record.answer, (record.id, max_frames)


def test_sizes_vary_and_include_non_multiples_of_28(datasets: dict[str, Path]) -> None:
    sizes = {"image": set(), "video": set()}
    frame_counts = []
    for mixture in ("image-heavy", "video-heavy"):
        manifest = datasets[mixture]
        specs = {spec.id: spec for spec in synth.sample_specs(mixture, NUM_SAMPLES, seed=7)}
        for record in read_manifest(manifest):
            path = media_path(manifest, record.media[0])
            spec = specs[record.id]
            if record.media[0].kind == "image":
                sizes["image"].add(probe_image(path))
                assert probe_image(path) == (spec.width, spec.height)
            else:
                info = probe_video(path)
                sizes["video"].add((info.width, info.height))
                frame_counts.append(info.num_frames)
                # The specs (used for the token-length docs) describe the files exactly.
                assert (info.width, info.height, info.num_frames, info.fps) == (
                    spec.width, spec.height, spec.num_frames, spec.fps
                )
    for kind, (low, high) in (("image", (56, 224)), ("video", (56, 112))):
        sides = [side for size in sizes[kind] for side in size]
        assert min(sides) >= low and max(sides) <= high
        assert any(side % 28 for side in sides) and any(side % 28 == 0 for side in sides)
        assert len(sizes[kind]) >= 10
    assert min(frame_counts) <= 8 and max(frame_counts) >= 48  # short clips and a long tail


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    first = synth.generate_dataset(tmp_path / "a", "video-heavy", 12, seed=3)
    second = synth.generate_dataset(tmp_path / "b", "video-heavy", 12, seed=3)
    other = synth.generate_dataset(tmp_path / "c", "video-heavy", 12, seed=4)
    assert first.read_bytes() == second.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    for record in read_manifest(first):
        a, b = media_path(first, record.media[0]), media_path(second, record.media[0])
        assert a.read_bytes() == b.read_bytes(), record.id


def test_tokens_from_probes_equal_tokens_from_pixels(datasets: dict[str, Path]) -> None:
    """The planners cost samples from header probes only; the pixels must agree with that cost."""
    manifest = datasets["image-heavy"]
    limits, sampling = vision.TINY_PIXEL_LIMITS, synth.VIDEO_SAMPLING_BY_SCALE["tiny"]
    for record in read_manifest(manifest)[:40]:
        path = media_path(manifest, record.media[0])
        if record.media[0].kind == "image":
            width, height = probe_image(path)
            planned = vision.vision_tokens_for_image(
                height, width, min_pixels=limits.image_min_pixels, max_pixels=limits.image_max_pixels
            )
            _, grid = vision.preprocess_image(
                load_image(path), min_pixels=limits.image_min_pixels, max_pixels=limits.image_max_pixels
            )
        else:
            info = probe_video(path)
            num_frames = num_frames_to_sample(
                info.num_frames, info.fps, fps=sampling.fps, max_frames=sampling.max_frames
            )
            planned = vision.vision_tokens_for_video(
                num_frames,
                info.height,
                info.width,
                min_pixels=limits.video_min_pixels,
                max_pixels=limits.video_max_pixels,
            )
            frames, _ = load_video(path, fps=sampling.fps, max_frames=sampling.max_frames)
            _, grid = vision.preprocess_video(
                frames, min_pixels=limits.video_min_pixels, max_pixels=limits.video_max_pixels
            )
        assert planned == int(np.prod(grid)) // 4, record.id


def test_paper_scale_specs_are_realistic() -> None:
    specs = synth.sample_specs("video-heavy", 200, seed=0, scale="paper")
    longvila = [s.num_frames for s in specs if s.source == "longvila"]
    nextqa = [s.num_frames for s in specs if s.source == "nextqa"]
    images = [max(s.width, s.height) for s in specs if s.source == "geo3k"]
    assert np.median(nextqa) > 100 and np.median(longvila) > np.median(nextqa)
    assert max(longvila) > 4 * np.median(longvila)  # long tail
    assert 150 <= min(images) and max(images) <= 800


def test_cli_writes_a_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert synth.main([str(tmp_path), "--mixture", "only-video", "--num-samples", "3", "--seed", "1"]) == 0
    records = read_manifest(tmp_path / "manifest.jsonl", check_files=True)
    assert [r.source for r in records] == ["longvila"] * 3
    assert "manifest.jsonl" in capsys.readouterr().out


# ------------------------------------------------------------------------------ media


def test_frame_sampling_rules() -> None:
    assert num_frames_to_sample(64, 4.0) == 64
    assert num_frames_to_sample(63, 4.0) == 62  # even
    assert num_frames_to_sample(100, 4.0, max_frames=33) == 32
    assert num_frames_to_sample(120, 30.0, fps=2.0) == 8  # 4 s at 2 fps
    assert num_frames_to_sample(3, 30.0, fps=0.1) == 2  # at least one temporal patch
    assert num_frames_to_sample(1, 30.0) == 1
    assert sample_frame_indices(7, 6).tolist() == [0, 1, 2, 4, 5, 6]
    assert sample_frame_indices(5, 5).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        num_frames_to_sample(10, 4.0, max_frames=1)


@given(total=st.integers(1, 5000), fps=st.one_of(st.none(), st.floats(0.1, 60)), cap=st.integers(2, 1024))
def test_frame_sampling_properties(total: int, fps: float | None, cap: int) -> None:
    count = num_frames_to_sample(total, 24.0, fps=fps, max_frames=cap)
    assert 1 <= count <= min(total, cap)
    assert count % 2 == 0 or count == total == 1
    indices = sample_frame_indices(total, count)
    assert len(indices) == count and indices[0] >= 0 and indices[-1] < total
    assert np.all(np.diff(indices) > 0)


def test_probe_counts_packets_when_the_container_reports_no_frames(tmp_path: Path) -> None:
    path = tmp_path / "clip.mkv"
    frames = np.zeros((7, 48, 64, 3), dtype=np.uint8)
    frames[:, :, :, 0] = 200
    import av

    with av.open(str(path), mode="w", format="matroska") as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for pts, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = pts
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0  # the premise: mkv stores no frame count
    info = probe_video(path)
    assert (info.num_frames, info.width, info.height, info.codec) == (7, 64, 48, "h264")
    decoded, loaded = load_video(path)
    assert decoded.shape == (6, 48, 64, 3) and loaded.sampled_indices == (0, 1, 2, 4, 5, 6)


def test_frame_range_decodes_by_seeking_and_equals_the_whole_clip(tmp_path: Path) -> None:
    """A range of sampled frames is bit-equal to the same frames of the whole clip, and the codec
    decodes only from the keyframe before the range (keyframes every 10 frames here), not the clip
    before it; without a keyframe to skip to it decodes from the start, as a whole decode does."""
    from titanrl.data.synth import write_mp4

    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 255, (48, 64, 3), dtype=np.uint8) for _ in range(120)]
    # sampled frame k is source frame 2k + 1
    for keyint, expected in ((10, {(0, 4): 8, (24, 30): 20, (50, 60): 20, (58, 60): 10}),
                             (None, {(0, 4): 8, (24, 30): 60, (50, 60): 120, (58, 60): 120})):
        path = tmp_path / f"keyint{keyint}.mp4"
        write_mp4(path, iter(frames), 64, 48, 30.0, keyint=keyint)
        whole, info = load_video(path, max_frames=60)  # every second source frame
        assert info.decoded_frames == 120
        for (start, stop), decoded in expected.items():
            part, part_info = load_video(path, max_frames=60, frame_range=(start, stop))
            assert np.array_equal(part, whole[start:stop]), (keyint, start, stop)
            assert part_info.sampled_indices == info.sampled_indices
            assert part_info.decoded_frames == decoded, (keyint, start, stop, part_info.decoded_frames)
    with pytest.raises(ValueError, match="outside the 60 sampled frames"):
        load_video(path, max_frames=60, frame_range=(58, 62))


def test_decord_backend_agrees_with_pyav(datasets: dict[str, Path]) -> None:
    pytest.importorskip("decord")
    manifest = datasets["video-heavy"]
    record = next(r for r in read_manifest(manifest) if r.source == "longvila")
    path = media_path(manifest, record.media[0])
    with_pyav, info_pyav = load_video(path, max_frames=16)
    with_decord, info_decord = load_video(path, max_frames=16, backend="decord")
    assert with_pyav.shape == with_decord.shape
    assert info_pyav.sampled_indices == info_decord.sampled_indices
    # Different YUV->RGB conversions: close, not equal.
    assert np.abs(with_pyav.astype(int) - with_decord.astype(int)).mean() < 8


def _copy_truncated(source: Path, target: Path, fraction: float) -> Path:
    data = source.read_bytes()
    target.write_bytes(data[: int(len(data) * fraction)])
    return target


def test_missing_corrupt_and_truncated_files_raise_media_error(datasets: dict[str, Path], tmp_path: Path) -> None:
    manifest = datasets["image-heavy"]
    records = read_manifest(manifest)
    by_ext = {}
    for record in records:
        by_ext.setdefault(Path(record.media[0].path).suffix, media_path(manifest, record.media[0]))
    missing = tmp_path / "nope.png"
    for loader in (load_image, probe_image, load_video, probe_video):
        with pytest.raises(MediaError, match="nope.png.*does not exist"):
            loader(missing)
    garbage_image = tmp_path / "garbage.png"
    garbage_image.write_bytes(b"this is not an image" * 10)
    garbage_video = tmp_path / "garbage.mp4"
    garbage_video.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 100)
    for loader, path in (
        (load_image, garbage_image),
        (probe_image, garbage_image),
        (probe_video, garbage_video),
        (load_video, garbage_video),
    ):
        with pytest.raises(MediaError) as error:
            loader(path)
        assert str(path) in str(error.value)
    for ext in (".png", ".jpg"):
        truncated = _copy_truncated(by_ext[ext], tmp_path / f"truncated{ext}", 0.5)
        with pytest.raises(MediaError, match=f"truncated\\{ext}"):
            load_image(truncated)
    video_source = next(
        media_path(manifest, r.media[0]) for r in records if r.source == "longvila"
    )
    truncated_video = _copy_truncated(video_source, tmp_path / "truncated.mp4", 0.6)
    with pytest.raises(MediaError, match="truncated.mp4"):
        load_video(truncated_video)
    error = MediaError("/data/x.mp4", "bad")
    clone = pickle.loads(pickle.dumps(error))  # crosses process boundaries in loader workers
    assert (clone.path, clone.reason, str(clone)) == ("/data/x.mp4", "bad", "/data/x.mp4: bad")


# ------------------------------------------------------------------------------ manifest


def _write_lines(path: Path, objects: list[dict]) -> Path:
    path.write_text("".join(json.dumps(obj) + "\n" for obj in objects))
    return path


def _good_line() -> dict:
    return {
        "id": "s1",
        "source": "geo3k",
        "prompt": "<image>\nWhat colour?",
        "media": [{"path": "media/a.png", "kind": "image"}],
        "answer": "red",
        "answer_choices": ["red", "blue"],
    }


def test_manifest_round_trip(tmp_path: Path) -> None:
    records = [
        SampleRecord("a", "geo3k", "<image> colour?", [MediaEntry("m/a.png", "image")], "red", ["red", "blue"]),
        SampleRecord("b", "nextqa", "<video> colour?", [MediaEntry("m/b.mp4", "video")], "blue", ["red", "blue"]),
    ]
    path = write_manifest(records, tmp_path / "manifest.jsonl")
    assert read_manifest(path) == records


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda o: o.pop("answer"), r":2: sample 's1': missing key 'answer'"),
        (lambda o: o["media"][0].update(kind="audio"), r":2: sample 's1': key 'media\[0\].kind' is 'audio'"),
        (lambda o: o.update(prompt="no placeholder"), r":2: sample 's1': key 'prompt' has 0 media placeholder"),
        (lambda o: o.update(prompt="<video> wrong kind"), r"placeholders \['<video>'\] do not match"),
        (lambda o: o["media"][0].pop("path"), r":2: sample 's1': media\[0\]: missing key 'path'"),
        (lambda o: o.update(source=""), r":2: sample 's1': key 'source' is empty"),  # any other name is accepted
        (lambda o: o.update(answer="green"), r"key 'answer' is 'green', not one of"),
    ],
)
def test_manifest_errors_name_line_sample_and_key(tmp_path: Path, mutate, message: str) -> None:
    good, bad = _good_line(), _good_line()
    good["id"] = "s0"
    mutate(bad)
    path = _write_lines(tmp_path / "manifest.jsonl", [good, bad])
    with pytest.raises(ManifestError, match=message):
        read_manifest(path)


def test_manifest_missing_media_file_and_bad_json(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "manifest.jsonl", [_good_line()])
    read_manifest(path)  # files are not checked by default
    with pytest.raises(ManifestError, match=r":1: sample 's1': key 'media\[0\].path' names a missing file .*a.png"):
        read_manifest(path, check_files=True)
    path.write_text("{not json\n")
    with pytest.raises(ManifestError, match=r"manifest.jsonl:1: invalid JSON"):
        read_manifest(path)
    with pytest.raises(ManifestError, match="duplicate"):
        record = SampleRecord("x", "geo3k", "<image>", [MediaEntry("a.png", "image")], "red")
        write_manifest([record, record], tmp_path / "m")


def test_dataset_folder_is_relocatable(datasets: dict[str, Path], tmp_path: Path) -> None:
    moved = tmp_path / "moved"
    shutil.copytree(datasets["only-video"].parent, moved)
    records = read_manifest(moved / "manifest.jsonl", check_files=True)
    assert all(not Path(r.media[0].path).is_absolute() for r in records)
