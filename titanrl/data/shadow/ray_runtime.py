"""Ray for ShadowLoader: one Ray per job, one preprocessor actor per node, and a clean tear-down.

**Local (``data.ray_address`` empty), single node.** Rank 0 starts a private Ray instance
(``address="local"``: never an unrelated cluster found through ``RAY_ADDRESS`` or /tmp/ray) bound to
127.0.0.1, with the object store capped at ``data.ray_object_store_bytes``, no dashboard, and token
authentication with a fresh random token. It broadcasts the address and token over the process group;
the other ranks connect to that same instance as extra drivers. So N torchrun ranks share ONE Ray. A
multi-node job must name a cluster (``data.ray_address``): a loopback instance cannot be shared across
machines.

**Cluster (``data.ray_address`` set).** Every rank joins the cluster; rank 0 places one preprocessor
actor on every alive node (NodeAffinity, hard) in a namespace unique to the job, so jobs sharing a
cluster never see each other's actors.

**Errors.** Before ``ray.init`` every rank opens a TCP connection to the address with a short timeout,
so an unreachable Ray is a ``DataUnavailableError`` naming the address within seconds (Ray's own
client retries for minutes). If rank 0 cannot start Ray, the others receive its error instead of an
address and raise it, rather than waiting.

**Tear-down** (``shutdown``, collective): barrier; rank 0 kills the actors; the ranks that connected
disconnect; barrier; rank 0 shuts its instance down (GCS, raylet, workers all exit). A process that
found Ray already initialized (a test fixture, a trainer that uses Ray for something else) leaves it
running.
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titanrl.data.shadow.comm import Comm
from titanrl.data.shadow.types import DataUnavailableError

CONNECT_TIMEOUT_S = 5.0
ACTOR_READY_TIMEOUT_S = 120.0


@dataclass
class PreprocessorSpec:
    """What every rank needs to find and use one preprocessor."""

    name: str
    node_id: str


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
    closed: bool = False


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
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        namespace=namespace,
        logging_level="WARNING",
        log_to_driver=True,
        **kwargs,
    )


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
        ray.init(address=data_address, namespace=namespace, logging_level="WARNING")
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
            ray.init(address=address, namespace=payload["namespace"], logging_level="WARNING")
        except Exception as error:
            raise DataUnavailableError(f"rank {comm.rank} cannot join Ray at {address}: {error}") from None
        connected_here = True
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    session = RaySession(payload["address"], payload["namespace"], owns, connected_here, local, node_id)
    session.rank_nodes = comm.all_gather(node_id)
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
) -> None:
    """Rank 0 places one preprocessor per node; every rank gets handles to all of them (collective)."""
    import ray

    specs: list[dict[str, str]] | dict[str, str] | None = None
    actors: list[Any] = []
    if comm.rank == 0:
        try:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            if session.local:
                nodes = [session.node_id]
            else:
                nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
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
                ).remote(manifest_dir, settings, num_threads, cache_bytes,
                         journal_path=str(Path(tempfile.gettempdir()) / f"{name}.crash-journal.json")))
                specs.append({"name": name, "node_id": node})
            ray.get([a.ping.remote() for a in actors], timeout=ACTOR_READY_TIMEOUT_S)
        except Exception as error:
            specs = {"error": f"{type(error).__name__}: {error}"}
    specs = comm.broadcast(specs)
    if isinstance(specs, dict):
        raise DataUnavailableError(f"rank 0 could not start the preprocessors: {specs['error']}")
    assert specs is not None
    session.preprocessors = [PreprocessorSpec(s["name"], s["node_id"]) for s in specs]
    # Rank 0 keeps the creating handles: they own the actors (an actor whose owner's handles are all
    # gone is destroyed, name or not); the other ranks look them up by name.
    session.handles = actors if comm.rank == 0 else [
        ray.get_actor(s.name, namespace=session.namespace) for s in session.preprocessors]


# -------------------------------------------------------------------------------------- shutdown


def shutdown(session: RaySession, comm: Comm, *, timeout_s: float = 30.0) -> None:
    """Collective tear-down (see the module docstring). Safe to call twice."""
    if session.closed:
        return
    session.closed = True
    import ray

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
    comm.barrier()
    if session.owns_instance:
        ray.shutdown()
