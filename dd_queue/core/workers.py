"""Splitting one pass over a fragment between threads that the caller owns.

The merge and the outer step work piece by piece (at most ``CHUNK_ELEMENTS`` each), and numpy
releases the GIL inside each piece's ufuncs, so two threads run two pieces at once. The core
owns no threads: the shell passes :class:`Workers` (the synchronizer's pool,
``synchronizer.merge_threads``). :func:`split_map` hands each worker one contiguous run of the
items and returns the per-item results in the items' order, so whatever a caller sums from them
sums in the same order for any number of workers: the results are bit-identical to one thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

T = TypeVar("T")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Pending(Protocol[R_co]):
    """A call running on another thread (``concurrent.futures.Future`` is one)."""

    def result(self) -> R_co: ...


class Workers(Protocol):
    """Threads to share a pass with (``dd_queue.synchronizer.workers.ThreadWorkers``).

    Attributes:
        width: Runs that go at once, counting the calling thread (1 = no help).
    """

    @property
    def width(self) -> int: ...

    def submit(self, fn: Callable[[T], R], arg: T, /) -> Pending[R]: ...


def split_map(
    fn: Callable[[Sequence[T]], list[R]], items: Sequence[T], workers: Workers | None
) -> list[R]:
    """``fn`` over contiguous runs of ``items``, one run per worker and one on the calling
    thread; the concatenated results (``fn`` returns one per item, in order).

    With no workers, a width of 1 or fewer than two items, this is ``fn(items)`` inline. Every
    run has finished when this returns or raises (no thread still writes into shared arrays).
    """
    width = min(workers.width, len(items)) if workers is not None else 1
    if width <= 1 or workers is None:
        return fn(items)
    cuts = [len(items) * k // width for k in range(width + 1)]
    runs = [items[a:b] for a, b in itertools.pairwise(cuts)]
    pending = [workers.submit(fn, run) for run in runs[1:]]
    results: list[list[R]] = []
    error: BaseException | None = None
    try:
        results.append(fn(runs[0]))
    except BaseException as exc:
        error = exc
    for p in pending:  # wait for every run, even after an error: none may still be writing
        try:
            results.append(p.result())
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error
    return [r for run in results for r in run]


__all__ = ["Pending", "Workers", "split_map"]
