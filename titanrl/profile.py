"""Hardware profile of a job's ranks, for heterogeneity-aware scheduling (HetRL, section 4.1).

    python -m titanrl.profile --out profile.json [--config configs/tiny_cpu.toml] [--engine] [--seconds S]
    torchrun --nproc-per-node N -m titanrl.profile --out profile.json ...   # every rank measures itself

What each rank measures, in the run's dtype (``model.dtype`` of ``--config``, else float32; ``--dtype``
overrides), on its own device (CUDA: the rank's GPU; else the CPU cores the process may run on):

- ``matmul_tflops``: a square matmul (CPU n=1024, CUDA n=8192), 2*n^3 FLOPs per call.
- ``attention_tflops``: ``scaled_dot_product_attention`` with ``is_causal=True``, batch 1, at a few sequence
  lengths (``attention_by_seq``; CPU: 4 heads of 64, s = 256, 512, 1024; CUDA: 32 heads of 128, s = 1024, 4096,
  8192); FLOPs per call counted as 4*b*h*s^2*d / 2 (QK^T and PV, halved for the causal mask,
  whatever the kernel really skips); the headline is the median over the lengths.
- ``memory_gb``: memory capacity in GiB (2^30 bytes). CUDA: the device's total memory. CPU: this rank's share
  of the host: the host's RAM (or the cgroup's memory limit when lower) divided by the ranks reporting the same
  host name (``host_memory_gb`` is the whole).
- ``hbm_gbps``: memory bandwidth in GB/s (10^9 bytes/s) of a large tensor copy (``dst.copy_(src)``), counting
  read + write (2 x the tensor's bytes per copy): HBM on a GPU, DRAM on CPU (256 MiB, past the caches).
- ``gen_tokens_per_s``: generated (not prompt) tokens per second of the rollout engine the config describes
  (``rollout.engine``: vLLM or HF generate) on a short batch of text prompts; ``null`` unless ``--engine``.
- ``links``: one entry per pair of ranks (``src < dst``; a link is taken as symmetric): ``gbps`` (10^9 bit/s)
  from a ping-pong of a large message (CPU 32 MiB, CUDA 64 MiB; one-way time = round trip / 2, median of 5)
  and ``latency_ms`` (a 4-byte message's round trip / 2, median of 30; every pair's latency is taken before
  any bulk transfer). Pairs are measured one at a time, the other ranks waiting, so they do not contend. gloo
  (CPU) uses point-to-point send/recv: between two ranks of one host that is gloo's TCP over loopback, not
  shared memory. NCCL (CUDA) uses ``all_to_all_single`` on the existing group with every split 0 but the
  pair's (NCCL's send/recv on the group's own communicator; ``dist.send``/``recv`` would create a new 2-rank
  communicator per pair, which would outlive the profile). ``--link-method`` picks either.
- ``host`` (``TITANRL_HOST`` if set, so namespaced "hosts" on one machine can be told apart, else
  ``socket.gethostname()``), ``device``, ``device_name`` (CUDA: the GPU's name; CPU: the CPU model from
  /proc/cpuinfo), ``cpu_affinity`` (``os.sched_getaffinity``: ranks pinned so that two share a core each get
  about half of it) and ``num_threads`` (torch's intra-op threads).

Robustness: the compute and memory probes start on every rank at the same moment (a barrier before each)
and run for the same wall-clock budget, so ranks that share cores (with each other or anything else) measure
the share they will get when they all train at once. A probe warms up first, then times several windows of
many calls each (CUDA: synchronised every ~10 ms of calls) and reports the median window's throughput; a window
spans many scheduler time slices, so time-sharing shows in it (the median of single calls would not see the
preemptions that fall between calls). ``--seconds`` scales every probe's budget (default 1 s each: ~10 s in
all with 2 CPU ranks, start-up included).

From the trainer: ``profile_ranks(dtype=..., device=info.device)`` after the process group exists; every rank
calls it (it is collective) and gets the same dict. It uses the existing default group and creates nothing
that outlives the call (the torch RNG state is restored; its tensors are freed, on CUDA with
``torch.cuda.empty_cache()``; a process group it had to create - ``WORLD_SIZE`` > 1 and none initialised - is
destroyed again). Measuring all pairs' links takes O(world^2) pair exchanges (``links=False`` skips them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Sequence

SCHEMA_VERSION = 1
_GIB = float(1 << 30)

# Probe sizes per device type: big enough to be past launch overheads and caches, small enough that a probe
# has many calls in a ~0.2 s window on two CPU cores.
_SIZES = {
    "cpu": dict(matmul_n=1024, attn_heads=4, attn_dim=64, attn_seqs=(256, 512, 1024), copy_bytes=256 << 20,
                link_bytes=32 << 20),
    "cuda": dict(matmul_n=8192, attn_heads=32, attn_dim=128, attn_seqs=(1024, 4096, 8192), copy_bytes=1 << 30,
                 link_bytes=64 << 20),
}
_LINK_REPEATS = 5
_LATENCY_REPEATS = 30
_GEN_PROMPTS = 8
_GEN_N = 4
_GEN_MAX_NEW_TOKENS = 32


# ---------------------------------------------------------------------------------------------- host facts

def host_name() -> str:
    return os.environ.get("TITANRL_HOST") or socket.gethostname()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


def cpu_affinity() -> list[int] | None:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def host_memory_bytes() -> int:
    """The host's RAM, or the cgroup's memory limit (v2 or v1) when that is lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


