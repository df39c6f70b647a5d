"""Shared helpers of the ShadowLoader tests: a tiny dataset with bad samples, configs, comparisons."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from titanrl.data.manifest import MediaEntry, SampleRecord, read_manifest, write_manifest
from titanrl.data.synth import generate_dataset

TEXT_ONLY = "geo3k-textonly"  # a good sample without media (nothing to decode)

# id -> the kind of bad sample it is (what BadSample.reason must say)
BAD_SAMPLES = {
    "geo3k-missing": "missing",  # manifest names a file that does not exist
    "geo3k-corrupt": "corrupt",  # not an image at all (header probe fails)
    "nextqa-truncated": "corrupt",  # valid header, stream cut in half (fails only when decoded)
    "nextqa-audio": "unsupported",  # an mp4 with no video stream
}


def _audio_only_mp4(path: Path) -> None:
    import av

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        for i in range(4):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def make_dataset(root: Path, num_samples: int = 12, mixture: str = "video-heavy", seed: int = 0,
                 with_bad: bool = True) -> Path:
    """A synthetic dataset; with_bad appends a text-only sample and the BAD_SAMPLES after the good ones."""
    manifest = generate_dataset(root, mixture, num_samples, seed=seed)
    if not with_bad:
        return manifest
    records = read_manifest(manifest)
    image = next(r for r in records if r.media[0].kind == "image") if any(
        r.media[0].kind == "image" for r in records) else None
    video = next(r for r in records if r.media[0].kind == "video")
    media = root / "media"
    (media / "corrupt.png").write_bytes(b"this is not a png file")
    data = (root / video.media[0].path).read_bytes()
    (media / "truncated.mp4").write_bytes(data[: len(data) // 2])  # faststart: the header survives
    _audio_only_mp4(media / "audio.mp4")
    image_prompt = image.prompt if image is not None else "<image>\nWhat colour is the square?"

    def bad(sample_id: str, prompt: str, path: str, kind: str, like: SampleRecord) -> SampleRecord:
        return dataclasses.replace(like, id=sample_id, source=sample_id.split("-")[0], prompt=prompt,
                                   media=[MediaEntry(path, kind)])  # type: ignore[arg-type]

    records += [
        dataclasses.replace(video, id=TEXT_ONLY, source="geo3k", media=[],
                            prompt="Which word names the colour of a ripe tomato: red, green, blue or yellow?"),
        bad("geo3k-missing", image_prompt, "media/missing.png", "image", video),
        bad("geo3k-corrupt", image_prompt, "media/corrupt.png", "image", video),
        bad("nextqa-truncated", video.prompt, "media/truncated.mp4", "video", video),
        bad("nextqa-audio", video.prompt, "media/audio.mp4", "video", video),
    ]
    return write_manifest(records, manifest)


def job_config(*overrides: str):
    from titanrl.config import load_config

    return load_config(None, ["--rl.global_batch_size=4", "--data.prefetch_batches=2", *overrides])


def assert_same_sample(a, b) -> None:
    """Two materialized results (Materialized or BadSample) are bit-identical."""
    from titanrl.data.shadow import BadSample

    assert type(a) is type(b), (a, b)
    if isinstance(a, BadSample):
        assert (a.position, a.sample_id, a.reason) == (b.position, b.sample_id, b.reason), (a, b)
        return
    assert a.position == b.position and a.meta.sample_id == b.meta.sample_id
    assert a.prompt_ids.dtype == b.prompt_ids.dtype and np.array_equal(a.prompt_ids, b.prompt_ids)
    assert a.grids == b.grids
    if a.pixel_values is None or b.pixel_values is None:
        assert a.pixel_values is None and b.pixel_values is None and not a.grids
    else:
        assert a.pixel_values.dtype == b.pixel_values.dtype == np.float32
        assert a.pixel_values.shape == b.pixel_values.shape
        assert a.pixel_values.tobytes() == b.pixel_values.tobytes()  # bit-identical, NaN-safe
    assert len(a.media) == len(b.media)
    for x, y in zip(a.media, b.media):
        assert x.kind == y.kind and x.sampled_fps == y.sampled_fps
        assert x.frames.dtype == y.frames.dtype == np.uint8 and np.array_equal(x.frames, y.frames)
