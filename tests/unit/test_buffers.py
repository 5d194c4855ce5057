"""The synchronizer's pool of fragment-sized float32 arrays."""

from __future__ import annotations

import numpy as np

from dd_queue.bus import MemoryBus
from dd_queue.core.codec import encode_fp32_view
from dd_queue.core.outer import NesterovState, state_to_bytes
from dd_queue.synchronizer import blobs
from dd_queue.synchronizer.buffers import HEADROOM, BufferPool, framed
from dd_queue.wire import pack_blob


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
    fresh = np.empty(1000, np.float32)
    pool.give([fresh])  # not made by the pool (no room for a header): not kept
    assert pool.take(1000) is not fresh


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


def test_framed_puts_the_prefix_right_in_front_of_a_pooled_array():
    pool = BufferPool()
    a = pool.take(6)
    a[:] = np.arange(6, dtype=np.float32)
    view = framed(a, b"head")
    assert view is not None and view.readonly
    assert bytes(view) == b"head" + a.tobytes()
    np.testing.assert_array_equal(a, np.arange(6))  # the values are untouched
    assert framed(a, b"x" * (HEADROOM + 1)) is None  # no room: the caller joins
    assert framed(np.zeros(6, np.float32), b"head") is None  # not pooled
    assert framed(a[1:], b"head") is None  # a view of a pooled array


def test_staged_blobs_are_the_same_bytes_pooled_or_not():
    """Θ_p and momentum blobs framed in place equal the joined ones the learners decode."""
    bus = MemoryBus("t")
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=60)
    assert lease is not None
    pool = BufferPool()
    values = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    pooled = pool.take(values.size)
    pooled[:] = values
    for version, theta in enumerate((values, pooled)):
        state = NesterovState(theta, step=3)
        vref, _, mref = blobs.stage(
            bus, lease, fragment_id=0, version=version, theta=theta, state=state
        )
        expected = pack_blob(
            run_id="t", blob_key=vref.ref.key, encoded=encode_fp32_view(values.copy())
        )
        assert bus.get_blob(vref.ref) == expected
        assert bus.get_blob(mref) == state_to_bytes(NesterovState(values.copy(), step=3))
