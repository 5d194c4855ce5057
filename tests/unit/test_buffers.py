"""The synchronizer's pool of fragment-sized float32 arrays."""

from __future__ import annotations

import numpy as np

from dd_queue.synchronizer.buffers import BufferPool


def test_a_given_array_is_handed_out_again():
    pool = BufferPool()
    a = pool.take(1000)
    assert a.dtype == np.float32 and a.shape == (1000,) and a.flags.writeable
    pool.give([a])
    assert pool.take(1000) is a
    assert pool.take(1000) is not a  # it was taken: the pool is empty again


def test_views_read_only_foreign_sizes_and_other_dtypes_are_not_kept():
    pool = BufferPool()
    base = pool.take(1000)
    view = base[:500]
    read_only = pool.take(1000)
    read_only.flags.writeable = False
    pool.give([view, read_only, np.empty(1000, np.float64), np.empty(7, np.float32)])
    assert pool.take(1000) is not read_only  # nothing was kept
    pool.give([np.empty(500, np.float32)])  # a size never taken
    assert pool.take(500).base is None


def test_an_array_given_twice_is_kept_once():
    pool = BufferPool()
    a = pool.take(100)
    pool.give([a, a])
    assert pool.take(100) is a
    assert pool.take(100) is not a


def test_the_pool_keeps_at_most_its_byte_budget():
    pool = BufferPool(max_free_bytes=4 * 100 * 2)  # two arrays of 100 elements
    arrays = [pool.take(100) for _ in range(3)]
    pool.give(arrays)
    again = [pool.take(100) for _ in range(3)]
    assert sum(any(x is y for y in arrays) for x in again) == 2
