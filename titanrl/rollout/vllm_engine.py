"""vLLM rollout engine: one vLLM engine per data-parallel rank (or per T ranks with tensor parallelism).

Where it runs is ``titanrl.rollout.launch``'s: colocated, in the rank's own process through vLLM's external
launcher (no engine-core or worker processes, 2-7 s to start on the tiny model plus ~5 s for the first
``import vllm``; the worker binds the rank's device); disaggregated, in child processes (its engine core, which
holds its worker at tensor parallelism 1, and at T > 1 its T workers).
Weights arrive in memory (``update_weights``: tensors by reference into the model's ``load_weights``, in place; or,
in child processes, over the push's process group: ``receive_weights``). A CPU engine keeps its linear weights beside
the kernels vLLM-CPU packs from them, and packs those again after a push (``titanrl.rollout.vllm_plugin``); where
vLLM drops the weights anyway, pushes go through its layer-wise reload (``in_place`` False). What that costs, and
how it is contained:

- vLLM's worker calls ``torch.distributed``: in a torchrun rank it finds the trainer's process
  group and makes its own groups from it (tensor-parallel blocks of T ranks) -- ``new_group`` is collective, so
  **every rank must build its engine at the same point** (the trainer's init). Outside torchrun it starts
  a world-of-one group over a ``file://`` store in the temp dir: no TCP port is opened, so
  several engines on one machine never collide on ports.
- While it starts, vLLM reseeds the global RNGs, replaces ``torch.set_num_threads`` with a no-op
  and rewrites ``LOCAL_WORLD_SIZE``, ``LD_PRELOAD`` and some ``TORCHINDUCTOR_*`` variables. The
  engine restores all of them afterwards, and restores the torch RNG after each call (vLLM's CPU
  sampler draws from it even when every request is seeded).
- Threads: no core binding in-process; vLLM computes with the process's torch intra-op pool
  (torchrun sets ``OMP_NUM_THREADS=1`` per rank when several run on one machine), or with
  ``rollout.num_threads`` threads while the engine runs when that is set.
- Memory: ``rollout.kv_cache_bytes`` is per engine (per rank). vLLM's multi-modal processor
  cache is off (it would default to 4 GiB per engine). vLLM's CPU worker sets the process's
  memory policy to bind to the NUMA node of its first allowed CPU (``init_cpu_memory_env``),
  and the engine core ``gc.freeze()``s the heap at start (undone by ``close``); on a one-node
  machine the first is moot.
- Shutdown: call ``close()``. vLLM's own shutdown (also run if the engine is garbage-collected)
  destroys the default process group; ``close`` keeps the trainer's.
- Logs: vLLM logs at INFO on every rank; the trainer routes it to the rank's log file
  (``metrics.verbose``); set ``VLLM_LOGGING_LEVEL=WARNING`` to quiet it there too. The per-reload
  "Failed to load weights" warnings of buffer-only layers are dropped (``_DerivedBufferFilter``).

Environment set before vLLM is imported (only where unset; see ``VLLM_ENV``).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from titanrl._platform_compat import NEW_SESSION_ENV
from titanrl.data.preprocess import DecodedMedia
from titanrl.rollout.types import (
    PromptMismatchError,
    RolloutRequest,
    RolloutSample,
    WeightsMismatchError,
    check_prompt_ids,
    request_seed,
    token_limits,
    torch_threads,
)
from titanrl.models.qwen2_5_vl.state_dict_adapter import canonical_hf_name
from titanrl.rollout.launch import EngineLaunch, engine_launch
from titanrl.rollout.vllm_plugin import KEEP_WEIGHTS_ENV, repack_cpu_kernels
from titanrl.rollout.weights import (QWEN2_5_VL_PACKED_MODULES, TensorInfo, check_update, checked_stream,
                                     file_tensors, read_header, read_headers, weight_files)

log = logging.getLogger(__name__)

VLLM_ENV: dict[str, str] = {
    # In-process engine core + worker: starts in seconds, no child processes, shares the rank.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # Never pin threads to cores: the rank process owns its affinity, and several ranks (each
    # with an engine) may share a machine. (Only the multiprocess executor binds; belt and braces.)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # Reserve no core for vLLM's own frontend (1.4-1.7x throughput on 2 cores).
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    # Anything vLLM would bind or advertise stays on loopback.
    "VLLM_HOST_IP": "127.0.0.1",
    # No usage reporting (and no network access is needed at all).
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # titanrl's vLLM plugin: a CPU engine's linear layers keep their weights beside their packed kernels, so a push
    # loads in place
    KEEP_WEIGHTS_ENV: "1",
}
# Legacy variable that would silently override rollout.kv_cache_bytes (in GiB).
_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"


def set_vllm_env() -> dict[str, str]:
    """Apply ``VLLM_ENV`` where unset (call before importing vllm); return what is in effect."""
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    if os.environ.get(_KV_ENV):
        warnings.warn(f"ignoring {_KV_ENV}={os.environ[_KV_ENV]!r}: rollout.kv_cache_bytes sizes the KV cache")
        del os.environ[_KV_ENV]
    return {k: os.environ[k] for k in VLLM_ENV}


@contextmanager
def _contain_global_state(restore_rng: bool = True) -> Iterator[None]:
    """Undo what vLLM changes in the process while it starts (env, RNGs, set_num_threads)."""
    env_before = dict(os.environ)
    set_num_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate()) if restore_rng else None
    try:
        yield
    finally:
        for k in set(os.environ) | set(env_before):
            if k.startswith("VLLM_"):
                continue  # vLLM's own settings may be read again later
            if k not in env_before:
                os.environ.pop(k, None)
            elif os.environ.get(k) != env_before[k]:
                os.environ[k] = env_before[k]
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            set_num_threads(threads)
        if rng is not None:
            torch.set_rng_state(rng[0])
            np.random.set_state(rng[1])
            random.setstate(rng[2])


@contextmanager
def _without_collections() -> Iterator[None]:
    """``gc.collect`` and ``gc.unfreeze`` do nothing inside (vLLM's shutdown calls both; the heap vLLM froze at
    start-up stays out of the collector's sight, Python's exit included)."""
    collect, unfreeze = gc.collect, gc.unfreeze
    gc.collect, gc.unfreeze = (lambda generation=2: 0), (lambda: None)
    try:
        yield
    finally:
        gc.collect, gc.unfreeze = collect, unfreeze


def _packed_modules(model: Any) -> dict:
    """The fused modules of vLLM's model (a module-level function: apply_model pickles it to an engine core
    in a child process)."""
    return dict(getattr(model, "packed_modules_mapping", {}) or {})


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _worker_layout(worker: Any) -> dict[str, Any]:
    """Runs inside vLLM's worker: the device it bound, its place in vLLM's groups, and whether a push loads into its
    model in place (``_reload``)."""
    from vllm.distributed import parallel_state as ps

    return {"device": str(worker.device), "rank": int(worker.rank), "local_rank": int(worker.local_rank),
            "tp_ranks": list(ps.get_tp_group().ranks), "world_ranks": list(ps.get_world_group().ranks),
            "backend": _backend_name(worker.parallel_config.distributed_executor_backend),
            "pid": os.getpid(),
            "in_place": _keeps_weights(worker.model_runner.get_model())}


def _backend_name(backend: Any) -> str:
    """vLLM's executor as its config names it: a string, or a class given instead (uni inside the engine core)."""
    return {"UniProcExecutor": "uni"}.get(getattr(backend, "__name__", ""), str(backend))


