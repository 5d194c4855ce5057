"""The data structures of :class:`~dd_queue.bus.memory.MemoryBus`: a stream with consumer groups
and pending lists that follows Redis 7 semantics, and an expiring string value.

Plain data with the operations Redis runs on it; not thread-safe on their own (the bus holds its
lock around every use).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from dd_queue.bus._values import format_stream_id
from dd_queue.bus.types import Entry

StreamId = tuple[int, int]


@dataclass
class Value:
    """A string key's bytes and its expiry on the bus clock (None: never)."""

    data: bytes
    expires_at_s: float | None = None

    def expired(self, now_s: float) -> bool:
        return self.expires_at_s is not None and now_s >= self.expires_at_s


@dataclass
class Counts:
    """A hash of integer counters (``HINCRBY``/``HGETALL``)."""

    fields: dict[str, int] = field(default_factory=dict)


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


__all__ = ["Counts", "Group", "Pending", "Stream", "StreamId", "Value"]
