"""``build_rollout_engine``: the engine a job's config asks for, on one rank."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from titanrl.config import JobConfig
from titanrl.data.manifest import SampleRecord


def mm_limits_for(records: Iterable[SampleRecord]) -> dict[str, int]:
    """Most images and most videos any one prompt has (at least 1 each), for vLLM's
    ``limit_mm_per_prompt``: its memory profiling and encoder budget are sized by it."""
    limits = {"image": 1, "video": 1}
    for r in records:
        for kind in limits:
            limits[kind] = max(limits[kind], sum(1 for m in r.media if m.kind == kind))
    return limits


def build_rollout_engine(
    cfg: JobConfig,
    model_dir: str | Path,
    rank: int,
    *,
    mm_limits: dict[str, int] | None = None,
    launch=None,
    tp_group=None,
    sleep: bool = False,
):
    """The rollout engine of ``cfg.rollout.engine`` for this rank, on the checkpoint in
    ``model_dir``. vLLM: every rank must call this at the same point (see vllm_engine).

    ``launch``: where vLLM runs (``titanrl.rollout.launch.engine_launch``: in the rank's process with vLLM's
    external launcher, or in child processes (engine core, workers) for the disaggregated placement, where only
    some ranks build an engine); unset: this process alone. ``tp_group``: the process group of the ranks an
    in-process engine spans (``rollout.tensor_parallel_size`` > 1). The HF engine runs in-process always.

    ``sleep``: the engine gives its device memory back between generations (``engine.sleep()``, after each;
    ``JobConfig.engine_sleeps`` decides).

    ``mm_limits``: most images/videos per prompt (``mm_limits_for(records)``; the trainer passes the run's);
    unset = read ``cfg.data.path`` (or ``cfg.data.manifest``) when it is a titanrl manifest, else 1 of each
    (the synthetic mixtures)."""
    ro = cfg.rollout
    if mm_limits is None:
        mm_limits = {"image": 1, "video": 1}
        source = cfg.data.path or cfg.data.manifest
        if source:
            from titanrl.data.manifest import read_manifest
            from titanrl.data.sources import is_native_manifest

            if is_native_manifest(source, cfg.data.format):
                mm_limits = mm_limits_for(read_manifest(Path(source).expanduser(), check_files=False))
    seed = ro.seed if ro.seed is not None else cfg.job.seed
    if ro.engine == "vllm":
        from titanrl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_dir,
            dtype=cfg.model.dtype,
            max_model_len=cfg.model.max_seq_len,
            kv_cache_bytes=ro.kv_cache_bytes,
            enforce_eager=ro.enforce_eager,
            mm_limits=mm_limits,
            min_pixels=cfg.data.min_pixels,
            max_pixels=cfg.data.max_pixels,
            num_threads=ro.num_threads,
            seed=seed + rank,
            launch=launch,
            tp_group=tp_group,
            sleep=sleep,
        )
    if ro.engine == "hf":
        from titanrl.rollout.hf_engine import HFGenerateEngine

        return HFGenerateEngine(
            model_dir,
            dtype=cfg.model.dtype,
            fps=cfg.data.fps,
            max_frames=cfg.data.max_frames,
            min_pixels=cfg.data.min_pixels,
            max_pixels=cfg.data.max_pixels,
            num_threads=ro.num_threads,
            sleep=sleep,
        )
    raise ValueError(f"unknown rollout.engine {ro.engine!r}")
