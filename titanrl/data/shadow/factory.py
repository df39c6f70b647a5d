"""One entry point for both loaders: ``build_loader(cfg, info, model_dir, manifest_path)``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Union

from titanrl.data.preprocess import MediaSettings
from titanrl.data.shadow.centralized import CentralizedLoader
from titanrl.data.shadow.comm import Comm
from titanrl.data.shadow.loader import ShadowLoader
from titanrl.data.shadow.metadata import MetadataTable, load_metadata
from titanrl.data.shadow.plan import AssignFn

if TYPE_CHECKING:
    from titanrl.config import JobConfig
    from titanrl.data.prompt import PromptEncoder
    from titanrl.distributed import DistInfo
    from titanrl.fs_share import FolderGroup

Loader = Union[ShadowLoader, CentralizedLoader]


def media_settings(cfg: "JobConfig", model_dir: str | Path) -> MediaSettings:
    d = cfg.data
    return MediaSettings.from_checkpoint(
        model_dir, fps=d.fps, max_frames=d.max_frames, video_backend=d.video_backend,
        min_pixels=d.min_pixels, max_pixels=d.max_pixels,
    )


def load_table(
    cfg: "JobConfig", manifest_path: str | Path, settings: MediaSettings, encoder: "PromptEncoder", comm: Comm,
    first: bool | None = None,
) -> MetadataTable:
    """Metadata on every rank; the ranks ``first`` (default: rank 0; one per machine when caches are local) load
    before the others, so a cold metadata cache is probed once per cache, not once per rank."""
    def load() -> MetadataTable:
        return load_metadata(manifest_path, settings, encoder, max_prompt_tokens=cfg.data.max_prompt_tokens,
                             use_cache=cfg.data.metadata_cache)

    table = load() if (comm.rank == 0 if first is None else first) else None
    comm.barrier()
    return table if table is not None else load()


def build_loader(
    cfg: "JobConfig",
    info: "DistInfo",
    model_dir: str | Path,
    manifest_path: str | Path,
    assign: AssignFn | None = None,
    *,
    encoder: "PromptEncoder | None" = None,
    cache: "FolderGroup | None" = None,
) -> Loader:
    """The loader ``cfg.data.loader`` names. Collective under torchrun (every rank calls it).

    ``assign(metas, world) -> list[list[int]]`` splits each global batch over ranks (default:
    ``plan.assign_balanced``); a position listed for several ranks is fetched by each of them.
    ``cache``: the ranks sharing ``model.cache_dir`` (``titanrl.assets.cache_group``; default: every rank). Where
    it is not shared, each machine's preprocessor reads the manifest its machine's ranks read.
    """
    from titanrl.data.prompt import PromptEncoder

    comm = Comm.from_torch()
    if comm.world != info.world_size or comm.rank != info.rank:
        raise RuntimeError(
            f"torch.distributed says rank {comm.rank}/{comm.world}, DistInfo {info.rank}/{info.world_size}"
        )
    settings = media_settings(cfg, model_dir)
    encoder = encoder or PromptEncoder.from_pretrained(model_dir)
    table = load_table(cfg, manifest_path, settings, encoder, comm, first=cache.is_leader if cache else None)
    # a node without ranks reads rank 0's manifest only where that is the same file on every machine: the cache is
    # shared, or the manifest is the user's own (data.path, which every machine reads at the same path)
    shared = cache is None or cache.shared or not Path(manifest_path).resolve().is_relative_to(cache.folder.resolve())
    common = dict(global_batch_size=cfg.rl.global_batch_size, seed=cfg.job.seed, assign=assign,
                  on_bad_sample=cfg.data.on_bad_sample)
    if cfg.data.loader == "centralized":
        return CentralizedLoader(table, settings, comm, num_decode_workers=cfg.data.num_decode_workers,
                                 prefetch_batches=cfg.data.prefetch_batches, **common)
    return build_shadow_loader(cfg, table, settings, comm, manifest_shared=shared, **common)


def build_shadow_loader(cfg: "JobConfig", table: MetadataTable, settings: MediaSettings, comm: Comm,
                        manifest_shared: bool = True, **loader_kwargs) -> ShadowLoader:
    from titanrl.data.shadow import ray_runtime

    d = cfg.data
    session = ray_runtime.connect(d.ray_address, d.ray_object_store_bytes, comm,
                                  local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", comm.world)))
    try:
        ray_runtime.start_preprocessors(
            session, comm, manifest_dir=str(Path(table.manifest_path).parent.resolve()), settings=settings,
            num_threads=d.num_decode_workers, cache_bytes=_cache_bytes(d.ray_object_store_bytes),
            manifest_shared=manifest_shared,
        )
    except BaseException:
        ray_runtime.shutdown(session, comm)
        raise
    # asynchronous: the training ranks fetch frames of a step the rollout ranks handed out max_staleness steps
    # before, so its samples stay held that long
    hold = cfg.workflow.max_staleness + 1 if cfg.workflow.mode == "async" else 1
    return ShadowLoader(table, settings, session, comm, prefetch_batches=d.prefetch_batches, hold_steps=hold,
                        fetch_timeout_s=d.fetch_timeout_s, **loader_kwargs)


def _cache_bytes(object_store_bytes: int) -> int:
    # Decoded frames live in the object store; decode ahead into at most half of it, so fetch
    # copies and frame-range slices have room and nothing spills in steady state.
    return object_store_bytes // 2 if object_store_bytes else 2 << 30
