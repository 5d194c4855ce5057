"""Reusing the synchronizer's big float32 arrays instead of allocating fresh ones every round.

Each round decodes M contributions into float32 arrays of the fragment's size (an int8/int4
payload keeps its codes and scales in the first ~1.02 B/element of one: ``core.blockwise``; the
pool takes such a ``Blockwise`` back as its buffer) and makes a new Θ_p, momentum and merged Δ
of the same size. Fresh arrays that large come from the kernel (numpy asks for transparent huge
pages), so their first write pays page faults that zero every page:
measured here, a 1M-element int8 decode took 2.6 ms into a fresh array and 1.5 ms into a reused
one. A ``BufferPool`` keeps arrays the synchronizer is done with and hands them out again.

A buffer is given back only where nothing can still read it: a round's decoded contributions,
merged Δ, and previous Θ_p and momentum after the commit that replaced them, and a superseded
contribution once its successor holds its place. A runtime that is dropped (lost lease, bus
error) gives nothing back; its arrays are freed as usual. Thread-safe (the fetch thread takes,
the loop gives back).

Every pooled array has ``HEADROOM`` spare bytes in front of it, in the same allocation, so that a
blob made of a short header and the array's bytes (Θ_p's blob framing, the momentum's header)
can be written from one contiguous buffer (``framed``) instead of being joined into a 4 B/element
copy first.

The pool allocates on the heap, or with another allocator (``allocate_with``): fetch processes
decode into arrays in shared memory (``dd_queue.synchronizer.fetchers.shared_bytes``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import numpy as np
import numpy.typing as npt

from dd_queue.core.blockwise import Blockwise, Delta
from dd_queue.core.merge import F32

__all__ = ["HEADROOM", "BufferPool", "framed"]

MAX_FREE_BYTES = 256 << 20
"""Largest total size of the arrays kept for reuse."""
HEADROOM = 4096
"""Spare bytes in front of every pooled array (a blob header is a few hundred)."""


def framed(array: F32, prefix: bytes) -> memoryview | None:
    """``prefix`` followed by ``array``'s bytes, as one read-only view: ``prefix`` is written
    into the spare bytes in front of an array from ``BufferPool.take``. None for any other
    array, a prefix longer than ``HEADROOM``, or a big-endian machine (then join them as usual).
    """
    backing = _backing(array)
    if backing is None or len(prefix) > HEADROOM or array.dtype != np.dtype("<f4"):
        return None  # (blobs hold little-endian float32)
    start = HEADROOM - len(prefix)
    backing[start:HEADROOM] = np.frombuffer(prefix, dtype=np.uint8)
    return backing[start:].data.toreadonly()


def _backing(array: F32) -> npt.NDArray[np.uint8] | None:
    """The allocation ``BufferPool.take`` made for ``array`` (None if it made none)."""
    base = array.base
    if (
        isinstance(base, np.ndarray)
        and base.dtype == np.uint8
        and base.ndim == 1
        and array.dtype == np.float32
        and array.ndim == 1
        and array.flags.c_contiguous
        and base.nbytes == HEADROOM + array.nbytes
        and array.ctypes.data == base.ctypes.data + HEADROOM
    ):
        return base
    return None


def _heap(nbytes: int) -> npt.NDArray[np.uint8]:
    return np.empty(nbytes, dtype=np.uint8)


class BufferPool:
    """Free float32 arrays by element count, up to ``max_free_bytes`` in all.

    Args:
        max_free_bytes: Arrays given back beyond this total are dropped.
    """

    def __init__(self, max_free_bytes: int = MAX_FREE_BYTES) -> None:
        self._free: dict[int, list[F32]] = {}  # by size; only sizes that were taken
        self._free_bytes = 0
        self._max_free_bytes = max_free_bytes
        self._lock = threading.Lock()
        self._allocate: Callable[[int], npt.NDArray[np.uint8]] = _heap

    def allocate_with(self, allocate: Callable[[int], npt.NDArray[np.uint8]]) -> None:
        """Make new arrays from ``allocate(nbytes)`` (a writable uint8 array of that size);
        the arrays kept for reuse so far are dropped, so every array taken from now on is one
        of ``allocate``'s."""
        with self._lock:
            self._allocate = allocate
            self._free.clear()
            self._free_bytes = 0

    def take(self, size: int) -> F32:
        """A writable, C-contiguous float32 array of ``size`` elements (content undefined)."""
        with self._lock:
            free = self._free.setdefault(size, [])
            if free:
                self._free_bytes -= 4 * size
                return free.pop()
        backing = self._allocate(HEADROOM + 4 * size)
        array: F32 = backing[HEADROOM:].view(np.float32)
        return array

    def give(self, arrays: Iterable[Delta]) -> None:
        """Keep arrays for reuse (a ``Blockwise``: the buffer its codes are stored in). The
        caller must hold no other reference that is still used; arrays the pool did not make
        (views of them included), read-only ones, and sizes never taken, are ignored."""
        with self._lock:
            for given in arrays:
                a = given.buffer if isinstance(given, Blockwise) else given
                if a is None:
                    continue
                free = self._free.get(a.size)
                reusable = (
                    free is not None
                    and all(a is not b for b in free)  # given twice: keep it once
                    and _backing(a) is not None
                    and a.flags.writeable
                )
                if (
                    free is not None
                    and reusable
                    and self._free_bytes + a.nbytes <= self._max_free_bytes
                ):
                    free.append(a)
                    self._free_bytes += a.nbytes
