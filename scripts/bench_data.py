"""ShadowLoader vs the centralized (verl-like) loader: data wait, memory, decode throughput.

    python scripts/bench_data.py [--mixtures video-heavy only-video] [--nproc 4] [--steps 6] \
        [--compute-s 3] [--global-batch-size 8] [--max-frames 16] [--out benchmarks/data]

For each mixture (synthetic, ``--scale paper`` media) and each loader, the script launches
``torchrun --nproc-per-node N`` on itself (``worker`` mode). Every rank runs ``--warmup`` + ``--steps``
steps of: next_step() + materialize() (timed: the data wait the rank is exposed to), then a simulated
compute of ``--compute-s`` seconds (sleep), then a barrier (the step's gradient collective). Memory
is each process's peak RSS (shared object-store pages count in every process that maps them); rank 0
also samples the RSS of all of Ray's processes. A separate ``planner`` process plans the same steps
from metadata alone (ShadowLoader's planning role; FlexRL's single controller) and reports its memory.

The preprocessing is transformers' Qwen2.5-VL defaults (video frames 128..768 x 28^2 pixels, no total
cap), so pixel_values have the size the paper's runs move; the model is only a tokenizer here.
Results: ``<out>.json`` and ``<out>.md`` (targets, measured table, and a 16 x 8 GPU cost model from
the measured per-sample costs; see ``scale_model``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import provenance, provenance_text  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# transformers' Qwen2VL processor defaults (what the paper's Qwen2.5-VL / MiMo-VL runs use)
PAPER_IMAGE = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}
PAPER_VIDEO = {"min_pixels": 128 * 28 * 28, "max_pixels": 768 * 28 * 28, "cap_pixels_per_frame": False,
               "max_video_tokens": 128000}


# ----------------------------------------------------------------------------------- set-up


def bench_checkpoint(cache: Path) -> Path:
    """The tiny checkpoint's tokenizer with transformers' default pixel limits (built once)."""
    target = cache / "bench_ckpt"
    if (target / ".complete").is_file():
        return target
    from titanrl.models.make_tiny import make_tiny_checkpoint

    if target.exists():
        shutil.rmtree(target)
    make_tiny_checkpoint(target, size="tiny", seed=0)
    for name, limits in (("preprocessor_config.json", PAPER_IMAGE), ("video_preprocessor_config.json", PAPER_VIDEO)):
        cfg = json.loads((target / name).read_text())
        cfg.update(limits)
        cfg["size"] = {"shortest_edge": limits["min_pixels"], "longest_edge": limits["max_pixels"]}
        (target / name).write_text(json.dumps(cfg, indent=2))
    (target / ".complete").write_text("ok\n")
    return target


def bench_dataset(cache: Path, mixture: str, num_samples: int, scale: str) -> Path:
    target = cache / f"{mixture}_{scale}_n{num_samples}"
    if not (target / ".complete").is_file():
        from titanrl.data.synth import generate_dataset

        if target.exists():
            shutil.rmtree(target)
        t0 = time.perf_counter()
        generate_dataset(target, mixture, num_samples, seed=0, scale=scale)
        print(f"[bench] generated {target} in {time.perf_counter() - t0:.1f} s", flush=True)
        (target / ".complete").write_text("ok\n")
    return target / "manifest.jsonl"


# The loaders compared: (data.loader, prefetch steps or None = --prefetch). The centralized loader is
# run twice: as verl does it (nothing decoded ahead) and with the same prefetch depth ShadowLoader gets
# (rank 0 decodes ahead in the background), so what ShadowLoader still wins shows apart from prefetch.
LOADERS = {"centralized": ("centralized", 0), "centralized+prefetch": ("centralized", None), "shadow": ("shadow", None)}


def overrides(args: argparse.Namespace, loader: str) -> list[str]:
    kind, prefetch = LOADERS[loader]
    prefetch = args.prefetch if prefetch is None else prefetch
    return [
        f"--data.loader={kind}", f"--data.slice_loading={kind == 'shadow'}".lower(),
        f"--rl.global_batch_size={args.global_batch_size}",
        f"--data.max_frames={args.max_frames}", f"--data.fps={args.fps}",
        f"--data.num_decode_workers={args.decode_workers}", f"--data.prefetch_batches={prefetch}",
        f"--data.max_prompt_tokens={10**6}", f"--model.max_seq_len={2 * 10**6}",
        f"--data.ray_object_store_bytes={args.object_store_bytes}",
    ]


# ----------------------------------------------------------------------------------- measurement


def rss_bytes(pid: int | None = None) -> int:
    import psutil

    return psutil.Process(pid or os.getpid()).memory_info().rss


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RaySampler:
    """Peak summed RSS of every Ray process of this node (daemons, object store, workers, actors)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _pids(self) -> set[int]:
        import psutil
        import ray

        node = ray._private.worker._global_node
        if node is None:
            return set()
        pids = {p.process.pid for procs in node.all_processes.values() for p in procs}
        for pid in list(pids):
            try:
                pids |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        return pids

    def _run(self, interval_s: float) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            for pid in self._pids():
                try:
                    total += psutil.Process(pid).memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


