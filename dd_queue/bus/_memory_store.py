"""State behind :class:`~dd_queue.bus.memory.MemoryBus`: a stream with consumer groups and
pending lists that follows Redis 7 semantics, an expiring string value, and ``MemoryCore``, the
locked key space that the MemoryBus mixins share.

``Stream`` and ``Value`` are not thread-safe on their own; callers hold ``MemoryCore._cond``.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dd_queue.bus._redis_conn import BusAddress
from dd_queue.bus._values import check_fields, check_key, check_maxlen
from dd_queue.bus.types import DEFAULT_CHUNK_BYTES, Entry, format_stream_id, parse_stream_id
from dd_queue.clock import Clock, SystemClock
from dd_queue.errors import BusError
from dd_queue.keys import Keys

StreamId = tuple[int, int]
_SWEEP_EVERY_WRITES = 256


@dataclass
class Value:
    """A string key's bytes and its expiry on the bus clock (None: never)."""

    data: bytes
    expires_at_s: float | None = None

    def expired(self, now_s: float) -> bool:
        return self.expires_at_s is not None and now_s >= self.expires_at_s


@dataclass
class Pending:
    """One pending-list entry: owner, time of last delivery (bus clock), deliveries."""

    consumer: str
    delivered_at_s: float
    count: int

    def idle_ms(self, now_s: float) -> int:
        return max(0, int((now_s - self.delivered_at_s) * 1000))


@dataclass
class Group:
    """A consumer group: last delivered id and the pending list (id order = insertion order)."""

    last_id: StreamId = (0, 0)
    pel: dict[StreamId, Pending] = field(default_factory=dict)


class Stream:
    """An append-only log of field maps with Redis-style ids ``(ms, seq)`` and groups."""

    def __init__(self) -> None:
        self.ids: list[StreamId] = []
        self.data: dict[StreamId, dict[str, bytes]] = {}
        self.last_id: StreamId = (0, 0)
        self.groups: dict[str, Group] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, now_ms: int, fields: dict[str, bytes]) -> StreamId:
        """Append with a new id above every earlier one (ms from the clock, seq breaks ties)."""
        last_ms, last_seq = self.last_id
        new_id = (now_ms, 0) if now_ms > last_ms else (last_ms, last_seq + 1)
        if new_id == (0, 0):  # Redis never issues 0-0
            new_id = (0, 1)
        self.ids.append(new_id)
        self.data[new_id] = fields
        self.last_id = new_id
        return new_id

    def after(self, after: StreamId, count: int) -> list[StreamId]:
        """Ids greater than ``after``, oldest first, at most ``count``."""
        start = bisect_right(self.ids, after)
        return self.ids[start : start + count]

    def trim(self, maxlen: int) -> int:
        """Drop the oldest entries beyond ``maxlen`` (pending lists keep their ids, as Redis)."""
        excess = max(0, len(self.ids) - maxlen)
        for old in self.ids[:excess]:
            del self.data[old]
        del self.ids[:excess]
        return excess

    def entry(self, stream: str, entry_id: StreamId, delivery_count: int) -> Entry:
        """Entry view of ``entry_id``; empty fields if it was trimmed."""
        fields = self.data.get(entry_id, {})
        return Entry(stream, format_stream_id(entry_id), dict(fields), delivery_count)

    def deliver_new(self, group: Group, consumer: str, count: int, now_s: float) -> list[StreamId]:
        """``XREADGROUP … >``: hand the next entries to ``consumer`` and make them pending."""
        new_ids = self.after(group.last_id, count)
        for new_id in new_ids:
            group.pel[new_id] = Pending(consumer, now_s, 1)
        if new_ids:
            group.last_id = new_ids[-1]
        return new_ids

    def redeliver_own(
        self, group: Group, consumer: str, count: int, now_s: float, after: StreamId = (0, 0)
    ) -> list[tuple[StreamId, int]]:
        """``XREADGROUP … <after>``: the consumer's pending ids above ``after``; live ones count
        one more delivery."""
        out: list[tuple[StreamId, int]] = []
        for pending_id in sorted(group.pel):
            pending = group.pel[pending_id]
            if pending.consumer != consumer or pending_id <= after:
                continue
            if pending_id in self.data:  # Redis does not count re-reads of trimmed entries
                pending.count += 1
                pending.delivered_at_s = now_s
            out.append((pending_id, pending.count))
            if len(out) >= count:
                break
        return out

    def autoclaim(
        self, group: Group, consumer: str, min_idle_ms: int, count: int, now_s: float
    ) -> tuple[list[tuple[StreamId, int]], list[StreamId]]:
        """``XAUTOCLAIM`` over the whole pending list: ``(claimed ids + counts, deleted ids)``."""
        claimed: list[tuple[StreamId, int]] = []
        deleted: list[StreamId] = []
        for pending_id in sorted(group.pel):
            if len(claimed) >= count:
                break
            pending = group.pel[pending_id]
            if pending_id not in self.data:
                del group.pel[pending_id]
                deleted.append(pending_id)
            elif pending.idle_ms(now_s) >= min_idle_ms:
                pending.consumer, pending.delivered_at_s = consumer, now_s
                pending.count += 1
                claimed.append((pending_id, pending.count))
        return claimed, deleted


class MemoryCore:
    """State and locked helpers shared by the MemoryBus mixins (callers hold ``_cond``)."""

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
        self._data: dict[str, Stream | Value] = {}
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

    def _refuse_if_closed(self, what: str) -> None:
        if self._closed:
            raise BusError(f"bus closed: {what} after close() (build a new bus)")

    def _value(self, key: str) -> Value | None:
        """Live string value at ``key`` (expired ones are dropped); a stream is WRONGTYPE."""
        item = self._data.get(key)
        if item is None:
            return None
        if isinstance(item, Stream):
            raise BusError(f"WRONGTYPE: {key!r} holds a stream, not a string value")
        if item.expired(self._clock.now()):
            del self._data[key]
            return None
        return item

    def _stream(self, key: str) -> Stream | None:
        """Stream at ``key`` or None; a live string value is WRONGTYPE."""
        item = self._data.get(key)
        if isinstance(item, Value):
            if not item.expired(self._clock.now()):
                raise BusError(f"WRONGTYPE: {key!r} holds a string value, not a stream")
            del self._data[key]
            return None
        return item

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

    def delete(self, keys: Sequence[str]) -> int:
        with self._cond:
            now = self._clock.now()
            existing = 0
            for key in set(keys):
                item = self._data.pop(key, None)
                if item is not None and not (isinstance(item, Value) and item.expired(now)):
                    existing += 1
            return existing

    def close(self) -> None:
        """Wake every blocked reader; they (and later reads) raise ``BusError("bus closed")``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
