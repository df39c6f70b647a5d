"""Rows of a dataset on disk, whatever the container: JSONL, JSON, Parquet, or a Hugging Face
``datasets`` folder written by ``save_to_disk`` (Arrow stream files).

``iter_rows(path)`` yields ``Row(file, index, data)``: ``data`` is the row as plain Python values
(Arrow structs become dicts, binary columns ``bytes``), ``index`` its 0-based position in ``file``,
so every error can name the file, the row and the key. A Parquet file is read one row group at a
time (a large file is never held whole in memory).

``dataset_units(path)`` cuts a dataset into units of reading work for several ranks (DistFlow's
distributed dataloader): one per Parquet row group (its row count and size come from the file's
footer, nothing else is read), one per JSONL / JSON / Arrow file. ``iter_unit_rows(unit)`` reads
one unit's rows only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

TABLE_SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet")


class DatasetError(ValueError):
    """A dataset that cannot be read as asked; the message names the file, row and key where known."""


@dataclass(frozen=True)
class Row:
    file: Path
    index: int  # 0-based row of `file`
    data: dict[str, Any]

    @property
    def where(self) -> str:
        return f"{self.file}: row {self.index}: "


def is_saved_hf_dataset(path: Path) -> bool:
    """A folder that ``datasets.Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``) wrote."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def data_files(path: str | Path) -> list[Path]:
    """The files ``path`` stands for, in a fixed order: itself, a saved HF dataset's Arrow files, or a
    folder's ``.jsonl`` / ``.json`` / ``.parquet`` files (sorted; not recursive)."""
    path = Path(path).expanduser()
    if path.is_file():
        if path.suffix not in TABLE_SUFFIXES:
            raise DatasetError(f"{path}: unsupported file type {path.suffix!r}, expected one of {list(TABLE_SUFFIXES)}")
        return [path]
    if not path.exists():
        raise DatasetError(f"{path}: does not exist")
    if is_saved_hf_dataset(path):
        return _hf_arrow_files(path)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in TABLE_SUFFIXES
                   and not p.name.endswith(".meta.jsonl"))
    if not files:
        raise DatasetError(f"{path}: folder has no {', '.join(TABLE_SUFFIXES)} files and is not a saved HF dataset")
    return files


def _hf_arrow_files(folder: Path) -> list[Path]:
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        if "train" not in splits:
            raise DatasetError(f"{folder}: saved DatasetDict has no 'train' split ({splits}); point data.path at one")
        folder = folder / "train"
    state = json.loads((folder / "state.json").read_text())
    files = [folder / f["filename"] for f in state.get("_data_files", [])]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise DatasetError(f"{folder}: saved HF dataset lists missing Arrow files {missing or '(none listed)'}")
    return files


@dataclass(frozen=True)
class Unit:
    """A piece of a dataset one rank reads: a Parquet row group, or a whole file of another kind."""

    file_index: int  # position of ``file`` in data_files(path)
    file: Path
    group: int | None  # Parquet row group; None: the whole file
    first_row: int  # index in ``file`` of the unit's first row
    nbytes: int  # the row group's uncompressed size in the footer, or the file's size: the split's weight

    @property
    def name(self) -> str:
        return f"{self.file.name}" + (f" row group {self.group}" if self.group is not None else "")


def dataset_units(path: str | Path) -> list[Unit]:
    """The dataset's units in reading order (a Parquet file's row groups from its footer alone)."""
    units = []
    for i, file in enumerate(data_files(path)):
        if file.suffix != ".parquet":
            units.append(Unit(i, file, None, 0, file.stat().st_size))
            continue
        meta = _parquet_file(file).metadata
        first = 0
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            units.append(Unit(i, file, g, first, group.total_byte_size))
            first += group.num_rows
    return units


def iter_unit_rows(unit: Unit) -> Iterator[Row]:
    """The rows of one unit (a Parquet unit reads its row group and nothing else)."""
    if unit.group is None:
        yield from iter_file_rows(unit.file)
        return
    table = _parquet_file(unit.file).read_row_group(unit.group)
    for k, data in enumerate(table.to_pylist()):
        yield Row(unit.file, unit.first_row + k, data)


def parquet_columns(file: Path) -> list[str]:
    """A Parquet file's top-level column names, from its footer."""
    return list(_parquet_file(file).schema_arrow.names)


def _parquet_file(file: Path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file)
    except Exception as e:
        raise DatasetError(f"{file}: not a readable Parquet file ({e})") from None


def iter_rows(path: str | Path) -> Iterator[Row]:
    for file in data_files(path):
        yield from iter_file_rows(file)


def iter_file_rows(file: Path) -> Iterator[Row]:
    if file.suffix == ".jsonl":
        yield from _jsonl_rows(file)
    elif file.suffix == ".json":
        yield from _json_rows(file)
    elif file.suffix == ".parquet":
        yield from _parquet_rows(file)
    elif file.suffix == ".arrow":
        yield from _arrow_rows(file)
    else:
        raise DatasetError(f"{file}: unsupported file type {file.suffix!r}")


def _object(obj: Any, file: Path, index: int) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise DatasetError(f"{file}: row {index}: expected an object, got {type(obj).__name__}")
    return obj


def _jsonl_rows(file: Path) -> Iterator[Row]:
    index = 0
    with file.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{file}: row {index} (line {line_number}): invalid JSON ({e.msg})") from None
            yield Row(file, index, _object(obj, file, index))
            index += 1


def _json_rows(file: Path) -> Iterator[Row]:
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{file}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise DatasetError(f"{file}: expected a JSON list of rows (or {{'data': [...]}})")
    for index, item in enumerate(obj):
        yield Row(file, index, _object(item, file, index))


def _parquet_rows(file: Path) -> Iterator[Row]:
    pf = _parquet_file(file)
    index = 0
    for group in range(pf.num_row_groups):
        for data in pf.read_row_group(group).to_pylist():
            yield Row(file, index, data)
            index += 1


def _arrow_rows(file: Path) -> Iterator[Row]:
    import pyarrow as pa

    index = 0
    with pa.memory_map(str(file)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(reader)
        for batch in batches:
            for data in batch.to_pylist():
                yield Row(file, index, data)
                index += 1
