"""Model and dataset a run needs, built on first use into the cache when the config names none.

The cache is prepared once per group of ranks that share ``model.cache_dir`` (``titanrl.fs_share``): the
whole job on one machine or a shared filesystem, else each machine with a local disk. A group's first
rank builds under a file lock (two runs sharing a cache never build the same thing at once), an import of
``data.path`` is split over the group's ranks; the others wait for their group and then find it ready. A
finished build is marked by a ``.complete`` file, so a build killed half-way is redone, never used.
"""

from __future__ import annotations

import fcntl
import shutil
import socket
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

from titanrl.config import ConfigError, JobConfig
from titanrl.distributed import DistInfo
from titanrl.fs_share import FolderGroup, folder_group


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_once(target: Path, build, group: FolderGroup | None = None, collective: bool = False) -> Path:
    """``build(target)`` unless a complete build is there. Without ``group`` one process builds under the lock.
    With ``group`` every rank of it calls this: its first rank holds the lock, decides for the group, clears the
    folder, builds (with ``collective`` every rank of the group builds its part) and marks it complete; every
    rank returns once it is complete."""
    lead = group is None or group.is_leader
    marker = target / ".complete"
    with _file_lock(target.parent / f".{target.name}.lock") if lead else nullcontext():
        needed = not marker.is_file()
        if group is not None:
            needed = group.gather(needed)[0]  # the leader's view, under its lock
        if needed:
            if lead and target.exists():
                shutil.rmtree(target)
            if collective and group is not None:
                group.barrier()
            if lead or collective:
                build(target)
            if lead:
                marker.write_text("ok\n")
    if group is not None:
        group.barrier()
    return target


def cache_group(cfg: JobConfig, info: DistInfo) -> FolderGroup:
    """The ranks that share this rank's ``model.cache_dir`` (collective); rank 0 says so when the cache is not
    shared by every rank."""
    group = folder_group(cfg.cache_dir, info, cfg.job.collective_timeout_s)
    if not group.shared and info.is_main:
        from titanrl.console import say

        say(f"[titanrl] model.cache_dir {str(cfg.cache_dir)!r} is not shared by every machine: each group of ranks "
            f"that shares one prepares its own model and data (rank 0's: {group.describe()})")
    return group


def model_dir(cfg: JobConfig, info: DistInfo, group: FolderGroup | None = None) -> Path:
    """``model.path``, or a random ``model.flavor`` checkpoint built in the cache (collective)."""
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path={cfg.model.path!r} has no config.json (on {socket.gethostname()}): a Hugging "
                              "Face checkpoint folder, at the same path on every machine")
        return path
    if cfg.model.path_missing("training"):
        raise ConfigError(cfg.model.path_missing("training"))
    return tiny_checkpoint(cfg.cache_dir, cfg.model.flavor, cfg.job.seed, group or cache_group(cfg, info))


def tiny_checkpoint(cache_dir: str | Path, flavor: str, seed: int, group: FolderGroup | None = None) -> Path:
    """The random ``flavor`` checkpoint of ``seed`` in ``cache_dir/models`` (the trainer's, and the scripts'), built
    once under the cache's lock if it is not complete there."""
    from titanrl.models.make_tiny import make_tiny_checkpoint

    target = Path(cache_dir).expanduser() / "models" / f"qwen2_5_vl_{flavor}_seed{seed}"
    return _build_once(target, lambda d: make_tiny_checkpoint(d, size=flavor, seed=seed), group)


def manifest_path(cfg: JobConfig, info: DistInfo, group: FolderGroup | None = None) -> Path:
    """The titanrl manifest of the run: data.path (or data.manifest) read in place when it is one, else
    imported into the cache (titanrl.data.sources); without either, a synthesized dataset (in
    data.synth_format, imported the same way when that is not titanrl)."""
    d = cfg.data
    group = group or cache_group(cfg, info)
    source, key = (d.path, "data.path") if d.path else (d.manifest, "data.manifest")
    if source:
        if not Path(source).expanduser().exists():
            raise ConfigError(f"{key}={source!r} does not exist (on {socket.gethostname()}); the data must be at "
                              "the same path on every machine")
    else:
        key = "synthesized data"
        from titanrl.data.synth import cache_name, generate_dataset

        target = cfg.cache_dir / "data" / cache_name(d.mixture, d.num_samples, cfg.job.seed)
        if d.synth_format != "titanrl":
            target = target.with_name(f"{target.name}_{d.synth_format}")

        _build_once(target, lambda out: generate_dataset(out, d.mixture, d.num_samples, seed=cfg.job.seed,
                                                         fmt=d.synth_format), group)
        source = target / ("manifest.jsonl" if d.synth_format == "titanrl" else "train.parquet")
        if d.synth_format == "titanrl":
            return source
    return _import(cfg, info, group, str(source), key)


# the held-out set's seed stream: past every seed a run takes (job.seed is below 2**32), so its samples are never
# those of a training set made by the same generator
HELD_OUT_SEED = 1 << 32


def held_out_size(cfg: JobConfig) -> int:
    """Samples of the synthesized held-out set (eval.max_prompts; 0: a quarter of data.num_samples, at least 8)."""
    return cfg.eval.max_prompts or max(8, cfg.data.num_samples // 4)


def eval_manifest_path(cfg: JobConfig, info: DistInfo, group: FolderGroup | None = None) -> Path:
    """The titanrl manifest of the held-out prompts: eval.path (read in place, or imported like data.path), or
    without it a held-out set of the synthesizer (data.mixture; ids prefixed "heldout-")."""
    e = cfg.eval
    group = group or cache_group(cfg, info)
    if e.path:
        if not Path(e.path).expanduser().exists():
            raise ConfigError(f"eval.path={e.path!r} does not exist (on {socket.gethostname()}); the data must be at "
                              "the same path on every machine")
        return _import(cfg, info, group, e.path, "eval.path")
    n, seed = held_out_size(cfg), HELD_OUT_SEED + cfg.job.seed
    from titanrl.data.synth import cache_name, generate_dataset

    target = cfg.cache_dir / "data" / f"heldout_{cache_name(cfg.data.mixture, n, cfg.job.seed)}"

    _build_once(target, lambda out: generate_dataset(out, cfg.data.mixture, n, seed=seed, id_prefix="heldout-"), group)
    return target / "manifest.jsonl"


def _import(cfg: JobConfig, info: DistInfo, group: FolderGroup, source: str, key: str) -> Path:
    """``source`` as a titanrl manifest: itself when it is one, else its import into the cache, which every rank
    of the cache's group takes part in (each reads only its own Parquet row groups;
    titanrl.data.sources.import_dataset)."""
    from titanrl.console import say
    from titanrl.data.formats import ColumnMap
    from titanrl.data.sources import ImportSettings, dataset_manifest
    d = cfg.data
    settings = ImportSettings(
        format=d.format, on_bad_sample=d.on_bad_sample,
        columns=ColumnMap(d.prompt_key, d.answer_key, d.image_key, d.video_key, d.system_prompt),
    )
    path, report = dataset_manifest(source, cfg.cache_dir, settings,
                                    lambda t, build: _build_once(t, build, group, collective=True),
                                    rank=group.index, world=group.size, gather=group.gather)
    if info.is_main and report is not None:
        skipped = f", {len(report.skipped)} bad rows skipped (listed in {path.parent / 'import.json'})"
        say(f"[titanrl] {key} {source!r}: {report.samples} samples from {report.rows} rows"
            f"{skipped if report.skipped else ''}; imported to {path.parent}")
    return path
