"""Shared passes (``core.workers``): the merge and the outer step on several threads.

- ``split_map`` returns the per-item results in order for any width, runs inline without
  workers, and when a run fails it waits for every other run before raising.
- The merge (weighted mean and RDA, float32 and int8 codes, segments cut anywhere) and the
  Nesterov step (first step, weight decay, plain SGD, in place and into ``out``) give the very
  same bits with 1, 2 or 3 threads.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dd_queue.core.codec import CodecSpec, DecodeLimits, decode_delta, encode
from dd_queue.core.fragments import Fragment, Segment
from dd_queue.core.merge import CHUNK_ELEMENTS, merge_weighted
from dd_queue.core.outer import NesterovState, nesterov_step
from dd_queue.core.workers import split_map
from dd_queue.synchronizer import workers as workers_module
from dd_queue.synchronizer.workers import ThreadWorkers, merge_threads, shared_workers

WIDTHS = (2, 3)


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float32).tobytes()


def layout(n: int, cuts: Sequence[int]) -> Fragment:
    """``n`` elements cut into segments at ``cuts``; the first segment is an embedding."""
    edges = [0, *sorted({c for c in cuts if 0 < c < n}), n]
    pairs = enumerate(itertools.pairwise(edges))
    segs = tuple(Segment(f"s{i}", a, b, (b - a,), i == 0) for i, (a, b) in pairs)
    return Fragment(index=0, segments=segs, size=n)


@pytest.mark.parametrize("width", [1, 2, 3, 8])
@pytest.mark.parametrize("count", [0, 1, 2, 5, 17])
def test_split_map_keeps_the_items_order(width: int, count: int) -> None:
    threads: set[str] = set()

    def square(run: Sequence[int]) -> list[int]:
        threads.add(threading.current_thread().name)
        return [x * x for x in run]

    items = list(range(count))
    assert split_map(square, items, shared_workers(width)) == [x * x for x in items]
    assert split_map(square, items, None) == [x * x for x in items]
    if count >= 2 and width >= 2:  # the caller works too, and a pool thread helped
        assert threading.current_thread().name in threads
        assert any(name.startswith("ddq-merge") for name in threads)


def test_a_failed_run_is_raised_after_every_run_has_finished() -> None:
    failed, done = threading.Event(), threading.Event()

    def run(items: Sequence[int]) -> list[int]:
        if items[0] == 0:  # the caller's own run
            failed.set()
            raise ValueError("first run fails")
        assert failed.wait(10)  # the pool's run ends only after the caller's has failed
        done.set()
        return list(items)

    with pytest.raises(ValueError, match="first run fails"):
        split_map(run, [0, 1], ThreadWorkers(2))
    assert done.is_set()  # nothing still writes when split_map returns


def test_thread_workers_refuse_a_width_below_one() -> None:
    with pytest.raises(ValueError, match="≥ 1"):
        ThreadWorkers(0)
    assert shared_workers(1) is None and shared_workers(2) is shared_workers(2)


@pytest.mark.parametrize(
    ("cores", "fetch", "want"), [(2, 2, 1), (2, 0, 2), (1, 0, 1), (8, 2, 4), (6, 3, 3), (64, 2, 4)]
)
def test_auto_merge_threads_take_the_cores_the_fetch_processes_leave(
    monkeypatch: pytest.MonkeyPatch, cores: int, fetch: int, want: int
) -> None:
    monkeypatch.setattr(workers_module.os, "sched_getaffinity", lambda _: set(range(cores)))
    width, why = merge_threads(0, fetch)
    assert width == want
    assert f"{cores} usable cores, {fetch} fetch processes" in why
    assert merge_threads(3, fetch) == (3, "merge_threads: 3 in the config")


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 5 * CHUNK_ELEMENTS + 7),
    m=st.integers(1, 5),
    rule=st.sampled_from(["mean", "rda"]),
    codes=st.integers(0, 2),
    data=st.data(),
)
def test_the_merge_has_the_same_bits_on_any_number_of_threads(
    n: int, m: int, rule: str, codes: int, data: st.DataObject
) -> None:
    cuts = data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4))
    fragment = layout(n, cuts)
    rng = np.random.default_rng(n + m)
    vectors: list = []
    for k in range(m):
        x = (rng.standard_normal(n) * 10.0 ** -(k % 4)).astype(np.float32)
        if k < codes:  # int8 codes and block scales, merged as codes
            e = encode(x, CodecSpec("int8", block_size=256))
            vectors.append(decode_delta(e.header, e.payload, limits=DecodeLimits()))
        else:
            vectors.append(x)
    weights = rng.random(m) + 0.05
    one = merge_weighted(vectors, weights, fragment, rule=rule)  # type: ignore[arg-type]
    for width in WIDTHS:
        many = merge_weighted(
            vectors,
            weights,
            fragment,
            rule=rule,  # type: ignore[arg-type]
            workers=shared_workers(width),
        )
        assert bits(many.delta) == bits(one.delta)
        assert many.delta_norm == one.delta_norm
        assert many.fallback_segments == one.fallback_segments


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 4 * CHUNK_ELEMENTS + 3),
    step=st.sampled_from([0, 5]),
    momentum=st.sampled_from([0.0, 0.9]),
    weight_decay=st.sampled_from([0.0, 0.01]),
    into_out=st.booleans(),
)
def test_the_outer_step_has_the_same_bits_on_any_number_of_threads(
    n: int, step: int, momentum: float, weight_decay: float, into_out: bool
) -> None:
    rng = np.random.default_rng(n)
    theta = rng.standard_normal(n).astype(np.float32)
    delta = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    buf = rng.standard_normal(n).astype(np.float32)
    results = []
    for workers in (None, *map(shared_workers, WIDTHS)):
        p, state = theta.copy(), NesterovState(buf.copy(), step)
        kw = {"lr": 0.7, "momentum": momentum, "weight_decay": weight_decay, "workers": workers}
        if into_out:
            out = (np.empty_like(p), NesterovState(np.empty_like(buf)))
            nesterov_step(p, delta, state, out=out, **kw)  # type: ignore[arg-type]
            p, state = out
        else:
            nesterov_step(p, delta, state, **kw)  # type: ignore[arg-type]
        results.append((bits(p), bits(state.momentum_buffer), state.step))
    assert all(r == results[0] for r in results[1:])
