"""Edges of the buses' values, blobs, leases, fenced commits and heartbeats.

What every bus must do alike runs on all of them (fixture ``bus_case``): argument errors that
name the argument, refused stagings that write nothing, commit markers under the lease with
their TTL, lost-lease messages that name the holder. What only one backend can show (an exact
FakeClock boundary on MemoryBus; Redis ``TIME``, logs, closed-bus errors and stored heartbeat
scores on RedisBus) is tested on that backend alone.
"""

from __future__ import annotations

import logging
import math
import re

import fakeredis
import pytest
import redis
from redis.cluster import RedisCluster

from dd_queue.bus import (
    MAX_BLOB_BYTES,
    BlobRef,
    Bus,
    InvalidArgument,
    Lease,
    MemoryBus,
    RedisBus,
    SetOp,
)
from dd_queue.bus.types import COMMIT_MARKER_TTL_S, MAX_BLOB_CHUNKS
from dd_queue.clock import FakeClock
from dd_queue.errors import BlobMissing, BusError, ConfigError, LeaseLost
from dd_queue.keys import blob_chunk_key, commit_marker_key, fence_key
from tests.integration.conftest import CHUNK_BYTES, BusCase
from tests.rediscluster import LocalCluster
from tests.redisproc import RedisProcess

REDIS_KINDS = ("fakeredis", "redis", "valkey-wheel", "cluster")


def _raw(case: BusCase) -> redis.Redis:
    """A plain client of the server behind a Redis bus case (to read what the bus stored); on a
    cluster, a cluster client (the same commands, routed by slot)."""
    if isinstance(case.server, RedisProcess):
        return case.server.client()
    if isinstance(case.server, LocalCluster):
        seed = case.server.nodes[0]
        return RedisCluster(host=seed.host, port=seed.port)  # type: ignore[return-value]
    assert isinstance(case.server, fakeredis.FakeServer)
    return fakeredis.FakeRedis(server=case.server)


REDIS_ONLY = pytest.mark.parametrize("bus_case", REDIS_KINDS, indirect=True)
"""The contract's Redis backends only (no skip on MemoryBus: the test is not made there)."""


def _need_redis(case: BusCase) -> RedisBus:
    assert isinstance(case.bus, RedisBus), case.kind
    return case.bus


def _missing(bus: Bus, ref: BlobRef) -> bool:
    try:
        bus.get_blob(ref)
    except BlobMissing:
        return True
    return False


def _staged_refused(key: str, chunk: int) -> str:
    return (
        f"staged blob {key!r} (chunk {chunk}) already holds another payload: another holder "
        "staged under the same fencing token; stop acting for this lease and re-acquire "
        "(a new token names a new key)"
    )


# ── argument errors name the argument ───────────────────────────────────────────────────────


def test_blob_argument_errors_name_the_argument(bus_case: BusCase) -> None:
    bus = bus_case.bus
    empty_key = "^blob key must be a non-empty key string, got ''$"
    with pytest.raises(InvalidArgument, match=empty_key):
        bus.put_blob("", b"x", ttl_s=60)
    with pytest.raises(InvalidArgument, match=empty_key):
        bus.put_blobs([("", b"x")], ttl_s=60)
    key = bus.keys.up_blob(0, 1, "L0")
    too_big = b"\0" * (MAX_BLOB_CHUNKS * CHUNK_BYTES + 1)
    over = (
        f"blob {key!r} of {len(too_big)} bytes in {MAX_BLOB_CHUNKS + 1} chunks is over the "
        f"limit of {MAX_BLOB_BYTES} bytes / {MAX_BLOB_CHUNKS} chunks; raise blob_chunk_bytes"
    )
    for put in (
        lambda: bus.put_blob(key, too_big, ttl_s=60),
        lambda: bus.put_blobs([(key, too_big)], ttl_s=60),
        lambda: bus.append_with_blob(
            bus.keys.up(0), {"m": b"1"}, blob_key=key, data=too_big, ttl_s=60
        ),
    ):
        with pytest.raises(InvalidArgument) as caught:
            put()
        assert str(caught.value) == over
    assert bus.get(key) is None


