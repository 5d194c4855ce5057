"""What only a real redis-server can show: restarts, lost state, persistence, a dead server.

Each test owns its redis-server (fixture ``private_server``) and kills or restarts it freely.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from dd_queue.bus import AckOp, AppendOp, Entry, RedisBus, RedisOptions, SetOp, ops
from dd_queue.errors import BlobMissing, BusError, BusUnavailable, ConfigError, LeaseLost
from dd_queue.keys import SYNC_GROUP
from tests.bus_support import pending_ids, stage_global
from tests.integration.conftest import (
    blocked_clients,
    connections_received,
    require_redis_server,
    wait_until,
)
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
        bus.commit(before, [SetOp(bus.keys.state(0), b"stale")], commit_id="0:1")
    after = bus.acquire_lease(name, "sync-0", ttl_s=30)
    assert after is not None
    assert after.token > before.token  # the counter was lost, the server clock was not
    bus.commit(after, [SetOp(bus.keys.state(0), b"fresh")], commit_id="0:1")
    assert bus.get(bus.keys.state(0)) == b"fresh"
    # The old incarnation (same owner) stays fenced: its commit is refused ...
    with pytest.raises(LeaseLost):
        bus.commit(before, [SetOp(bus.keys.state(0), b"stale")], commit_id="0:2")
    assert bus.get(bus.keys.state(0)) == b"fresh"
    # ... and its staging lands under its own token, never on the committed blob.
    ref = stage_global(bus, after, fragment_id=0, version=1, payload=b"theta", ttl_s=60)
    bus.commit(after, [AppendOp(bus.keys.down(0), {"blob": ref.to_bytes()})], commit_id="0:3")
    stale = stage_global(bus, before, fragment_id=0, version=1, payload=b"STALE", ttl_s=60)
    assert stale.key != ref.key
    latest = ops.latest_global(bus, 0)
    assert latest is not None and bus.get_blob(ops.blob_ref(latest)) == b"theta"


class _LoseFirstReply:
    """Stands in for a script's client: runs the first call, then loses its reply."""

    def __init__(self, real: redis.Redis) -> None:
        self.real, self.calls = real, 0

    def evalsha(self, *args: object) -> object:
        out = self.real.evalsha(*args)  # type: ignore[arg-type]
        self.calls += 1
        if self.calls == 1:
            raise redis.TimeoutError("Timeout reading from socket")  # the server ran it
        return out

    def script_load(self, script: str) -> object:
        return self.real.script_load(script)


