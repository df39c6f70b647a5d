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
ZOOM_MARK = 3  # the dot's side: under a pixel at the first view, ~12 in a zoom on the region
ZOOM_REGION = (420, 420, 476, 476)  # x0, y0, x1, y1: the 56 x 56 region the prompt says the dot is in


def zoom_records(outdir: str | Path, num_samples: int, seed: int = 0, id_prefix: str = "") -> list[SampleRecord]:
    """The task that needs ``titanrl.envs.zoom:ZoomEnv``: a small coloured dot on grey noise, somewhere in the region
    the prompt names, its colour the answer, unreadable at the first view's resolution and plain in a zoom on the
    region (``rollout.max_turns > 1``)."""
    from titanrl.data.synth import ANSWER_CHOICES, COLOURS, _grey_noise, _rng, write_image

    outdir = Path(outdir)
    (outdir / "media").mkdir(parents=True, exist_ok=True)
    x0, y0, x1, y1 = ZOOM_REGION
    records = []
    for i in range(num_samples):
        rng = _rng(seed, i, 31)
        colour = ANSWER_CHOICES[int(rng.integers(len(ANSWER_CHOICES)))]
        pixels = _grey_noise(rng, ZOOM_SIDE, ZOOM_SIDE, block=16)
        x = int(rng.integers(x0 + ZOOM_MARK, x1 - 2 * ZOOM_MARK))
        y = int(rng.integers(y0 + ZOOM_MARK, y1 - 2 * ZOOM_MARK))
        pixels[y:y + ZOOM_MARK, x:x + ZOOM_MARK] = COLOURS[colour]
        rel = f"media/{id_prefix}zoom-{i:05d}.png"
        write_image(outdir / rel, pixels)
        prompt = (f"<image>\nA small coloured dot is in the region {x0},{y0},{x1},{y1} of this {ZOOM_SIDE} x "
                  f"{ZOOM_SIDE} picture. To look closer, reply <zoom>x0,y0,x1,y1</zoom> (pixels). Then answer "
                  "with one word: red, green, blue or yellow.")
        records.append(SampleRecord(f"{id_prefix}zoom-{i:05d}", "zoom", prompt, [MediaEntry(rel, "image")], colour,
                                    list(ANSWER_CHOICES)))
    return records


def _verl_row(record: SampleRecord, images: list[dict], videos: list[str]) -> dict[str, Any]:
    messages = ([{"role": "system", "content": record.system}] if record.system is not None else [])
    messages.append({"role": "user", "content": record.prompt})
    return {"data_source": record.source, "prompt": messages, "images": images, "videos": videos,
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": record.answer},
            "extra_info": {"id": record.id}, "id": record.id}


def _easyr1_row(record: SampleRecord, images: list[dict], videos: list[str]) -> dict[str, Any]:
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
