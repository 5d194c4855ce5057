"""The threads that share the merge and the outer step (``synchronizer.merge_threads``).

The core splits its passes (``dd_queue.core.workers.split_map``) but owns no threads; this is
the pool it is handed. One pool per width for the whole process: synchronizers that run in one
process (the in-process runner, tests) share it, and its threads start on first use.

How many: a second thread halves the merge's wall time only where a core is free for it. On a
2-core machine whose fetch processes keep the other core busy it made the synchronizer slower
(bench/bench_synchronizer.py: 12–14 rounds/s on 2 threads against 15–17 on one), so
``merge_threads: 0`` (the default) takes the cores the fetch processes leave, from 1 to 4.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

MAX_AUTO_THREADS = 4


class ThreadWorkers(ThreadPoolExecutor):
    """``width - 1`` threads; the calling thread is the last worker (``core.workers.Workers``)."""

    def __init__(self, width: int) -> None:
        if width < 1:
            raise ValueError(f"merge threads must be ≥ 1, got {width}")
        super().__init__(max(1, width - 1), thread_name_prefix="ddq-merge")
        self._width = width

    @property
    def width(self) -> int:
        return self._width


def merge_threads(configured: int, fetch_processes: int) -> tuple[int, str]:
    """Threads for the merge (``configured``, or 0 for the cores that ``fetch_processes``
    leave, in [1, ``MAX_AUTO_THREADS``]), with the reason."""
    if configured > 0:
        return configured, f"merge_threads: {configured} in the config"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    free = (cores or 1) - fetch_processes
    width = max(1, min(MAX_AUTO_THREADS, free))
    return width, (
        f"merge_threads: auto, {width}: {cores} usable cores, {fetch_processes} fetch processes"
    )


@functools.cache
def shared_workers(width: int) -> ThreadWorkers | None:
    """The process's pool of ``width`` (None for 1: the merge runs on the calling thread)."""
    return ThreadWorkers(width) if width > 1 else None


__all__ = ["MAX_AUTO_THREADS", "ThreadWorkers", "merge_threads", "shared_workers"]