def _keeps_weights(model: torch.nn.Module) -> bool:
    """Whether every parameter of the engine's model holds its values (vLLM-CPU drops a weight it packed into a kernel,
    leaving an empty parameter, unless titanrl's plugin keeps it)."""
    return all(p.numel() > 0 for p in model.parameters())


def _reload(worker: Any, tensors: Iterator[tuple[str, torch.Tensor]], partial: bool = False) -> None:
    """Runs inside vLLM's worker: (HF name, tensor) pairs into the model, in place. Where the model keeps its
    weights (CUDA; CPU with titanrl's vLLM plugin) the model's own ``load_weights`` copies each into its parameter
    (fused modules take their parts through their weight loaders), as verl pushes, and on CPU each layer's packed
    GEMM kernel is packed again from its new weight; where vLLM-CPU dropped the weights, its layer-wise reload
    rebuilds each layer. ``partial``: an update of some whole modules (the push of what a step changes, checked by
    ``check_update``): the others keep their weights (the reload puts their tensors back, and its warnings that they
    were not loaded say nothing)."""
    model = worker.model_runner.get_model()
    in_place = getattr(worker, "_titanrl_in_place", None)
    if in_place is None:
        in_place = worker._titanrl_in_place = _keeps_weights(model)
    if in_place:
        repack_cpu_kernels(model, model.load_weights(tensors))
        return
    _quiet_derived_buffer_warnings(model)
    if not partial:
        worker.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
        return
    loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
    for logger in loggers:
        logger.addFilter(_not_loaded_filter)
    try:
        worker.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
    finally:
        for logger in loggers:
            logger.removeFilter(_not_loaded_filter)


