"""Synthetic stand-ins for the paper's Geo3K / NExTQA / LongVILA-Reason mixtures, generated locally.

    python -m titanrl.data.synth OUTDIR --mixture image-heavy|video-heavy|only-video|arithmetic|zoom \
        --num-samples N [--seed S] [--scale tiny|paper] [--format titanrl|verl|easyr1]

writes ``OUTDIR/media/*`` (PNG/JPEG images, h264 mp4 videos) and ``OUTDIR/manifest.jsonl``; with
``--format verl|easyr1`` also ``OUTDIR/train.parquet``, the same samples in that schema with the
images embedded as bytes (``titanrl.data.synth_formats``). ``arithmetic`` is a different task: count
the squares of an image and add a number, answered in ``\\boxed{}`` (for the ``math`` reward). ``zoom``: the colour of
a dot too small to read at the first view's resolution, for multi-turn runs with ``titanrl.envs.zoom:ZoomEnv``.

The samples have the *shape* of the real sources -- one image of moderate, varied size with a
geometry-style text (Geo3K); a short clip of tens of frames (NExTQA); a long clip with a long tail of
frame counts (LongVILA-Reason) -- mixed by the paper's sampling weights, so sequence-length skew and
vision-tower cost behave like the paper's workloads. The *task* is deliberately easy so that a ~1M
parameter VLM trained from scratch with RL learns it within minutes on CPU, with an exactly verifiable
answer: every question asks for one of four colours, carried by a large region of the picture.

- geo3k:    "What colour is the square?" -- a uniform square covering 45-75% of the shorter side on a
            grey noise background with a few dark diagram lines under it.
- nextqa:   "What colour is the ball?" -- a disc whose radius is 25-40% of the shorter side, moving
            across a panning grey noise background; same colour in every frame.
- longvila: "Which colour fills most frames?" -- scenes of large coloured rectangles; the answer colour
            is the strict plurality of frames under every uniform sampling of >= 8 frames (checked
            with titanrl.data.media's sampling rule, so any fps/max_frames leaving >= 8 frames keeps it).

Everything is drawn from numpy generators seeded by (seed, sample index), so a seed gives the same
manifest and the same file bytes (PNG, JPEG and single-threaded x264 are deterministic).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from titanrl.data.manifest import MediaEntry, SampleRecord, write_manifest
from titanrl.data.media import sample_frame_indices

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 215, 40),
}
ANSWER_CHOICES: list[str] = list(COLOURS)
CHOICES_TEXT = "Answer with one word: red, green, blue or yellow."

# The paper's sampling weights (sec. 5.1): Geo3K : NExTQA : LongVILA-Reason.
MIXTURES: dict[str, dict[str, int]] = {
    "image-heavy": {"geo3k": 5, "nextqa": 2, "longvila": 1},
    "video-heavy": {"geo3k": 1, "nextqa": 2, "longvila": 5},
    "only-video": {"geo3k": 0, "nextqa": 0, "longvila": 1},
}
SCALES: tuple[str, ...] = ("tiny", "paper")

# The longvila answer must survive any uniform subsampling down to this many frames.
MIN_SAMPLED_FRAMES_FOR_PLURALITY = 8


@dataclass(frozen=True)
class VideoSampling:
    """How a scale's videos are meant to be loaded (titanrl.data.media.load_video arguments)."""

    fps: float | None
    max_frames: int


# Tiny: keep every frame up to 64. Paper: 2 fps capped at 256 frames (the paper's runs use 64-256).
VIDEO_SAMPLING_BY_SCALE: dict[str, VideoSampling] = {
    "tiny": VideoSampling(fps=None, max_frames=64),
    "paper": VideoSampling(fps=2.0, max_frames=256),
}


