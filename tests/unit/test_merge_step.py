"""The merge that takes the outer step itself (``merge_fragment(step=OuterStep(...))``).

- It gives the very bits of ``merge_fragment`` followed by ``nesterov_step``: weighted mean and
  RDA, float32 and int8 codes, the first step, momentum 0, weight decay, in place and into
  ``out``, on 1 or 2 threads, segments cut anywhere.
- A weighted-mean merge never stores Δ (``delta`` is None, ``out`` untouched); RDA stores it.
- ``no_update`` takes no step; a step of the wrong size, or one that writes into a
  contribution or ``out``, is refused before anything is written.
- A merge that fails (NaN) with a step into ``out`` leaves Θ_p and the momentum as they were.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dd_queue.core.codec import CodecSpec, DecodeLimits, decode_delta, encode
from dd_queue.core.fragments import Fragment, Segment
from dd_queue.core.merge import CHUNK_ELEMENTS, ContributionData, merge_fragment
from dd_queue.core.outer import NesterovState, OuterStep, nesterov_step
from dd_queue.errors import CoreError
from dd_queue.synchronizer.workers import ThreadWorkers


def layout(n: int, cuts: Sequence[int]) -> Fragment:
    """``n`` elements cut into segments at ``cuts``; the first segment is an embedding."""
    edges = [0, *sorted({c for c in cuts if 0 < c < n}), n]
    pairs = enumerate(itertools.pairwise(edges))
    segs = tuple(Segment(f"s{i}", a, b, (b - a,), i == 0) for i, (a, b) in pairs)
    return Fragment(index=0, segments=segs, size=n)


def contributions(n: int, m: int, seed: int, codes: bool) -> list[ContributionData]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(m):
        v = rng.standard_normal(n, dtype=np.float32) * np.float32(10.0 ** rng.integers(-4, 2))
        delta = v
        if codes and i % 2:
            e = encode(v, CodecSpec("int8"))
            delta = decode_delta(e.header, e.payload, limits=DecodeLimits())  # type: ignore[assignment]
        out.append(ContributionData(f"L{i}", delta, 100 + 7 * i, 1 + i, 0))
    return out


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float32).tobytes()


@settings(max_examples=40, deadline=None)
@given(
    n=st.sampled_from([1, 5, CHUNK_ELEMENTS - 3, CHUNK_ELEMENTS + 17, 2 * CHUNK_ELEMENTS + 1]),
    cuts=st.lists(st.integers(0, 3 * CHUNK_ELEMENTS), max_size=3),
    m=st.integers(1, 4),
    rule=st.sampled_from(["mean", "rda"]),
    codes=st.booleans(),
    first=st.booleans(),
    momentum=st.sampled_from([0.0, 0.9]),
    weight_decay=st.sampled_from([0.0, 0.01]),
    into_out=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_the_merge_that_steps_gives_the_bits_of_merge_then_nesterov_step(
    n: int,
    cuts: list[int],
    m: int,
    rule: str,
    codes: bool,
    first: bool,
    momentum: float,
    weight_decay: float,
    into_out: bool,
    threads: int,
    seed: int,
) -> None:
    fragment = layout(n, cuts)
    contribs = contributions(n, m, seed, codes)
    rng = np.random.default_rng(seed + 1)
    theta = rng.standard_normal(n, dtype=np.float32)
    buf = rng.standard_normal(n, dtype=np.float32)
    step_no = 0 if first else 3
    hyper = {"lr": 0.7, "momentum": momentum, "weight_decay": weight_decay}
    workers = ThreadWorkers(threads) if threads > 1 else None
    try:
        # the reference: merge, then the step over the stored Δ
        p_ref, s_ref = theta.copy(), NesterovState(buf.copy(), step_no)
        ref = merge_fragment(contribs, fragment, rule=rule)  # type: ignore[arg-type]
        assert ref.delta is not None
        nesterov_step(p_ref, ref.delta, s_ref, **hyper)  # type: ignore[arg-type]
        # the merge that steps
        p, s = theta.copy(), NesterovState(buf.copy(), step_no)
        out = np.full(n, 7.0, dtype=np.float32)
        if into_out:
            p_new, s_new = np.empty_like(p), NesterovState(np.empty_like(buf), 0)
            step = OuterStep(p, s, out=(p_new, s_new), **hyper)  # type: ignore[arg-type]
        else:
            p_new, s_new = p, s
            step = OuterStep(p, s, **hyper)  # type: ignore[arg-type]
        got = merge_fragment(
            contribs,
            fragment,
            rule=rule,  # type: ignore[arg-type]
            out=out,
            workers=workers,
            step=step,
        )
    finally:
        if workers is not None:
            workers.shutdown()
    assert bits(p_new) == bits(p_ref)
    assert bits(s_new.momentum_buffer) == bits(s_ref.momentum_buffer)
    assert s_new.step == step_no + 1
    assert got.delta_norm == ref.delta_norm and got.weights == ref.weights
    if rule == "mean" or all(s.is_embedding for s in fragment.segments):
        assert got.delta is None and (out == 7.0).all()  # Δ never stored
    else:
        assert got.delta is out and bits(out) == bits(ref.delta)
    if into_out:  # the old Θ_p and momentum are read only
        assert bits(p) == bits(theta) and bits(s.momentum_buffer) == bits(buf)


def test_no_update_takes_no_step() -> None:
    n = 10
    theta, buf = np.ones(n, dtype=np.float32), np.ones(n, dtype=np.float32)
    state = NesterovState(buf, 2)
    zero = [ContributionData("L0", np.ones(n, dtype=np.float32), 0, 0, 0)]
    step = OuterStep(theta, state, lr=0.7, momentum=0.9)
    result = merge_fragment(zero, layout(n, []), rule="mean", step=step)
    assert result.kind == "no_update"
    assert (theta == 1).all() and (buf == 1).all() and state.step == 2


def test_a_step_of_another_size_or_over_the_merge_s_arrays_is_refused() -> None:
    n = 16
    contribs = contributions(n, 2, 0, codes=False)
    fragment = layout(n, [4])
    theta, state = np.zeros(n, dtype=np.float32), NesterovState.zeros(n)
    with pytest.raises(CoreError, match="over 8 elements; the fragment has 16"):
        small = OuterStep(np.zeros(8, dtype=np.float32), NesterovState.zeros(8), lr=1, momentum=0)
        merge_fragment(contribs, fragment, rule="mean", step=small)
    into_contribution = OuterStep(contribs[0].delta, state, lr=1.0, momentum=0.0)  # type: ignore[arg-type]
    with pytest.raises(CoreError, match="writes into a contribution or out"):
        merge_fragment(contribs, fragment, rule="mean", step=into_contribution)
    out = np.empty(n, dtype=np.float32)
    into_out = OuterStep(theta, state, lr=1.0, momentum=0.0, out=(out, NesterovState.zeros(n)))
    with pytest.raises(CoreError, match="writes into a contribution or out"):
        merge_fragment(contribs, fragment, rule="rda", out=out, step=into_out)
    assert (theta == 0).all() and state.step == 0


@pytest.mark.parametrize("rule", ["mean", "rda"])
def test_a_failed_merge_leaves_the_committed_arrays_alone(rule: str) -> None:
    n = 3 * CHUNK_ELEMENTS
    contribs = contributions(n, 2, 1, codes=False)
    contribs[1].delta[-1] = np.nan  # found only in the last piece, after the others stepped
    theta, buf = np.ones(n, dtype=np.float32), np.ones(n, dtype=np.float32)
    state = NesterovState(buf, 1)
    p_new, s_new = np.empty_like(theta), NesterovState(np.empty_like(buf), 0)
    step = OuterStep(theta, state, lr=0.7, momentum=0.9, out=(p_new, s_new))
    with pytest.raises(CoreError, match="contribution of L1 has NaN or Inf"):
        merge_fragment(contribs, layout(n, [CHUNK_ELEMENTS]), rule=rule, step=step)  # type: ignore[arg-type]
    assert (theta == 1).all() and (buf == 1).all() and state.step == 1 and s_new.step == 0