def _not_loaded_filter(record: logging.LogRecord) -> bool:
    """vLLM's warnings that a module's weights were not in an update (expected in a partial one)."""
    return record.msg not in ("%s: Failed to load weights", "Following weights were not loaded from checkpoint: %s")


def _eager_token_ranks(worker: Any) -> None:
    """rollout.enforce_eager, in each of the engine's workers: vLLM still torch.compiles one sampler helper
    (``batched_count_greater_than``: the rank of each sampled token among the vocabulary) on its first call, ~4 s of
    inductor per engine process on CPU, warm cache or not; the same counts come from the function itself (titanrl
    reads the sampled tokens' log-probs, not their ranks)."""
    from vllm.v1.sample import sampler

    compiled = getattr(sampler, "batched_count_greater_than", None)
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    if eager is not None:
        sampler.batched_count_greater_than = eager


def _reload_tensors(worker: Any, tensors: Iterator[tuple[str, torch.Tensor]], partial: bool = False) -> None:
    """In the rank's process (in-process engines): the tensors arrive as they are, by reference."""
    _reload(worker, tensors, partial)


def _reload_files(worker: Any, files: list[str], partial: bool = False) -> None:
    """An engine in child processes, from safetensors files (``load_weights``; the trainer's push sends none)."""
    _reload(worker, file_tensors(files), partial)


def _join_weight_group(worker: Any, address: tuple[str, int], world: int, first: int, timeout_s: float) -> None:
    """Runs inside each of the engine's workers: join the weight push's process group as rank first + its own."""
    from titanrl.distributed import stateless_group

    worker._titanrl_weight_group = stateless_group(address, first + int(worker.rank), world, worker.device,
                                                   timeout_s)


def _receive_weights(worker: Any, buckets: list, partial: bool = False) -> None:
    """Runs inside each of the engine's workers: the buckets the first training rank broadcasts, into the model."""
    from titanrl.rl.weight_sync import Bucket, receive_buckets

    buckets = [Bucket.from_wire(b) for b in buckets]
    _reload(worker, receive_buckets(buckets, worker._titanrl_weight_group, worker.device), partial)