@dataclass(frozen=True)
class ScaleProfile:
    image_side_range: tuple[int, int]  # geo3k image sides, pixels
    video_sizes: tuple[tuple[int, int], ...]  # (width, height) choices for "realistic" video sizes
    video_side_range: tuple[int, int]  # range for the random-size videos (even sides)
    nextqa_seconds: tuple[float, float, float, float]  # lognormal median, sigma, clip low, clip high
    longvila_seconds: tuple[float, float, float, float]
    nextqa_fps: float  # native frame rate of the written files
    longvila_fps: float
    geo3k_preamble_sentences: tuple[int, int]  # inclusive range
    video_preamble_sentences: tuple[int, int]


# Tiny: images 56..224 px, videos 56..112 px and 4..64 frames -- CPU-test sized, still skewed.
# Paper: Geo3K-like diagrams of 150..800 px; NExTQA ~40 s clips (its mean is 44 s) and LongVILA
# clips of minutes with a tail to 15 min, at 360p-480p. Files are written at a low native fps
# (4 and 2) to bound generation time; loading at 2 fps (capped at 256) is what the paper feeds.
PROFILES: dict[str, ScaleProfile] = {
    "tiny": ScaleProfile(
        image_side_range=(56, 224),
        video_sizes=((56, 56), (84, 56), (112, 84), (112, 112), (84, 84)),
        video_side_range=(56, 112),
        nextqa_seconds=(3.0, 0.45, 1.0, 6.0),
        longvila_seconds=(7.0, 0.45, 4.0, 16.0),
        nextqa_fps=4.0,
        longvila_fps=4.0,
        geo3k_preamble_sentences=(0, 2),
        video_preamble_sentences=(0, 1),
    ),
    "paper": ScaleProfile(
        image_side_range=(150, 800),
        video_sizes=((640, 360), (640, 480), (480, 360), (854, 480), (426, 240), (560, 420)),
        video_side_range=(240, 640),
        nextqa_seconds=(40.0, 0.45, 8.0, 180.0),
        longvila_seconds=(180.0, 0.9, 30.0, 900.0),
        nextqa_fps=4.0,
        longvila_fps=2.0,
        geo3k_preamble_sentences=(2, 6),
        video_preamble_sentences=(1, 3),
    ),
}

_GEO3K_PREAMBLE = (
    "The figure shows a geometric diagram drawn on a grey background.",
    "Several straight line segments are drawn in a dark colour.",
    "A square is placed in the figure and all four of its sides have equal length.",
    "The square is filled with a single uniform colour.",
    "Ignore the grey texture of the background, it carries no information.",
    "The lines of the diagram pass underneath the square.",
    "Look at the whole figure before answering the question.",
)
_NEXTQA_PREAMBLE = (
    "The video shows a ball moving across a grey scene.",
    "The camera slowly pans while the ball moves.",
    "The ball keeps the same colour for the whole clip.",
)
_LONGVILA_PREAMBLE = (
    "The video is made of several scenes, each showing a large coloured rectangle.",
    "Scenes change from time to time and some colours appear only briefly.",
    "Count how long each colour is on screen over the whole video.",
    "The grey texture around the rectangles carries no information.",
)


@dataclass(frozen=True)
class SampleSpec:
    """Everything about a sample except its pixels: enough to cost it (sizes) and to render it."""

    id: str
    source: str
    seed: int  # dataset seed; with `index` it fixes the rendering stream
    index: int  # position in the dataset
    prompt: str
    answer: str
    kind: str  # "image" | "video"
    width: int
    height: int
    num_frames: int  # 1 for images
    fps: float  # native frame rate of the file (0 for images)
    file_ext: str  # ".png", ".jpg", ".mp4"

    @property
    def media_path(self) -> str:
        return f"media/{self.id}{self.file_ext}"


# ------------------------------------------------------------------------------------ specs


# A mixture's generator changed in a way that changes its samples: its cached sets (model.cache_dir/data) take the
# version in their folder name, so a cache filled by the earlier generator is not read as this one's.
GENERATOR_VERSIONS: dict[str, int] = {"zoom": 4}  # 4: four squares in one first-view pixel (2: a dot in a region)


