"""A private Redis Cluster for tests and benchmarks: 3 masters + 3 replicas on loopback.

Six ``redis-server --cluster-enabled yes`` processes (each a :class:`RedisProcess` with its own
directory and ``nodes.conf``) on free ports whose cluster bus port (port + 10000) is free too,
joined by ``redis-cli --cluster create … --cluster-replicas 1``. :meth:`LocalCluster.start`
returns once every node reports ``cluster_state:ok`` and every replica's link to its master is
up, so a test never races the cluster's own start.

    with LocalCluster() as cluster:
        bus = RedisBus(cluster.url, "run")

Failures are real: :meth:`kill` sends SIGKILL to a node, :meth:`planned_failover` runs
``CLUSTER FAILOVER`` on a replica, :meth:`cut_off` makes a replica miss its master's writes
(SIGSTOP, and its link dropped), and :meth:`wait_promoted` waits until a replica took over.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.crc import key_slot

from tests.redisproc import RedisProcess

NODE_TIMEOUT_MS = 2000
"""``cluster-node-timeout``: a master silent this long is failed over (the default is 15 s)."""


_NODE_ARGS = (
    "--cluster-enabled", "yes",
    "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
    "--cluster-require-full-coverage", "yes",
)  # fmt: skip


def redis_cli_path() -> str | None:
    """Path of ``redis-cli`` (it creates the cluster), or None when it is not installed."""
    return shutil.which("redis-cli")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cluster_ports(n: int) -> list[int]:
    """``n`` ports on 127.0.0.1 that are free, each with its cluster bus port (+10000) free."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port < 55536 and port not in ports and _free(port + 10000):
            ports.append(port)
    return ports


@dataclass(frozen=True)
class NodeRole:
    """One node as the cluster sees it: its port, whether it is a master, its slots."""

    port: int
    master: bool
    slots: tuple[tuple[int, int], ...]


