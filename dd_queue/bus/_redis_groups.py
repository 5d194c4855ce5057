"""RedisBus's consumer-group bookkeeping: groups, pending lists, reclaim, delivery counts.

A mixin of :class:`~dd_queue.bus.redis_streams.RedisBus` (which sets the attributes declared
here). Commands that act for a consumer (re-reading its pending entries, reclaiming) recreate a
group that a Redis restart dropped; read-only inspection (``pending_summary``, ``pending``) and
``delete_consumer`` never create anything: a missing group or stream reads as empty.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
from redis.typing import KeyT, StreamIdT

from dd_queue.bus import _replies
from dd_queue.bus._redis_conn import Connections, NoGroup
from dd_queue.bus._values import format_stream_id, parse_stream_id
from dd_queue.bus.types import Entry, PendingEntry, PendingSummary, Reclaimed

T = TypeVar("T")
log = logging.getLogger("dd_queue.bus")

_PENDING_PAGE = 100


class RedisGroupOps:
    """Consumer groups and pending lists on Redis."""

    _conn: Connections

    def ensure_group(self, stream: str, group: str) -> None:
        def create() -> None:
            try:
                self._conn.control.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):
                    raise

        self._conn.call("ensure_group", create)

    def _with_group(self, streams: Sequence[str], group: str, what: str, fn: Callable[[], T]) -> T:
        try:
            return self._conn.call(what, fn)
        except NoGroup:
            # Redis restarted without persistence (or the stream was deleted): recreate the
            # group at id 0 so entries appended since the restart are still delivered.
            log.warning("bus.group_recreated %s on %s", group, list(streams))
            for stream in streams:
                self.ensure_group(stream, group)
            return self._conn.call(what, fn)

    def read_own_pending(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        count: int = 100,
        after_id: str = "0-0",
    ) -> list[Entry]:
        start: dict[KeyT, StreamIdT] = {stream: format_stream_id(parse_stream_id(after_id))}
        raw = self._with_group(
            [stream],
            group,
            "read_own_pending",
            lambda: self._conn.control.xreadgroup(group, consumer, start, count=count),
        )
        found = _replies.xread(raw, delivery_count=0)
        counts = self._delivery_counts(stream, group, consumer, [e.id for e in found])
        return [Entry(e.stream, e.id, e.fields, counts.get(e.id, 1)) for e in found]

    def _delivery_counts(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> dict[str, int]:
        """Delivery counts of ``consumer``'s pending ``ids`` (ascending), from ranged
        ``XPENDING … <first> <last> <n> <consumer>`` calls (usually one). An id missing from
        the answer (the group vanished meanwhile) is left out; callers default to 1."""
        if not ids:
            return {}
        wanted, counts = set(ids), dict[str, int]()
        last, page = ids[-1], max(_PENDING_PAGE, len(ids))

        def fetch(first: str) -> list[PendingEntry]:
            raw = self._conn.call(
                "pending",
                lambda: self._conn.control.xpending_range(
                    stream, group, first, last, page, consumername=consumer
                ),
            )
            return _replies.pending_range(raw)

        start = ids[0]
        while True:
            try:
                rows = fetch(start)
            except NoGroup:  # the group vanished (restart) since the read: counts unknown
                return counts
            counts.update({r.id: r.delivery_count for r in rows if r.id in wanted})
            if len(rows) < page or len(counts) == len(wanted):
                return counts
            ms, seq = parse_stream_id(rows[-1].id)
            start = format_stream_id((ms, seq + 1))

    def reclaim(
        self, stream: str, group: str, consumer: str, *, min_idle_ms: int, count: int = 100
    ) -> Reclaimed:
        claimed: list[Entry] = []
        deleted: list[str] = []
        cursor = "0-0"
        while len(claimed) < count:
            raw = self._autoclaim(
                stream, group, consumer, min_idle_ms, cursor, count - len(claimed)
            )
            cursor, got, gone = _replies.xautoclaim(stream, raw)
            claimed += got
            deleted += gone
            if cursor == "0-0":
                break
        if deleted:  # 7.x already dropped them; Redis 6.2 keeps them pending until acked
            self._conn.call("ack", lambda: self._conn.control.xack(stream, group, *deleted))
        ordered = sorted(claimed, key=lambda e: parse_stream_id(e.id))
        counts = self._delivery_counts(stream, group, consumer, [e.id for e in ordered])
        entries = [Entry(e.stream, e.id, e.fields, counts.get(e.id, 1)) for e in claimed]
        return Reclaimed(entries=entries, deleted_ids=deleted)

    def _autoclaim(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, start: str, count: int
    ) -> object:
        return self._with_group(
            [stream],
            group,
            "reclaim",
            lambda: self._conn.control.xautoclaim(
                stream, group, consumer, min_idle_ms, start_id=start, count=count
            ),
        )

    def pending_summary(self, stream: str, group: str) -> PendingSummary:
        try:
            raw = self._conn.call(
                "pending_summary", lambda: self._conn.control.xpending(stream, group)
            )
        except NoGroup:
            return PendingSummary(0, None, None, {})
        return _replies.pending_summary(raw)

    def pending(
        self,
        stream: str,
        group: str,
        *,
        count: int = 100,
        consumer: str | None = None,
        min_idle_ms: int = 0,
    ) -> list[PendingEntry]:
        try:
            raw = self._conn.call(
                "pending",
                lambda: self._conn.control.xpending_range(
                    stream, group, "-", "+", count, consumername=consumer, idle=min_idle_ms or None
                ),
            )
        except NoGroup:
            return []
        return _replies.pending_range(raw)

    def delete_consumer(self, stream: str, group: str, consumer: str) -> int:
        try:
            raw = self._conn.call(
                "delete_consumer",
                lambda: self._conn.control.xgroup_delconsumer(stream, group, consumer),
            )
        except NoGroup:
            return 0
        return _replies.as_int(raw)


__all__ = ["RedisGroupOps"]
