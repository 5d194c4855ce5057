"""``MemoryBus``: the in-process twin of ``RedisBus`` for the deterministic runner and tests.

Same semantics as Redis 7 for everything the ``Bus`` protocol exposes: stream ids, consumer
groups, pending lists with delivery counts, idle times and TTLs on the injected ``Clock``,
trimming that leaves trimmed ids pending, fenced leases and all-or-nothing commits. One lock
guards all state (Redis is single-threaded too); blocking reads wait on a condition variable
in *wall* time (``block_ms``), while idle times and expiries follow the injected clock, so a
``FakeClock`` makes them deterministic. Trimming is exact even when ``approximate=True`` (Redis
may keep more; the contract only promises at least ``maxlen`` entries stay).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from dd_queue.bus._memory_kv import MemoryKeyValueOps
from dd_queue.bus._values import check_stream_id
from dd_queue.bus.commit_ops import check_dead_letter
from dd_queue.bus.types import (
    COMMIT_MARKER_TTL_S,
    Entry,
    InvalidArgument,
    PendingEntry,
    PendingSummary,
    Reclaimed,
    dead_letter_fields,
    format_stream_id,
    parse_stream_id,
)
from dd_queue.keys import dead_letter_marker_key

T = TypeVar("T")


class MemoryBus(MemoryKeyValueOps):
    """A thread-safe in-memory bus.

    Args:
        run_id: Namespace for ``keys``.
        clock: Source of time for ids, idle times, TTLs and heartbeat ages (default: system).
        blob_chunk_bytes: Largest chunk a blob is split into, in bytes.
    """

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

    def trim(self, stream: str, *, maxlen: int, approximate: bool = True) -> int:
        if isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 0:
            raise InvalidArgument(f"trim maxlen must be an integer >= 0, got {maxlen!r}")
        with self._cond:
            found = self._stream(stream)
            return found.trim(maxlen) if found else 0

    def stream_length(self, stream: str) -> int:
        with self._cond:
            found = self._stream(stream)
            return len(found) if found else 0

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

    def read_latest(self, stream: str) -> Entry | None:
        with self._cond:
            found = self._stream(stream)
            return found.entry(stream, found.ids[-1], 0) if found and found.ids else None

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

    def pending(
        self,
        stream: str,
        group: str,
        *,
        count: int = 100,
        consumer: str | None = None,
        min_idle_ms: int = 0,
    ) -> list[PendingEntry]:
        with self._cond:
            grp = self._existing_group(stream, group)
            if grp is None:
                return []
            now = self._clock.now()
            out: list[PendingEntry] = []
            for pending_id in sorted(grp.pel):
                p = grp.pel[pending_id]
                idle_ms = p.idle_ms(now)
                if (consumer is None or p.consumer == consumer) and idle_ms >= min_idle_ms:
                    out.append(
                        PendingEntry(format_stream_id(pending_id), p.consumer, idle_ms, p.count)
                    )
                    if len(out) >= count:
                        break
            return out

    def delete_consumer(self, stream: str, group: str, consumer: str) -> int:
        with self._cond:
            grp = self._existing_group(stream, group)
            if grp is None:
                return 0
            held = [i for i, p in grp.pel.items() if p.consumer == consumer]
            for pending_id in held:
                del grp.pel[pending_id]
            return len(held)

    def dead_letter(
        self,
        entry: Entry,
        *,
        group: str,
        dlq: str,
        reason: str,
        maxlen: int | None = None,
    ) -> str:
        check_dead_letter(entry.stream, entry.id, group=group, dlq=dlq, maxlen=maxlen)
        marker = dead_letter_marker_key(dlq, entry.stream, entry.id)
        with self._cond:
            self._stream(entry.stream)  # type checks first: nothing applies on failure
            self._stream(dlq)
            done = self._value(marker)
            if done is not None:  # already moved (a retry): ack again, append nothing
                self._ack(entry.stream, group, [entry.id])
                return done.data.decode()
            fields = {**entry.fields, **dead_letter_fields(entry, group, reason)}
            new_id = self._append(dlq, fields, maxlen)
            self._ack(entry.stream, group, [entry.id])
            self._put(marker, new_id.encode(), COMMIT_MARKER_TTL_S)
            return new_id


__all__ = ["MemoryBus"]
