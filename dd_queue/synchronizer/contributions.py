"""The contribution source: new ``up`` entries through the group, each one's contribution read.

The synchronizer's loop reads contributions in one place. ``Contributions`` owns the consumer
group read of the owned fragments' ``up`` streams, the queue of entries read and not yet
admitted, and the read-ahead (``prefetch.Prefetcher``: a worker thread, or the fetch processes of
``fetchers``) that fetches, verifies and decodes each entry's payload before admission reaches
it. It hands the loop ``Batch`` es: one fragment's entries in stream order, whose items pair
each entry with its decoded contribution or the error that refused it
(``ops.read_contribution``'s). The loop admits a batch, then decides its fragment; nothing in
here calls back into the loop.

Reading ahead:

- ``read`` asks the group for new entries (blocking up to ``block_ms``) and queues them; their
  reads start at once, in order, within the read-ahead window.
- ``batches`` yields the queued entries, a run of one stream at a time. With read-ahead, just
  before the last run it reads the group once more without blocking, so the entries that
  arrived meanwhile are fetched and decoded while the loop merges; they are yielded by the
  next call.
- ``batch`` wraps entries that came another way (a fragment's own pending entries when it is
  taken, reclaimed ones) the same way.

Without read-ahead (``MemoryBus``, the deterministic runner), each entry is read when its item
is reached: the same calls in the same order as a plain loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from dd_queue.bus import Entry
from dd_queue.errors import BlobMissing, ProtocolError
from dd_queue.keys import SYNC_GROUP
from dd_queue.synchronizer.context import Context
from dd_queue.synchronizer.prefetch import Decoded, Prefetcher
from dd_queue.synchronizer.runtime import FragmentRuntime

__all__ = ["READ_COUNT", "Batch", "Contributions", "Item"]

READ_COUNT = 64
"""Entries read per ``up`` stream per group read."""


@dataclass(frozen=True, slots=True)
class Item:
    """One entry met for the first time in this lifetime, and what reading it gave.

    Attributes:
        entry: The ``up`` entry.
        read: Its message and decoded Δ (a pooled buffer: the taker gives it back), or None
            when the entry was trimmed (no fields) or could not be read.
        error: Why it could not be read (``ops.read_contribution``'s exception), or None.
    """

    entry: Entry
    read: Decoded | None
    error: ProtocolError | BlobMissing | None


class Batch:
    """Entries of one fragment's stream, in order; iterating reads each one (or takes its
    read-ahead result) when it is reached. Entries the fragment has seen in this lifetime are
    skipped. Use it as a context manager: on leaving, reads not taken are forgotten."""

    def __init__(self, reader: Prefetcher, rt: FragmentRuntime, entries: Sequence[Entry]) -> None:
        self.rt, self.entries, self._reader = rt, entries, reader
        reader.submit(_unread(entries, rt), fragment=rt.fragment)

    @property
    def fragment_id(self) -> int:
        return self.rt.fragment_id

    def __iter__(self) -> Iterator[Item]:
        for entry in self.entries:
            if not self.rt.first_sight(entry.id):
                continue
            if entry.deleted:
                yield Item(entry, None, None)
                continue
            try:
                decoded = self._reader.read(entry, fragment=self.rt.fragment)
            except (ProtocolError, BlobMissing) as exc:
                yield Item(entry, None, exc)
            else:
                yield Item(entry, decoded, None)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self._reader.discard(self.entries)  # those it did not read (seen before, or an error)


class Contributions:
    """New contributions of the owned fragments, read ahead of the loop (module doc).

    Args:
        ctx: The synchronizer's context.
        threads: Read-ahead worker threads (0: read inline when an item is reached).
        processes: Fetch processes instead of threads (``fetchers``; a bus made from a URL).
    """

    def __init__(self, ctx: Context, *, threads: int, processes: int) -> None:
        self._ctx = ctx
        self._reader = Prefetcher(ctx, threads=threads, processes=processes)
        self._queue: deque[Entry] = deque()  # read from the group, not yet in a batch

    @property
    def waiting(self) -> bool:
        """Whether entries read from the group wait for their batch."""
        return bool(self._queue)

    def start(self) -> None:
        """Start the fetch processes now (a takeover must not wait for their start-up)."""
        self._reader.start()

    def read(self, fragments: Mapping[int, FragmentRuntime], *, block_ms: int) -> None:
        """Read new entries of the fragments' ``up`` streams through the group (waiting up to
        ``block_ms`` for the first; 0: not at all) and queue them; their reads start."""
        ctx = self._ctx
        streams = [ctx.bus.keys.up(p) for p in sorted(fragments)]
        if not streams:
            return  # standby: nothing to read
        entries = ctx.bus.read_group(
            streams, SYNC_GROUP, ctx.owner, count=READ_COUNT, block_ms=block_ms or None
        )
        self._queue.extend(entries)
        by_stream = {ctx.bus.keys.up(p): rt for p, rt in fragments.items()}
        for stream in dict.fromkeys(e.stream for e in entries):
            if (rt := by_stream.get(stream)) is not None:
                todo = _unread((e for e in entries if e.stream == stream), rt)
                self._reader.submit(todo, fragment=rt.fragment)

    def batches(self, fragments: Mapping[int, FragmentRuntime]) -> Iterator[Batch]:
        """The queued entries, one stream's run at a time, for fragments still owned (the
        entries of a fragment no longer owned stay pending: its next owner reclaims them)."""
        by_stream = {self._ctx.bus.keys.up(p): rt for p, rt in fragments.items()}
        queue, self._queue = self._queue, deque()
        try:
            while queue:
                stream, run = queue[0].stream, []
                while queue and queue[0].stream == stream:
                    run.append(queue.popleft())
                rt = by_stream.get(stream)
                if rt is None or fragments.get(rt.fragment_id) is not rt:
                    self._reader.discard(run)
                    continue
                if self._reader.threaded and not queue and not self._queue:
                    self.read(fragments, block_ms=0)  # decoded while this run merges
                yield self.batch(rt, run)  # the taker closes it (``with``)
        finally:
            queue.extend(self._queue)  # an error left some: keep them, in order
            self._queue = queue

    def batch(self, rt: FragmentRuntime, entries: Sequence[Entry]) -> Batch:
        """Entries of ``rt``'s stream that came another way (pending, reclaimed)."""
        return Batch(self._reader, rt, entries)

    def forget(self, stream: str) -> None:
        """Drop the queued entries of a stream (its fragment's lease was lost)."""
        self._reader.discard(e for e in self._queue if e.stream == stream)
        self._queue = deque(e for e in self._queue if e.stream != stream)

    def clear(self) -> None:
        """Forget everything queued and read ahead (the bus failed: all is re-read)."""
        self._queue.clear()
        self._reader.clear()

    def close(self) -> None:
        """Forget everything and stop the read-ahead."""
        self._queue.clear()
        self._reader.close()


def _unread(entries: Iterable[Entry], rt: FragmentRuntime) -> list[Entry]:
    """The entries a batch of ``rt`` will read (not trimmed, not seen before)."""
    return [e for e in entries if not e.deleted and e.id not in rt.known]
