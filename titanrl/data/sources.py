"""``data.path`` -> the titanrl manifest the loaders read.

A titanrl JSONL manifest (``data.format`` "titanrl", or "auto" recognising one) is used in place.
Any other dataset -- verl / EasyR1 / column-mapped rows in JSONL, JSON, Parquet, a folder of those, or
a Hugging Face ``save_to_disk`` folder -- is imported once into a cache folder
``<model.cache_dir>/data/imported/<name>-<digest>/``: ``manifest.jsonl``, ``media/`` holding every
embedded image (bytes or base64) as the image file it is, and ``import.json`` (rows read, rows
skipped and why). Media given as paths stay where they are (the manifest names them by absolute
path). The digest covers the resolved path, every data file's size and mtime, and the settings that
shape the import, so editing the data re-imports it; the ranks import under rank 0's file lock and
rank 0 marks the folder complete last, so concurrent runs share one import and a killed import is redone.

Why extract embedded images to files rather than point manifest entries at (file, row group, row,
column): the decoding path (Ray preprocessors, the centralized loader, header probes for the
planner, the metadata cache keyed by file size and mtime) works on files, so extracted images are
decoded by the same code as any other image, and their sizes are read from the file header without
decoding pixels. The cost is one pass over the dataset on first use and a second copy of its image
bytes on disk.

The import is distributed (``import_dataset``): each rank reads only its own Parquet row groups (or
files), writes their images and reads their headers; ``import.json`` lists what each rank read.
Header probes land in the manifest's metadata cache, so the planner starts from cache hits.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from titanrl.data.formats import BadRow, ColumnMap, Draft, MediaRef, detect_format, parse_row
from titanrl.data.manifest import ManifestError, MediaEntry, SampleRecord, validate_record, write_manifest
from titanrl.data.media import FRAME_LIST_SUFFIX, write_frame_list
from titanrl.data.tables import (DatasetError, Row, data_files, dataset_units, iter_rows, iter_unit_rows,
                                 parquet_columns)

IMPORT_VERSION = 3  # bump when the import's output changes for the same input (3: videos given as frames)
_IMAGE_SUFFIX = {"PNG": ".png", "JPEG": ".jpg", "GIF": ".gif", "WEBP": ".webp", "BMP": ".bmp", "TIFF": ".tif"}


@dataclass(frozen=True)
class ImportSettings:
    """What shapes an import (DataConfig's format, column keys and on_bad_sample)."""

    format: str = "auto"
    columns: ColumnMap = ColumnMap()
    on_bad_sample: str = "error"


@dataclass(frozen=True)
class ImportReport:
    rows: int
    samples: int
    skipped: list[dict]  # {"file", "row", "error"} per skipped row
    ranks: list[dict] = field(default_factory=list)  # per rank: {"rank", "units", "rows", "bytes"} it read

    @classmethod
    def read(cls, folder: Path) -> "ImportReport":
        return cls(**json.loads((folder / "import.json").read_text()))


def resolve_format(path: str | Path, fmt: str) -> str:
    """``fmt``, or with "auto" the format of the dataset's first row (of a Parquet file: its column names, from
    the footer; no row is read)."""
    if fmt != "auto":
        return fmt
    files = data_files(path)
    if files[0].suffix == ".parquet":
        return detect_format(Row(files[0], 0, dict.fromkeys(parquet_columns(files[0]))))
    first = next(iter_rows(path), None)
    if first is None:
        raise DatasetError(f"{path}: the dataset has no rows")
    return detect_format(first)


def is_native_manifest(path: str | Path, fmt: str) -> bool:
    """A single titanrl JSONL file: read in place, not imported."""
    p = Path(path).expanduser()
    return p.is_file() and p.suffix == ".jsonl" and resolve_format(p, fmt) == "titanrl"


def import_folder(cache_dir: Path, path: str | Path, settings: ImportSettings) -> Path:
    """Where ``path`` is imported to under ``cache_dir`` with ``settings`` (see the module doc)."""
    path = Path(path).expanduser().resolve()
    files = data_files(path)
    key = {
        "version": IMPORT_VERSION, "path": str(path), "settings": asdict(settings),
        "files": [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in path.stem)[:40] or "dataset"
    return cache_dir / "data" / "imported" / f"{name}-{digest}"


def import_dataset(path: str | Path, target: Path, settings: ImportSettings, *, rank: int = 0, world: int = 1,
                   gather: Callable[[object], list] | None = None) -> ImportReport:
    """Import ``path`` into ``target``: ``manifest.jsonl``, ``media/``, ``import.json`` and the media header
    cache the ShadowLoader's planner reads (``manifest.meta.jsonl``).

    With ``world`` ranks (every rank calls it; ``gather`` is an all-gather of small objects, e.g.
    ``titanrl.distributed.all_gather_objects``) the dataset's units -- Parquet row groups, other files whole
    (``dataset_units``) -- are split over the ranks by size (Karmarkar-Karp), and each rank reads only its own
    units: it parses their rows, writes their embedded images to ``media/`` and reads those images' headers (no
    pixels are decoded). The ranks then exchange the records (text and paths, no image bytes) and every rank
    derives the same result; rank 0 writes the files. The output does not depend on ``world``: media are named
    by file and row, records kept in dataset order.

    A bad row raises ``BadRow`` naming file, row and key -- on every rank, the dataset's first bad row, as a
    one-process import would -- or with ``on_bad_sample = "skip"`` is left out and listed in the report."""
    from titanrl.data.shadow.metadata import HeaderCache, cache_path_for, probe_media_file
    from titanrl.parallel.balance import karmarkar_karp

    gather = gather or (lambda obj: [obj])
    fmt_or_error: object = None
    if rank == 0:  # the format from the first row: rank 0 alone reads it
        try:
            fmt_or_error = resolve_format(path, settings.format)
        except DatasetError as e:
            fmt_or_error = e
    fmt = gather(fmt_or_error)[0]
    if isinstance(fmt, Exception):
        raise fmt
    units = dataset_units(path)  # Parquet footers only
    mine = karmarkar_karp([u.nbytes for u in units], world)[rank] if units else []
    target.mkdir(parents=True, exist_ok=True)
    (target / "media").mkdir(exist_ok=True)
    probes = HeaderCache(None)  # this rank's probes, in memory; rank 0 saves the union
    part = {"records": [], "skipped": [], "rows": 0, "bytes": 0, "units": [], "error": None}
    for u in (units[i] for i in mine):
        part["units"].append(u.name)
        part["bytes"] += u.nbytes
        key = (u.file_index, u.first_row)
        try:
            for row in iter_unit_rows(u):
                key = (u.file_index, row.index)
                part["rows"] += 1
                try:
                    draft = parse_row(row, fmt, settings.columns)
                    record = _materialize(draft, target, u.file_index, row.index, row.where)
                    try:
                        validate_record(record, where=row.where)
                    except ManifestError as e:
                        raise BadRow(str(e)) from None
                except BadRow as e:
                    if settings.on_bad_sample != "skip":
                        raise
                    part["skipped"].append((key, {"file": str(row.file), "row": row.index, "error": str(e)}))
                    continue
                for m in record.media:
                    probe_media_file(target, m.path, m.kind, probes)
                part["records"].append((key, asdict(record), f"{row.file}: row {row.index}"))
        except DatasetError as e:  # BadRow too: this rank's first error is its units' earliest
            part["error"] = (key, e)
            break
    part["headers"] = probes.entries
    parts = gather(part)
    errors = sorted((p["error"] for p in parts if p["error"] is not None), key=lambda x: x[0])
    if errors:
        raise errors[0][1]
    records: list[SampleRecord] = []
    skipped = sorted((s for p in parts for s in p["skipped"]), key=lambda x: x[0])
    seen: dict[str, str] = {}
    for key, fields, where in sorted((r for p in parts for r in p["records"]), key=lambda x: x[0]):
        record = SampleRecord(**{**fields, "media": [MediaEntry(**m) for m in fields["media"]]})
        if record.id in seen:
            error = BadRow(f"{where}: key 'id' {record.id!r} duplicates the id of {seen[record.id]}")
            if settings.on_bad_sample != "skip":
                raise error
            skipped.append((key, {"file": where.rsplit(": row ", 1)[0], "row": key[1], "error": str(error)}))
            continue
        seen[record.id] = where
        records.append(record)
    skipped.sort(key=lambda x: x[0])
    rows = sum(p["rows"] for p in parts)
    if not records:
        first = f"; first: {skipped[0][1]['error']}" if skipped else ""
        raise DatasetError(f"{path}: no usable rows ({rows} read, {len(skipped)} skipped{first})")
    report = ImportReport(
        rows=rows, samples=len(records), skipped=[s for _, s in skipped],
        ranks=[{"rank": r, "units": p["units"], "rows": p["rows"], "bytes": p["bytes"]} for r, p in enumerate(parts)],
    )
    if rank == 0:
        write_manifest(records, target / "manifest.jsonl")
        cache = HeaderCache(cache_path_for(target / "manifest.jsonl"))
        for p in parts:
            cache.entries.update(p["headers"])
        cache.dirty = True
        cache.save()
        (target / "import.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    return report


def _materialize(draft: Draft, target: Path, file_index: int, row: int, where: str) -> SampleRecord:
    media = []
    for k, ref in enumerate(draft.media):
        stem = f"media/{file_index:03d}-{row:08d}-{k}"  # by file and row: any world size, same names
        if ref.frames is not None:  # a video given as frames: a frame list beside the embedded ones
            frames = [_media_file(frame, target, f"{stem}-{j}", where) for j, frame in enumerate(ref.frames)]
            rel = stem + FRAME_LIST_SUFFIX
            write_frame_list(target / rel, [f if Path(f).is_absolute() else Path(f).name for f in frames], ref.fps)
            media.append(MediaEntry(rel, ref.kind))
        else:
            media.append(MediaEntry(_media_file(ref, target, stem, where), ref.kind))
    return SampleRecord(draft.id, draft.source, draft.prompt, media, draft.answer, draft.answer_choices,
                        draft.system, draft.history)


def _media_file(ref: MediaRef, target: Path, stem: str, where: str) -> str:
    """Where the manifest finds ``ref``: its file (absolute), or its embedded bytes written to ``stem`` + suffix
    (relative to the import folder)."""
    if ref.data is None:
        return str(ref.path)
    suffix = (_image_suffix if ref.kind == "image" else _video_suffix)(ref.data, f"{where}key {ref.key!r}")
    rel = stem + suffix
    (target / rel).write_bytes(ref.data)
    return rel


def _image_suffix(data: bytes, where: str) -> str:
    """The file suffix of encoded image bytes, from the header alone (no pixels decoded)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt, (width, height) = image.format, image.size
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise BadRow(f"{where}: image bytes ({len(data)} B) are not a readable image ({e})") from None
    if width < 1 or height < 1:
        raise BadRow(f"{where}: image is {width}x{height}")
    return _IMAGE_SUFFIX.get(fmt or "", f".{(fmt or 'img').lower()}")


def _video_suffix(data: bytes, where: str) -> str:
    """The file suffix of a video's bytes, from its container's header (no frame decoded)."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise BadRow(f"{where}: video bytes ({len(data)} B) hold no video stream")
            extensions = set(container.format.extensions or ())
    except av.error.FFmpegError as e:
        raise BadRow(f"{where}: video bytes ({len(data)} B) are not a readable video ({e})") from None
    for ext in ("mp4", "mkv", "webm", "avi", "mov"):
        if ext in extensions:
            return f".{ext}"
    return f".{sorted(extensions)[0]}" if extensions else ".video"


def dataset_manifest(path: str | Path, cache_dir: Path, settings: ImportSettings,
                     build_once: Callable[[Path, Callable[[Path], None]], Path], *, rank: int = 0, world: int = 1,
                     gather: Callable[[object], list] | None = None) -> tuple[Path, ImportReport | None]:
    """The manifest for ``data.path``: the file itself when it is a titanrl JSONL manifest, else its
    import (built with ``build_once(target, build)``, e.g. titanrl.assets' locked build, by ``world`` ranks
    with ``gather``: ``import_dataset``); the import's report, or None for a manifest read in place."""
    if is_native_manifest(path, settings.format):
        return Path(path).expanduser(), None
    target = import_folder(cache_dir, path, settings)
    build_once(target, lambda d: import_dataset(path, d, settings, rank=rank, world=world, gather=gather))
    return target / "manifest.jsonl", ImportReport.read(target)
