"""Model and dataset a run needs, built on first use into the cache when the config names none.

Rank 0 builds under a file lock (two runs sharing a cache never build the same thing at once);
the other ranks wait at a barrier and then find it ready. A finished build is marked by a
``.complete`` file, so a build killed half-way is redone, never used.
"""

from __future__ import annotations

import fcntl
import shutil
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

from titanrl.config import JobConfig
from titanrl.distributed import DistInfo, barrier


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_once(target: Path, build, info: DistInfo | None = None) -> Path:
    """``build(target)`` unless a complete build is there. Without ``info`` one process builds under the lock. With
    ``info`` every rank calls it and ``build`` is collective (each rank builds its part): rank 0 holds the lock,
    decides for all, clears the folder and marks it complete; every rank returns once it is complete."""
    from titanrl.distributed import all_gather_objects

    main = info is None or info.is_main
    marker = target / ".complete"
    with _file_lock(target.parent / f".{target.name}.lock") if main else nullcontext():
        needed = not marker.is_file()
        if info is not None:
            needed = all_gather_objects(needed)[0]  # rank 0's view, under its lock
        if needed:
            if main and target.exists():
                shutil.rmtree(target)
            if info is not None:
                barrier()
            build(target)
            if main:
                marker.write_text("ok\n")
    if info is not None:
        barrier()
    return target


def model_dir(cfg: JobConfig, info: DistInfo) -> Path:
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path={cfg.model.path!r} has no config.json")
        return path
    target = cfg.cache_dir / "models" / f"qwen2_5_vl_{cfg.model.flavor}_seed{cfg.job.seed}"
    if info.is_main:
        from titanrl.models.make_tiny import make_tiny_checkpoint

        _build_once(target, lambda d: make_tiny_checkpoint(d, size=cfg.model.flavor, seed=cfg.job.seed))
    barrier()
    return target


def manifest_path(cfg: JobConfig, info: DistInfo) -> Path:
    """The titanrl manifest of the run: data.path (or data.manifest) read in place when it is one, else
    imported into the cache (titanrl.data.sources); without either, a synthesized dataset (in
    data.synth_format, imported the same way when that is not titanrl)."""
    d = cfg.data
    source, key = (d.path, "data.path") if d.path else (d.manifest, "data.manifest")
    if source:
        if not Path(source).expanduser().exists():
            raise FileNotFoundError(f"{key}={source!r} does not exist")
    else:
        key = "synthesized data"
        target = cfg.cache_dir / "data" / f"{d.mixture}_n{d.num_samples}_seed{cfg.job.seed}"
        if d.synth_format != "titanrl":
            target = target.with_name(f"{target.name}_{d.synth_format}")
        if info.is_main:
            from titanrl.data.synth import generate_dataset

            _build_once(target, lambda out: generate_dataset(out, d.mixture, d.num_samples, seed=cfg.job.seed,
                                                             fmt=d.synth_format))
        barrier()
        source = target / ("manifest.jsonl" if d.synth_format == "titanrl" else "train.parquet")
        if d.synth_format == "titanrl":
            return source
    return _import(cfg, info, str(source), key)


def _import(cfg: JobConfig, info: DistInfo, source: str, key: str) -> Path:
    """``source`` as a titanrl manifest: itself when it is one, else its import into the cache, which every rank
    takes part in (each reads only its own Parquet row groups; titanrl.data.sources.import_dataset)."""
    from titanrl.console import say
    from titanrl.data.formats import ColumnMap
    from titanrl.data.sources import ImportSettings, dataset_manifest
    from titanrl.distributed import all_gather_objects

    d = cfg.data
    settings = ImportSettings(
        format=d.format, on_bad_sample=d.on_bad_sample,
        columns=ColumnMap(d.prompt_key, d.answer_key, d.image_key, d.video_key, d.system_prompt),
    )
    path, report = dataset_manifest(source, cfg.cache_dir, settings, lambda t, build: _build_once(t, build, info),
                                    rank=info.rank, world=info.world_size, gather=all_gather_objects)
    if info.is_main and report is not None:
        skipped = f", {len(report.skipped)} bad rows skipped (listed in {path.parent / 'import.json'})"
        say(f"[titanrl] {key} {source!r}: {report.samples} samples from {report.rows} rows"
            f"{skipped if report.skipped else ''}; imported to {path.parent}")
    return path
