"""What only a real redis-server can show: restarts, lost state, persistence, a dead server.

Each test owns its redis-server (fixture ``private_server``) and kills or restarts it freely.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from dd_queue.bus import Entry, RedisBus, RedisOptions, SetOp
from dd_queue.errors import BlobMissing, BusUnavailable, ConfigError, LeaseLost
from dd_queue.keys import SYNC_GROUP
from tests.integration.conftest import require_redis_server
from tests.redisproc import RedisProcess

G = SYNC_GROUP


@pytest.fixture
def bus(private_server: RedisProcess) -> Iterator[RedisBus]:
    """A bus that rides out restarts of up to 10 s."""
    rbus = RedisBus(private_server.url, "restart", options=RedisOptions(unavailable_after_s=10.0))
    try:
        yield rbus
    finally:
        rbus.close()


def test_operations_resume_after_a_crash_restart_without_persistence(
    private_server: RedisProcess, bus: RedisBus
) -> None:
    up = bus.keys.up(0)
    bus.append(up, {"m": b"before"})
    assert len(bus.read_group(up, G, "sync-0")) == 1
    ref = bus.put_blob(bus.keys.up_blob(0, 1, "L0"), b"payload", ttl_s=60)

    private_server.restart()  # SIGKILL + start on the same port: everything is gone

    assert bus.pending_summary(up, G).count == 0  # NOGROUP → group recreated, PEL lost
    assert bus.read_own_pending(up, G, "sync-0") == []
    with pytest.raises(BlobMissing):
        bus.get_blob(ref)
    after = bus.append(up, {"m": b"after"})
    [entry] = bus.read_group(up, G, "sync-0")
    assert entry.id == after and entry.fields["m"] == b"after"


def test_blocked_reader_resumes_across_a_restart(
    private_server: RedisProcess, bus: RedisBus
) -> None:
    up = bus.keys.up(0)
    bus.ensure_group(up, G)
    started, result = threading.Event(), []

    def reader() -> None:
        started.set()
        result.extend(bus.read_group(up, G, "sync-0", block_ms=15_000))

    thread = threading.Thread(target=reader)
    thread.start()
    assert started.wait(5)
    private_server.restart()
    # Whether the reader is still retrying or already recreated the group at id 0, an
    # entry appended now is delivered to it.
    entry_id = bus.append(up, {"m": b"after restart"})
    thread.join(timeout=14)
    assert not thread.is_alive()
    assert [e.id for e in result] == [entry_id]


def test_leases_and_scripts_after_a_restart(private_server: RedisProcess, bus: RedisBus) -> None:
    name = bus.keys.lease(0)
    before = bus.acquire_lease(name, "sync-0", ttl_s=30)
    assert before is not None
    private_server.restart()
    # The lease is gone with the data set; the script cache too (NOSCRIPT → reloaded).
    with pytest.raises(LeaseLost):
        bus.commit(before, [SetOp(bus.keys.state(0), b"stale")])
    after = bus.acquire_lease(name, "sync-0", ttl_s=30)
    assert after is not None
    bus.commit(after, [SetOp(bus.keys.state(0), b"fresh")])
    assert bus.get(bus.keys.state(0)) == b"fresh"


@pytest.fixture
def aof_server() -> Iterator[RedisProcess]:
    """A private redis-server with AOF persistence (appendfsync everysec)."""
    require_redis_server()
    with RedisProcess(appendonly=True) as server:
        yield server


def test_aof_keeps_entries_groups_pending_and_blobs_over_a_restart(
    aof_server: RedisProcess,
) -> None:
    rbus = RedisBus(aof_server.url, "aof", options=RedisOptions(unavailable_after_s=10.0))
    try:
        up = rbus.keys.up(0)
        ids = [rbus.append(up, {"i": str(i).encode()}) for i in range(3)]
        rbus.read_group(up, G, "sync-0", count=2)
        ref = rbus.put_blob(rbus.keys.up_blob(0, 1, "L0"), b"kept", ttl_s=600)
        aof_server.restart(graceful=True)  # SIGTERM: Redis fsyncs the AOF on shutdown
        assert [p.id for p in rbus.pending(up, G)] == ids[:2]
        assert [e.id for e in rbus.read_group(up, G, "sync-0", count=10)] == ids[2:]
        assert rbus.get_blob(ref) == b"kept"
    finally:
        rbus.close()


@pytest.mark.slow
def test_a_server_that_stays_down_raises_bus_unavailable_in_bounded_time(
    private_server: RedisProcess,
) -> None:
    bound_s = 1.0
    rbus = RedisBus(
        private_server.url,
        "down",
        options=RedisOptions(unavailable_after_s=bound_s, retry_base_s=0.02, retry_cap_s=0.2),
    )
    try:
        rbus.append(rbus.keys.events(), {"k": b"v"})
        private_server.kill()
        for operation in (
            lambda: rbus.append(rbus.keys.events(), {"k": b"v"}),
            lambda: rbus.read_group(rbus.keys.up(0), G, "c", block_ms=500),
            lambda: rbus.heartbeat("L0", b"", ttl_s=5),
        ):
            started = time.monotonic()
            with pytest.raises(BusUnavailable, match="unreachable"):
                operation()
            elapsed_s = time.monotonic() - started
            assert bound_s * 0.9 <= elapsed_s < 2 * bound_s
    finally:
        rbus.close()


def test_long_blocking_reads_are_split_below_the_socket_timeout(
    private_server: RedisProcess,
) -> None:
    options = RedisOptions(max_block_ms=100, socket_timeout_s=1.2)
    rbus = RedisBus(private_server.url, "split", options=options)
    try:
        up = rbus.keys.up(0)
        started = time.monotonic()
        assert rbus.read_group(up, G, "c", block_ms=350) == []
        assert time.monotonic() - started >= 0.3
        got: list[Entry] = []
        waiting = threading.Event()

        def reader() -> None:
            waiting.set()
            got.extend(rbus.read_group(up, G, "c", block_ms=5_000))

        thread = threading.Thread(target=reader)
        thread.start()
        assert waiting.wait(5)
        entry_id = rbus.append(up, {"m": b"x"})
        thread.join(timeout=5)
        assert [e.id for e in got] == [entry_id]
    finally:
        rbus.close()


def test_socket_timeout_must_exceed_the_longest_block() -> None:
    with pytest.raises(ConfigError, match="socket_timeout_s"):
        RedisOptions(max_block_ms=5000, socket_timeout_s=5.0)
    with pytest.raises(ConfigError):
        RedisOptions(unavailable_after_s=0)