# ----------------------------------------------------------------------------------- worker (torchrun)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from titanrl.config import load_config
    from titanrl.data.shadow import BadSample, ShadowLoader, build_loader
    from titanrl.distributed import init_distributed

    info = init_distributed()
    cfg = load_config(None, overrides(args, args.loader))
    t0 = time.perf_counter()
    loader = build_loader(cfg, info, args.ckpt, args.manifest)
    build_s = time.perf_counter() - t0
    sampler = RaySampler() if info.rank == 0 and isinstance(loader, ShadowLoader) else None
    base_rss = rss_bytes()
    waits, steps, samples, pixel_bytes, frame_bytes, sampled_frames, bad = [], [], 0, 0, 0, 0, 0
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step = loader.next_step()
        results = step.materialize()
        wait = time.perf_counter() - t0
        time.sleep(args.compute_s)  # the step's compute, which prefetched decoding overlaps
        dist.barrier()  # the step's collective: a rank that waits for data delays everyone
        if i >= args.warmup:
            waits.append(wait)
            steps.append(time.perf_counter() - t0)
            for r in results:
                if isinstance(r, BadSample):
                    bad += 1
                    continue
                samples += 1
                pixel_bytes += r.pixel_values.nbytes if r.pixel_values is not None else 0
                frame_bytes += sum(m.frames.nbytes for m in r.media)
                sampled_frames += sum(len(m.frames) for m in r.media)
        del results, step
    out = {
        "rank": info.rank, "build_s": build_s, "waits": waits, "steps": steps, "samples": samples, "bad": bad,
        "pixel_bytes": pixel_bytes, "frame_bytes": frame_bytes, "sampled_frames": sampled_frames,
        "base_rss": base_rss, "peak_rss": peak_rss_bytes(),
        "loader_stats": dict(loader.stats),
    }
    if isinstance(loader, ShadowLoader):
        out["materializer"] = dict(loader.materializer.stats)
        if info.rank == 0:
            out["preprocessors"] = loader.preprocessor_stats()
    gathered: list = [None] * info.world_size
    dist.all_gather_object(gathered, out)
    ray_peak = sampler.stop() if sampler is not None else 0
    loader.close()
    if info.rank == 0:
        Path(args.result).write_text(json.dumps({"ranks": gathered, "ray_peak_rss": ray_peak}, default=float))
    dist.barrier()
    dist.destroy_process_group()


