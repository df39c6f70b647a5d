"""Ray for ShadowLoader: one Ray per job, one preprocessor actor per node, and a clean tear-down.

**Local (``data.ray_address`` empty), single node.** Rank 0 starts a private Ray instance
(``address="local"``: never an unrelated cluster found through ``RAY_ADDRESS`` or /tmp/ray) bound to
127.0.0.1, with the object store capped at ``data.ray_object_store_bytes``, no dashboard, and token
authentication with a fresh random token. It broadcasts the address and token over the process group;
the other ranks connect to that same instance as extra drivers. So N torchrun ranks share ONE Ray. A
multi-node job must name a cluster (``data.ray_address``): a loopback instance cannot be shared across
machines.

**Cluster (``data.ray_address`` set).** Every rank joins the cluster as a driver attached to the raylet
of its own host; rank 0 places one preprocessor actor on every alive node (NodeAffinity, hard) in a
namespace unique to the job, so jobs sharing a cluster never see each other's actors. Ray finds a
driver's raylet by reading the process table; where that table shows several raylets (hosts that
share a PID namespace: network namespaces or containers on one machine, ``--pid=host``) it would
attach every driver to the head's raylet, and the driver would advertise an address that the other
hosts cannot reach (a large reply to it then never arrives). ``connect`` names the raylet whose node
address is one of this host's own interface addresses (``driver_node_ip``).

**Reachability.** Once the preprocessors run, every rank receives a probe reply larger than Ray's
inline limit from each of them (the path a frame-range fetch takes, through the object stores of
both hosts) within ``PROBE_TIMEOUT_S``; a rank that cannot is an error on every rank naming the rank,
its host and the preprocessor's host, in seconds rather than after ``data.fetch_timeout_s``.

**Errors.** Before ``ray.init`` every rank opens a TCP connection to the address with a short timeout,
so an unreachable Ray is a ``DataUnavailableError`` naming the address within seconds (Ray's own
client retries for minutes). If rank 0 cannot start Ray, the others receive its error instead of an
address and raise it, rather than waiting.

**Tear-down** (``shutdown``, collective): barrier; rank 0 kills the actors; the ranks that connected
disconnect; barrier; rank 0 shuts its instance down (GCS, raylet, workers all exit). A process that
found Ray already initialized (a test fixture, a trainer that uses Ray for something else) leaves it
running. After a failure (``collective=False``) no rank waits for another: each releases what it holds
and exits, so the ranks still in a collective with it see its connections close at once.
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from titanrl.data.shadow.comm import Comm
from titanrl.data.shadow.types import DataUnavailableError

CONNECT_TIMEOUT_S = 5.0
ACTOR_READY_TIMEOUT_S = 120.0
PROBE_TIMEOUT_S = 20.0
# larger than Ray's inline-return limit (100 KiB): the probe reply travels through the object stores
PROBE_BYTES = 256 * 1024


@dataclass
class PreprocessorSpec:
    """What every rank needs to find and use one preprocessor."""

    name: str
    node_id: str
    host: str = ""  # the node's address (its raylet's node IP), for messages


@dataclass
class RaySession:
    address: str
    namespace: str
    owns_instance: bool  # this process started Ray: it shuts it down last
    connected_here: bool  # this process called ray.init (and disconnects at tear-down)
    local: bool
    node_id: str
    preprocessors: list[PreprocessorSpec] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    rank_nodes: list[str] = field(default_factory=list)
    rank_hosts: list[str] = field(default_factory=list)  # each rank's node address, for messages
    closed: bool = False

    def host_of_node(self, node_id: str) -> str:
        for rank_node, host in zip(self.rank_nodes, self.rank_hosts):
            if rank_node == node_id:
                return host
        for spec in self.preprocessors:
            if spec.node_id == node_id:
                return spec.host
        return node_id[:12]


# ------------------------------------------------------------------------------------- connect


def _local_env(token: str) -> None:
    """Environment for a loopback, token-authenticated instance; must precede ray's first use."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray server binds 127.0.0.1
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = token
    import sys

    if "ray" in sys.modules:  # imported before us: refresh what it read from the environment at import
        import ray._private.ray_constants as rc

        rc.ENABLE_RAY_CLUSTER = False
        try:
            from ray._raylet import Config

            Config.initialize("")
        except Exception:
            pass