def test_append_with_blob_argument_errors_write_nothing(bus_case: BusCase) -> None:
    bus = bus_case.bus
    stream, blob_key = bus.keys.up(0), bus.keys.up_blob(0, 1, "L0")
    cases: list[tuple[dict[str, object], str]] = [
        ({"stream": ""}, "^stream must be a non-empty key string, got ''$"),
        ({"blob_key": ""}, "^blob key must be a non-empty key string, got ''$"),
        ({"fields": {"": b"x"}}, "^append fields: field names must be non-empty strings"),
        ({"maxlen": 0}, "^append maxlen must be None or an integer >= 1, got 0$"),
    ]
    for override, message in cases:
        kwargs: dict[str, object] = {
            "stream": stream,
            "fields": {"m": b"1"},
            "blob_key": blob_key,
            "data": b"payload",
            "ttl_s": 60,
            **override,
        }
        with pytest.raises(InvalidArgument, match=message):
            bus.append_with_blob(**kwargs)  # type: ignore[arg-type]
        assert bus.get(blob_key) is None, f"{override}: the blob was written"
        assert bus.stream_length(stream) == 0


def test_lease_name_errors_name_the_argument(bus_case: BusCase) -> None:
    with pytest.raises(InvalidArgument, match=r"^lease name must be a non-empty key string"):
        bus_case.bus.acquire_lease("", "sync-0", ttl_s=30)


def test_heartbeat_member_errors_name_the_argument(bus_case: BusCase) -> None:
    with pytest.raises(ConfigError, match=r"^heartbeat member 'bad:name' must be 1-64"):
        bus_case.bus.heartbeat("bad:name", b"", ttl_s=1)


# ── blobs ───────────────────────────────────────────────────────────────────────────────────


def test_put_blobs_and_append_with_blob_keep_the_ttl(bus_case: BusCase) -> None:
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    refs = bus.put_blobs(
        [(bus.keys.up_blob(0, 1, "L0"), b"a" * 2000), (bus.keys.up_blob(0, 1, "L1"), b"b")],
        ttl_s=1.0,
    )
    _, plain = bus.append_with_blob(
        bus.keys.up(0), {"m": b"1"}, blob_key=bus.keys.up_blob(0, 2, "L0"), data=b"c", ttl_s=1.0
    )
    _, fenced = bus.append_with_blob(
        bus.keys.up(0),
        {"m": b"2"},
        blob_key=bus.keys.global_blob(0, 3, lease.token),
        data=b"d" * 3000,
        ttl_s=1.0,
    )
    every = [*refs, plain, fenced]
    assert not any(_missing(bus, ref) for ref in every)
    bus_case.eventually(
        lambda: all(_missing(bus, ref) for ref in every), after_s=1.05, what="blob expiry"
    )


def test_append_with_blob_refers_to_its_blob_under_either_kind_of_key(bus_case: BusCase) -> None:
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    stream = bus.keys.down(0)
    plain_key = bus.keys.up_blob(0, 1, "L0")
    fenced_key = bus.keys.global_blob(0, 1, lease.token)
    for i, key in enumerate([plain_key, fenced_key, plain_key, fenced_key]):
        data = bytes([i]) * 2500  # 3 chunks
        if i >= 2:
            bus.delete_blobs([BlobRef(key, 3, 2500)])
        entry_id, ref = bus.append_with_blob(
            stream,
            {"i": str(i).encode()},
            blob_key=key,
            data=data,
            ttl_s=60,
            maxlen=2,
            approximate=False,
        )
        assert ref == BlobRef(key, 3, 2500)
        latest = bus.read_latest(stream)
        assert latest is not None and latest.id == entry_id
        assert latest.fields == {"i": str(i).encode(), "blob": ref.to_bytes()}
        assert bus.get_blob(BlobRef.from_bytes(latest.fields["blob"])) == data
        assert bus.stream_length(stream) == min(i + 1, 2)
    other = bus.acquire_lease(bus.keys.lease(1), "sync-1", ttl_s=30)
    assert other is not None
    _, named = bus.append_with_blob(
        stream,
        {"i": b"x"},
        blob_key=bus.keys.global_blob(1, 1, other.token),
        data=b"n",
        ttl_s=60,
        ref_field="theta",
    )
    latest = bus.read_latest(stream)
    assert latest is not None and latest.fields == {"i": b"x", "theta": named.to_bytes()}