def planner(args: argparse.Namespace) -> None:
    """Plan the same steps from metadata alone and report this process's memory."""
    import tracemalloc

    import torch  # noqa: F401  (the same imports a rank has, so the baseline is comparable)

    from titanrl.config import load_config
    from titanrl.data.prompt import PromptEncoder
    from titanrl.data.shadow import ProxyLoader, assign_balanced, load_metadata, media_settings
    from titanrl.data.shadow.plan import consumers_of, route_samples

    cfg = load_config(None, overrides(args, "shadow"))
    settings = media_settings(cfg, args.ckpt)
    encoder = PromptEncoder.from_pretrained(args.ckpt)
    # Warm the libraries the planner uses (FFmpeg via PyAV, Pillow, the chat template) on one sample,
    # so the growth measured below is the planner's data, not code loaded on first use.
    from titanrl.data.manifest import read_manifest

    records = read_manifest(args.manifest)
    first = list({r.media[0].kind: r for r in reversed(records) if r.media}.values())  # one per media kind
    load_metadata(args.manifest, settings, encoder, use_cache=False, records=first)
    base = rss_bytes()
    tracemalloc.start()
    t0 = time.perf_counter()
    table = load_metadata(args.manifest, settings, encoder, max_prompt_tokens=cfg.data.max_prompt_tokens)
    proxy = ProxyLoader(table, args.global_batch_size, seed=0)
    for _ in range(args.warmup + args.steps):
        _, metas, _ = proxy.next_batch()
        consumers = consumers_of(assign_balanced(metas, args.nproc), len(metas))
        route_samples(metas, consumers, ["node0"], ["node0"] * args.nproc)
    plan_s = time.perf_counter() - t0
    _, traced_peak = tracemalloc.get_traced_memory()
    import pickle

    Path(args.result).write_text(json.dumps({
        "base_rss": base, "rss_after": rss_bytes(), "peak_rss": peak_rss_bytes(), "traced_peak": traced_peak,
        "table_pickle_bytes": len(pickle.dumps(table.metas)), "samples": len(table), "plan_s": plan_s,
        "media_bytes_on_disk": sum((Path(args.manifest).parent / m.path).stat().st_size
                                   for meta in table.metas for m in meta.media),
    }))


# ----------------------------------------------------------------------------------- driver


