"""A heterogeneous cluster for the HetRL scheduler (HetRL sec. 3.1 / appendix B.1): devices and the links between them.

Two sources, one result (:class:`Cluster`: a flat tuple of :class:`Device` plus bandwidth and latency matrices
between every pair of devices):

- :func:`load_cluster` reads a hand-written ``cluster.toml``::

      [devices.a100]          # one table per device type (the table name is the type)
      count = 24
      tflops = 312            # dense fp16/bf16 TFLOP/s
      memory_gb = 40          # GB (10^9 bytes) of device memory
      hbm_gbps = 2039         # GB/s (10^9 bytes/s) of memory bandwidth
      intra_gbps = 600        # GB/s between two devices of one host (needed when per_host > 1)
      per_host = 8            # devices per host (default 1); must divide count
      intra_latency_ms = 0.005  # optional (default 0.005)
      region = "virginia"     # optional: every host of this type in one region
      regions = ["ohio", "virginia", "virginia"]  # optional instead: one region per host, in host order

      [[links]]               # between two groups of hosts, named by device type, region or host name
      between = ["a100", "l4"]
      gbps = 5                # Gbit/s (10^9 bits/s), as networks are quoted
      latency_ms = 10

      [default_link]          # optional: every pair of hosts no [[links]] entry names
      gbps = 100
      latency_ms = 0.05

  Units follow the HetRL paper's Table 1 and sec. 5.1: device memory bandwidth and the intra-host
  bandwidth in GB/s (bytes), network links in Gbit/s (bits). Hosts are named ``<type>-<i>`` (``a100-0`` ..);
  devices get ids 0.. in file order (types in table order, hosts in order, devices within a host in order).
  Two devices of one host use ``intra_gbps`` / ``intra_latency_ms`` of their type. Two devices on different
  hosts use the most specific ``[[links]]`` entry naming both sides (host 3 > region 2 > type 1 points a side,
  the sum of both sides decides; equally specific entries: the later one in the file wins), else
  ``[default_link]``, else the file is refused with the pair named: there is no silent default, not even
  between two hosts of the same type (write ``between = ["a100", "a100"]``).

- :func:`cluster_from_profile` reads the JSON ``python -m titanrl.profile`` writes: each rank becomes one
  device with the rank as its id (a plan is then expressible in ranks), typed by its ``device_name``;
  ``matmul_tflops`` is its compute speed, ``gen_tokens_per_s`` (when measured) calibrates its generation cost
  (:mod:`titanrl.hetero.cost`), and every pair of ranks needs a measured link (``src < dst``; taken as
  symmetric; a missing pair is refused by name).

Mistakes raise :class:`ClusterError` naming the file and the key (``cluster.toml: devices.a100.tflops must be
> 0, got -3``).
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

_GB = 1e9  # device memory, bandwidths: decimal units as hardware is quoted
_DEVICE_KEYS = {"count", "tflops", "memory_gb", "hbm_gbps", "intra_gbps", "per_host", "intra_latency_ms", "region",
                "regions"}
_LINK_KEYS = {"between", "gbps", "latency_ms"}
_DEFAULT_INTRA_LATENCY_MS = 0.005  # NVLink / PCIe peer copy: microseconds
_PROFILE_RANK_KEYS = ("rank", "host", "device", "device_name", "matmul_tflops", "memory_gb", "hbm_gbps")


class ClusterError(ValueError):
    """A user-facing mistake in a cluster description or profile; the message names the file and key."""


@dataclass(frozen=True)
class Device:
    """One device of the cluster. ``id`` is its index in :attr:`Cluster.devices` (a profile's rank)."""

    id: int
    type: str
    host: str
    region: str
    tflops: float  # dense TFLOP/s in the run's dtype
    memory_gb: float  # GB (10^9 bytes)
    hbm_gbps: float  # GB/s (10^9 bytes/s)
    gen_tokens_per_s: float | None = None  # measured rollout-engine throughput (profile), None: not measured
    local_rank: int | None = None  # the rank's local rank on its host (profile)
    cpu_affinity: tuple[int, ...] | None = None  # the cores the rank ran on (profile, CPU ranks)
    device_name: str = ""  # the profile's device description


@dataclass(frozen=True, eq=False)
class Cluster:
    """Devices and the pairwise links between them.

    ``bandwidth[i, j]`` is bytes/s from device ``i`` to ``j`` (``inf`` on the diagonal: a device's own memory is
    not a link), ``latency[i, j]`` seconds (0 on the diagonal). ``source`` names where it came from, for errors.
    """

    devices: tuple[Device, ...]
    bandwidth: np.ndarray
    latency: np.ndarray
    source: str = "<cluster>"

    def __post_init__(self) -> None:
        n = len(self.devices)
        if n < 1:
            raise ClusterError(f"{self.source}: no devices")
        for i, d in enumerate(self.devices):
            if d.id != i:
                raise ClusterError(f"{self.source}: device {i} has id {d.id}; ids must be 0..{n - 1} in order")
        if self.bandwidth.shape != (n, n) or self.latency.shape != (n, n):
            raise ClusterError(f"{self.source}: bandwidth/latency must be {n}x{n} matrices")
        self.bandwidth.setflags(write=False)
        self.latency.setflags(write=False)

    def __len__(self) -> int:
        return len(self.devices)

    @property
    def types(self) -> tuple[str, ...]:
        """Device types in order of first appearance."""
        return tuple(dict.fromkeys(d.type for d in self.devices))

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d.host for d in self.devices))

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d.region for d in self.devices))

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(bytes/s, seconds) from device ``a`` to device ``b``."""
        return float(self.bandwidth[a, b]), float(self.latency[a, b])

    def of_type(self, device_type: str) -> tuple[int, ...]:
        return tuple(d.id for d in self.devices if d.type == device_type)

    def describe(self) -> str:
        """One line per device type: count, hosts, regions and specs."""
        lines = [f"{len(self)} devices on {len(self.hosts)} host(s) in {len(self.regions)} region(s)"]
        for t in self.types:
            ds = [d for d in self.devices if d.type == t]
            hosts = len({d.host for d in ds})
            regions = ", ".join(dict.fromkeys(d.region for d in ds))
            lines.append(f"  {t}: {len(ds)} on {hosts} host(s) [{regions}], {_span(d.tflops for d in ds)} TFLOP/s, "
                         f"{_span(d.memory_gb for d in ds)} GB, {_span(d.hbm_gbps for d in ds)} GB/s memory")
        return "\n".join(lines)


def _span(values) -> str:
    values = list(values)
    lo, hi = min(values), max(values)
    return f"{lo:.4g}" if lo == hi else f"{lo:.4g}-{hi:.4g}"


# ------------------------------------------------------------------------------------------------ cluster.toml

def load_cluster(path: str | Path) -> Cluster:
    """The cluster a ``cluster.toml`` describes (module doc for the format)."""
    source = str(path)
    try:
        with Path(path).expanduser().open("rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ClusterError(f"cluster file not found: {source}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ClusterError(f"{source} is not valid TOML: {err}") from None
    return cluster_from_dict(table, source=Path(source).name)


def cluster_from_dict(table: dict[str, Any], *, source: str = "<cluster>") -> Cluster:
    """The cluster of an already-parsed ``cluster.toml`` table (what :func:`load_cluster` reads)."""
    unknown = sorted(set(table) - {"devices", "links", "default_link"})
    if unknown:
        raise ClusterError(f"{source}: unknown key {unknown[0]!r} (expected devices, links, default_link)")
    types = table.get("devices")
    if not isinstance(types, dict) or not types:
        raise ClusterError(f"{source}: needs at least one [devices.<type>] table")

    devices: list[Device] = []
    intra: dict[str, tuple[float, float]] = {}  # type -> (bytes/s, seconds)
    for name, spec in types.items():
        key = f"devices.{name}"
        if not isinstance(spec, dict):
            raise ClusterError(f"{source}: {key} must be a table")
        bad = sorted(set(spec) - _DEVICE_KEYS)
        if bad:
            raise ClusterError(f"{source}: unknown key {key}.{bad[0]} "
                               f"(expected one of {', '.join(sorted(_DEVICE_KEYS))})")
        count = _int(spec, "count", key, source, minimum=1)
        per_host = _int(spec, "per_host", key, source, minimum=1, default=1)
        if count % per_host:
            raise ClusterError(f"{source}: {key}.count ({count}) must be a multiple of {key}.per_host ({per_host})")
        tflops = _positive(spec, "tflops", key, source)
        memory = _positive(spec, "memory_gb", key, source)
        hbm = _positive(spec, "hbm_gbps", key, source)
        if per_host > 1 or "intra_gbps" in spec:
            intra_bw = _positive(spec, "intra_gbps", key, source)
        else:
            intra_bw = math.inf  # one device per host: never used
        intra_lat = _nonnegative(spec, "intra_latency_ms", key, source, default=_DEFAULT_INTRA_LATENCY_MS)
        intra[name] = (intra_bw * _GB, intra_lat * 1e-3)
        hosts = count // per_host
        if "region" in spec and "regions" in spec:
            raise ClusterError(f"{source}: set {key}.region or {key}.regions, not both")
        if "regions" in spec:
            regions = spec["regions"]
            if (not isinstance(regions, list) or len(regions) != hosts
                    or not all(isinstance(r, str) and r for r in regions)):
                raise ClusterError(f"{source}: {key}.regions must list {hosts} region names (one per host), "
                                   f"got {regions!r}")
        else:
            region = spec.get("region", "default")
            if not isinstance(region, str) or not region:
                raise ClusterError(f"{source}: {key}.region must be a non-empty string, got {region!r}")
            regions = [region] * hosts
        for h in range(hosts):
            for _ in range(per_host):
                devices.append(Device(id=len(devices), type=name, host=f"{name}-{h}", region=regions[h],
                                      tflops=tflops, memory_gb=memory, hbm_gbps=hbm))

    links = _parse_links(table.get("links", []), devices, source)
    default = None
    if "default_link" in table:
        spec = table["default_link"]
        if not isinstance(spec, dict):
            raise ClusterError(f"{source}: default_link must be a table")
        bad = sorted(set(spec) - {"gbps", "latency_ms"})
        if bad:
            raise ClusterError(f"{source}: unknown key default_link.{bad[0]} (expected gbps, latency_ms)")
        default = (_positive(spec, "gbps", "default_link", source) * _GB / 8,
                   _nonnegative(spec, "latency_ms", "default_link", source) * 1e-3)

    n = len(devices)
    bandwidth = np.empty((n, n))
    latency = np.empty((n, n))
    # links are between hosts: resolve each pair of hosts once
    host_of = [d.host for d in devices]
    first = {}
    for d in devices:
        first.setdefault(d.host, d)
    resolved: dict[tuple[str, str], tuple[float, float]] = {}
    for a, ha in first.items():
        for b, hb in first.items():
            if a != b:
                resolved[a, b] = _resolve_link(ha, hb, links, default, source)
    for i in range(n):
        for j in range(n):
            if i == j:
                bandwidth[i, j], latency[i, j] = math.inf, 0.0
            elif host_of[i] == host_of[j]:
                bandwidth[i, j], latency[i, j] = intra[devices[i].type]
            else:
                bandwidth[i, j], latency[i, j] = resolved[host_of[i], host_of[j]]
    return Cluster(tuple(devices), bandwidth, latency, source)


@dataclass(frozen=True)
class _Link:
    index: int
    sides: tuple[str, str]
    bandwidth: float  # bytes/s
    latency: float  # s


def _parse_links(entries: Any, devices: list[Device], source: str) -> list[_Link]:
    if not isinstance(entries, list):
        raise ClusterError(f"{source}: links must be an array of tables ([[links]])")
    names = {d.type for d in devices} | {d.region for d in devices} | {d.host for d in devices}
    links = []
    for i, spec in enumerate(entries):
        key = f"links[{i}]"
        if not isinstance(spec, dict):
            raise ClusterError(f"{source}: {key} must be a table")
        bad = sorted(set(spec) - _LINK_KEYS)
        if bad:
            raise ClusterError(f"{source}: unknown key {key}.{bad[0]} (expected between, gbps, latency_ms)")
        between = spec.get("between")
        if not isinstance(between, list) or len(between) != 2 or not all(isinstance(s, str) for s in between):
            raise ClusterError(f"{source}: {key}.between must name two device types, regions or hosts, got {between!r}")
        for side in between:
            if side not in names:
                raise ClusterError(f"{source}: {key}.between names {side!r}, which is no device type, region or "
                                   f"host of this cluster (types: {', '.join(sorted({d.type for d in devices}))})")
        links.append(_Link(i, (between[0], between[1]), _positive(spec, "gbps", key, source) * _GB / 8,
                           _nonnegative(spec, "latency_ms", key, source) * 1e-3))
    return links


def _specificity(name: str, d: Device) -> int:
    """How specifically ``name`` names device ``d``'s host (0: not at all)."""
    if name == d.host:
        return 3
    if name == d.region:
        return 2
    if name == d.type:
        return 1
    return 0