def test_append_with_blob_trims_approximately_by_default(bus_case: BusCase) -> None:
    # Approximate trimming removes whole stream nodes only: five small entries share one node,
    # so a real server keeps them all; MemoryBus and fakeredis trim exactly (at least maxlen).
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    stream = bus.keys.down(0)
    for i in range(5):
        key = bus.keys.global_blob(0, i, lease.token) if i % 2 else bus.keys.up_blob(0, i, "L")
        bus.append_with_blob(stream, {"i": b"%d" % i}, blob_key=key, data=b"x", ttl_s=60, maxlen=2)
    length = bus.stream_length(stream)
    if bus_case.kind in ("redis", "valkey-wheel"):
        assert length == 5
    else:
        assert 2 <= length <= 5


def test_a_refused_staging_writes_no_chunk(bus_case: BusCase) -> None:
    # Chunk 0 claims a token-named blob: when another payload holds it, none of the other
    # chunks is written either (they would be orphans under the current holder's name).
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    key = bus.keys.global_blob(0, 1, lease.token)
    mine = bus.put_blob(key, b"a" * 10, ttl_s=60)
    stale = b"b" * (2 * CHUNK_BYTES + 1)  # 3 chunks
    for put in (
        lambda: bus.put_blob(key, stale, ttl_s=60),
        lambda: bus.put_blobs([(key, stale)], ttl_s=60),
        lambda: bus.append_with_blob(
            bus.keys.down(0), {"m": b"1"}, blob_key=key, data=stale, ttl_s=60
        ),
    ):
        with pytest.raises(LeaseLost) as caught:
            put()
        assert str(caught.value) == _staged_refused(key, 0)
        assert bus.get(blob_chunk_key(key, 1)) is None
        assert bus.get(blob_chunk_key(key, 2)) is None
    assert bus.get_blob(mine) == b"a" * 10
    assert bus.stream_length(bus.keys.down(0)) == 0
    # Same first chunk, another second: refused at chunk 1, chunk 1 left as it was.
    two = bus.keys.momentum_blob(0, 1, lease.token)
    first = bus.put_blob(two, b"m" * CHUNK_BYTES + b"1", ttl_s=60)
    with pytest.raises(LeaseLost) as caught:
        bus.put_blob(two, b"m" * CHUNK_BYTES + b"2", ttl_s=60)
    assert str(caught.value) == _staged_refused(two, 1)
    assert bus.get_blob(first) == b"m" * CHUNK_BYTES + b"1"


# ── leases ──────────────────────────────────────────────────────────────────────────────────


def test_lease_value_format_and_token_from_the_bus_clock(bus_case: BusCase) -> None:
    bus = bus_case.bus
    name = bus.keys.lease(0)
    before_us = round(bus.server_time_s() * 1_000_000)
    lease = bus.acquire_lease(name, "sync-0", ttl_s=30)
    after_us = round(bus.server_time_s() * 1_000_000)
    assert lease is not None
    assert before_us <= lease.token <= after_us  # exactly the clock on a FakeClock
    assert re.fullmatch("[0-9a-f]{16}", lease.nonce)
    assert bus.get(name) == f"{lease.token}:{lease.nonce}:sync-0".encode()
    assert bus.get(fence_key(name)) == str(lease.token).encode()


def test_a_non_lease_value_is_quoted_to_80_bytes(bus_case: BusCase) -> None:
    bus = bus_case.bus
    name = bus.keys.lease(0)
    bus.set(name, b"z" * 200)
    with pytest.raises(BusError) as caught:
        bus.acquire_lease(name, "sync-0", ttl_s=30)
    message = str(caught.value)
    assert message.startswith(f"acquire_lease: {name} holds ")
    assert message.endswith(", not a lease value; delete the key")
    assert message.count("z") == 80


def _lost(name: str, holder: str, lease: Lease) -> str:
    return (
        f"lease {name} is held by {holder}, not {lease.value}; "
        "stop acting for this lease, re-acquire"
    )