def cache_name(mixture: str, num_samples: int, seed: int) -> str:
    """The folder of a synthesized set in ``model.cache_dir/data``."""
    version = GENERATOR_VERSIONS.get(mixture, 1)
    return f"{mixture}_n{num_samples}_seed{seed}" + (f"_v{version}" if version > 1 else "")


def source_counts(mixture: str, num_samples: int) -> dict[str, int]:
    """Samples per source: the weights apportioned by largest remainder, so counts sum to N and are
    within one of N * weight / total (ties go to the earlier source)."""
    if mixture not in MIXTURES:
        raise ValueError(f"unknown mixture {mixture!r}; expected one of {list(MIXTURES)}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    weights = MIXTURES[mixture]
    total = sum(weights.values())
    exact = {source: num_samples * weight / total for source, weight in weights.items()}
    counts = {source: math.floor(value) for source, value in exact.items()}
    leftover = num_samples - sum(counts.values())
    by_remainder = sorted(weights, key=lambda s: (-(exact[s] - counts[s]), list(weights).index(s)))
    for source in by_remainder[:leftover]:
        counts[source] += 1
    return counts


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *stream]))


def _even(value: int) -> int:
    return value - value % 2


def _image_side(rng: np.random.Generator, low: int, high: int) -> int:
    # Half the sides are multiples of 28 (no resize needed), half arbitrary (exercises resizing).
    if rng.random() < 0.5:
        return int(rng.choice(np.arange(math.ceil(low / 28) * 28, high + 1, 28)))
    return int(rng.integers(low, high + 1))


def _video_size(rng: np.random.Generator, profile: ScaleProfile) -> tuple[int, int]:
    """(width, height), both even (yuv420p). Half take a common size; half a random one (mostly
    landscape, aspect 0.55..1) whose sides are usually not multiples of 28."""
    if rng.random() < 0.5:
        width, height = profile.video_sizes[int(rng.integers(len(profile.video_sizes)))]
        return width, height
    low, high = profile.video_side_range
    long_side = _even(int(rng.integers(low, high + 1)))
    short_side = max(low, _even(int(round(long_side * rng.uniform(0.55, 1.0)))))
    return (long_side, short_side) if rng.random() < 0.8 else (short_side, long_side)


def _clip_frames(rng: np.random.Generator, seconds: tuple[float, float, float, float], fps: float) -> int:
    median, sigma, low, high = seconds
    duration = float(np.clip(rng.lognormal(math.log(median), sigma), low, high))
    return max(4, int(round(duration * fps)))


def _preamble(rng: np.random.Generator, pool: Sequence[str], count_range: tuple[int, int]) -> str:
    count = int(rng.integers(count_range[0], count_range[1] + 1))
    chosen = rng.choice(len(pool), size=min(count, len(pool)), replace=False)
    return "".join(pool[int(i)] + " " for i in sorted(chosen))


def _make_spec(source: str, index: int, seed: int, profile: ScaleProfile, id_prefix: str = "") -> SampleSpec:
    rng = _rng(seed, index, 0)
    answer = ANSWER_CHOICES[int(rng.integers(len(ANSWER_CHOICES)))]
    sample_id = f"{id_prefix}{source}-{index:05d}"
    if source == "geo3k":
        low, high = profile.image_side_range
        width, height = _image_side(rng, low, high), _image_side(rng, low, high)
        text = _preamble(rng, _GEO3K_PREAMBLE, profile.geo3k_preamble_sentences)
        prompt = f"<image>\n{text}What colour is the square? {CHOICES_TEXT}"
        ext = ".png" if rng.random() < 0.5 else ".jpg"
        return SampleSpec(sample_id, source, seed, index, prompt, answer, "image", width, height, 1, 0.0, ext)
    width, height = _video_size(rng, profile)
    if source == "nextqa":
        fps = profile.nextqa_fps
        num_frames = _clip_frames(rng, profile.nextqa_seconds, fps)
        text = _preamble(rng, _NEXTQA_PREAMBLE, profile.video_preamble_sentences)
        question = "What colour is the ball?"
    elif source == "longvila":
        fps = profile.longvila_fps
        num_frames = max(MIN_SAMPLED_FRAMES_FOR_PLURALITY * 2, _clip_frames(rng, profile.longvila_seconds, fps))
        text = _preamble(rng, _LONGVILA_PREAMBLE, profile.video_preamble_sentences)
        question = "Which colour fills most frames?"
    else:
        raise ValueError(f"unknown source {source!r}")
    prompt = f"<video>\n{text}{question} {CHOICES_TEXT}"
    return SampleSpec(sample_id, source, seed, index, prompt, answer, "video", width, height, num_frames, fps, ".mp4")


