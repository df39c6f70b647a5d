"""``data.path`` -> the titanrl manifest the loaders read.

A titanrl JSONL manifest (``data.format`` "titanrl", or "auto" recognising one) is used in place.
Any other dataset -- verl / EasyR1 / column-mapped rows in JSONL, JSON, Parquet, a folder of those, or
a Hugging Face ``save_to_disk`` folder -- is imported once into a cache folder
``<model.cache_dir>/data/imported/<name>-<digest>/``: ``manifest.jsonl``, ``media/`` holding every
embedded image (bytes or base64) as the image file it is, and ``import.json`` (rows read, rows
skipped and why). Media given as paths stay where they are (the manifest names them by absolute
path). The digest covers the resolved path, every data file's size and mtime, and the settings that
shape the import, so editing the data re-imports it; rank 0 imports under a file lock and marks the
folder complete last, so concurrent runs share one import and a killed import is redone.

Why extract embedded images to files rather than point manifest entries at (file, row group, row,
column): the decoding path (Ray preprocessors, the centralized loader, header probes for the
planner, the metadata cache keyed by file size and mtime) works on files, so extracted images are
decoded by the same code as any other image, and their sizes are read from the file header without
decoding pixels. The cost is one pass over the dataset on first use and a second copy of its image
bytes on disk. Not done: per-rank row-group reading of Parquet -- the import reads every row group
once, on rank 0; after it, ranks read only their own samples' image files.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from titanrl.data.formats import BadRow, ColumnMap, Draft, detect_format, parse_row
from titanrl.data.manifest import ManifestError, MediaEntry, SampleRecord, validate_record, write_manifest
from titanrl.data.tables import DatasetError, data_files, iter_rows

IMPORT_VERSION = 1  # bump when the import's output changes for the same input
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

    @classmethod
    def read(cls, folder: Path) -> "ImportReport":
        return cls(**json.loads((folder / "import.json").read_text()))


def resolve_format(path: str | Path, fmt: str) -> str:
    """``fmt``, or with "auto" the format of the dataset's first row."""
    if fmt != "auto":
        return fmt
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


def import_dataset(path: str | Path, target: Path, settings: ImportSettings) -> ImportReport:
    """Read every row of ``path``, write ``target/manifest.jsonl``, ``target/media/`` and
    ``target/import.json``. A bad row raises ``BadRow`` (naming file, row and key), or with
    ``on_bad_sample = "skip"`` is left out and listed in the report."""
    fmt = resolve_format(path, settings.format)
    target.mkdir(parents=True, exist_ok=True)
    (target / "media").mkdir(exist_ok=True)
    records: list[SampleRecord] = []
    skipped: list[dict] = []
    seen: dict[str, str] = {}
    rows = 0
    for row in iter_rows(path):
        rows += 1
        try:
            draft = parse_row(row, fmt, settings.columns)
            if draft.id in seen:
                raise BadRow(f"{row.where}key 'id' {draft.id!r} duplicates the id of {seen[draft.id]}")
            record = _materialize(draft, target, len(records), row.where)
            try:
                validate_record(record, where=row.where)
            except ManifestError as e:
                raise BadRow(str(e)) from None
        except BadRow as e:
            if settings.on_bad_sample != "skip":
                raise
            skipped.append({"file": str(row.file), "row": row.index, "error": str(e)})
            continue
        seen[draft.id] = f"{row.file}: row {row.index}"
        records.append(record)
    if not records:
        raise DatasetError(f"{path}: no usable rows ({rows} read, {len(skipped)} skipped"
                           + (f"; first: {skipped[0]['error']}" if skipped else "") + ")")
    write_manifest(records, target / "manifest.jsonl")
    report = ImportReport(rows=rows, samples=len(records), skipped=skipped)
    (target / "import.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    return report


def _materialize(draft: Draft, target: Path, position: int, where: str) -> SampleRecord:
    media = []
    for k, ref in enumerate(draft.media):
        if ref.data is not None:
            suffix = _image_suffix(ref.data, f"{where}key {ref.key!r}")
            rel = f"media/{position:07d}-{k}{suffix}"
            (target / rel).write_bytes(ref.data)
            media.append(MediaEntry(rel, ref.kind))
        else:
            media.append(MediaEntry(str(ref.path), ref.kind))
    return SampleRecord(draft.id, draft.source, draft.prompt, media, draft.answer, draft.answer_choices,
                        draft.system)


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


def dataset_manifest(path: str | Path, cache_dir: Path, settings: ImportSettings,
                     build_once: Callable[[Path, Callable[[Path], None]], Path]) -> tuple[Path, ImportReport | None]:
    """The manifest for ``data.path``: the file itself when it is a titanrl JSONL manifest, else its
    import (built with ``build_once(target, build)``, e.g. titanrl.assets' locked build); the
    import's report, or None for a manifest read in place."""
    if is_native_manifest(path, settings.format):
        return Path(path).expanduser(), None
    target = import_folder(cache_dir, path, settings)
    build_once(target, lambda d: import_dataset(path, d, settings))
    return target / "manifest.jsonl", ImportReport.read(target)