def _renew_lost(case: BusCase, lease: Lease, holder: str) -> str:
    if case.kind == "memory":
        return _lost(lease.name, holder, lease)
    return (
        f"lease {lease.name!r} token {lease.token} of {lease.owner!r} expired or was taken "
        "over; stop acting for it and re-acquire"
    )


def test_lost_lease_errors_say_who_holds_it(bus_case: BusCase) -> None:
    bus = bus_case.bus
    name = bus.keys.lease(0)
    old = bus.acquire_lease(name, "sync-0", ttl_s=30)
    assert old is not None
    assert bus.release_lease(old)
    with pytest.raises(LeaseLost) as caught:
        bus.commit(old, [SetOp(bus.keys.state(0), b"x")], commit_id="0:1")
    assert str(caught.value) == _lost(name, "nobody (expired)", old)
    with pytest.raises(LeaseLost) as caught:
        bus.renew_lease(old, ttl_s=30)
    assert str(caught.value) == _renew_lost(bus_case, old, "nobody (expired)")
    new = bus.acquire_lease(name, "sync-1", ttl_s=30)
    assert new is not None
    with pytest.raises(LeaseLost) as caught:
        bus.commit(old, [SetOp(bus.keys.state(0), b"x")], commit_id="0:2")
    assert str(caught.value) == _lost(name, new.value, old)
    with pytest.raises(LeaseLost) as caught:
        bus.renew_lease(old, ttl_s=30)
    assert str(caught.value) == _renew_lost(bus_case, old, new.value)
    assert bus.get(bus.keys.state(0)) is None


def test_memory_lost_lease_error_survives_a_non_utf8_holder() -> None:
    bus = MemoryBus("kvh", clock=FakeClock(1000.0))
    name = bus.keys.lease(0)
    lease = bus.acquire_lease(name, "sync-0", ttl_s=30)
    assert lease is not None
    bus.set(name, b"9:n:\xff")
    with pytest.raises(LeaseLost) as caught:
        bus.renew_lease(lease, ttl_s=30)
    assert str(caught.value) == _lost(name, "9:n:\ufffd", lease)


def test_memory_tokens_count_up_from_one_at_clock_zero() -> None:
    # Tokens are max(last + 1, clock in µs); with no counter yet, last is 0.
    clock = FakeClock(0.0)
    bus = MemoryBus("kvh", clock=clock)
    name = bus.keys.lease(0)
    first = bus.acquire_lease(name, "sync-0", ttl_s=30)
    second = bus.acquire_lease(name, "sync-0", ttl_s=30)
    assert first is not None and second is not None
    assert (first.token, second.token) == (1, 2)
    bus.set(fence_key(bus.keys.lease(1)), b"garbage")  # not a number: counts as 0
    third = bus.acquire_lease(bus.keys.lease(1), "sync-0", ttl_s=30)
    assert third is not None and third.token == 1


# ── fenced commits ──────────────────────────────────────────────────────────────────────────


def test_commit_marker_lives_under_the_lease_for_its_ttl(bus_case: BusCase) -> None:
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=COMMIT_MARKER_TTL_S * 3)
    assert lease is not None
    bus.commit(lease, [SetOp(bus.keys.state(0), b"v1")], commit_id="0:1")
    marker = commit_marker_key(lease.name, "0:1")
    assert bus.get(marker) is not None
    if bus_case.clock is not None:
        bus_case.clock.advance(COMMIT_MARKER_TTL_S - 1)
        assert bus.get(marker) is not None
        bus_case.clock.advance(2)
        assert bus.get(marker) is None
    else:
        raw = _raw(bus_case)
        try:
            pttl = raw.pttl(marker)
        finally:
            raw.close()
        assert COMMIT_MARKER_TTL_S * 1000 - 60_000 < pttl <= COMMIT_MARKER_TTL_S * 1000


# ── heartbeats ──────────────────────────────────────────────────────────────────────────────


