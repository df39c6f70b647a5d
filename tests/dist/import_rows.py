"""Run under torchrun: the distributed import of a Parquet dataset (titanrl.data.sources.import_dataset).

Every Parquet row group any rank reads is recorded (``ParquetFile.read_row_group`` and the whole-file
readers are wrapped), then, all ranks together:
1. ``titanrl.assets.manifest_path`` imports ``--data`` into ``--cache`` (the trainer's path: rank 0's
   file lock, every rank reading its own row groups);
2. ``--bad`` (a row with a missing key in a row group rank 0 does not own) with ``on_bad_sample = "error"``:
   every rank must raise the same error naming the file, the row and the key;
3. two "machines" without a shared cache: ranks 0-1 use ``<cache>-split/m0``, ranks 2-3 ``<cache>-split/m1``.
   ``assets.cache_group`` finds the two groups; each builds the tiny checkpoint and imports ``--data`` into its own
   cache, the import split over its two ranks.

Each rank writes ``<out>/rank<r>.json``; tests/test_formats.py checks them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq

from titanrl import assets
from titanrl.config import JobConfig
from titanrl.data.formats import BadRow
from titanrl.data.sources import ImportSettings, import_dataset
from titanrl.distributed import all_gather_objects, barrier, init_distributed, shutdown

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--bad", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    info = init_distributed(120)

    reads: list[tuple[int | None, str]] = []
    original = pq.ParquetFile.read_row_group

    def read_row_group(self, i, *a, **k):
        reads.append(i)
        return original(self, i, *a, **k)

    def whole(*a, **k):
        raise AssertionError("a whole-file Parquet read during the import")

    pq.ParquetFile.read_row_group = read_row_group
    pq.ParquetFile.read = whole
    pq.ParquetFile.iter_batches = whole
    pq.read_table = whole

    cfg = JobConfig()
    cfg.model.cache_dir = args.cache
    cfg.data.path = args.data
    manifest = assets.manifest_path(cfg, info)
    good_reads = sorted(reads)

    reads.clear()
    error = None
    try:
        import_dataset(args.bad, Path(args.cache) / "bad", ImportSettings(on_bad_sample="error"), rank=info.rank,
                       world=info.world_size, gather=all_gather_objects)
    except BadRow as e:
        error = str(e)
    barrier()

    reads.clear()
    cfg.model.cache_dir = f"{args.cache}-split/m{info.rank // 2}"
    group = assets.cache_group(cfg, info)
    split_model = assets.model_dir(cfg, info, group)
    split_manifest = assets.manifest_path(cfg, info, group)
    out = {"manifest": str(manifest), "reads": good_reads, "bad_error": error, "bad_reads": sorted(reads),
           "split": {"ranks": list(group.ranks), "shared": group.shared, "manifest": str(split_manifest),
                     "model": str(split_model), "reads": sorted(reads)}}
    Path(args.out, f"rank{info.rank}.json").write_text(json.dumps(out))
    shutdown()  # gloo's threads end before the interpreter's


if __name__ == "__main__":
    main()