def _resolve_link(a: Device, b: Device, links: list[_Link], default: tuple[float, float] | None,
                  source: str) -> tuple[float, float]:
    best, best_score = None, 0
    for link in links:
        x, y = link.sides
        score = 0
        for p, q in ((x, y), (y, x)):
            sa, sb = _specificity(p, a), _specificity(q, b)
            if sa and sb:
                score = max(score, sa + sb)
        if score and score >= best_score:  # later entries win ties
            best, best_score = link, score
    if best is not None:
        return best.bandwidth, best.latency
    if default is not None:
        return default
    raise ClusterError(
        f"{source}: no link between host {a.host} ({a.type}, region {a.region}) and host {b.host} ({b.type}, region "
        f"{b.region}): add a [[links]] entry with between = [{a.type!r}, {b.type!r}] (or their regions or hosts), "
        "or a [default_link] table")


def _value(spec: dict, name: str, key: str, source: str, default: Any) -> Any:
    if name not in spec:
        if default is None:
            raise ClusterError(f"{source}: {key}.{name} is required")
        return default
    value = spec[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{source}: {key}.{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ClusterError(f"{source}: {key}.{name} must be finite, got {value!r}")
    return value


def _int(spec: dict, name: str, key: str, source: str, *, minimum: int, default: int | None = None) -> int:
    value = _value(spec, name, key, source, default)
    if value != int(value) or value < minimum:
        raise ClusterError(f"{source}: {key}.{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _positive(spec: dict, name: str, key: str, source: str, default: float | None = None) -> float:
    value = _value(spec, name, key, source, default)
    if value <= 0:
        raise ClusterError(f"{source}: {key}.{name} must be > 0, got {value!r}")
    return float(value)


def _nonnegative(spec: dict, name: str, key: str, source: str, default: float | None = None) -> float:
    value = _value(spec, name, key, source, 0.0 if default is None else default)
    if value < 0:
        raise ClusterError(f"{source}: {key}.{name} must be >= 0, got {value!r}")
    return float(value)


# ------------------------------------------------------------------------------------------------ profile.json

def cluster_from_profile(path: str | Path) -> Cluster:
    """The cluster a ``python -m titanrl.profile`` JSON measured: one device per rank (module doc)."""
    source = Path(path).name
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        raise ClusterError(f"profile not found: {path} (write one with `python -m titanrl.profile --out {path}`)") \
            from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ClusterError(f"{source} is not valid JSON: {err}") from None
    return cluster_from_profile_dict(data, source=source)


def cluster_from_profile_dict(data: dict[str, Any], *, source: str = "<profile>") -> Cluster:
    """:func:`cluster_from_profile` of an already-parsed profile."""
    if not isinstance(data, dict):
        raise ClusterError(f"{source}: a profile is a JSON object")
    if data.get("version") != 1:
        raise ClusterError(f"{source}: version must be 1, got {data.get('version')!r}")
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise ClusterError(f"{source}: ranks must be a non-empty list")
    world = data.get("world_size", len(ranks))
    if world != len(ranks):
        raise ClusterError(f"{source}: world_size is {world} but ranks lists {len(ranks)}")
    by_rank: dict[int, dict] = {}
    for i, r in enumerate(ranks):
        if not isinstance(r, dict):
            raise ClusterError(f"{source}: ranks[{i}] must be an object")
        for k in _PROFILE_RANK_KEYS:
            if k not in r:
                raise ClusterError(f"{source}: ranks[{i}].{k} is missing")
        rank = r["rank"]
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < len(ranks) or rank in by_rank:
            raise ClusterError(f"{source}: ranks[{i}].rank must be a distinct integer in 0..{len(ranks) - 1}, "
                               f"got {rank!r}")
        for k in ("matmul_tflops", "memory_gb", "hbm_gbps"):
            _positive(r, k, f"ranks[{i}]", source)
        gen = r.get("gen_tokens_per_s")
        if gen is not None:
            _positive(r, "gen_tokens_per_s", f"ranks[{i}]", source)
        by_rank[rank] = r
    devices = []
    for rank in range(len(ranks)):
        r = by_rank[rank]
        affinity = r.get("cpu_affinity")
        devices.append(Device(
            id=rank, type=str(r["device_name"]) or str(r["device"]), host=str(r["host"]), region=str(r["host"]),
            tflops=float(r["matmul_tflops"]), memory_gb=float(r["memory_gb"]) * (1 << 30) / _GB,  # GiB -> GB
            hbm_gbps=float(r["hbm_gbps"]),
            gen_tokens_per_s=None if r.get("gen_tokens_per_s") is None else float(r["gen_tokens_per_s"]),
            local_rank=r.get("local_rank"), cpu_affinity=None if affinity is None else tuple(affinity),
            device_name=str(r["device_name"]) + (f" ({r['device']})" if r["device"] else "")))

    n = len(devices)
    bandwidth = np.full((n, n), math.nan)
    latency = np.full((n, n), math.nan)
    np.fill_diagonal(bandwidth, math.inf)
    np.fill_diagonal(latency, 0.0)
    links = data.get("links", [])
    if not isinstance(links, list):
        raise ClusterError(f"{source}: links must be a list")
    for i, link in enumerate(links):
        key = f"links[{i}]"
        if not isinstance(link, dict) or not {"src", "dst", "gbps", "latency_ms"} <= set(link):
            raise ClusterError(f"{source}: {key} needs src, dst, gbps and latency_ms")
        a, b = link["src"], link["dst"]
        if a not in by_rank or b not in by_rank or a == b:
            raise ClusterError(f"{source}: {key} links ranks {a!r} and {b!r}; both must be distinct ranks of the "
                               "profile")
        bw = _positive(link, "gbps", key, source) * _GB / 8
        lat = _nonnegative(link, "latency_ms", key, source)
        bandwidth[a, b] = bandwidth[b, a] = bw
        latency[a, b] = latency[b, a] = lat * 1e-3
    missing = np.argwhere(np.isnan(bandwidth))
    if len(missing):
        a, b = sorted(int(x) for x in missing[0])
        raise ClusterError(f"{source}: no link measured between ranks {a} and {b} (profile again without --no-links)")
    return Cluster(tuple(devices), bandwidth, latency, source)


def uniform_cluster(specs: Sequence[tuple[str, int, float, float, float]], *, gbps: float = 100.0,
                    latency_ms: float = 0.01, source: str = "<uniform>") -> Cluster:
    """A cluster of one device per host, every pair linked alike: ``specs`` lists ``(type, count, tflops,
    memory_gb, hbm_gbps)``. For tests and quick what-ifs."""
    devices = []
    for name, count, tflops, memory, hbm in specs:
        for _ in range(count):
            devices.append(Device(id=len(devices), type=name, host=f"{name}-{len(devices)}", region="default",
                                  tflops=tflops, memory_gb=memory, hbm_gbps=hbm))
    n = len(devices)
    bandwidth = np.full((n, n), gbps * _GB / 8)
    latency = np.full((n, n), latency_ms * 1e-3)
    np.fill_diagonal(bandwidth, math.inf)
    np.fill_diagonal(latency, 0.0)
    return Cluster(tuple(devices), bandwidth, latency, source)