def test_a_commit_whose_reply_is_lost_is_retried_without_applying_twice(
    private_server: RedisProcess, bus: RedisBus
) -> None:
    k = bus.keys
    up = k.up(0)
    bus.append(up, {"m": b"a"})
    bus.append(up, {"m": b"b"})
    ids = tuple(e.id for e in bus.read_group(up, G, "sync-0", count=10))
    lease = bus.acquire_lease(k.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    lossy = _LoseFirstReply(bus._conn.control)
    bus._commit_script.registered_client = lossy  # type: ignore[assignment]
    result = bus.commit(
        lease,
        [
            SetOp(k.state(0), b"v7"),
            AppendOp(k.down(0), {"version": b"7"}),
            AppendOp(k.rounds(0), {"round": b"7"}),
            AckOp(up, G, ids),
        ],
        commit_id="0:7",
    )
    assert lossy.calls == 2  # it was sent twice ...
    assert result.replayed and result.acked == 2  # ... and reports the first run
    assert [e.fields for e in bus.read(k.down(0))] == [{"version": b"7"}]
    assert [e.id for e in bus.read(k.rounds(0))] == [result.entry_ids[1]]


def _ddq_clients(server: RedisProcess, name: str) -> list[str]:
    client = server.client()
    try:
        return [c["name"] for c in client.client_list() if c["name"] == name]
    finally:
        client.close()


def test_close_ends_a_blocked_read_and_leaves_no_connection(
    private_server: RedisProcess,
) -> None:
    rbus = RedisBus(private_server.url, "close", options=RedisOptions(max_block_ms=2000))
    up = rbus.keys.up(0)
    rbus.ensure_group(up, G)
    outcome: list[object] = []

    def reader() -> None:
        try:
            outcome.append(rbus.read_group(up, G, "c", block_ms=10_000))
        except BusError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    wait_until(lambda: blocked_clients(private_server) >= 1, 5, "a blocked reader")
    assert _ddq_clients(private_server, "ddq-reader") == ["ddq-reader"]
    closed_at = time.monotonic()
    rbus.close()
    thread.join(timeout=5)
    assert time.monotonic() - closed_at < 1.0  # not one more max_block_ms on a new socket
    assert len(outcome) == 1 and isinstance(outcome[0], BusError)
    assert "closed" in str(outcome[0])
    wait_until(lambda: not _ddq_clients(private_server, "ddq-reader"), 2, "reader disconnect")
    with pytest.raises(BusError, match="closed"):
        rbus.append(up, {"m": b"x"})


def test_an_exhausted_pool_is_not_reported_as_an_unreachable_server(
    private_server: RedisProcess,
) -> None:
    options = RedisOptions(max_connections=4, unavailable_after_s=5.0)
    rbus = RedisBus(private_server.url, "pool", options=options)
    up = rbus.keys.up(0)
    rbus.ensure_group(up, G)
    errors: list[BusError] = []

    def reader(name: str) -> None:
        try:
            rbus.read_group(up, G, name, block_ms=10_000)
        except BusError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(f"c{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: blocked_clients(private_server) >= 4, 5, "4 blocked readers")
        started = time.monotonic()
        with pytest.raises(BusError, match="pool exhausted") as raised:
            rbus.read_group(up, G, "c4", block_ms=100)
        assert not isinstance(raised.value, BusUnavailable)
        assert time.monotonic() - started < 1.0  # at once, not after unavailable_after_s
        assert rbus.append(up, {"m": b"x"})  # other clients have their own pools
    finally:
        rbus.close()
        for thread in threads:
            thread.join(timeout=5)
    assert len(errors) + sum(not t.is_alive() for t in threads) >= 4


def test_delivery_counts_survive_a_vanished_group(
    private_server: RedisProcess, bus: RedisBus
) -> None:
    up = bus.keys.up(0)
    bus.append(up, {"m": b"x"})
    [entry] = bus.read_group(up, G, "c")
    bus.delete([up])  # what a restart between the read and the count looks like
    assert bus._delivery_counts(up, G, "c", [entry.id]) == {}


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
        assert pending_ids(aof_server.url, up, G) == ids[:2]
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
    # block_ms is twice the socket timeout: one unsplit BLOCK would time the socket out and
    # reconnect (or give up), a split one stays on its connection and returns [] on time.
    options = RedisOptions(max_block_ms=100, socket_timeout_s=1.2, unavailable_after_s=1.0)
    rbus = RedisBus(private_server.url, "split", options=options)
    probe = private_server.client()
    try:
        up = rbus.keys.up(0)
        assert rbus.read_group(up, G, "c") == []  # the reader connection now exists
        connections = connections_received(probe)
        started = time.monotonic()
        assert rbus.read_group(up, G, "c", block_ms=2_500) == []
        assert time.monotonic() - started >= 2.5 - 0.02
        assert connections_received(probe) == connections  # no reconnect
        got: list[Entry] = []

        def reader() -> None:
            got.extend(rbus.read_group(up, G, "c", block_ms=5_000))

        thread = threading.Thread(target=reader)
        thread.start()
        wait_until(lambda: blocked_clients(private_server) >= 1, 5, "a blocked reader")
        entry_id = rbus.append(up, {"m": b"x"})
        thread.join(timeout=5)
        assert [e.id for e in got] == [entry_id]
    finally:
        probe.close()
        rbus.close()


def test_socket_timeout_must_exceed_the_longest_block() -> None:
    with pytest.raises(ConfigError, match="socket_timeout_s"):
        RedisOptions(max_block_ms=5000, socket_timeout_s=5.0)
    with pytest.raises(ConfigError):
        RedisOptions(unavailable_after_s=0)