def sample_specs(mixture: str, num_samples: int, seed: int = 0, scale: str = "tiny",
                 id_prefix: str = "") -> list[SampleSpec]:
    """The dataset's samples without pixels, in dataset order (sources interleaved by a seeded shuffle); each id is
    ``id_prefix`` + source + index."""
    if scale not in PROFILES:
        raise ValueError(f"unknown scale {scale!r}; expected one of {list(SCALES)}")
    counts = source_counts(mixture, num_samples)
    sources = [source for source, count in counts.items() for _ in range(count)]
    order = _rng(seed, 2**31 - 1).permutation(len(sources))
    return [_make_spec(sources[int(j)], index, seed, PROFILES[scale], id_prefix) for index, j in enumerate(order)]


# ------------------------------------------------------------------------------------ pixels


def _grey_noise(rng: np.random.Generator, height: int, width: int, block: int) -> np.ndarray:
    """Achromatic blocky noise around mid-grey: texture without colour, cheap for PNG/h264 to encode."""
    rows, cols = -(-height // block), -(-width // block)
    small = np.clip(rng.normal(128.0, 28.0, size=(rows, cols)), 0, 255).astype(np.uint8)
    grey = np.repeat(np.repeat(small, block, axis=0), block, axis=1)[:height, :width]
    return np.repeat(grey[:, :, None], 3, axis=2)


def render_square_image(spec: SampleSpec, rng: np.random.Generator) -> np.ndarray:
    from PIL import Image, ImageDraw

    height, width = spec.height, spec.width
    canvas = Image.fromarray(_grey_noise(rng, height, width, block=max(2, min(height, width) // 28)))
    draw = ImageDraw.Draw(canvas)
    for _ in range(int(rng.integers(1, 4))):  # diagram lines, drawn first so the square stays uniform
        x0, x1 = rng.integers(0, width, size=2)
        y0, y1 = rng.integers(0, height, size=2)
        draw.line([(int(x0), int(y0)), (int(x1), int(y1))], fill=(30, 30, 30), width=max(1, min(height, width) // 60))
    pixels = np.array(canvas)
    side = int(round(rng.uniform(0.45, 0.75) * min(height, width)))
    top = int(rng.integers(0, height - side + 1))
    left = int(rng.integers(0, width - side + 1))
    pixels[top : top + side, left : left + side] = COLOURS[spec.answer]
    return pixels


def _panning_background(
    rng: np.random.Generator, height: int, width: int, num_frames: int
) -> Iterator[np.ndarray]:
    pan = max(8, width // 4)
    wide = _grey_noise(rng, height, width + pan, block=max(2, min(height, width) // 14))
    for t in range(num_frames):
        offset = int(round(pan * t / max(1, num_frames - 1)))
        yield wide[:, offset : offset + width]


def ball_frames(spec: SampleSpec, rng: np.random.Generator) -> Iterator[np.ndarray]:
    height, width = spec.height, spec.width
    radius = min(rng.uniform(0.25, 0.4) * min(height, width), min(height, width) / 2 - 1)
    centre = np.array([rng.uniform(radius, height - radius), rng.uniform(radius, width - radius)])
    velocity = rng.normal(0.0, 0.04 * min(height, width), size=2)
    rows, cols = np.ogrid[:height, :width]
    colour = COLOURS[spec.answer]
    for background in _panning_background(rng, height, width, spec.num_frames):
        frame = background.copy()
        frame[(rows - centre[0]) ** 2 + (cols - centre[1]) ** 2 <= radius**2] = colour
        yield frame
        centre = centre + velocity
        for axis, limit in ((0, height), (1, width)):  # bounce off the borders
            if not radius <= centre[axis] <= limit - radius:
                velocity[axis] = -velocity[axis]
                centre[axis] = float(np.clip(centre[axis], radius, limit - radius))


def _plurality_holds(frame_colours: np.ndarray, answer: int, min_samples: int) -> bool:
    """True when `answer` is the strict plurality among frames for every even uniform sample size."""
    total = len(frame_colours)
    for count in range(min(min_samples, total - total % 2), total + 1, 2):
        picked = np.bincount(frame_colours[sample_frame_indices(total, count)], minlength=len(COLOURS))
        others = np.delete(picked, answer)
        if picked[answer] <= others.max():
            return False
    return True


def longvila_scene_colours(spec: SampleSpec, rng: np.random.Generator) -> np.ndarray:
    """Per-frame colour index: scenes whose majority colour is the answer, redrawn until the answer is
    the strict plurality for every uniform sampling of at least MIN_SAMPLED_FRAMES_FOR_PLURALITY frames."""
    answer = ANSWER_CHOICES.index(spec.answer)
    others = [i for i in range(len(COLOURS)) if i != answer]
    total = spec.num_frames
    for _ in range(1000):
        num_scenes = int(rng.integers(3, 8))
        scene_colours = [answer] * int(rng.integers(1, 3)) + [int(rng.choice(others)) for _ in range(num_scenes)]
        scene_colours = [scene_colours[int(i)] for i in rng.permutation(len(scene_colours))]
        answer_share = rng.uniform(0.55, 0.8)
        weights = np.array(
            [answer_share / scene_colours.count(answer) if c == answer else 0.0 for c in scene_colours]
        )
        other_slots = [i for i, c in enumerate(scene_colours) if c != answer]
        weights[other_slots] = (1 - answer_share) * rng.dirichlet(np.ones(len(other_slots)))
        lengths = np.maximum(1, np.round(weights * total).astype(int))
        lengths[-1] = max(1, total - int(lengths[:-1].sum()))
        if lengths.sum() != total:
            continue
        colours = np.repeat(np.array(scene_colours), lengths)
        if _plurality_holds(colours, answer, MIN_SAMPLED_FRAMES_FOR_PLURALITY):
            return colours
    # Unreachable in practice (a 55%+ share in contiguous scenes almost always passes); fall back to a
    # clip that is all answer colour rather than an unverifiable sample.
    return np.full(total, answer)


def scene_frames(spec: SampleSpec, rng: np.random.Generator) -> Iterator[np.ndarray]:
    height, width = spec.height, spec.width
    colours = longvila_scene_colours(spec, rng)
    palette = [COLOURS[name] for name in ANSWER_CHOICES]
    box = (0, 0, height, width)
    for t, background in enumerate(_panning_background(rng, height, width, spec.num_frames)):
        if t == 0 or colours[t] != colours[t - 1]:  # a new scene: a new rectangle covering 60-90% per side
            box_h = int(rng.uniform(0.6, 0.9) * height)
            box_w = int(rng.uniform(0.6, 0.9) * width)
            top, left = int(rng.integers(0, height - box_h + 1)), int(rng.integers(0, width - box_w + 1))
            box = (top, left, top + box_h, left + box_w)
        frame = background.copy()
        frame[box[0] : box[2], box[1] : box[3]] = palette[int(colours[t])]
        yield frame


# ------------------------------------------------------------------------------------ files


def write_image(path: Path, pixels: np.ndarray) -> None:
    from PIL import Image

    image = Image.fromarray(pixels)
    if path.suffix == ".jpg":
        image.save(path, format="JPEG", quality=90)
    else:
        image.save(path, format="PNG")


def write_mp4(path: Path, frames: Iterator[np.ndarray], width: int, height: int, fps: float,
              keyint: int | None = None) -> None:
    """h264 (libx264, yuv420p) in mp4 with the index up front (faststart), written deterministically.
    ``keyint``: at most this many frames between keyframes (x264's default, 250, when None)."""
    import av

    with av.open(
        str(path), mode="w", format="mp4", container_options={"movflags": "+faststart", "fflags": "+bitexact"}
    ) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # One thread: x264's output does not depend on threading, but keep encoding cheap and predictable
        # on a 2-core machine where data-loader workers run alongside.
        stream.codec_context.thread_count = 1
        stream.options = {"preset": "ultrafast", "crf": "23", **({"g": str(keyint)} if keyint else {})}
        for pts, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = pts
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def render_sample(spec: SampleSpec, outdir: str | Path) -> SampleRecord:
    """Write the sample's media file under `outdir` and return its manifest record."""
    outdir = Path(outdir)
    path = outdir / spec.media_path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = _rng(spec.seed, spec.index, 1)
    if spec.source == "geo3k":
        write_image(path, render_square_image(spec, rng))
    elif spec.source == "nextqa":
        write_mp4(path, ball_frames(spec, rng), spec.width, spec.height, spec.fps)
    else:
        write_mp4(path, scene_frames(spec, rng), spec.width, spec.height, spec.fps)
    return SampleRecord(
        id=spec.id,
        source=spec.source,
        prompt=spec.prompt,
        media=[MediaEntry(path=spec.media_path, kind=spec.kind)],  # type: ignore[arg-type]
        answer=spec.answer,
        answer_choices=list(ANSWER_CHOICES),
    )


def generate_dataset(
    outdir: str | Path, mixture: str, num_samples: int, seed: int = 0, scale: str = "tiny", fmt: str = "titanrl",
    id_prefix: str = "",
) -> Path:
    """Generate media and ``manifest.jsonl`` in `outdir`; return the manifest path, or with ``fmt`` =
    verl / easyr1 the path of ``train.parquet`` holding the same samples in that schema. Sample ids (and media file
    names) start with ``id_prefix``."""
    from titanrl.data.synth_formats import arithmetic_records, write_format, zoom_records

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    if mixture == "arithmetic":
        records = arithmetic_records(outdir, num_samples, seed, id_prefix)
    elif mixture == "zoom":
        records = zoom_records(outdir, num_samples, seed, id_prefix)
    else:
        records = [render_sample(spec, outdir) for spec in sample_specs(mixture, num_samples, seed, scale, id_prefix)]
    manifest = write_manifest(records, outdir / "manifest.jsonl")
    if fmt == "titanrl":
        return manifest
    return write_format(records, outdir, outdir / "train.parquet", fmt)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m titanrl.data.synth", description="Generate a synthetic Geo3K/NExTQA/LongVILA-shaped dataset."
    )
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--mixture", choices=[*MIXTURES, "arithmetic", "zoom"], required=True)
    parser.add_argument("--num-samples", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", choices=list(SCALES), default="tiny")
    parser.add_argument("--format", choices=["titanrl", "verl", "easyr1"], default="titanrl",
                        help="also write OUTDIR/train.parquet in this schema (images embedded as bytes)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    manifest = generate_dataset(args.outdir, args.mixture, args.num_samples, seed=args.seed, scale=args.scale,
                                fmt=args.format)
    counts = ({"geo3k": args.num_samples} if args.mixture == "arithmetic" else {"zoom": args.num_samples}
              if args.mixture == "zoom" else source_counts(args.mixture, args.num_samples))
    print(f"wrote {manifest} ({args.num_samples} samples {counts}) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
