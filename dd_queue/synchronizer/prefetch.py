"""Reading contributions ahead of the loop that admits them, on a worker thread.

Reading one contribution (``ops.read_contribution``) is a GET of its payload, a CRC-32 and a
dequantisation into float32: work that runs mostly outside the GIL (socket reads, zlib, numpy).
A ``Prefetcher`` with a worker thread reads entries in the order they were submitted while the
synchronizer's loop admits, merges and commits the ones before them. Everything else stays on
the loop's thread, in entry order: the loop asks for each entry's result when it reaches the
entry and gets exactly what an inline read returns, or raises what it raises
(``ProtocolError``, ``BlobMissing``, ``BusError``), so validation, dead-lettering, admission
and the fenced commits are unchanged. A read ahead of time may find a payload that an earlier
entry's commit deletes a moment later; only a duplicate or late twin of a merged entry shares
a payload, and admission settles such an entry by its outcome either way, never merging it.

Without a worker (``threads=0``: ``MemoryBus`` and the deterministic in-process runner), an
entry is read when its result is asked for: the same calls in the same order as a plain loop.

Memory: at most ``window`` entries, and at most ``window_bytes`` of decoded float32, are read
ahead of the loop; further submitted entries wait (as references) for their turn.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from dd_queue.bus import Entry, ops
from dd_queue.core.merge import F32
from dd_queue.messages import Contribution
from dd_queue.synchronizer.context import Context

__all__ = ["Prefetcher", "Read"]

log = logging.getLogger("dd_queue.synchronizer")

Read = Callable[[Entry], tuple[Contribution, F32]]
"""Reads one ``up`` entry: ``ops.read_contribution``'s result, or its exception."""

WINDOW = 16
"""Most entries read ahead."""
WINDOW_BYTES = 128 << 20
"""Most decoded float32 bytes read ahead (4 B × elements per entry)."""

_Key = tuple[str, str]  # (stream, entry id)


class Prefetcher:
    """Reads ``up`` entries ahead of time on ``threads`` workers (0: inline, when asked).

    Args:
        ctx: The synchronizer's context (bus, run id, limits).
        threads: Worker threads; 0 reads inline.
        window: Most entries read ahead.
        window_bytes: Most decoded bytes read ahead.
    """

    def __init__(
        self,
        ctx: Context,
        *,
        threads: int,
        window: int = WINDOW,
        window_bytes: int = WINDOW_BYTES,
    ) -> None:
        if threads < 0 or window < 1 or window_bytes < 1:
            raise ValueError(f"bad prefetch settings: {threads=}, {window=}, {window_bytes=}")
        self._ctx = ctx
        self._window, self._window_bytes = window, window_bytes
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix=f"ddq-{ctx.owner}-fetch")
            if threads
            else None
        )
        self._waiting: OrderedDict[_Key, tuple[Entry, int]] = OrderedDict()  # not yet started
        self._started: dict[_Key, tuple[Future[tuple[Contribution, F32]], int]] = {}
        self._started_bytes = 0

    @property
    def threaded(self) -> bool:
        """Whether entries are read on a worker thread."""
        return self._pool is not None

    def submit(self, entries: Iterable[Entry], *, elements: int) -> None:
        """Queue entries to read ahead, in this order (a no-op without a worker).

        Args:
            entries: Entries the loop will ask for (not deleted, not yet offered).
            elements: Elements of one decoded contribution of theirs (bounds memory).
        """
        if self._pool is None:
            return
        for entry in entries:
            key = (entry.stream, entry.id)
            if key not in self._started:
                self._waiting[key] = (entry, 4 * elements)
        self._top_up()

    def read(self, entry: Entry) -> tuple[Contribution, F32]:
        """The entry's contribution: read ahead if it was, else read now on this thread.

        Raises:
            What ``ops.read_contribution`` raises for it.
        """
        key = (entry.stream, entry.id)
        started = self._started.pop(key, None)
        self._waiting.pop(key, None)
        if started is None:
            self._top_up()
            return self._read_now(entry)
        future, nbytes = started
        self._started_bytes -= nbytes
        self._top_up()
        return future.result()

    def discard(self, entries: Iterable[Entry]) -> None:
        """Forget entries the loop will not ask for (a read already running finishes alone)."""
        for entry in entries:
            key = (entry.stream, entry.id)
            self._waiting.pop(key, None)
            if (started := self._started.pop(key, None)) is not None:
                started[0].cancel()
                self._started_bytes -= started[1]
        self._top_up()

    def clear(self) -> None:
        """Forget everything submitted."""
        for future, _ in self._started.values():
            future.cancel()
        self._waiting.clear()
        self._started.clear()
        self._started_bytes = 0

    def close(self) -> None:
        """Forget everything and stop the worker (a running read finishes alone)."""
        self.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _read_now(self, entry: Entry) -> tuple[Contribution, F32]:
        ctx = self._ctx
        return ops.read_contribution(ctx.bus, entry, run_id=ctx.run_id, limits=ctx.limits)

    def _top_up(self) -> None:
        pool = self._pool
        while pool is not None and self._waiting and len(self._started) < self._window:
            key, (entry, nbytes) = next(iter(self._waiting.items()))
            if self._started and self._started_bytes + nbytes > self._window_bytes:
                return
            del self._waiting[key]
            self._started[key] = (pool.submit(self._read_now, entry), nbytes)
            self._started_bytes += nbytes