def run_worker(args: argparse.Namespace, loader: str, manifest: Path, ckpt: Path, result: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "--standalone",
           __file__, "worker", "--loader", loader, "--manifest", str(manifest), "--ckpt", str(ckpt),
           "--result", str(result), *common_flags(args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{loader} worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    print(f"[bench] {manifest.parent.name} {loader}: {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads(result.read_text())


def run_planner(args: argparse.Namespace, manifest: Path, ckpt: Path, result: Path) -> dict:
    cmd = [sys.executable, __file__, "planner", "--manifest", str(manifest), "--ckpt", str(ckpt),
           "--result", str(result), *common_flags(args)]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(result.read_text())


def common_flags(args: argparse.Namespace) -> list[str]:
    return ["--world", str(args.nproc), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--compute-s", str(args.compute_s), "--global-batch-size", str(args.global_batch_size),
            "--max-frames", str(args.max_frames), "--fps", str(args.fps), "--decode-workers",
            str(args.decode_workers), "--prefetch", str(args.prefetch),
            "--object-store-bytes", str(args.object_store_bytes)]


def summarize(run: dict) -> dict:
    import numpy as np

    ranks = run["ranks"]
    waits = np.array([r["waits"] for r in ranks])  # [rank, step]
    steps = np.array([r["steps"] for r in ranks])
    samples = sum(r["samples"] for r in ranks)
    per_step_wait = waits.max(axis=0)  # the step waits for its slowest rank
    per_step_time = steps.max(axis=0)
    out = {
        "wait_s_mean": float(per_step_wait.mean()), "wait_s_max": float(per_step_wait.max()),
        "wait_s_median": float(np.median(per_step_wait)),
        "step_s_mean": float(per_step_time.mean()), "wait_fraction": float(per_step_wait.sum() / per_step_time.sum()),
        "rank_wait_s_mean": [float(w.mean()) for w in waits],
        "samples": samples, "bad": sum(r["bad"] for r in ranks),
        "pixel_bytes_per_sample": sum(r["pixel_bytes"] for r in ranks) / max(samples, 1),
        "frame_bytes_per_sample": sum(r["frame_bytes"] for r in ranks) / max(samples, 1),
        "sampled_frames_per_sample": sum(r.get("sampled_frames", 0) for r in ranks) / max(samples, 1),
        "rank_peak_rss": [r["peak_rss"] for r in ranks], "rank_base_rss": [r["base_rss"] for r in ranks],
        "rank0_rss_growth": ranks[0]["peak_rss"] - ranks[0]["base_rss"],
        "ray_peak_rss": run["ray_peak_rss"],
        "total_peak_rss": sum(r["peak_rss"] for r in ranks) + run["ray_peak_rss"],
        "build_s": max(r["build_s"] for r in ranks),
        "loading_throughput": samples / max(float(per_step_wait.sum()), 1e-9),  # samples per exposed second
    }
    if "preprocessors" in ranks[0]:
        pre = ranks[0]["preprocessors"]
        decoded = sum(p["decoded"] for p in pre)
        out["decode_s_per_sample"] = sum(p["decode_s"] for p in pre) / max(decoded, 1)
        out["decoded"] = decoded
        # codec frames: a sampled clip decodes every frame up to its last sampled one
        out["frames_per_decode_s"] = sum(p["frames"] for p in pre) / max(sum(p["decode_s"] for p in pre), 1e-9)
        # the frames a sample keeps (2 fps, up to max_frames; an image is one)
        out["sampled_frames_per_decode_s"] = out["sampled_frames_per_sample"] / max(out["decode_s_per_sample"], 1e-9)
        mats = [r["materializer"] for r in ranks]
        out["patchify_s_per_sample"] = sum(m["patchify_s"] for m in mats) / max(sum(m["samples"] for m in mats), 1)
        out["fetch_retries"] = sum(m["retries"] for m in mats)
    else:
        st = ranks[0]["loader_stats"]
        out["central_decode_s_per_step"] = st["decode_s"] / max(st["steps"], 1)
        out["central_send_s_per_step"] = st["send_s"] / max(st["steps"], 1)
        out["central_decode_s_per_sample"] = st["decode_s"] / max(st["samples"], 1)
    return out


def scale_model(costs: dict, gbs: int = 256, nodes: int = 16, gpus_per_node: int = 8,
                driver_workers: int = 8, node_decode_threads: int = 32, driver_gbps: float = 100.0,
                compute_s: float = 82.5, decode_factor: float = 1.0) -> dict:
    """Loading time per step at 16 x 8 GPUs from the measured per-sample costs.

    Per-sample work = decode (one preprocessor thread, x ``decode_factor``) + preprocess (resize,
    normalise, patchify: one rank). Centralized (verl at its best, ``data.return_multi_modal_inputs=false``):
    one driver decodes the whole batch with ``driver_workers`` processes and sends every sample's uint8 frames
    to its rank through one ``driver_gbps`` link, and each rank preprocesses its own; nothing overlaps the step. ShadowLoader: one preprocessor per node decodes
    with ``node_decode_threads`` threads, every rank preprocesses its own GBS/GPUs samples, transfers
    are node-local zero-copy; all of it overlaps the previous step's compute (``compute_s``: FlexRL's
    85.7 s step minus its 3.2 s of loading), so only what exceeds it plus the measured fetch latency
    (``shadow_wait_s``) is exposed.
    """
    d = costs["decode_s_per_sample"] * decode_factor
    p = costs["patchify_s_per_sample"]
    central_compute = gbs * d / driver_workers + gbs / (nodes * gpus_per_node) * p
    central_send = gbs * costs["frame_bytes_per_sample"] / (driver_gbps / 8 * 1e9)
    shadow_work = gbs * d / (nodes * node_decode_threads) + gbs / (nodes * gpus_per_node) * p
    shadow_exposed = max(0.0, shadow_work - compute_s) + costs["shadow_wait_s"]
    return {
        "gbs": gbs, "gpus": nodes * gpus_per_node, "decode_factor": decode_factor,
        "central_s": central_compute + central_send, "central_decode_s": central_compute, "central_send_s": central_send,
        "central_driver_bytes": gbs * costs["frame_bytes_per_sample"],
        "shadow_work_s": shadow_work, "shadow_exposed_s": shadow_exposed,
        "speedup": (central_compute + central_send) / max(shadow_exposed, 1e-9),
        "work_speedup": (central_compute + central_send) / max(shadow_work, 1e-9),
        "assumptions": {"driver_workers": driver_workers, "node_decode_threads": node_decode_threads,
                        "driver_gbps": driver_gbps, "compute_s": compute_s},
    }


def report(args: argparse.Namespace, results: dict) -> str:
    gib = 1 / 2**30
    lines = [
        "# Data-loading benchmark: ShadowLoader vs centralized (issue 5)",
        "",
        f"Generated by `python scripts/bench_data.py {' '.join(sys.argv[1:])}` on a {os.cpu_count()}-core CPU "
        f"machine shared with other jobs (load average {results['load']} at the start), "
        f"{provenance_text(results)}. {args.nproc} ranks "
        f"(torchrun, gloo), global batch {args.global_batch_size} prompts, {args.steps} measured steps after "
        f"{args.warmup} warm-up, simulated compute {args.compute_s:.1f} s per step (sleep) + a barrier, "
        f"{args.decode_workers} decode threads (per node preprocessor / on rank 0), prefetch "
        f"{args.prefetch} steps, videos sampled at {args.fps:g} fps up to {args.max_frames} frames, synthetic "
        f"`--scale {args.scale}` media with transformers' default Qwen2.5-VL pixel limits. Definitions: "
        "`scripts/bench_data.py`; design: `docs/shadowloader.md`.",
        "",
        "Data wait = time a rank spends in `next_step()` + `materialize()`; per step, the slowest rank's "
        "(the barrier makes everyone wait for it). Peak RSS counts shared object-store pages in every "
        "process that maps them. `centralized` decodes nothing ahead (verl); `centralized+prefetch` decodes "
        f"{args.prefetch} steps ahead on rank 0 in the background (the same depth ShadowLoader gets). The compute "
        "is a sleep, so background decoding costs nothing here; on a real step it competes with rank 0's "
        "compute (the end-to-end benchmark is where that shows).",
        "",
        "## Targets",
        "",
        "| target | measured | status |",
        "|---|---|---|",
    ]
    rows = []
    for mixture, r in results["mixtures"].items():
        c, s, pl = r["centralized"], r["shadow"], r["planner"]
        cp = r.get("centralized+prefetch")
        planner_growth = max(pl["rss_after"] - pl["base_rss"], 0)
        ratio_mem = planner_growth / max(c["rank0_rss_growth"], 1)
        rows.append((mixture, c, s, pl, planner_growth, ratio_mem))
        lines.append(f"| {mixture}: planner memory < 1% of the centralized driver's | planner +{planner_growth / 2**20:.1f} MiB "
                     f"RSS ({pl['traced_peak'] / 2**20:.2f} MiB traced) vs driver +{c['rank0_rss_growth'] / 2**20:.0f} MiB: "
                     f"{100 * ratio_mem:.2f}% | {'met' if ratio_mem < 0.01 else 'not met'} |")
        lines.append(f"| {mixture}: exposed data wait <= 2% of the step | {100 * s['wait_fraction']:.2f}% "
                     f"({1000 * s['wait_s_mean']:.0f} ms of {s['step_s_mean']:.2f} s; centralized "
                     f"{100 * c['wait_fraction']:.1f}%) | {'met' if s['wait_fraction'] <= 0.02 else 'not met'} |")
        lines.append(f"| {mixture}: loading speed-up over centralized (ratio of exposed wait per step) | "
                     f"{c['wait_s_mean'] / max(s['wait_s_mean'], 1e-9):.0f}x on means, "
                     f"{c['wait_s_median'] / max(s['wait_s_median'], 1e-9):.0f}x on medians | reported |")
        if cp is not None:
            lines.append(f"| {mixture}: loading speed-up over centralized with the same prefetch | "
                         f"{cp['wait_s_mean'] / max(s['wait_s_mean'], 1e-9):.1f}x on means "
                         f"({1000 * cp['wait_s_mean']:.0f} ms vs {1000 * s['wait_s_mean']:.0f} ms), driver RSS growth "
                         f"{cp['rank0_rss_growth'] / 2**20:.0f} MiB vs ShadowLoader rank 0 "
                         f"{s['rank0_rss_growth'] / 2**20:.0f} MiB | reported |")
    lines += [
        "",
        "## Measured",
        "",
        "| mixture | loader | data wait / step (mean, median, max) | step time | wait share | rank peak RSS (GiB, each) | Ray RSS peak (GiB) | total peak (GiB) | rank 0 RSS growth (MiB) | pixel_values / sample (MiB) | uint8 frames / sample (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mixture, c, s, pl, planner_growth, _ in rows:
        for name in LOADERS:
            r = results["mixtures"][mixture].get(name)
            if r is None:
                continue
            lines.append(
                f"| {mixture} | {name} | {r['wait_s_mean']:.3f} s, {r['wait_s_median']:.3f} s, {r['wait_s_max']:.3f} s | "
                f"{r['step_s_mean']:.2f} s | "
                f"{100 * r['wait_fraction']:.1f}% | {', '.join(f'{x * gib:.2f}' for x in r['rank_peak_rss'])} | "
                f"{r['ray_peak_rss'] * gib:.2f} | {r['total_peak_rss'] * gib:.2f} | {r['rank0_rss_growth'] / 2**20:.0f} | "
                f"{r['pixel_bytes_per_sample'] / 2**20:.1f} | {r['frame_bytes_per_sample'] / 2**20:.1f} |")
    lines += [
        "",
        "| mixture | planner: samples | metadata (pickled) | RSS growth | traced peak | media on disk | plan time, all steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for mixture, c, s, pl, planner_growth, _ in rows:
        lines.append(f"| {mixture} | {pl['samples']} | {pl['table_pickle_bytes'] / 1024:.0f} KiB | "
                     f"{planner_growth / 2**20:.1f} MiB | {pl['traced_peak'] / 2**20:.2f} MiB | "
                     f"{pl['media_bytes_on_disk'] / 2**20:.1f} MiB | {1000 * pl['plan_s']:.0f} ms |")
    lines += [
        "",
        "| mixture | decode s / sample (one thread) | codec frames / decode s | sampled frames / decode s | "
        "rank preprocess s / sample | "
        "centralized rank-0 decode / step | centralized send (uint8 frames) / step | loading throughput, centralized "
        "-> shadow (samples / exposed s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mixture, c, s, pl, _, _ in rows:
        sampled = f"{s['sampled_frames_per_decode_s']:.0f}" if "sampled_frames_per_decode_s" in s else "-"
        lines.append(f"| {mixture} | {s['decode_s_per_sample']:.3f} | {s['frames_per_decode_s']:.0f} | {sampled} | "
                     f"{s['patchify_s_per_sample']:.3f} | {c['central_decode_s_per_step']:.2f} s | "
                     f"{c['central_send_s_per_step']:.2f} s | {c['loading_throughput']:.1f} -> "
                     f"{s['loading_throughput']:.0f} |")
    lines += [
        "",
        "## 16 nodes x 8 GPUs, global batch 256 (model, not measurement)",
        "",
        "`scale_model` in the script. Per-sample work = decode (measured, one preprocessor thread) + preprocess "
        "(resize, normalise, patchify; measured, one rank); bytes per sample measured. Centralized = one driver "
        "decoding the whole batch with 8 decode workers and sending the uint8 frames through one 100 Gb/s link "
        "(verl with `data.return_multi_modal_inputs=false`; its default also sends float32 pixel_values), each "
        "rank preprocessing its own, nothing overlapped. ShadowLoader = 16 node preprocessors with 32 decode threads each, "
        "each rank preprocesses its own 2 samples, node-local zero-copy transfers, all overlapped with an 82.5 s "
        "compute step (FlexRL's 85.7 s step minus its 3.2 s of loading), so only the excess plus the fetch latency "
        "measured above is exposed. The second row per mixture multiplies decode by 10: synthetic clips are flat "
        "colour fields that decode far faster than real footage.",
        "",
        "| mixture | decode x | centralized loading / step | of which work | of which send | driver holds | ShadowLoader work / step (hidden) | ShadowLoader exposed / step | speed-up, work (no overlap) | speed-up, exposed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mixture, r in results["mixtures"].items():
        for m in r["scale_model"]:
            lines.append(f"| {mixture} | {m['decode_factor']:g} | {m['central_s']:.1f} s | {m['central_decode_s']:.1f} s | "
                         f"{m['central_send_s']:.1f} s | {m['central_driver_bytes'] / 2**30:.1f} GiB | "
                         f"{m['shadow_work_s']:.2f} s | {1000 * m['shadow_exposed_s']:.0f} ms | {m['work_speedup']:.0f}x | "
                         f"{m['speedup']:.0f}x |")
    lines += [
        "",
        "The paper measured 375 s (veRL) vs 3.9 s (ShadowLoader) of loading per step on 128 GPUs (96x). The "
        "model's centralized cost is far lower than veRL's because it counts only decode, preprocess and one "
        "uint8 hop (veRL also builds PIL images in Python and relays tensors worker -> driver -> trainers). "
        "The exposed ratio is large because ShadowLoader's residual here is only the fetch latency of an "
        "already-decoded step (FlexRL's 3.2-3.9 s residual includes costs this model leaves out); the work "
        "ratio (spreading decode over 16 nodes and preprocessing over 128 ranks, before any overlap) is the "
        "conservative figure.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="driver", choices=["driver", "worker", "planner"])
    parser.add_argument("--mixtures", nargs="+", default=["video-heavy", "only-video"])
    parser.add_argument("--nproc", "--world", dest="nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--compute-s", type=float, default=3.0)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--scale", default="paper", choices=["tiny", "paper"])
    parser.add_argument("--max-frames", type=int, default=16)
    parser.add_argument("--fps", type=float, default=2.0)
    parser.add_argument("--decode-workers", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--object-store-bytes", type=int, default=2 << 30)
    parser.add_argument("--cache", default="~/.cache/titanrl/bench_data")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "data"))
    # worker / planner
    parser.add_argument("--loader", default="shadow")
    parser.add_argument("--manifest")
    parser.add_argument("--ckpt")
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.mode == "worker":
        return worker(args)
    if args.mode == "planner":
        return planner(args)

    cache = Path(args.cache).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    ckpt = bench_checkpoint(cache)
    results: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("manifest", "ckpt", "result")},
                     **provenance(), "load": " / ".join(f"{x:.1f}" for x in os.getloadavg()), "mixtures": {}}
    for mixture in args.mixtures:
        manifest = bench_dataset(cache, mixture, args.num_samples, args.scale)
        per = {"planner": run_planner(args, manifest, ckpt, cache / "planner.json")}
        for loader in LOADERS:
            per[loader] = summarize(run_worker(args, loader, manifest, ckpt, cache / f"{loader}.json"))
        costs = {**per["shadow"], **{k: v for k, v in per["centralized"].items() if k.startswith("central_")},
                 "shadow_wait_s": per["shadow"]["wait_s_mean"]}
        per["scale_model"] = [scale_model(costs, decode_factor=f) for f in (1.0, 10.0)]
        results["mixtures"][mixture] = per
        print(json.dumps({k: per[k] for k in LOADERS}, indent=1, default=float)[:2000], flush=True)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=float))
    out.with_suffix(".md").write_text(report(args, results))
    print(f"[bench] wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
