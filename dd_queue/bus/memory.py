"""``MemoryBus``: the in-process twin of ``RedisBus`` for the deterministic runner and tests.

The whole class is here, its methods in the order of the ``Bus`` protocol (streams, consumer
groups, plain values, blobs, leases and fenced commits, heartbeats), as in ``RedisBus``
(``redis_streams.py``); the locked key-space helpers they share close the class. The data
structures it keeps (``Stream``, ``Group``, ``Pending``, ``Value``) are in ``_memory_store``.

Same semantics as Redis 7 for everything the ``Bus`` protocol exposes: stream ids, consumer
groups, pending lists with delivery counts, idle times and TTLs on the injected ``Clock``,
trimming that leaves trimmed ids pending, fenced leases and all-or-nothing commits. One lock
guards all state (Redis is single-threaded too); blocking reads wait on a condition variable
in *wall* time (``block_ms``), while idle times and expiries follow the injected clock, so a
``FakeClock`` makes them deterministic. Trimming is exact even when ``approximate=True`` (Redis
may keep more; the contract only promises at least ``maxlen`` entries stay).

Key layout and value formats match ``RedisBus`` exactly (chunk keys, ``<token>:<nonce>:<owner>``
lease values, the fence key, commit markers), so code that inspects keys sees the same thing on
both buses. Fencing tokens are ``max(last + 1, clock in microseconds)`` as on Redis; staged blobs
named after a token are written only where free, as with ``SET NX``.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from dd_queue.bus import _chunks
from dd_queue.bus._memory_store import Counts, Group, Stream, Value
from dd_queue.bus._redis_conn import BusAddress
from dd_queue.bus._values import (
    check_counts,
    check_fields,
    check_key,
    check_maxlen,
    check_stream_id,
    format_stream_id,
    parse_stream_id,
    ttl_ms,
)
from dd_queue.bus.commit_ops import (
    AckOp,
    AppendOp,
    CommitOp,
    CommitResult,
    DeleteOp,
    SetOp,
    check_same_slot,
    commit_keys,
    decode_commit_marker,
    encode_commit_result,
    primitive_ops,
)
from dd_queue.bus.types import (
    COMMIT_MARKER_TTL_S,
    DEFAULT_CHUNK_BYTES,
    BlobData,
    BlobRef,
    Entry,
    HeartbeatInfo,
    Lease,
    MemoryInfo,
    PendingSummary,
    Reclaimed,
)
from dd_queue.clock import Clock, SystemClock
from dd_queue.errors import BusError, LeaseLost
from dd_queue.keys import (
    Keys,
    blob_chunk_key,
    check_name,
    commit_marker_key,
    fence_key,
    names_fencing_token,
)

T = TypeVar("T")
_LEASE_VALUE = re.compile(rb"[0-9]+:[^:]*:(.*)", re.DOTALL)
_SWEEP_EVERY_WRITES = 256


class MemoryBus:
    """A thread-safe in-memory bus.

    Args:
        run_id: Namespace for ``keys``.
        clock: Source of time for ids, idle times, TTLs and heartbeat ages (default: system).
        blob_chunk_bytes: Largest chunk a blob is split into, in bytes.
    """

    def __init__(
        self,
        run_id: str = "local",
        *,
        clock: Clock | None = None,
        blob_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if blob_chunk_bytes < 1:
            raise ValueError(f"blob_chunk_bytes must be >= 1, got {blob_chunk_bytes}")
        self._keys = Keys(run_id)
        self._clock: Clock = clock or SystemClock()
        self._chunk_bytes = blob_chunk_bytes
        # One re-entrant lock for all state (Redis is single-threaded too); its condition
        # wakes blocked readers on every append.
        self._cond = threading.Condition(threading.RLock())
        self._data: dict[str, Stream | Value | Counts] = {}
        self._beats: dict[str, tuple[bytes, float, float]] = {}  # payload, seen_s, expires_s
        self._writes = 0
        self._waiting = 0
        self._closed = False

    @property
    def keys(self) -> Keys:
        return self._keys

    @property
    def blob_chunk_bytes(self) -> int:
        return self._chunk_bytes

    @property
    def remote(self) -> bool:
        return False  # in this process: reading ahead on a worker costs more than it saves

    @property
    def address(self) -> BusAddress | None:
        return None  # no other process can reach it

    @property
    def waiting_readers(self) -> int:
        """How many blocking reads are waiting for an entry right now (for tests that must
        append only once a reader really blocks, like ``blocked_clients`` on Redis)."""
        with self._cond:
            return self._waiting

    # ── streams ───────────────────────────────────────────────────────────────────────────
    def append(
        self,
        stream: str,
        fields: Mapping[str, bytes],
        *,
        maxlen: int | None = None,
        approximate: bool = True,
    ) -> str:
        with self._cond:
            return self._append(stream, fields, maxlen)

    def stream_length(self, stream: str) -> int:
        with self._cond:
            found = self._stream(stream)
            return len(found) if found else 0

    def read(
        self,
        stream: str,
        *,
        after_id: str = "0-0",
        count: int = 100,
        block_ms: int | None = None,
    ) -> list[Entry]:
        start = parse_stream_id("0-0" if after_id == "$" else after_id)
        if after_id == "$":  # pinned now, like RedisBus: only entries appended after the call
            with self._cond:
                found = self._stream(stream)
                start = found.last_id if found else start

        def attempt() -> list[Entry]:
            current = self._stream(stream)
            if current is None:
                return []
            return [current.entry(stream, i, 0) for i in current.after(start, count)]

        return self._wait_for(block_ms, attempt)

    def _wait_for(self, block_ms: int | None, attempt: Callable[[], list[T]]) -> list[T]:
        deadline = time.monotonic() + block_ms / 1000 if block_ms else None
        with self._cond:
            while True:
                self._refuse_if_closed("read")
                found = attempt()
                if found or deadline is None:
                    return found
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    return []
                self._waiting += 1
                try:
                    self._cond.wait(remaining_s)
                finally:
                    self._waiting -= 1

    def read_latest(self, stream: str) -> Entry | None:
        with self._cond:
            found = self._stream(stream)
            return found.entry(stream, found.ids[-1], 0) if found and found.ids else None

    # ── consumer groups ───────────────────────────────────────────────────────────────────
    def ensure_group(self, stream: str, group: str) -> None:
        with self._cond:
            self._group(stream, group)

    def read_group(
        self,
        streams: str | Sequence[str],
        group: str,
        consumer: str,
        *,
        count: int = 1,
        block_ms: int | None = None,
    ) -> list[Entry]:
        names = [streams] if isinstance(streams, str) else list(streams)

        def attempt() -> list[Entry]:
            now = self._clock.now()
            out: list[Entry] = []
            for name in names:
                stream, grp = self._group(name, group)
                out += [
                    stream.entry(name, i, 1) for i in stream.deliver_new(grp, consumer, count, now)
                ]
            return out

        return self._wait_for(block_ms, attempt)

    def read_own_pending(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        count: int = 100,
        after_id: str = "0-0",
    ) -> list[Entry]:
        after = parse_stream_id(after_id)
        with self._cond:
            found, grp = self._group(stream, group)
            pairs = found.redeliver_own(grp, consumer, count, self._clock.now(), after)
            return [found.entry(stream, i, n) for i, n in pairs]

    def ack(
        self, stream: str, group: str, ids: Sequence[str], *, delete_keys: Sequence[str] = ()
    ) -> int:
        for entry_id in ids:
            check_stream_id("ack id", entry_id)
        with self._cond:
            acked = self._ack(stream, group, ids)
            self.delete(delete_keys)
            return acked

    def reclaim(
        self, stream: str, group: str, consumer: str, *, min_idle_ms: int, count: int = 100
    ) -> Reclaimed:
        with self._cond:
            found, grp = self._group(stream, group)
            claimed, deleted = found.autoclaim(grp, consumer, min_idle_ms, count, self._clock.now())
            return Reclaimed(
                entries=[found.entry(stream, i, n) for i, n in claimed],
                deleted_ids=[format_stream_id(i) for i in deleted],
            )

    def pending_summary(self, stream: str, group: str) -> PendingSummary:
        with self._cond:
            grp = self._existing_group(stream, group)
            if grp is None or not grp.pel:
                return PendingSummary(0, None, None, {})
            per_consumer: dict[str, int] = {}
            for pending in grp.pel.values():
                per_consumer[pending.consumer] = per_consumer.get(pending.consumer, 0) + 1
            ordered = sorted(grp.pel)
            return PendingSummary(
                len(ordered),
                format_stream_id(ordered[0]),
                format_stream_id(ordered[-1]),
                per_consumer,
            )

    # ── plain values ──────────────────────────────────────────────────────────────────────
    def get(self, key: str) -> bytes | None:
        with self._cond:
            found = self._value(key)
            return found.data if found else None

    def set(self, key: str, value: bytes, *, ttl_s: float | None = None) -> None:
        if ttl_s is not None:
            ttl_ms(ttl_s)  # same validation as RedisBus
        with self._cond:
            self._put(key, value, ttl_s)

    def delete(self, keys: Sequence[str]) -> int:
        with self._cond:
            now = self._clock.now()
            existing = 0
            for key in set(keys):
                item = self._data.pop(key, None)
                if item is not None and not (isinstance(item, Value) and item.expired(now)):
                    existing += 1
            return existing

    # ── counts ────────────────────────────────────────────────────────────────────────────
    def add_counts(self, key: str, increments: Mapping[str, int]) -> None:
        check_key("counts key", key)
        checked = check_counts("add_counts", increments)
        with self._cond:
            found = self._counts(key)
            if not checked:
                return
            if found is None:
                found = self._data[key] = Counts()
            for name, n in checked.items():
                found.fields[name] = found.fields.get(name, 0) + n

    def read_counts(self, key: str) -> dict[str, int]:
        check_key("counts key", key)
        with self._cond:
            found = self._counts(key)
            return dict(found.fields) if found else {}

    def memory_info(self) -> MemoryInfo | None:
        return None

    def shard_of(self, key: str) -> str | None:
        return None

    # ── blobs ─────────────────────────────────────────────────────────────────────────────
    def put_blob(self, key: str, data: BlobData, *, ttl_s: float | None) -> BlobRef:
        check_key("blob key", key)
        if ttl_s is not None:
            ttl_ms(ttl_s)
        chunks, total = _chunks.split_chunks(data, self._chunk_bytes)
        _chunks.check_blob_size(key, total, len(chunks))
        values = [bytes(chunk) for chunk in chunks]
        with self._cond:
            if names_fencing_token(key):  # as SET NX: never overwrite another payload
                for index, value in enumerate(values):
                    found = self._value(blob_chunk_key(key, index))
                    if found is not None and found.data != value:
                        raise LeaseLost(
                            f"staged blob {key!r} (chunk {index}) already holds another "
                            "payload: another holder staged under the same fencing token; stop "
                            "acting for this lease and re-acquire (a new token names a new key)"
                        )
            for index, value in enumerate(values):
                self._put(blob_chunk_key(key, index), value, ttl_s)
        return BlobRef(key, len(chunks), total)

    def put_blobs(
        self, blobs: Sequence[tuple[str, BlobData]], *, ttl_s: float | None
    ) -> list[BlobRef]:
        for key, data in blobs:  # every blob checked before anything is written
            check_key("blob key", key)
            chunks, total = _chunks.split_chunks(data, self._chunk_bytes)
            _chunks.check_blob_size(key, total, len(chunks))
        with self._cond:
            return [self.put_blob(key, data, ttl_s=ttl_s) for key, data in blobs]

    def append_with_blob(
        self,
        stream: str,
        fields: Mapping[str, bytes],
        *,
        blob_key: str,
        data: BlobData,
        ttl_s: float,
        ref_field: str = "blob",
        maxlen: int | None = None,
        approximate: bool = True,
        counts: tuple[str, Mapping[str, int]] | None = None,
    ) -> tuple[str, BlobRef]:
        with self._cond:
            self._check_append(stream, {**fields, ref_field: b""}, maxlen)
            if counts is not None:
                check_key("counts key", counts[0])
                check_counts("append counts", counts[1])
                self._counts(counts[0])  # WRONGTYPE before anything is written
            ref = self.put_blob(blob_key, data, ttl_s=ttl_s)
            if counts is not None:
                self.add_counts(*counts)
            entry_id = self._append(stream, {**fields, ref_field: ref.to_bytes()}, maxlen)
        return entry_id, ref

    def get_blob(self, ref: BlobRef) -> bytes:
        _chunks.check_blob_ref(ref, self._keys, self._chunk_bytes)
        with self._cond:
            values = [self._value(key) for key in ref.chunk_keys()]
        return _chunks.join_chunks(ref, [v.data if v else None for v in values])

    def delete_blobs(self, refs: Sequence[BlobRef]) -> int:
        for ref in refs:  # every reference first: a forged one deletes nothing
            _chunks.check_blob_ref(ref, self._keys, self._chunk_bytes)
        return self.delete([key for ref in refs for key in ref.chunk_keys()])

    # ── leases and fenced commits ─────────────────────────────────────────────────────────
    def acquire_lease(self, name: str, owner: str, *, ttl_s: float) -> Lease | None:
        check_key("lease name", name)
        ttl_ms(ttl_s)
        nonce = secrets.token_hex(8)
        with self._cond:
            current = self._value(name)
            if current is not None:
                parsed = _LEASE_VALUE.fullmatch(current.data)
                if parsed is None:
                    raise BusError(
                        f"acquire_lease: {name} holds {current.data[:80]!r}, not a lease value; "
                        "delete the key"
                    )
                if parsed.group(1) != owner.encode():
                    return None
            now = self._clock.now()
            counter = self._value(fence_key(name))
            last = int(counter.data) if counter and counter.data.isdigit() else 0
            token = max(last + 1, int(now * 1_000_000))
            self._put(fence_key(name), str(token).encode(), None)
            lease = Lease(name, owner, token, now + ttl_s, nonce)
            self._put(name, lease.value.encode(), ttl_s)
            return lease

    def renew_lease(self, lease: Lease, *, ttl_s: float) -> Lease:
        ttl_ms(ttl_s)
        with self._cond:
            self._check_lease(lease)
            self._put(lease.name, lease.value.encode(), ttl_s)
            return Lease(
                lease.name, lease.owner, lease.token, self._clock.now() + ttl_s, lease.nonce
            )

    def release_lease(self, lease: Lease) -> bool:
        with self._cond:
            current = self._value(lease.name)
            if current is None or current.data != lease.value.encode():
                return False
            del self._data[lease.name]
            return True

    def _check_lease(self, lease: Lease) -> None:
        current = self._value(lease.name)
        if current is None or current.data != lease.value.encode():
            holder = current.data.decode(errors="replace") if current else "nobody (expired)"
            raise LeaseLost(
                f"lease {lease.name} is held by {holder}, not {lease.value}; "
                "stop acting for this lease, re-acquire"
            )

    def commit(self, lease: Lease, ops: Sequence[CommitOp], *, commit_id: str) -> CommitResult:
        marker = commit_marker_key(lease.name, commit_id)
        steps = primitive_ops(ops)
        check_same_slot(lease.name, [key for op in steps for key in commit_keys(op)])
        with self._cond:
            found = self._value(marker)
            replay = decode_commit_marker(found.data) if found else None
            if replay is not None and replay[1] == lease.value:
                return replay[0]  # this commit already ran; its reply was lost
            # Everything that can fail is checked before the first write (as the Lua script).
            self._check_lease(lease)
            for op in steps:
                if isinstance(op, AppendOp | AckOp):
                    self._stream(op.stream)  # raises WRONGTYPE for a string key
            entry_ids: list[str] = []
            acked = 0
            for op in steps:
                if isinstance(op, SetOp):
                    self._put(op.key, op.value, op.ttl_s)
                elif isinstance(op, AppendOp):
                    entry_ids.append(self._append(op.stream, op.fields, op.maxlen))
                elif isinstance(op, AckOp):
                    acked += self._ack(op.stream, op.group, op.ids)
                elif isinstance(op, DeleteOp):
                    self.delete(op.keys)
            result = CommitResult(tuple(entry_ids), acked)
            self._put(marker, encode_commit_result(result, lease.value), COMMIT_MARKER_TTL_S)
            return result

    # ── heartbeats ────────────────────────────────────────────────────────────────────────
    def server_time_s(self) -> float:
        return self._clock.now()

    def heartbeat(self, member: str, payload: bytes, *, ttl_s: float) -> None:
        check_name("heartbeat member", member)
        ttl_ms(ttl_s)
        with self._cond:
            now = self._clock.now()
            self._beats[member] = (bytes(payload), now, now + ttl_s)

    def heartbeats(self) -> dict[str, HeartbeatInfo]:
        with self._cond:
            now = self._clock.now()
            for member in [m for m, (_, _, expires) in self._beats.items() if now >= expires]:
                del self._beats[member]
            return {
                member: HeartbeatInfo(payload, max(0.0, now - seen_s))
                for member, (payload, seen_s, _) in self._beats.items()
            }

    def remove_heartbeat(self, member: str) -> bool:
        with self._cond:
            return self._beats.pop(member, None) is not None

    # ── closing ───────────────────────────────────────────────────────────────────────────
    def close(self) -> None:
        """Wake every blocked reader; they (and later reads) raise ``BusError("bus closed")``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ── the key space (callers hold ``_cond``) ────────────────────────────────────────────
    def _refuse_if_closed(self, what: str) -> None:
        if self._closed:
            raise BusError(f"bus closed: {what} after close() (build a new bus)")

    def _value(self, key: str) -> Value | None:
        """Live string value at ``key`` (expired ones are dropped); a stream is WRONGTYPE."""
        item = self._data.get(key)
        if item is None:
            return None
        if not isinstance(item, Value):
            raise BusError(f"WRONGTYPE: {key!r} holds a {_kind(item)}, not a string value")
        if item.expired(self._clock.now()):
            del self._data[key]
            return None
        return item

    def _stream(self, key: str) -> Stream | None:
        """Stream at ``key`` or None; a live string value is WRONGTYPE."""
        item = self._data.get(key)
        if isinstance(item, Counts):
            raise BusError(f"WRONGTYPE: {key!r} holds a {_kind(item)}, not a stream")
        if isinstance(item, Value):
            if not item.expired(self._clock.now()):
                raise BusError(f"WRONGTYPE: {key!r} holds a string value, not a stream")
            del self._data[key]
            return None
        return item

    def _counts(self, key: str) -> Counts | None:
        """Counters at ``key`` or None; another live type is WRONGTYPE."""
        item = self._data.get(key)
        if item is None or isinstance(item, Counts):
            return item
        if isinstance(item, Value) and item.expired(self._clock.now()):
            del self._data[key]
            return None
        raise BusError(f"WRONGTYPE: {key!r} holds a {_kind(item)}, not a hash of counters")

    def _stream_or_new(self, key: str) -> Stream:
        found = self._stream(key)
        if found is None:
            found = self._data[key] = Stream()
        return found

    def _group(self, stream: str, group: str) -> tuple[Stream, Group]:
        # A missing group (or stream) is created at id 0, as RedisBus does after NOGROUP.
        found = self._stream_or_new(stream)
        return found, found.groups.setdefault(group, Group())

    def _existing_group(self, stream: str, group: str) -> Group | None:
        """The group if it exists; creates nothing (read-only inspection)."""
        found = self._stream(stream)
        return found.groups.get(group) if found else None

    def _put(self, key: str, data: bytes, ttl_s: float | None) -> None:
        self._writes += 1
        now = self._clock.now()
        if self._writes % _SWEEP_EVERY_WRITES == 0:  # orphaned blobs must not pile up
            dead = [k for k, v in self._data.items() if isinstance(v, Value) and v.expired(now)]
            for key_to_drop in dead:
                del self._data[key_to_drop]
        self._data[key] = Value(bytes(data), None if ttl_s is None else now + ttl_s)

    def _check_append(self, stream: str, fields: Mapping[str, bytes], maxlen: int | None) -> None:
        """Everything that could make an append fail, checked before any write."""
        check_key("stream", stream)
        check_fields("append fields", fields)
        check_maxlen("append maxlen", maxlen)
        self._stream(stream)  # WRONGTYPE for a string key

    def _append(self, stream: str, fields: Mapping[str, bytes], maxlen: int | None) -> str:
        self._check_append(stream, fields, maxlen)
        target = self._stream_or_new(stream)
        now_ms = int(self._clock.now() * 1000)
        new_id = target.add(now_ms, {name: bytes(value) for name, value in fields.items()})
        if maxlen is not None:
            target.trim(maxlen)
        self._cond.notify_all()
        return format_stream_id(new_id)

    def _ack(self, stream: str, group: str, ids: Sequence[str]) -> int:
        found = self._stream(stream)
        grp = found.groups.get(group) if found else None
        if grp is None:
            return 0
        return sum(grp.pel.pop(parse_stream_id(i), None) is not None for i in set(ids))


__all__ = ["MemoryBus"]


def _kind(item: Stream | Value | Counts) -> str:
    return {Stream: "stream", Value: "string value", Counts: "hash of counters"}[type(item)]