class LocalCluster:
    """3 masters and 3 replicas (by default), started and torn down as one.

    Args:
        masters: Number of masters (the slots are split evenly among them).
        replicas: Replicas per master.
        start_timeout_s: How long to wait for the cluster to report ok.
    """

    def __init__(
        self,
        *,
        masters: int = 3,
        replicas: int = 1,
        start_timeout_s: float = 30.0,
        aclfile: Path | None = None,
        login: tuple[str, str] | None = None,
    ):
        self.n_masters, self.n_replicas = masters, replicas
        self.login = login
        auth: tuple[str, ...] = ()
        if aclfile is not None:  # every node loads the same users; replicas log in as `login`
            if login is None:
                raise ValueError("an aclfile needs a login (an admin user) for replication")
            auth = ("--aclfile", str(aclfile), "--masteruser", login[0], "--masterauth", login[1])
        self.start_timeout_s = start_timeout_s
        ports = cluster_ports(masters * (1 + replicas))
        self.nodes = [
            RedisProcess(
                port=port,
                extra_args=(*_NODE_ARGS, *auth),
                login=login,
            )
            for port in ports
        ]

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,…``: every node is a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def node(self, port: int) -> RedisProcess:
        return next(n for n in self.nodes if n.port == port)

    def start(self) -> LocalCluster:
        """Start the servers, create the cluster and wait until it serves every slot."""
        cli = redis_cli_path()
        if cli is None:
            raise FileNotFoundError("redis-cli is not installed (apt-get install redis-tools)")
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
            creds = ["--user", self.login[0], "--pass", self.login[1]] if self.login else []
            done = subprocess.run(
                [cli, *creds, "--cluster", "create", *addresses,
                 "--cluster-replicas", str(self.n_replicas), "--cluster-yes"],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"cluster create failed:\n{done.stdout}{done.stderr}")
            self.wait_healthy(self.start_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def client(self, port: int, **kwargs: object) -> redis.Redis:
        """A plain (non-cluster) client of one node."""
        options: dict[str, object] = {"socket_timeout": 2.0, **kwargs}
        if self.login is not None:
            options = {"username": self.login[0], "password": self.login[1], **options}
        return redis.Redis(host="127.0.0.1", port=port, **options)  # type: ignore[arg-type]

    def _ask(self, port: int, fn: object) -> object:
        client = self.client(port)
        try:
            return fn(client)  # type: ignore[operator]
        finally:
            client.close()

    def roles(self) -> list[NodeRole]:
        """Every running node's role and slots, as the first reachable node reports them."""
        for node in self.nodes:
            if not node.running:
                continue
            try:
                raw = self._ask(node.port, lambda c: c.execute_command("CLUSTER", "NODES"))
            except redis.RedisError:
                continue
            return _parse_nodes(raw)
        raise RuntimeError("no cluster node answers")

    def masters(self) -> list[NodeRole]:
        """The masters that serve slots now (failed ones left out)."""
        return [r for r in self.roles() if r.master and r.slots]

    def master_of_key(self, key: str) -> int:
        """Port of the master that serves ``key``'s slot now."""
        slot = key_slot(key.encode())
        for role in self.masters():
            if any(lo <= slot <= hi for lo, hi in role.slots):
                return role.port
        raise RuntimeError(f"no master serves slot {slot}")

    def replica_of(self, master_port: int) -> int:
        """Port of a replica of ``master_port`` (as that replica reports its master)."""
        for node in self.nodes:
            if node.port == master_port or not node.running:
                continue
            info = self._ask(node.port, lambda c: c.info("replication"))
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == master_port:  # type: ignore[union-attr]
                return node.port
        raise RuntimeError(f"no replica of {master_port}")

    def healthy(self) -> bool:
        """Every running node reports ``cluster_state:ok``, the running masters cover every
        slot and every running replica's link to its master is up."""
        try:
            for node in self.nodes:
                if not node.running:
                    continue
                info = self._ask(node.port, lambda c: c.execute_command("CLUSTER", "INFO"))
                text = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in text:
                    return False
                repl = self._ask(node.port, lambda c: c.info("replication"))
                if repl.get("role") == "slave" and repl.get("master_link_status") != "up":  # type: ignore[union-attr]
                    return False
            covered = sum(hi - lo + 1 for r in self.masters() for lo, hi in r.slots)
            return covered == 16384
        except (redis.RedisError, RuntimeError):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not healthy after {timeout_s} s: {self.roles()}")
            time.sleep(0.05)

    def kill(self, port: int) -> None:
        """SIGKILL one node (its data and ``nodes.conf`` stay for a restart)."""
        self.node(port).kill()

    def cut_off(self, replica_port: int, master_port: int) -> None:
        """Make a replica miss its master's writes: SIGSTOP it, then drop its link on the master
        (``CLIENT KILL TYPE replica``); the master goes on answering writes that no replica
        has. :meth:`thaw` lets the replica run again."""
        pid = self.node(replica_port).pid
        assert pid is not None, f"{replica_port} is not running"
        os.kill(pid, signal.SIGSTOP)
        self._ask(master_port, lambda c: c.execute_command("CLIENT", "KILL", "TYPE", "replica"))

    def thaw(self, port: int) -> None:
        """SIGCONT a node stopped by :meth:`cut_off`."""
        pid = self.node(port).pid
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    def replicas_connected(self, master_port: int) -> int:
        """``connected_slaves`` of a master (``INFO replication``)."""
        info = self._ask(master_port, lambda c: c.info("replication"))
        return int(info.get("connected_slaves", 0))  # type: ignore[union-attr]

    def planned_failover(self, replica_port: int) -> None:
        """``CLUSTER FAILOVER`` on a replica: it takes over from its master without loss."""
        self._ask(replica_port, lambda c: c.execute_command("CLUSTER", "FAILOVER"))

    def wait_promoted(self, port: int, timeout_s: float = 20.0) -> None:
        """Wait until node ``port`` is a master that serves slots and the cluster is ok."""
        deadline = time.monotonic() + timeout_s
        while not (any(r.port == port for r in self.masters()) and self.healthy()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{port} not promoted after {timeout_s} s: {self.roles()}")
            time.sleep(0.05)

    def flush(self) -> None:
        """FLUSHALL on every running master (the tests own this cluster)."""
        for role in self.masters():
            with contextlib.suppress(redis.RedisError):
                self._ask(role.port, lambda c: c.flushall())

    def close(self) -> None:
        """Kill every node and remove their directories."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse_nodes(raw: object) -> list[NodeRole]:
    """``CLUSTER NODES`` → roles (redis-py may hand back text or an already parsed dict)."""
    if isinstance(raw, dict):
        roles = []
        for address, info in raw.items():
            flags = str(info.get("flags", ""))
            slots = tuple((int(s[0]), int(s[-1])) for s in info.get("slots", []))
            if "fail" in flags.split(","):
                continue
            roles.append(NodeRole(int(address.rpartition(":")[2]), "master" in flags, slots))
        return roles
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    roles = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8 or "fail" in parts[2].split(","):
            continue
        port = int(parts[1].partition("@")[0].rpartition(":")[2])
        slots = []
        for spec in parts[8:]:
            if spec.startswith("["):
                continue  # a slot being migrated
            lo, _, hi = spec.partition("-")
            slots.append((int(lo), int(hi or lo)))
        roles.append(NodeRole(port, "master" in parts[2].split(","), tuple(slots)))
    return roles
