"""Blocking group reads over streams that live on several Redis Cluster slots.

One ``XREADGROUP`` may only name keys of one slot. A synchronizer reads the ``up`` streams of all
its fragments, one slot each (their hash tags), spread over the cluster's masters. Reading them
one after another would serialise it behind the slowest node, and blocking on one would miss the
others. :class:`FanOut` reads every slot's streams at once, one worker thread each, and returns as
soon as any has entries.

A slot's read that is still blocked when the call returns is not abandoned: ``XREADGROUP >``
hands entries over (they become pending for this consumer), so whatever it returns later is kept
and handed out by the next call with the same group, consumer and streams. Only a bus closed
while such a read is in flight drops its entries; they stay pending for this consumer, and the
reclaim loop (or the consumer's own-pending read after a restart) picks them up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Generic, TypeVar

T = TypeVar("T")
Read = Callable[[int | None], list[T]]
"""One slot's read: ``read(block_ms)`` (None: do not block), returning what it found."""

_WAIT_MARGIN_S = 1.0


class FanOut(Generic[T]):
    """Concurrent blocking reads, one per key (a slot's streams with group and consumer).

    Args:
        max_workers: Threads for reads in flight at once (one per slot being waited on).
    """

    def __init__(self, max_workers: int = 32) -> None:
        self._max_workers = max_workers
        self._lock = threading.Lock()
        self._inflight: dict[Hashable, Future[list[T]]] = {}
        self._carried: dict[Hashable, list[T]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def read(self, parts: Sequence[tuple[Hashable, Read[T]]], block_ms: int | None) -> list[T]:
        """Entries of every part, in the order of ``parts``.

        First what reads left in flight by earlier calls found; else one non-blocking read of
        every part not in flight; else (with ``block_ms``) a blocking read of each at once,
        returning when the first finds something or ``block_ms`` has passed.

        Raises:
            Whatever a part's read raised (its key's other results are kept for the next call).
        """
        keys = [key for key, _ in parts]
        with self._lock:
            found = self._harvest(keys)
            idle = [(key, read) for key, read in parts if key not in self._inflight]
        if found:
            return found
        swept: list[tuple[Hashable, list[T]]] = []
        try:
            for key, read in idle:
                swept.append((key, read(None)))
        finally:  # what was read before a failure is kept, not lost
            with self._lock:
                for key, got in swept:
                    self._carried.setdefault(key, []).extend(got)
        with self._lock:
            found = self._harvest(keys)
        if found or not block_ms:
            return found
        with self._lock:
            pool = self._executor()
            for key, read in idle:
                if key not in self._inflight:
                    self._inflight[key] = pool.submit(read, block_ms)
            waiting = [self._inflight[key] for key in keys if key in self._inflight]
        wait(waiting, timeout=block_ms / 1000 + _WAIT_MARGIN_S, return_when=FIRST_COMPLETED)
        with self._lock:
            return self._harvest(keys)

    def _harvest(self, keys: Sequence[Hashable]) -> list[T]:
        """Results of finished reads and carried entries of ``keys`` (under the lock)."""
        error: BaseException | None = None
        for key in keys:
            future = self._inflight.get(key)
            if future is None or not future.done():
                continue
            del self._inflight[key]
            problem = future.exception()
            if problem is not None:
                error = error or problem
            else:
                self._carried.setdefault(key, []).extend(future.result())
        if error is not None:
            raise error
        found: list[T] = []
        for key in keys:
            found += self._carried.pop(key, [])
        return found

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="ddq-fanout")
        return self._pool

    @property
    def in_flight(self) -> int:
        """Reads still waiting on the server."""
        with self._lock:
            return sum(not f.done() for f in self._inflight.values())

    def close(self) -> None:
        """Stop taking reads; those in flight end when the bus's connections close."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