class _DerivedBufferFilter(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" for layers that own buffers but no parameters.

    vLLM's layer-wise reload counts buffers as loadable; layers whose only tensors are derived at
    construction (rotary cos/sin caches: ``RotaryEmbedding``, ``MRotaryEmbedding``; the image
    rescale/normalise constants of ``FusedMMInputNorm``) find nothing of theirs in a checkpoint, so
    every reload warns per such layer although vLLM then puts the same tensors back. Nothing was
    lost: the trainer's weights all arrive (the rollout probe checks it). A layer that has parameters
    and fails to load still warns."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.names)


def _quiet_derived_buffer_warnings(model: torch.nn.Module) -> None:
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if any(isinstance(f, _DerivedBufferFilter) for f in logger.filters):
        return
    derived = {type(m).__name__ for m in model.modules()
               if any(True for _ in m.buffers(recurse=False)) and not any(True for _ in m.parameters(recurse=False))}
    with_params = {type(m).__name__ for m in model.modules() if any(True for _ in m.parameters(recurse=False))}
    logger.addFilter(_DerivedBufferFilter(derived - with_params))


def collapse_placeholders(ids: Sequence[int], pads: Sequence[int]) -> list[int]:
    """``ids`` with each run of one placeholder token (an image's or video's expanded pads) cut to one token."""
    out: list[int] = []
    for t in ids:
        t = int(t)
        if t in pads and out and out[-1] == t:
            continue
        out.append(t)
    return out


def video_metadata(media: DecodedMedia, temporal_patch_size: int) -> dict[str, Any]:
    """vLLM's (frames, metadata) for already-sampled frames. vLLM sets second_per_grid to
    temporal_patch_size / fps, so fps = the sampled fps makes it equal the trainer's
    (media_to_patches uses 1.0 s when the fps is unknown, hence the fallback)."""
    n = int(media.frames.shape[0])
    fps = float(media.sampled_fps) if media.sampled_fps > 0 else float(temporal_patch_size)
    return {
        "fps": fps,
        "duration": n / fps,
        "total_num_frames": n,
        "frames_indices": list(range(n)),
        "video_backend": "opencv",
        "do_sample_frames": False,
    }


def _dist_ident(worker: Any) -> str | None:
    """Runs inside each of the engine's workers: the ident vLLM-CPU's worker names its shared memory with."""
    return os.environ.get("VLLM_DIST_IDENT")


@contextmanager
def _cpu_shm_named(tp_group: Any, first_rank: int) -> Iterator[None]:
    """vLLM-CPU names the shared-memory files of its tensor-parallel all-reduce after its worker's init method. Under
    the external launcher that is ``env://`` in every run, so every engine over several ranks on a machine would open
    ``/dev/shm/-tp:0-[0-1]-cpushm_<rank>``: two runs at once collide, and after a run killed with -9 (its files left
    behind) the next one stops with "create shm in SHMManager failed. errno: 17". While the engine starts, its
    workers get ``env://titanrl-<token>`` instead (one random token per engine, sent from its first rank over the
    engine's ranks; it starts with the first rank's pid): the process group already exists, so vLLM only names the
    files with it. Files of such names that a killed run left (no process maps them) are removed first."""
    import torch.distributed as dist
    from vllm.v1.worker.cpu_worker import CPUWorker

    if dist.get_rank() == first_rank:
        _remove_stale_cpu_shm()
    token = [f"{os.getpid()}p{os.urandom(6).hex()}"]
    dist.broadcast_object_list(token, src=first_rank, group=tp_group)
    original = CPUWorker.init_device

    def init_device(worker: Any) -> None:
        if worker.distributed_init_method == "env://":
            worker.distributed_init_method = f"env://titanrl-{token[0]}"
        return original(worker)

    CPUWorker.init_device = init_device
    try:
        yield
    finally:
        CPUWorker.init_device = original


def mapped_shm_files(contains: str, pids: Iterable[int] | None = None) -> set[str]:
    """The paths under /dev/shm holding ``contains`` that processes ``pids`` (default: every process this one may
    read) map, from ``/proc/<pid>/maps``."""
    if pids is None:
        pids = (int(p.name) for p in Path("/proc").glob("[0-9]*"))
    mapped: set[str] = set()
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:  # a process that ended, or one of another user's
            continue
        mapped.update(line.rsplit(None, 1)[-1] for line in lines if "/dev/shm/" in line and contains in line)
    return mapped


def cpu_shm_maker_gone(name: str) -> bool:
    """Whether the engine's first rank that made a ``titanrl-<pid>p...cpushm_<rank>`` file (``_cpu_shm_named``) is
    gone."""
    pid = name.removeprefix("titanrl-").split("p", 1)[0]
    return pid.isdigit() and not Path(f"/proc/{pid}").exists()


def _remove_stale_cpu_shm(min_age_s: float = 10.0) -> list[str]:
    """Remove ``/dev/shm/titanrl-*cpushm_*`` files (``_cpu_shm_named``) that no process maps and whose engine's first
    rank (the pid their name starts with) is gone, or that are older than ``min_age_s`` (not one an engine starting
    now has made and not yet mapped): those of engines whose processes were killed, also just before this start
    (their last all-reduce wrote them seconds ago). Returns their names."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    now = time.time()
    candidates = [f for f in shm.glob("titanrl-*cpushm_*")
                  if cpu_shm_maker_gone(f.name) or now - f.stat().st_mtime > min_age_s]
    if not candidates:
        return []
    mapped = mapped_shm_files("cpushm_")
    removed = []
    for f in candidates:
        if str(f) not in mapped:
            try:
                f.unlink(missing_ok=True)
            except OSError:  # another user's
                continue
            removed.append(f.name)
    return removed


def _unlink_cpu_shm(ident: str | None) -> None:
    """Remove the shared-memory files of vLLM-CPU's tensor-parallel all-reduce named by ``ident`` (each rank of the
    group removes every one: the others have mapped them already, and a name already gone is no error)."""
    shm = Path("/dev/shm")
    if ident is None or not shm.is_dir():
        return
    prefix = ident.lstrip("/") + "-"  # shm_open drops leading slashes (an env:// launch's ident is "//")
    for path in shm.iterdir():
        if path.name.startswith(prefix) and "cpushm" in path.name:
            path.unlink(missing_ok=True)


class VLLMEngine:
    """``RolloutEngine`` on an in-process vLLM ``LLM``."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 2048,
        kv_cache_bytes: int = 256 << 20,
        enforce_eager: bool = True,
        mm_limits: dict[str, int] | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        num_threads: int = 0,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        max_num_seqs: int | None = None,
        banned_token_ids: Sequence[int] | None = None,
        launch: EngineLaunch | None = None,
        tp_group: Any = None,
        sleep: bool = False,
    ) -> None:
        import torch.distributed as dist

        self.model_dir = Path(model_dir)
        self._sleeps = sleep  # rollout.sleep: vLLM's sleep mode (CUDA / ROCm builds only)
        self._asleep = False
        self.num_threads = num_threads
        # where it runs (titanrl.rollout.launch); unset: this process alone, on device 0
        process_group = dist.is_available() and dist.is_initialized()
        if launch is None:  # one engine per rank, on the rank's device
            world = dist.get_world_size() if process_group else 1
            launch = engine_launch(dist.get_rank() if process_group else 0, int(os.environ.get("LOCAL_RANK", 0)),
                                   world, 1, _device_type(), process_group=process_group,
                                   local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        self.launch = launch
        # tensor parallelism inside the ranks (colocated): the ranks sharing the engine submit the same requests
        self.tp_group = tp_group if launch.in_process and launch.tensor_parallel_size > 1 else None
        if launch.in_process and launch.tensor_parallel_size > 1 and tp_group is None:
            raise ValueError("an engine over several ranks needs their process group (tp_group)")
        own_process = not launch.in_process
        if own_process:
            # the engine core (and its workers, or at TP 1 its worker inside it) in child processes: vLLM's default
            # mode; spawned, not forked
            # (this process runs gloo and Ray threads); apply_model's function is pickled to them
            os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_WORKER_MULTIPROC_METHOD="spawn",
                              VLLM_ALLOW_INSECURE_SERIALIZATION="1")
            # ... in a session of their own (titanrl._platform_compat: the start-up hook), so torchrun's SIGTERM to
            # the rank's process group reaches the rank only, which finishes its step with the engine and closes
            # it; if the rank is killed, vLLM's engine core sees its parent die and exits
            os.environ[NEW_SESSION_ENV] = "1"
        self.env = set_vllm_env()
        self._reference = read_headers(self.model_dir)  # what the engine loaded: names/shapes
        cfg = json.loads((self.model_dir / "config.json").read_text())
        self.image_token_id = int(cfg["image_token_id"])
        self.video_token_id = int(cfg["video_token_id"])
        self.temporal_patch_size = int((cfg.get("vision_config") or {}).get("temporal_patch_size", 2))
        # Never sample the vision pad tokens: a response holding one cannot be laid out by the
        # trainer (pads mark where vision features go). Reported log-probs stay unprocessed.
        banned = (self.image_token_id, self.video_token_id) if banned_token_ids is None else banned_token_ids
        self.logit_bias = {int(t): -100.0 for t in banned} or None
        mm_kwargs = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        self.mm_processor_kwargs = mm_kwargs or None
        self.mm_limits = dict(mm_limits or {"image": 1, "video": 1})

        # Whose default process group will vLLM use? Ours to tear down only if vLLM made it.
        self._owns_process_group = not process_group
        t0 = time.perf_counter()
        with self._threads(), _contain_global_state():
            from vllm import LLM, SamplingParams

            self._SamplingParams = SamplingParams
            kwargs: dict[str, Any] = dict(
                model=str(self.model_dir),
                dtype=dtype,
                enforce_eager=enforce_eager,
                kv_cache_memory_bytes=int(kv_cache_bytes),
                max_model_len=int(max_model_len),
                limit_mm_per_prompt=self.mm_limits,
                mm_processor_kwargs=self.mm_processor_kwargs,
                mm_processor_cache_gb=0,
                enable_prefix_caching=enable_prefix_caching,
                seed=seed,
                disable_log_stats=True,
                # A prompt prefilled in chunks makes vLLM rewind the seeded generator of the
                # partial request with Generator.set_offset, which CPU generators do not support
                # ("CPU Generator does not use offset"): schedule whole prompts only.
                enable_chunked_prefill=False,
                tensor_parallel_size=launch.tensor_parallel_size,
                # behaviour log-probs of the distribution the tokens were sampled from: after the logit bias,
                # the temperature and top-p (what importance weights of off-policy tokens divide by)
                logprobs_mode="processed_logprobs",
            )
            if launch.own_process and launch.backend == "uni":
                # one worker, inside vLLM's engine-core process (vLLM's choice on one GPU). vLLM's CPU build turns
                # the name "uni" into a worker process of its own there (for thread binding this engine does not do:
                # VLLM_CPU_OMP_THREADS_BIND=nobind); the class is the same executor on every platform: one spawned
                # process less (an import of vLLM, ~15 s on a loaded core) and no worker to wait for at close
                from vllm.v1.executor.uniproc_executor import UniProcExecutor

                kwargs["distributed_executor_backend"] = UniProcExecutor
            elif launch.in_process:  # in child processes over several workers vLLM picks mp itself
                kwargs["distributed_executor_backend"] = launch.backend
            if max_num_seqs is not None:
                kwargs["max_num_seqs"] = max_num_seqs
            if sleep:  # vLLM refuses it on a platform without sleep mode (its CPU build), naming the platform
                kwargs["enable_sleep_mode"] = True
            if launch.visible_devices:
                # the engine's workers take this rank's device and the next tensor_parallel_size - 1 (the ranks it
                # spans); the variable is read by the spawned processes only (restored on leaving the block)
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices[i] for i in launch.visible_devices)
            os.environ.update(launch.env)  # external_launcher: vLLM's worker reads RANK / LOCAL_RANK (restored)
            # everything alive now (the imports, the trainer's models) is out of the collector's sight: vLLM's
            # start-up collects several times (model load, heap freeze), each a scan of the whole heap (~2 s here)
            gc.freeze()
            named = _cpu_shm_named(self.tp_group, launch.engine_ranks[0]) \
                if self.tp_group is not None and _device_type() == "cpu" else nullcontext()
            try:
                with named:
                    self.llm = LLM(**kwargs)
            finally:
                os.environ.pop(NEW_SESSION_ENV, None)
        self.start_s = time.perf_counter() - t0
        self.own_process = own_process
        # vLLM-CPU's tensor-parallel all-reduce buffers (/dev/shm/<ident>-...-cpushm_<rank>): its C++ SHM manager
        # unlinks them only when its process exits normally, so an engine's workers that are terminated (an engine in
        # child processes) leave them behind; close() removes them, named by the ident the workers set
        self._cpu_shm_ident = self.llm.collective_rpc(_dist_ident)[0] if _device_type() == "cpu" else None
        self._outside_s = 0.0  # wall seconds of calls into an engine in child processes
        self.weight_version = 0
        # Fused modules of the engine's model: partial updates must cover them whole.
        packed = self.llm.apply_model(_packed_modules)
        self.packed_modules = (packed[0] if packed else None) or dict(QWEN2_5_VL_PACKED_MODULES)
        # what vLLM's workers took: device, rank, tensor-parallel group (checked by tests, logged by the trainer)
        self.layout = self.llm.collective_rpc(_worker_layout)
        # whether pushes load in place (the workers' models kept their weights) or through vLLM's layer-wise reload
        self.in_place = all(w["in_place"] for w in self.layout)
        if enforce_eager:
            self.llm.collective_rpc(_eager_token_ranks)

    def busy_outside_s(self) -> float:
        """Seconds the engine worked for this rank outside this process: the wall time of calls into an engine
        whose core runs in child processes (0 in-process, where this process's CPU time holds the work). Wall,
        not the children's CPU time: at tensor parallelism > 1 vLLM's worker processes busy-poll for a second after
        every request."""
        return self._outside_s

    # -- helpers ----------------------------------------------------------------------------

    def _threads(self):
        return torch_threads(self.num_threads)

    @contextmanager
    def _call(self) -> Iterator[None]:
        rng = torch.get_rng_state()
        t0 = time.perf_counter()
        try:
            with self._threads():
                yield
        finally:
            torch.set_rng_state(rng)
            if self.own_process:
                self._outside_s += time.perf_counter() - t0

    def _prompt(self, request: RolloutRequest, completion_ids: Sequence[int] | None = None) -> dict[str, Any]:
        images = [m.frames[0] for m in request.media if m.kind == "image"]
        videos = [(m.frames, video_metadata(m, self.temporal_patch_size)) for m in request.media if m.kind == "video"]
        for kind, items in (("image", images), ("video", videos)):
            if len(items) > self.mm_limits.get(kind, 0):
                raise ValueError(
                    f"request has {len(items)} {kind}(s); the engine was built for at most "
                    f"{self.mm_limits.get(kind, 0)} per prompt (build_rollout_engine's mm_limits)"
                )
        prompt: dict[str, Any]
        if completion_ids is None:
            prompt = {"prompt": request.prompt_text}
        else:
            tok = self.llm.get_tokenizer()
            # a multi-turn context's observation images sit in the completion with their placeholders expanded;
            # vLLM expands each image's single placeholder itself (as in the prompt's text)
            ids = list(tok(request.prompt_text, add_special_tokens=False)["input_ids"]) + collapse_placeholders(
                completion_ids, (self.image_token_id, self.video_token_id))
            prompt = {"prompt_token_ids": ids}
        mm: dict[str, Any] = {}
        if images:
            mm["image"] = images if len(images) > 1 else images[0]
        if videos:
            mm["video"] = videos if len(videos) > 1 else videos[0]
        if mm:
            prompt["multi_modal_data"] = mm
        return prompt

    def _check(self, request: RolloutRequest, got: Sequence[int], index: int, extra: Sequence[int] = ()) -> None:
        expected = np.concatenate([np.asarray(request.prompt_ids, dtype=np.int64), np.asarray(extra, dtype=np.int64)])
        check_prompt_ids(expected, got, what=f"request {index}" + (f" (key {request.key!r})" if request.key else ""),
                         image_token_id=self.image_token_id, video_token_id=self.video_token_id)

    # -- sleep ------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Give the device memory back until the next call (engine built with ``sleep=True``; else nothing):
        vLLM's sleep level 1, its weights to host memory and its KV cache discarded (level 2 would drop the weights
        too, but a parameter the weight push does not write would then come back as garbage)."""
        if self._sleeps and not self._asleep:
            with self._call():
                self.llm.sleep(level=1)
            self._asleep = True

    def _wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Wake what the next call needs: everything (generation), or only ``("weights",)`` (a weight push: the KV
        cache stays released until the next generation, vLLM's RL pattern)."""
        if self._asleep:
            with self._call():
                self.llm.wake_up(tags=list(tags) if tags else None)
            self._asleep = tags is not None

    # -- RolloutEngine ----------------------------------------------------------------------

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int | Sequence[int],
        seed: int,
    ) -> list[list[RolloutSample]]:
        if not requests and self.tp_group is None:
            return []
        limits = token_limits(max_new_tokens, len(requests))
        every, start = self._lockstep([(r, (n, temperature, top_p, m, seed)) for r, m in zip(requests, limits)])
        self._wake()
        prompts = [self._prompt(r, r.response_prefix or None) for r, _ in every]
        params = [
            self._SamplingParams(
                n=n_,
                temperature=temperature_,
                top_p=top_p_,
                top_k=0,
                max_tokens=max_new_tokens_,
                logprobs=0,
                seed=request_seed(seed_, r),
                logit_bias=self.logit_bias,
            )
            for r, (n_, temperature_, top_p_, max_new_tokens_, seed_) in every
        ]
        with self._call():
            outputs = self.llm.generate(prompts, params, use_tqdm=False) if prompts else []
        outputs = outputs[start:start + len(requests)]
        result = []
        for i, (request, out) in enumerate(zip(requests, outputs)):
            self._check(request, out.prompt_token_ids, i, extra=request.response_prefix)
            samples = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs)]
                reason = "stop" if c.finish_reason == "stop" else "length"
                samples.append(RolloutSample(ids, lps, reason, c.text, prompt_tokens=len(out.prompt_token_ids),
                                             cached_tokens=out.num_cached_tokens))
            result.append(samples)
        return result

    def score(self, request: RolloutRequest, completion_ids: Sequence[int]) -> list[float]:
        return self.score_many([(request, completion_ids)])[0]

    def score_many(self, items: Sequence[tuple[RolloutRequest, Sequence[int]]]) -> list[list[float]]:
        """``score`` of several (request, completion) pairs in one engine call (every rank of an engine over
        several ranks calls it, with its own pairs or none)."""
        items = [(r, [int(t) for t in ids]) for r, ids in items]
        every, start = self._lockstep([(r, ids) for r, ids in items if ids])
        if not every:
            return [[] for _ in items]
        self._wake()
        params = self._SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=None)
        with self._call():
            outs = self.llm.generate([self._prompt(r, ids) for r, ids in every], params, use_tqdm=False)
        scored = iter(outs[start:])
        result = []
        for i, (request, ids) in enumerate(items):
            if not ids:
                result.append([])
                continue
            out = next(scored)
            self._check(request, out.prompt_token_ids, i, extra=ids)
            first = len(out.prompt_token_ids) - len(ids)
            result.append([float(out.prompt_logprobs[first + j][t].logprob) for j, t in enumerate(ids)])
        return result

    def _lockstep(self, mine: list) -> tuple[list, int]:
        """An engine over several ranks in their processes (vLLM's external launcher) runs one schedule on every
        one of them: each rank submits the items of all of them, in rank order. Returns those items and where this
        rank's start (alone: its own, at 0)."""
        if self.tp_group is None:
            return mine, 0
        import torch.distributed as dist

        parts: list = [None] * self.launch.tensor_parallel_size
        dist.all_gather_object(parts, mine, group=self.tp_group)
        index = self.launch.engine_ranks.index(self.launch.rank)
        return [x for part in parts for x in part], sum(len(p) for p in parts[:index])

    # -- weights ----------------------------------------------------------------------------

    @property
    def workers(self) -> int:
        """The engine's worker processes that take a weight push (one per tensor-parallel rank in child
        processes; in the rank's process, none of their own)."""
        return 0 if self.launch.in_process else self.launch.tensor_parallel_size

    def _partial(self, layout: Mapping[str, Any]) -> bool:
        """Whether an update (checked: known names) leaves some of the engine's tensors out."""
        return len({canonical_hf_name(k) for k in layout}) < len(self._reference)

    def check_update(self, layout: Mapping[str, TensorInfo], where: str = "weight push") -> None:
        """WeightsMismatchError naming what does not fit, before anything loads (a reload that fails half-way kills
        the engine)."""
        check_update(self._reference, layout, where=where, packed=self.packed_modules)

    def update_weights(self, layout: Mapping[str, TensorInfo], tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """The weights in place from (HF name, tensor) pairs, in memory (an engine in the rank's process: they
        reach vLLM's worker by reference, on their device); ``layout`` declares them (names, shapes, dtypes: checked
        first, and each tensor against it as it arrives). Returns the seconds it took, cache resets included."""
        if not self.launch.in_process:
            raise ValueError("an engine in child processes receives a push over its weight group "
                             "(join_weight_group / receive_weights)")
        t0 = time.perf_counter()
        self.check_update(layout)
        self._wake(("weights",))  # the worker loads into its device parameters (its KV cache may stay asleep)
        with self._call():
            self.llm.collective_rpc(_reload_tensors, args=(checked_stream(tensors, layout), self._partial(layout)))
        self._after_update()
        return time.perf_counter() - t0

    def load_weights(self, hf_dir: str | Path) -> float:
        """The weights of an HF directory's safetensors (all or part of the model)."""
        t0 = time.perf_counter()
        files = weight_files(hf_dir)
        update: dict = {}
        for f in files:
            part = read_header(f)
            dup = set(part) & set(update)
            if dup:
                raise WeightsMismatchError(f"{hf_dir}: tensors in several files: {sorted(dup)[:5]}")
            update.update(part)
        self.check_update(update, where=str(hf_dir))
        if self.launch.in_process:
            self._wake(("weights",))
            with self._call():
                self.llm.collective_rpc(_reload_tensors, args=(file_tensors(files), self._partial(update)))
        else:
            self._wake(("weights",))
            with self._call():
                self.llm.collective_rpc(_reload_files, args=([str(f) for f in files], self._partial(update)))
        self._after_update()
        return time.perf_counter() - t0

    def join_weight_group(self, address: tuple[str, int], world: int, first: int, timeout_s: float) -> None:
        """The engine's workers (ranks ``first`` ..) join the weight push's process group hosted at ``address``."""
        with self._call():
            self.llm.collective_rpc(_join_weight_group, args=(tuple(address), world, first, timeout_s))

    def receive_weights(self, buckets: list) -> float:
        """The engine's workers receive a push over their weight group (the sender broadcasts ``buckets``)."""
        t0 = time.perf_counter()
        self._wake(("weights",))
        with self._call():
            partial = self._partial({name: None for b in buckets for name, *_ in b.entries})
            self.llm.collective_rpc(_receive_weights, args=([b.to_wire() for b in buckets], partial))
        self._after_update()
        return time.perf_counter() - t0

    def _after_update(self) -> None:
        # Stale vision embeddings / KV blocks computed with the old weights must go, or the next request with a seen
        # image hits "Encoder cache miss" (or reuses old KV).
        with self._call():
            self.llm.llm_engine.reset_encoder_cache()
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache (requests still running?)")
            self.llm.reset_mm_cache()
        self.weight_version += 1

    def close(self, *, collect: bool = True) -> None:
        """Shut the engine down and free its memory. Call it explicitly: vLLM's own shutdown
        (also run when the engine is garbage-collected) destroys the *default* process group,
        which under torchrun is the trainer's; here vLLM's groups go but the trainer's stays.

        ``collect=False`` (the process ends next, nothing is reused): the same shutdown without its
        garbage collections. vLLM's shutdown un-freezes the heap it froze at start-up and collects it
        twice, and this close once more: ~3 s per rank on the tiny 2-rank run (2-3 s of its wall time), for
        memory the process's exit frees."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        from vllm.distributed import parallel_state as ps

        destroy_env = ps.destroy_distributed_environment

        def destroy_vllm_groups_only() -> None:
            if ps._WORLD is not None:
                ps._WORLD.destroy()
            ps._WORLD = None
            ps._NODE_COUNT = None

        if not self._owns_process_group:
            ps.destroy_distributed_environment = destroy_vllm_groups_only
        try:
            with nullcontext() if collect else _without_collections():
                llm.llm_engine.engine_core.shutdown()
        finally:
            ps.destroy_distributed_environment = destroy_env
        del llm
        _unlink_cpu_shm(self._cpu_shm_ident)
        if collect:
            gc.collect()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["VLLMEngine", "VLLM_ENV", "set_vllm_env", "PromptMismatchError", "video_metadata"]
