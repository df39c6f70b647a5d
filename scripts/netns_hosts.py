"""Several hosts on one machine, for tests and benchmarks that need more than one: each host is a
network namespace with one interface on a shared bridge (in a hub namespace of its own), so ranks on
different "hosts" talk over real TCP between different addresses, and a Ray cluster spans them with
one node per host. Needs root and ``ip netns``.

    with Hosts(2) as hosts:                # 10.213.0.1, 10.213.0.2
        address = hosts.start_ray()        # Ray head on host 0, a worker on every other host
        hosts[1].popen(["torchrun", ...], env={...})   # with the cluster's token (RAY_AUTH_*) in its env
        hosts.shape(1, "100mbit")          # tbf on host 1's link (bandwidth; latency cannot be shaped here)
        hosts.throttle_port(1, 8076)       # traffic to that port leaving host 1 at 8 bit/s: blocked
        hosts.local_dir                    # one path, a different folder on each host (a local disk)

Every process on a host runs in a mount namespace of its own where ``hosts.local_dir`` is that host's own
folder (``hosts[i].disk``, bind-mounted): the same path on every host holds different files, as a node-local
disk does, for tests of machines that share no filesystem. Everything else is the machine's one filesystem.

Tear-down kills every process in the namespaces (by ``ip netns pids``), then deletes them; it runs on
exit from the ``with`` block whether or not the body raised, and ``python scripts/netns_hosts.py
down TAG`` removes what a killed process left behind.

The same commands on real hosts are in the README's "Several machines" section.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

SUBNET = "10.213.0"
RAY_PORT = 6379
OBJECT_MANAGER_PORT = 8076


class HostsUnavailable(RuntimeError):
    """This machine cannot build namespaced hosts (not root, or ``ip netns`` refused)."""


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    proc = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"tc {' '.join(args)} (in {ns}): {proc.stderr.strip()}")


def namespace_pids(ns: str) -> list[int]:
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _alive(pid: int) -> bool:
    """A process that still exists and is not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def remove_namespaces(names: Sequence[str], grace_s: float = 5.0) -> None:
    """Kill every process in the namespaces (TERM, then KILL after ``grace_s``), then delete them."""
    seen: set[int] = set()
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        pids = [p for ns in names for p in namespace_pids(ns)]
        seen.update(pids)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in seen):
            time.sleep(0.2)
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@dataclass
class Host:
    index: int
    ns: str  # network namespace name
    ip: str
    dev: str  # its interface (inside the namespace)
    cluster_env: dict[str, str] = field(default_factory=dict)  # every host's process gets it (Hosts.start_ray)
    disk: Path | None = None  # this host's own folder, seen at Hosts.local_dir by its processes
    local_dir: Path | None = None

    def cmd(self, argv: Sequence[str]) -> list[str]:
        if self.disk is None:
            return ["ip", "netns", "exec", self.ns, *argv]
        # a private mount namespace: the bind mount is this host's processes' alone
        return ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(self.disk), str(self.local_dir), *argv]

    def env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, **self.cluster_env, **(env or {})}

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.cmd(argv), env=self.env(env), **kwargs)

    def run(self, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(argv), env=self.env(env), **kwargs)


