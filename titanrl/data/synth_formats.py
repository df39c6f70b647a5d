"""The synthetic data in other schemas, and an arithmetic-about-the-image task for the ``math`` reward.

- ``arithmetic_records(outdir, n, seed)``: Geo3K-shaped images with 1-4 coloured squares on grey noise;
  the question asks for the number of squares plus a given number, answered in ``\\boxed{}`` (an exact,
  math-verify-checkable answer such as ``"7"``).
- ``write_format(records, manifest_dir, out, fmt)``: a titanrl manifest's samples as one Parquet file
  in verl's multimodal schema (chat-list ``prompt``, ``images`` as ``{bytes, path}``, ``videos`` as
  paths relative to the file, ``reward_model.ground_truth``, ``data_source``) or EasyR1's (``problem``,
  ``answer``, ``images``, ``videos``). Images are embedded as their file's bytes; videos stay files.

``python -m titanrl.data.synth OUTDIR --format verl|easyr1 [--task arithmetic]`` writes both the
media folder with ``manifest.jsonl`` and ``OUTDIR/train.parquet``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from titanrl.data.manifest import MediaEntry, SampleRecord

SYNTH_FORMATS: tuple[str, ...] = ("titanrl", "verl", "easyr1")
_SQUARE_COLOURS = ((220, 40, 40), (40, 180, 60), (40, 80, 220), (235, 215, 40))


def render_count_image(rng: np.random.Generator, width: int, height: int, count: int) -> np.ndarray:
    """Grey noise with ``count`` (1-4) non-overlapping coloured squares, one per chosen quadrant."""
    from titanrl.data.synth import _grey_noise

    pixels = _grey_noise(rng, height, width, block=max(2, min(height, width) // 28))
    cells = rng.permutation(4)[:count]
    ch, cw = height // 2, width // 2
    for cell in cells:
        side = int(rng.uniform(0.5, 0.85) * min(ch, cw))
        top = (cell // 2) * ch + int(rng.integers(0, ch - side + 1))
        left = (cell % 2) * cw + int(rng.integers(0, cw - side + 1))
        pixels[top : top + side, left : left + side] = _SQUARE_COLOURS[int(rng.integers(0, 4))]
    return pixels


def arithmetic_records(outdir: str | Path, num_samples: int, seed: int = 0, id_prefix: str = "") -> list[SampleRecord]:
    """Write ``num_samples`` PNG images under ``outdir/media`` and return their records."""
    from titanrl.data.synth import _image_side, _rng, write_image

    outdir = Path(outdir)
    (outdir / "media").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(num_samples):
        rng = _rng(seed, i, 25)
        width, height = _image_side(rng, 56, 224), _image_side(rng, 56, 224)
        count, add = int(rng.integers(1, 5)), int(rng.integers(0, 6))
        rel = f"media/{id_prefix}arith-{i:05d}.png"
        write_image(outdir / rel, render_count_image(rng, width, height, count))
        prompt = (f"<image>\nHow many coloured squares are in the picture? Add {add} to that number. "
                  "Put the final answer in \\boxed{}.")
        records.append(SampleRecord(f"{id_prefix}arith-{i:05d}", "geo3k", prompt, [MediaEntry(rel, "image")], str(count + add)))
    return records


ZOOM_SIDE = 896  # the picture's side: the tiny checkpoint's processor (at most 224 x 224) sees it 4x smaller
ZOOM_SQUARE = 1  # the side of each of the four squares: together they sit at the centre of a first-view pixel
_ZX, _ZY = 449, 449  # their top-left corner: the four fill 449-451, centred on first-view pixel 112, 112
ZOOM_REGION = (_ZX, _ZY, _ZX + 2 * ZOOM_SQUARE, _ZY + 2 * ZOOM_SQUARE)  # x0, y0, x1, y1: the four squares
ZOOM_TARGET = (_ZX, _ZY, _ZX + ZOOM_SQUARE, _ZY + ZOOM_SQUARE)  # the top-left one, the answer: a zoom shows it alone
ZOOM_NOISE = 16  # colour noise, pixel by pixel, this far around the region (it hides what leaks to neighbours)


def zoom_records(outdir: str | Path, num_samples: int, seed: int = 0, id_prefix: str = "") -> list[SampleRecord]:
    """The task that needs ``titanrl.envs.zoom:ZoomEnv``: four 1-pixel squares of the four answer colours, in random
    order, in ``ZOOM_REGION``; the answer is the colour of the top-left one, at ``ZOOM_TARGET``, which the prompt
    names.

    The four squares together are one pixel of the first view (the processor shrinks the picture 4x), which shows
    their mean: the same for every sample, so the answer is not in the first view (what the resize filter leaks
    into the neighbouring pixels is buried in colour noise). A zoom on the target shows its colour and nothing else.
    ``tests/test_multiturn.py`` checks both with linear probes."""
    from titanrl.data.synth import ANSWER_CHOICES, _rng, write_image

    outdir = Path(outdir)
    (outdir / "media").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(num_samples):
        pixels, colour = zoom_picture(_rng(seed, i, 31))
        rel = f"media/{id_prefix}zoom-{i:05d}.png"
        write_image(outdir / rel, pixels)
        prompt = ("<image>\nFour tiny squares of four colours fill the region {},{},{},{} of this {} x {} picture, too "
                  "small to tell apart at this size. What colour is the one at {},{},{},{}? To look closer, reply "
                  "<zoom>x0,y0,x1,y1</zoom> (pixels). Then answer with one word: red, green, blue or yellow."
                  ).format(*ZOOM_REGION, ZOOM_SIDE, ZOOM_SIDE, *ZOOM_TARGET)
        records.append(SampleRecord(f"{id_prefix}zoom-{i:05d}", "zoom", prompt, [MediaEntry(rel, "image")], colour,
                                    list(ANSWER_CHOICES)))
    return records


def zoom_picture(rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """One zoom-task picture (``ZOOM_SIDE`` square, uint8 RGB) and its answer."""
    from titanrl.data.synth import ANSWER_CHOICES, COLOURS, _grey_noise

    pixels = _grey_noise(rng, ZOOM_SIDE, ZOOM_SIDE, block=16)
    x0, y0, x1, y1 = ZOOM_REGION
    n = ZOOM_NOISE
    pixels[y0 - n:y1 + n, x0 - n:x1 + n] = rng.integers(0, 256, (y1 - y0 + 2 * n, x1 - x0 + 2 * n, 3), dtype=np.uint8)
    order = [ANSWER_CHOICES[k] for k in rng.permutation(len(ANSWER_CHOICES))]
    s = ZOOM_SQUARE
    for k, name in enumerate(order):  # top-left, top-right, bottom-left, bottom-right
        y, x = y0 + (k // 2) * s, x0 + (k % 2) * s
        pixels[y:y + s, x:x + s] = COLOURS[name]
    return pixels, order[0]


def _verl_row(record: SampleRecord, images: list[dict], videos: list[str]) -> dict[str, Any]:
    messages = ([{"role": "system", "content": record.system}] if record.system is not None else [])
    messages += [{"role": m["role"], "content": m["content"]} for m in record.history]
    messages.append({"role": "user", "content": record.prompt})
    return {"data_source": record.source, "prompt": messages, "images": images, "videos": videos,
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": record.answer},
            "extra_info": {"id": record.id}, "id": record.id}


def _easyr1_row(record: SampleRecord, images: list[dict], videos: list[str]) -> dict[str, Any]:
    if record.history:
        raise ValueError(f"sample {record.id!r}: EasyR1's problem column holds one user message, not a conversation")
    return {"id": record.id, "problem": record.prompt, "answer": record.answer, "images": images, "videos": videos}


def format_rows(records: Sequence[SampleRecord], manifest_dir: str | Path, out_dir: str | Path,
                fmt: str) -> list[dict[str, Any]]:
    """The rows of ``records`` in ``fmt`` (images as bytes; video paths relative to ``out_dir``)."""
    if fmt not in ("verl", "easyr1"):
        raise ValueError(f"format must be 'verl' or 'easyr1', got {fmt!r}")
    rows = []
    for record in records:
        images: list[dict] = []
        videos: list[str] = []
        for entry in record.media:
            path = Path(manifest_dir) / entry.path
            if entry.kind == "image":
                images.append({"bytes": path.read_bytes(), "path": None})
            else:
                videos.append(os.path.relpath(path, out_dir))
        rows.append((_verl_row if fmt == "verl" else _easyr1_row)(record, images, videos))
    return rows


def write_format(records: Sequence[SampleRecord], manifest_dir: str | Path, out: str | Path, fmt: str,
                 row_group_size: int = 64) -> Path:
    """One Parquet file of ``records`` in ``fmt`` (see the module doc)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = format_rows(records, manifest_dir, out.parent, fmt)
    image_type = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.Table.from_pylist(rows)
    table = table.set_column(table.schema.get_field_index("images"), "images",
                             pa.array([r["images"] for r in rows], type=image_type))
    table = table.set_column(table.schema.get_field_index("videos"), "videos",
                             pa.array([r["videos"] for r in rows], type=pa.list_(pa.string())))
    pq.write_table(table, out, row_group_size=row_group_size)
    return out