def pick_driver_node_ip(raylet_ips: set[str], host_ips: set[str]) -> str | None:
    """The node address a driver on this host must attach to, when Ray's own choice is ambiguous:
    several raylets visible (``raylet_ips``) and exactly one of them on an address of this host
    (``host_ips``). None leaves the choice to Ray (one raylet visible, or no way to tell)."""
    if len(raylet_ips) <= 1:
        return None
    mine = sorted(raylet_ips & host_ips)
    return mine[0] if len(mine) == 1 else None


def _visible_raylet_ips() -> set[str]:
    """``--node_ip_address`` of every raylet in the process table (what Ray's driver discovery reads)."""
    import psutil

    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if cmd and os.path.basename(cmd[0]) == "raylet":
            found.update(a.split("=", 1)[1] for a in cmd if a.startswith("--node_ip_address="))
    return found


def _host_ips() -> set[str]:
    """IPv4 addresses of this host's (this network namespace's) interfaces."""
    import psutil

    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}


def driver_node_ip() -> str | None:
    try:
        return pick_driver_node_ip(_visible_raylet_ips(), _host_ips())
    except Exception:  # no process table or interface list: Ray's own discovery
        return None


def _init_cluster_driver(address: str, namespace: str) -> None:
    import ray

    try:
        ray.init(address=address, namespace=namespace, logging_level="WARNING", _node_ip_address=driver_node_ip())
    except ConnectionError as error:
        if os.environ.get("RAY_AUTH_MODE", "disabled") == "token":
            raise
        # `ray start --head` (Ray 2.60) turns token authentication on when ~/.ray/auth_token holds a token; the
        # nodes and drivers that join send it only with RAY_AUTH_MODE=token. Ray's message (after ~20 s) names
        # neither
        raise ConnectionError(
            f"{error}; RAY_AUTH_MODE is not 'token' in this process: a cluster with token authentication (what "
            "`ray start --head` starts when ~/.ray/auth_token holds a token) refuses it. Set RAY_AUTH_MODE=token and the "
            "cluster's token (RAY_AUTH_TOKEN, or the file ~/.ray/auth_token) for `ray start` and torchrun on every "
            "machine") from None


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast, with the address in the message, when nothing listens there."""
    if address.startswith("ray://"):
        raise DataUnavailableError(
            f"data.ray_address={address!r}: Ray Client addresses are not supported; give the GCS address host:port"
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise DataUnavailableError(f"data.ray_address={address!r} is not host:port")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as error:
        raise DataUnavailableError(
            f"cannot reach Ray at {address} within {timeout_s:.0f} s ({error}); check data.ray_address and that "
            "the cluster (or rank 0's local instance) is running"
        ) from None


def _start_local(object_store_bytes: int, namespace: str, num_cpus: int | None) -> None:
    """A private instance; ``_local_env`` must have run (loopback, token) before ray was imported."""
    import ray

    kwargs: dict[str, Any] = {}
    if object_store_bytes:
        kwargs["object_store_memory"] = object_store_bytes
    with _daemons_in_own_sessions():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            namespace=namespace,
            logging_level="WARNING",
            log_to_driver=True,
            **kwargs,
        )


@contextmanager
def _daemons_in_own_sessions() -> Iterator[None]:
    """Start Ray's daemons in sessions of their own. torchrun stops a worker with ``killpg``: SIGTERM to every
    process of the worker's process group, where the daemons rank 0 starts would be; they died at once while the
    trainer's SIGTERM handler was still finishing the step and its checkpoint, which fetch data through them. In
    their own sessions they are stopped by the loader's ``close`` (``ray.shutdown``) after the checkpoint, and
    still die with the trainer if it is killed (Ray's parent-death signal does not depend on the group)."""
    from ray._private import services

    base = services.ConsolePopen

    class OwnSession(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSession
    try:
        yield
    finally:
        services.ConsolePopen = base


def _ray_initialized() -> bool:
    import sys

    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def _start_or_join_on_rank0(
    data_address: str, object_store_bytes: int, num_cpus: int | None, token: str
) -> dict[str, Any]:
    """Rank 0's half of ``connect``: what the other ranks need to join (or why they cannot)."""
    import ray

    if _ray_initialized():  # a test fixture or the trainer started Ray already: use it, do not own it
        ctx = ray.get_runtime_context()
        return {"address": ctx.gcs_address, "namespace": ctx.namespace, "token": os.environ.get("RAY_AUTH_TOKEN", "")}
    namespace = f"titanrl-{uuid.uuid4().hex[:12]}"
    if data_address:
        check_reachable(data_address)
        _init_cluster_driver(data_address, namespace)
    else:
        _start_local(object_store_bytes, namespace, num_cpus)
    return {"address": ray.get_runtime_context().gcs_address, "namespace": namespace, "token": token,
            "started": True}


def connect(data_address: str, object_store_bytes: int, comm: Comm, *, local_world_size: int | None = None,
            num_cpus: int | None = None) -> RaySession:
    """Join (or start, on rank 0) the job's Ray; collective over `comm`."""
    local = not data_address
    world_on_node = local_world_size if local_world_size is not None else int(
        os.environ.get("LOCAL_WORLD_SIZE", comm.world))
    if local and comm.world > world_on_node:
        raise DataUnavailableError(
            f"a job over several nodes ({comm.world} ranks, {world_on_node} per node) needs data.ray_address: "
            "a local Ray instance is bound to 127.0.0.1 and cannot be shared across machines"
        )
    payload: dict[str, Any] | None = None
    if comm.rank == 0:
        try:
            token = ""
            if local and not _ray_initialized():
                token = secrets.token_hex(32)
                _local_env(token)  # before ray's first import: loopback servers, token authentication
            payload = _start_or_join_on_rank0(data_address, object_store_bytes, num_cpus, token)
        except Exception as error:  # tell the other ranks instead of leaving them waiting
            payload = {"error": f"{type(error).__name__}: {error}"}
    payload = comm.broadcast(payload)
    assert payload is not None
    if "error" in payload:
        raise DataUnavailableError(f"rank 0 could not start or join Ray: {payload['error']}")
    started = bool(payload.get("started"))
    owns = comm.rank == 0 and started and local
    connected_here = comm.rank == 0 and started
    if comm.rank != 0 and not _ray_initialized():
        address = payload["address"] if local else data_address
        if local:
            _local_env(payload["token"])
        check_reachable(address)
        import ray

        try:
            if local:
                ray.init(address=address, namespace=payload["namespace"], logging_level="WARNING")
            else:
                _init_cluster_driver(address, payload["namespace"])
        except Exception as error:
            raise DataUnavailableError(f"rank {comm.rank} cannot join Ray at {address}: {error}") from None
        connected_here = True
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    session = RaySession(payload["address"], payload["namespace"], owns, connected_here, local, node_id)
    host = ray.util.get_node_ip_address()  # the address this driver advertises
    session.rank_nodes, session.rank_hosts = map(list, zip(*comm.all_gather((node_id, host))))
    return session


# ---------------------------------------------------------------------------------- preprocessors


def _preprocessor_class():
    import ray

    from titanrl.data.shadow.preprocessor import PreprocessorCore

    class RayPreprocessor(PreprocessorCore):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, put=ray.put, get=ray.get, **kwargs)

    return ray.remote(RayPreprocessor)


def start_preprocessors(
    session: RaySession,
    comm: Comm,
    *,
    manifest_dir: str,
    settings: Any,
    num_threads: int,
    cache_bytes: int,
    max_restarts: int = -1,
    manifest_shared: bool = True,
) -> None:
    """Rank 0 places one preprocessor per node; every rank gets handles to all of them (collective).

    ``manifest_dir`` is this rank's: a node's preprocessor reads the folder its node's ranks read (machines whose
    caches are local disks each hold their own import). A node without ranks gets one reading rank 0's folder
    when ``manifest_shared`` (the same files on every machine), else none."""
    import ray

    specs: list[dict[str, str]] | dict[str, str] | None = None
    actors: list[Any] = []
    dirs = comm.all_gather(manifest_dir)
    if comm.rank == 0:
        try:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            hosts = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes() if n.get("Alive")}
            node_dirs: dict[str, str] = {}
            for node, folder in zip(session.rank_nodes, dirs):
                node_dirs.setdefault(node, folder)
            nodes = [session.node_id] if session.local else sorted(
                n for n in hosts if n in node_dirs or manifest_shared)
            cls = _preprocessor_class()
            specs = []
            job = uuid.uuid4().hex[:8]  # two loaders in one namespace (tests, a second loader) never clash
            for i, node in enumerate(nodes):
                name = f"titanrl-preprocessor-{job}-{i}"
                actors.append(cls.options(
                    name=name,
                    namespace=session.namespace,
                    num_cpus=0,  # threads that wait on I/O and FFmpeg; placement is by node, not by CPUs
                    # fetches wait for decodes in their own threads; decodes have theirs
                    max_concurrency=4 * num_threads + 32,
                    # unbounded: every restart is bounded by the crash journal instead (a crash condemns a
                    # sample, narrows the suspects, or counts towards crash_journal.MAX_UNATTRIBUTED)
                    max_restarts=max_restarts,
                    max_task_retries=2,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(node_dirs.get(node, manifest_dir), settings, num_threads, cache_bytes,
                         journal_path=str(Path(tempfile.gettempdir()) / f"{name}.crash-journal.json")))
                specs.append({"name": name, "node_id": node, "host": hosts.get(node, "")})
            ray.get([a.ping.remote() for a in actors], timeout=ACTOR_READY_TIMEOUT_S)
        except Exception as error:
            specs = {"error": f"{type(error).__name__}: {error}"}
    specs = comm.broadcast(specs)
    if isinstance(specs, dict):
        raise DataUnavailableError(f"rank 0 could not start the preprocessors: {specs['error']}")
    assert specs is not None
    session.preprocessors = [PreprocessorSpec(s["name"], s["node_id"], s["host"]) for s in specs]
    # Rank 0 keeps the creating handles: they own the actors (an actor whose owner's handles are all
    # gone is destroyed, name or not); the other ranks look them up by name.
    session.handles = actors if comm.rank == 0 else [
        ray.get_actor(s.name, namespace=session.namespace) for s in session.preprocessors]
    check_preprocessors_reachable(session, comm)


def check_preprocessors_reachable(session: RaySession, comm: Comm, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Every rank receives a reply larger than Ray's inline limit from every preprocessor (collective):
    a rank that cannot receive one - a host whose object store or driver the other hosts cannot reach -
    is an error on every rank, naming the rank, its host and the preprocessor's host."""
    import ray

    problems = []
    refs = [handle.probe.remote(PROBE_BYTES) for handle in session.handles]
    deadline = time.monotonic() + timeout_s
    for spec, ref in zip(session.preprocessors, refs):
        try:
            got = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1))
            if len(got) != PROBE_BYTES:
                raise RuntimeError(f"got {len(got)} of {PROBE_BYTES} bytes")
        except Exception as error:
            what = "no reply" if isinstance(error, ray.exceptions.GetTimeoutError) else type(error).__name__
            problems.append(f"rank {comm.rank} on host {session.rank_hosts[comm.rank]} received no data from the "
                            f"preprocessor on host {spec.host or spec.node_id[:12]} within {timeout_s:.0f} s ({what})")
    problems = [p for rank_problems in comm.all_gather(problems) for p in rank_problems]
    if problems:
        raise DataUnavailableError(
            "; ".join(problems[:4]) + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
            + ": the hosts' Ray object stores or drivers cannot reach each other (check each host's "
            "--node-ip-address, that every host can open the other's Ray ports, and GLOO_SOCKET_IFNAME)")


# -------------------------------------------------------------------------------------- shutdown


def shutdown(session: RaySession, comm: Comm, *, timeout_s: float = 30.0, collective: bool = True) -> None:
    """Tear-down (see the module docstring): collective unless ``collective=False`` (after a failure,
    when the other ranks may be anywhere). Safe to call twice."""
    if session.closed:
        return
    session.closed = True
    import ray

    if collective:
        comm.barrier()
    if comm.rank == 0:
        try:  # lets each preprocessor remove its crash journal; a dead one just does not answer
            ray.get([handle.close.remote() for handle in session.handles], timeout=5)
        except Exception:
            pass
        for handle in session.handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
    session.handles = []
    if session.connected_here and not session.owns_instance:
        ray.shutdown()
    if collective:
        comm.barrier()
    if session.owns_instance:
        ray.shutdown()