class Hosts:
    def __init__(self, n: int, tag: str | None = None) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"1 to 200 hosts, got {n}")
        self.tag = tag or f"trl{os.getpid() % 100000}"
        self.hub = f"{self.tag}-hub"
        self.cluster_env: dict[str, str] = {}  # shared by every host
        # each host's local disk (a folder here), seen by its processes at local_dir
        self.local_dir = Path("/tmp") / f"{self.tag}-local"
        self.disks = Path("/tmp") / f"{self.tag}-disks"
        self.hosts = [Host(i, f"{self.tag}-h{i}", f"{SUBNET}.{i + 1}", f"{self.tag}e{i}"[-15:], self.cluster_env,
                           self.disks / f"h{i}", self.local_dir) for i in range(n)]
        self.ray_dir = Path("/tmp") / f"{self.tag}-ray"  # short: Ray's socket paths must fit 107 bytes
        self.ray_address = ""

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    @property
    def namespaces(self) -> list[str]:
        return [h.ns for h in self.hosts] + [self.hub]

    def up(self) -> "Hosts":
        if os.geteuid() != 0:
            raise HostsUnavailable("namespaced hosts need root (ip netns)")
        if shutil.which("ip") is None:
            raise HostsUnavailable("no `ip` command (iproute2)")
        if shutil.which("unshare") is None:
            raise HostsUnavailable("no `unshare` command (util-linux), needed for the hosts' local disks")
        self.local_dir.mkdir(exist_ok=True)
        for h in self.hosts:
            h.disk.mkdir(parents=True, exist_ok=True)
        try:
            _ip("netns", "add", self.hub)
        except RuntimeError as error:
            raise HostsUnavailable(f"ip netns refused: {error}") from None
        try:
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for h in self.hosts:
                peer = f"{self.tag}p{h.index}"[-15:]
                _ip("netns", "add", h.ns)
                _ip("link", "add", h.dev, "type", "veth", "peer", "name", peer)
                _ip("link", "set", h.dev, "netns", h.ns)
                _ip("link", "set", peer, "netns", self.hub)
                _ip("-n", self.hub, "link", "set", peer, "master", "br0")
                _ip("-n", self.hub, "link", "set", peer, "up")
                _ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", h.dev)
                _ip("-n", h.ns, "link", "set", "lo", "up")
                _ip("-n", h.ns, "link", "set", h.dev, "up")
        except BaseException:
            self.down()
            raise
        return self

    def start_ray(self, num_cpus: int = 1, object_manager_port: int = OBJECT_MANAGER_PORT) -> str:
        """A Ray head on host 0 and a worker on every other host (each bound to its host's address);
        returns the cluster address to pass as ``data.ray_address``. Token authentication with a fresh token,
        set on every node and every process started on a host from now on (a head turns it on whenever
        ~/.ray/auth_token holds a token, but the nodes and drivers that join send it only with
        ``RAY_AUTH_MODE=token``: it must be the same everywhere)."""
        head = self.hosts[0]
        self.cluster_env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        env = {"RAY_USAGE_STATS_ENABLED": "0"}
        common = ["--num-cpus", str(num_cpus), "--object-manager-port", str(object_manager_port),
                  "--disable-usage-stats"]
        self.ray_dir.mkdir(parents=True, exist_ok=True)
        ray = [sys.executable, "-m", "ray.scripts.scripts", "start"]
        for h in self.hosts:
            argv = ray + (["--head", "--port", str(RAY_PORT), "--include-dashboard=false",
                           f"--temp-dir={self.ray_dir}"] if h is head else ["--address", f"{head.ip}:{RAY_PORT}"])
            proc = h.run(argv + ["--node-ip-address", h.ip, *common], env=env, capture_output=True, text=True,
                         timeout=120)
            if proc.returncode:
                raise RuntimeError(f"ray start on {h.ns} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        self.ray_address = f"{head.ip}:{RAY_PORT}"
        return self.ray_address

    def shape(self, i: int, rate: str, burst: str = "64kbit", latency: str = "50ms") -> None:
        """Limit host i's outgoing bandwidth (tbf)."""
        h = self.hosts[i]
        _tc(h.ns, "qdisc", "replace", "dev", h.dev, "root", "tbf", "rate", rate, "burst", burst, "latency", latency)

    def throttle_port(self, i: int, port: int) -> None:
        """Traffic leaving host i for ``port`` (any host) goes through an 8 bit/s class: a firewall in
        effect (this kernel has no tc actions to drop with)."""
        h = self.hosts[i]
        _tc(h.ns, "qdisc", "replace", "dev", h.dev, "root", "handle", "1:", "htb", "default", "20")
        _tc(h.ns, "class", "add", "dev", h.dev, "parent", "1:", "classid", "1:10", "htb", "rate", "8bit",
            "ceil", "8bit")
        _tc(h.ns, "class", "add", "dev", h.dev, "parent", "1:", "classid", "1:20", "htb", "rate", "10gbit")
        _tc(h.ns, "filter", "add", "dev", h.dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
            "ip", "dport", str(port), "0xffff", "flowid", "1:10")

    def unshape(self, i: int) -> None:
        h = self.hosts[i]
        subprocess.run(["ip", "netns", "exec", h.ns, "tc", "qdisc", "del", "dev", h.dev, "root"], capture_output=True)

    def down(self) -> None:
        remove_namespaces(self.namespaces)
        for folder in (self.ray_dir, self.disks, self.local_dir):
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> "Hosts":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    down = sub.add_parser("down", help="remove the namespaces (and their processes) of a tag")
    down.add_argument("tag")
    args = parser.parse_args(argv)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    remove_namespaces([n for n in names if n.startswith(f"{args.tag}-")])
    for suffix in ("ray", "disks", "local"):
        shutil.rmtree(Path("/tmp") / f"{args.tag}-{suffix}", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