def test_memory_heartbeat_is_gone_exactly_at_its_expiry() -> None:
    # As on Redis (ZRANGEBYSCORE -inf now drops members whose expiry is <= now).
    clock = FakeClock(1000.0)
    bus = MemoryBus("kvh", clock=clock)
    bus.heartbeat("L0", b"a", ttl_s=5.0)
    clock.advance(4.5)
    assert set(bus.heartbeats()) == {"L0"}
    clock.advance(0.5)
    assert bus.heartbeats() == {}


@REDIS_ONLY
def test_redis_heartbeat_ages_and_lost_payloads(bus_case: BusCase) -> None:
    bus = _need_redis(bus_case)
    bus.heartbeat("L0", b"step=1", ttl_s=600)
    bus.heartbeat("L1", b"step=2", ttl_s=600)
    raw = _raw(bus_case)
    try:
        now_ms = bus.server_time_s() * 1000
        raw.zadd(bus.keys.heartbeat_seen(), {"L0": now_ms - 1_000_000})  # seen 1000 s ago
        raw.hdel(bus.keys.heartbeat_data(), "L1")  # its payload lost (evicted, say)
    finally:
        raw.close()
    beats = bus.heartbeats()
    assert beats["L0"].payload == b"step=1"
    assert beats["L0"].age_s == pytest.approx(1000.0, abs=0.3)
    assert beats["L1"].payload == b""


# ── Redis: server time, logs, closed bus ────────────────────────────────────────────────────


@REDIS_ONLY
def test_redis_server_time_is_redis_time(bus_case: BusCase) -> None:
    bus = _need_redis(bus_case)
    raw = _raw(bus_case)
    try:
        for _ in range(50):
            s, us = raw.time()
            before = s + us / 1e6
            now = bus.server_time_s()
            s, us = raw.time()
            assert before <= now <= s + us / 1e6
            # TIME's whole microseconds, to the float's precision (~0.24 µs at epoch times)
            fraction_us = (now - math.floor(now)) * 1e6
            assert abs(fraction_us - round(fraction_us)) < 0.2
    finally:
        raw.close()
    # TIME's reply read exactly: seconds + microseconds / 10^6
    bus._conn.heartbeat.time = lambda **_: [b"1700000000", b"999999"]  # type: ignore[method-assign]
    assert bus.server_time_s() == 1700000000 + 999999 / 1e6


@REDIS_ONLY
def test_redis_logs_acquisitions_and_replays(
    bus_case: BusCase, caplog: pytest.LogCaptureFixture
) -> None:
    bus = _need_redis(bus_case)
    caplog.set_level(logging.INFO, logger="dd_queue.bus")
    name = bus.keys.lease(0)
    lease = bus.acquire_lease(name, "sync-0", ttl_s=30)
    assert lease is not None
    ops = [SetOp(bus.keys.state(0), b"v")]
    bus.commit(lease, ops, commit_id="0:1")
    assert bus.commit(lease, ops, commit_id="0:1").replayed
    messages = [r.getMessage() for r in caplog.records if r.name == "dd_queue.bus"]
    assert f"bus.lease.acquired {name} token {lease.token} by sync-0" in messages
    assert f"bus.commit.replayed {name} 0:1" in messages


@REDIS_ONLY
def test_redis_calls_after_close_name_the_operation(bus_case: BusCase) -> None:
    bus = _need_redis(bus_case)
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    ref = bus.put_blob(bus.keys.up_blob(0, 1, "L0"), b"x", ttl_s=60)
    bus.close()
    calls = {
        "get": lambda: bus.get("k"),
        "set": lambda: bus.set("k", b"v"),
        "put_blob": lambda: bus.put_blob(bus.keys.up_blob(0, 2, "L0"), b"x", ttl_s=60),
        "get_blob": lambda: bus.get_blob(ref),
        "acquire_lease": lambda: bus.acquire_lease(bus.keys.lease(1), "sync-0", ttl_s=30),
        "renew_lease": lambda: bus.renew_lease(lease, ttl_s=30),
        "release_lease": lambda: bus.release_lease(lease),
        "commit": lambda: bus.commit(lease, [], commit_id="0:1"),
        "time": bus.server_time_s,
        "heartbeat": lambda: bus.heartbeat("L0", b"", ttl_s=30),
        "heartbeats": bus.heartbeats,
        "delete": lambda: bus.delete(["k"]),
        "remove_heartbeat": lambda: bus.remove_heartbeat("L0"),
    }
    assert bus.delete([]) == 0  # deleting nothing needs no server
    for what, call in calls.items():
        with pytest.raises(BusError) as caught:
            call()
        assert str(caught.value) == f"bus closed: {what} after close() (build a new bus)"