# ---------------------------------------------------------------------------------------------- timing

def _sig(x: float | None, digits: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else float(f"{x:.{digits}g}")


def _throughput(fn: Callable[[], Any], work: float, budget_s: float, sync: Callable[[], None],
                windows: int = 5) -> float:
    """``work`` units per second of ``fn``: warm-up (at least 2 calls, ~15% of ``budget_s``), then ``windows``
    windows sharing the rest of the budget, each as many calls as fit (in chunks of ~10 ms between
    synchronisations); the median window's rate."""
    warm_s = 0.15 * budget_s
    sync()
    start, calls = time.perf_counter(), 0
    while True:
        fn()
        sync()
        calls += 1
        elapsed = time.perf_counter() - start
        if calls >= 2 and elapsed >= warm_s:
            break
    chunk = max(1, int(0.01 / max(elapsed / calls, 1e-9)))
    window_s = (budget_s - warm_s) / windows
    rates = []
    for _ in range(windows):
        start, calls = time.perf_counter(), 0
        while True:
            for _ in range(chunk):
                fn()
            sync()
            calls += chunk
            elapsed = time.perf_counter() - start
            if elapsed >= window_s:
                break
        rates.append(calls * work / elapsed)
    return statistics.median(rates)


class _Probe:
    """The measurements of one rank on one device, in one dtype."""

    def __init__(self, device, dtype, seconds: float) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.dtype = dtype
        self.seconds = seconds
        self.cuda = device.type == "cuda"
        self.sizes = _SIZES["cuda" if self.cuda else "cpu"]

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def matmul_tflops(self) -> float:
        torch, n = self.torch, self.sizes["matmul_n"]
        a = torch.randn(n, n, device=self.device, dtype=self.dtype)
        b = torch.randn(n, n, device=self.device, dtype=self.dtype)
        out = torch.empty(n, n, device=self.device, dtype=self.dtype)
        rate = _throughput(lambda: torch.matmul(a, b, out=out), 2.0 * n ** 3, self.seconds, self.sync)
        return rate / 1e12

    def attention_tflops(self) -> dict[int, float]:
        import torch.nn.functional as F

        torch, s = self.torch, self.sizes
        h, d, seqs = s["attn_heads"], s["attn_dim"], s["attn_seqs"]
        out = {}
        for seq in seqs:
            q, k, v = (torch.randn(1, h, seq, d, device=self.device, dtype=self.dtype) for _ in range(3))
            flops = 4.0 * h * seq * seq * d / 2  # causal: half of QK^T and PV
            rate = _throughput(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), flops,
                               self.seconds / len(seqs), self.sync, windows=3)
            out[seq] = rate / 1e12
        return out

    def memory_gbps(self, copy_bytes: int) -> float:
        torch = self.torch
        n = max(1, copy_bytes // 4)
        src = torch.ones(n, device=self.device, dtype=torch.float32)
        dst = torch.empty_like(src)
        rate = _throughput(lambda: dst.copy_(src), 2.0 * src.nbytes, self.seconds, self.sync)
        return rate / 1e9

    def memory_capacity(self) -> tuple[float, float | None]:
        """(device memory GiB, free GiB) on CUDA; (host memory GiB, available GiB) on CPU."""
        if self.cuda:
            free, total = self.torch.cuda.mem_get_info(self.device)
            return total / _GIB, free / _GIB
        available = None
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024 / _GIB
        except OSError:
            pass
        return host_memory_bytes() / _GIB, available

    def device_name(self) -> str:
        return self.torch.cuda.get_device_name(self.device) if self.cuda else cpu_model()


# ---------------------------------------------------------------------------------------------- links

class _Links:
    """Ping-pong between two ranks of the default group, one pair at a time (every rank calls ``measure``)."""

    def __init__(self, rank: int, world: int, device, method: str, nbytes: int) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.world, self.device, self.method = rank, world, device, method
        self.big = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        self.big_in = torch.empty_like(self.big)
        self.tiny = torch.ones(1, dtype=torch.float32, device=device)
        self.tiny_in = torch.empty_like(self.tiny)
        self.empty = torch.empty(0, dtype=torch.float32, device=device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _move(self, src: int, dst: int, send, recv) -> None:
        """``send`` (on ``src``) into ``recv`` (on ``dst``)."""
        dist = self.dist
        if self.method == "p2p":
            if self.rank == src:
                dist.send(send, dst)
            elif self.rank == dst:
                dist.recv(recv, src)
            return
        # alltoall: every rank joins; only the pair's splits are non-zero
        n = send.numel()
        in_splits = [n if (self.rank == src and r == dst) else 0 for r in range(self.world)]
        out_splits = [n if (self.rank == dst and r == src) else 0 for r in range(self.world)]
        dist.all_to_all_single(recv if self.rank == dst else self.empty, send if self.rank == src else self.empty,
                               out_splits, in_splits)

    def _round_trip(self, a: int, b: int, msg, msg_in) -> float:
        self._sync()
        start = time.perf_counter()
        self._move(a, b, msg, msg_in)
        self._move(b, a, msg, msg_in)
        self._sync()
        return time.perf_counter() - start

    def latency(self, a: int, b: int) -> float | None:
        """Rank ``a``'s one-way small-message latency to ``b`` in seconds (None on every other rank)."""
        if self.method == "p2p" and self.rank not in (a, b):
            return None
        for _ in range(5):
            self._round_trip(a, b, self.tiny, self.tiny_in)
        lat = statistics.median(self._round_trip(a, b, self.tiny, self.tiny_in) for _ in range(_LATENCY_REPEATS))
        return lat / 2 if self.rank == a else None

    def bandwidth(self, a: int, b: int) -> float | None:
        """Rank ``a``'s one-way bandwidth to ``b`` in bytes/s (None on every other rank)."""
        if self.method == "p2p" and self.rank not in (a, b):
            return None
        self._round_trip(a, b, self.big, self.big_in)  # warm-up (buffers)
        big = statistics.median(self._round_trip(a, b, self.big, self.big_in) for _ in range(_LINK_REPEATS))
        return self.big.nbytes / (big / 2) if self.rank == a else None

    def measure_all(self, barrier: Callable[[], None]) -> list[dict]:
        """Every pair's link, measured one pair at a time (a barrier between pairs): first every pair's latency,
        then every pair's bandwidth (right after bulk transfers gloo's small messages take milliseconds for a
        while, so the latencies are taken on quiet connections). The links of which this rank is ``src``."""
        pairs = [(a, b) for a in range(self.world) for b in range(a + 1, self.world)]
        lat = {}
        for a, b in pairs:
            barrier()
            lat[a, b] = self.latency(a, b)
        links = []
        for a, b in pairs:
            barrier()
            bw = self.bandwidth(a, b)
            if self.rank == a:
                links.append({"src": a, "dst": b, "gbps": _sig(bw * 8 / 1e9), "latency_ms": _sig(lat[a, b] * 1e3),
                              "bytes": self.big.nbytes, "method": self.method})
        return links


# ---------------------------------------------------------------------------------------------- generation

def text_requests(encoder, count: int = _GEN_PROMPTS) -> list:
    """``count`` short text-only prompts (``RolloutRequest``s) for the generation probe."""
    from titanrl.rollout.types import RolloutRequest

    requests = []
    for i in range(count):
        prompt = f"Prompt {i}: name a colour and describe it in a few words."
        requests.append(RolloutRequest(encoder.render(prompt), encoder.encode(prompt, []), key=f"profile-{i}"))
    return requests


def generation_tokens_per_s(engine, requests: Sequence, budget_s: float, *, n: int = _GEN_N,
                            max_new_tokens: int = _GEN_MAX_NEW_TOKENS, seed: int = 0) -> float:
    """Generated tokens per second of ``engine`` on ``requests`` (``n`` samples each, at most ``max_new_tokens``
    new tokens): a warm-up call on one prompt, whose rate sizes the batch (as many of ``requests`` as fit about
    half of ``budget_s``, at least one), then batches until ``budget_s`` has passed (at least one); the median
    batch's rate."""
    def batch(reqs: Sequence, k: int, n: int, new: int) -> tuple[int, float]:
        start = time.perf_counter()
        groups = engine.generate(reqs, n=n, temperature=1.0, top_p=1.0, max_new_tokens=new, seed=seed + k)
        return sum(len(s.token_ids) for g in groups for s in g), time.perf_counter() - start

    tokens, elapsed = batch(requests[:1], 0, n, min(8, max_new_tokens))
    per_prompt_s = elapsed / max(tokens, 1) * n * max_new_tokens
    count = max(1, min(len(requests), int(0.5 * budget_s / max(per_prompt_s, 1e-9))))
    rates, start, k = [], time.perf_counter(), 1
    while not rates or time.perf_counter() - start < budget_s:
        tokens, elapsed = batch(requests[:count], k, n, max_new_tokens)
        rates.append(tokens / elapsed)
        k += 1
    return statistics.median(rates)


# ---------------------------------------------------------------------------------------------- the profile

def _dtype(dtype):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[str(dtype)]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (float32, bfloat16 or float16)") from None


def profile_ranks(*, dtype: Any = "float32", device=None, seconds: float = 1.0, engine=None, encoder=None,
                  requests: Sequence | None = None, links: bool = True, link_method: str | None = None,
                  link_bytes: int | None = None, log: Callable[[str], None] | None = None) -> dict:
    """The profile of every rank of the default process group (module doc); collective: every rank calls it and
    gets the same dict.

    ``device``: this rank's device (default: the current CUDA device, else CPU). ``seconds``: each probe's
    wall-clock budget. ``engine``: a built rollout engine (``generate`` as ``RolloutEngine``) to time, with
    ``requests`` or an ``encoder`` (``PromptEncoder``) to make text prompts from; None: ``gen_tokens_per_s``
    is null. ``links``: measure the links between ranks. ``link_method``: ``"p2p"`` (send/recv; the default
    on gloo) or ``"alltoall"`` (the default on NCCL). ``log``: progress lines (e.g. ``print`` on rank 0).

    Without an initialised process group it is a world of one, unless ``WORLD_SIZE`` > 1: then it joins
    torchrun's group itself and destroys it before returning."""
    import torch
    import torch.distributed as dist

    from titanrl import distributed as tdist

    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch_dtype = _dtype(dtype)
    log = log or (lambda _msg: None)
    if engine is not None and requests is None and encoder is None:
        raise ValueError("profile_ranks(engine=...) needs requests or an encoder to make them")
    if link_method not in (None, "p2p", "alltoall"):
        raise ValueError(f"link_method must be 'p2p' or 'alltoall', got {link_method!r}")

    with ExitStack() as stack:
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            tdist.init_distributed()
            stack.callback(tdist.shutdown)
        stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        backend = dist.get_backend() if dist.is_initialized() else None
        probe = _Probe(device, torch_dtype, seconds)

        def step(name: str, fn: Callable[[], Any]) -> Any:
            tdist.barrier()  # every rank starts the probe at the same moment
            started = time.perf_counter()
            value = fn()
            log(f"[profile] {name}: {time.perf_counter() - started:.1f} s (rank {rank})")
            return value

        # the host's rank count first: the copy probe's size and the memory share depend on it
        host = host_name()
        facts = tdist.all_gather_objects((host, engine is not None))
        ranks_on_host = sum(1 for h, _ in facts if h == host)
        capacity_gib, free_gib = probe.memory_capacity()
        copy_bytes = probe.sizes["copy_bytes"]
        if not probe.cuda:  # two copies of the tensor: keep them well inside this rank's share
            copy_bytes = max(16 << 20, min(copy_bytes, int(capacity_gib * _GIB / ranks_on_host / 16)))

        matmul = step("matmul", probe.matmul_tflops)
        attention = step("attention", probe.attention_tflops)
        memory_bw = step("memory bandwidth", lambda: probe.memory_gbps(copy_bytes))
        gen = None
        if any(has for _, has in facts):  # every rank joins the barrier, also one without an engine
            if engine is not None and requests is None:
                requests = text_requests(encoder)
            gen = step("generation", lambda: None if engine is None else
                       generation_tokens_per_s(engine, requests, seconds))

        mine = {
            "rank": rank,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "host": host,
            "device": str(device),
            "device_name": probe.device_name(),
            "matmul_tflops": _sig(matmul),
            "attention_tflops": _sig(statistics.median(attention.values())),
            "memory_gb": _sig(capacity_gib if probe.cuda else capacity_gib / ranks_on_host),
            "hbm_gbps": _sig(memory_bw),
            "gen_tokens_per_s": _sig(gen),
            "attention_by_seq": {str(s): _sig(v) for s, v in attention.items()},
            "host_memory_gb": None if probe.cuda else _sig(capacity_gib),
            "memory_free_gb": _sig(free_gib),
            "ranks_on_host": ranks_on_host,
            "cpu_affinity": cpu_affinity(),
            "num_threads": torch.get_num_threads(),
            "pid": os.getpid(),
        }

        measured: list[dict] = []
        method = link_method or ("alltoall" if "nccl" in str(backend) else "p2p")  # "cpu:gloo,cuda:nccl" on CUDA
        nbytes = link_bytes or probe.sizes["link_bytes"]
        if links and world > 1:
            tdist.barrier()
            started = time.perf_counter()
            prober = _Links(rank, world, device, method, nbytes)
            measured = prober.measure_all(tdist.barrier)
            del prober
            log(f"[profile] links: {time.perf_counter() - started:.1f} s (rank {rank})")
        if probe.cuda:
            torch.cuda.empty_cache()

        gathered = tdist.all_gather_objects((mine, measured))

    ranks = [r for r, _ in gathered]
    hosts = list(dict.fromkeys(r["host"] for r in ranks))
    return {
        "version": SCHEMA_VERSION,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "world_size": world,
        "hosts": hosts,
        "ranks": ranks,
        "links": sorted((link for _, ls in gathered for link in ls), key=lambda l: (l["src"], l["dst"])),
        "backend": backend,
        "seconds": seconds,
        "link_method": method if links and world > 1 else None,
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "units": {
            "matmul_tflops": "10^12 FLOP/s, square matmul, 2*n^3 FLOPs",
            "attention_tflops": "10^12 FLOP/s, causal SDPA, 4*h*s^2*d/2 FLOPs (median over attention_by_seq)",
            "memory_gb": "GiB; CPU: host RAM (or cgroup limit) / ranks on the host",
            "hbm_gbps": "10^9 B/s, tensor copy, read + write counted",
            "gen_tokens_per_s": "generated tokens/s of the rollout engine (text prompts)",
            "gbps": "10^9 bit/s, large-message ping-pong, one-way",
            "latency_ms": "small-message round trip / 2",
        },
    }


def format_table(profile: dict) -> str:
    """A short human-readable summary of a profile."""
    def f(x, spec=".3g") -> str:
        return "-" if x is None else format(x, spec)

    lines = [f"profile: {profile['world_size']} rank(s) on {len(profile['hosts'])} host(s), dtype "
             f"{profile['dtype']}"]
    head = f"{'rank':>4}  {'host':<12} {'device':<7} {'matmul':>8} {'attn':>8} {'mem GiB':>8} {'mem GB/s':>8} " \
           f"{'gen tok/s':>9}  {'cpus':<8} name"
    lines += [head, f"{'':>4}  {'':<12} {'':<7} {'TFLOP/s':>8} {'TFLOP/s':>8}"]
    for r in profile["ranks"]:
        cpus = r.get("cpu_affinity")
        cpus = "-" if cpus is None else ",".join(map(str, cpus)) if len(cpus) <= 4 else f"{len(cpus)} cpus"
        lines.append(f"{r['rank']:>4}  {r['host'][:12]:<12} {r['device'][:7]:<7} {f(r['matmul_tflops']):>8} "
                     f"{f(r['attention_tflops']):>8} {f(r['memory_gb']):>8} {f(r['hbm_gbps']):>8} "
                     f"{f(r['gen_tokens_per_s'], '.4g'):>9}  {cpus:<8} {r['device_name']}")
    if profile["links"]:
        lines.append(f"links ({profile.get('link_method')}):  src dst   Gbit/s  latency ms")
        for link in profile["links"]:
            lines.append(f"{'':>8}{link['src']:>5} {link['dst']:>3} {f(link['gbps']):>8} {f(link['latency_ms']):>11}")
    return "\n".join(lines)


def write_profile(profile: dict, path: str | os.PathLike) -> Path:
    """``profile`` as JSON at ``path`` (written to a temporary name and renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(profile, indent=1) + "\n")
    tmp.replace(path)
    return path


# ---------------------------------------------------------------------------------------------- command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m titanrl.profile",
        description="Measure every rank's compute, memory and links (run alone or under torchrun); rank 0 writes "
                    "the JSON. Arguments not listed here are config overrides (--section.key=value).")
    p.add_argument("--out", required=True, help="where rank 0 writes the profile JSON")
    p.add_argument("--config", help="job config (TOML): the dtype, and the rollout engine for --engine")
    p.add_argument("--engine", action="store_true", help="also time the config's rollout engine (needs a config)")
    p.add_argument("--seconds", type=float, default=1.0, help="wall-clock budget of each probe (default 1)")
    p.add_argument("--dtype", help="override the dtype (float32, bfloat16, float16)")
    p.add_argument("--no-links", action="store_true", help="skip the links between ranks")
    p.add_argument("--link-method", choices=("p2p", "alltoall"), help="default: p2p on gloo, alltoall on NCCL")
    p.add_argument("--link-mb", type=float, help="large message size in MiB (default: CPU 32, CUDA 64)")
    p.add_argument("--quiet", action="store_true", help="no table, no progress")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    cfg = None
    if args.config or overrides:
        from titanrl.config import ConfigError, load_config

        try:
            cfg = load_config(args.config, overrides)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if args.engine and cfg is None:
        print("error: --engine needs --config (the engine and model it describes)", file=sys.stderr)
        return 2
    dtype = args.dtype or (cfg.model.dtype if cfg is not None else "float32")

    from titanrl.distributed import init_distributed, shutdown

    info = init_distributed()
    log = (lambda msg: print(msg, flush=True)) if info.is_main and not args.quiet else None
    engine = encoder = None
    try:
        if args.engine:
            from titanrl import assets
            from titanrl.data.prompt import PromptEncoder
            from titanrl.rollout import build_rollout_engine

            model_dir = assets.model_dir(cfg, info)
            started = time.perf_counter()
            engine = build_rollout_engine(cfg, model_dir, info.rank)
            encoder = PromptEncoder.from_pretrained(model_dir)
            if log:
                log(f"[profile] {cfg.rollout.engine} engine on {model_dir}: built in "
                    f"{time.perf_counter() - started:.1f} s")
        profile = profile_ranks(dtype=dtype, device=info.device, seconds=args.seconds, engine=engine,
                                encoder=encoder, links=not args.no_links, link_method=args.link_method,
                                link_bytes=int(args.link_mb * (1 << 20)) if args.link_mb else None, log=log)
        if engine is not None:
            profile["engine"] = cfg.rollout.engine
            for r in profile["ranks"]:
                r["gen_engine"] = cfg.rollout.engine
        if info.is_main:
            path = write_profile(profile, args.out)
            if not args.quiet:
                print(format_table(profile))
                print(f"[profile] wrote {path}")
    finally:
        if engine is not None:
            engine.close()
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
