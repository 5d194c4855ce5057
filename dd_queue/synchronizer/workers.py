"""The threads that share the merge and the outer step (``synchronizer.merge_threads``).

The core splits its passes (``dd_queue.core.workers.split_map``) but owns no threads; this is
the pool it is handed. One pool per width for the whole process: synchronizers that run in one
process (the in-process runner, tests) share it, and its threads start on first use.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor


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


@functools.cache
def shared_workers(width: int) -> ThreadWorkers | None:
    """The process's pool of ``width`` (None for 1: the merge runs on the calling thread)."""
    return ThreadWorkers(width) if width > 1 else None


__all__ = ["ThreadWorkers", "shared_workers"]