@REDIS_ONLY
def test_redis_refusing_an_append_names_it_for_either_kind_of_blob(bus_case: BusCase) -> None:
    """The stream key holds a string: XADD is refused (WRONGTYPE) on the contribution path
    (one pipeline) and on the fenced path (blob first, then XADD)."""
    bus = _need_redis(bus_case)
    stream = bus.keys.up(0)
    bus.set(stream, b"not a stream")
    for blob_key in (bus.keys.up_blob(0, 1, "L0"), bus.keys.global_blob(0, 1, 7)):
        with pytest.raises(BusError, match=r"^Redis refused append_with_blob: .*WRONGTYPE"):
            bus.append_with_blob(stream, {"m": b"1"}, blob_key=blob_key, data=b"x", ttl_s=60)


def test_counts_add_up_refuse_bad_increments_and_other_types(bus_case: BusCase) -> None:
    bus = bus_case.bus
    key = bus.keys.counts("faults")
    assert bus.read_counts(key) == {}
    bus.add_counts(key, {"kill": 1, "stall": 0})
    bus.add_counts(key, {"kill": 2, "slow": 5})
    assert bus.read_counts(key) == {"kill": 3, "slow": 5}
    for bad in ({"kill": -1}, {"kill": 1.5}, {"kill": True}, {"": 1}):
        with pytest.raises(InvalidArgument, match="add_counts"):
            bus.add_counts(key, bad)  # type: ignore[arg-type]
    assert bus.read_counts(key) == {"kill": 3, "slow": 5}  # nothing half-applied
    bus.set(bus.keys.state(0), b"x")
    with pytest.raises(BusError, match="WRONGTYPE"):
        bus.add_counts(bus.keys.state(0), {"kill": 1})
    with pytest.raises(BusError, match="WRONGTYPE"):
        bus.read_counts(bus.keys.state(0))
    assert bus.delete([key]) == 1 and bus.read_counts(key) == {}


def test_memory_info_reads_the_server(bus_case: BusCase) -> None:
    info = bus_case.bus.memory_info()
    if bus_case.kind in ("memory", "fakeredis"):
        assert info is None  # no server / no INFO
    else:
        assert info is not None and info.used_bytes > 0 and info.max_bytes >= 0


def test_append_with_blob_adds_its_counts_in_the_same_write(bus_case: BusCase) -> None:
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    counts = bus.keys.counts("tokens")
    for i, key in enumerate(
        [bus.keys.up_blob(0, 1, "L0"), bus.keys.global_blob(0, 1, lease.token)]
    ):
        bus.append_with_blob(
            bus.keys.up(0),
            {"i": b"%d" % i},
            blob_key=key,
            data=b"x" * 2500,
            ttl_s=60,
            counts=(counts, {"L0|published": 7, "L0|computed": 0, "L0|dropped": i}),
        )
    assert bus.read_counts(counts) == {"L0|published": 14, "L0|dropped": 1}
    assert bus.stream_length(bus.keys.up(0)) == 2


def test_append_with_blob_count_errors_write_nothing(bus_case: BusCase) -> None:
    bus = bus_case.bus
    stream, blob_key, counts = bus.keys.up(0), bus.keys.up_blob(0, 1, "L0"), bus.keys.counts("t")
    for bad, message in [
        (("", {"a": 1}), "^counts key must be a non-empty key string, got ''$"),
        ((counts, {"a": -1}), "^append counts: 'a' must rise by an integer >= 0, got -1$"),
        ((counts, {"": 1}), "^append counts: field names must be non-empty strings"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            bus.append_with_blob(
                stream, {"m": b"1"}, blob_key=blob_key, data=b"x", ttl_s=60, counts=bad
            )
        assert bus.get(blob_key) is None and bus.stream_length(stream) == 0
        assert bus.read_counts(counts) == {}
