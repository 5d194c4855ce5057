"""The merge over the whole float32 range: subnormal to near ``float32`` max, degenerate
directions, and the int8/int4 code path against the float32 one.

The claims (issue #21): norms, the RDA radius and direction and the scale factors neither
overflow nor underflow; RDA of one contribution is that contribution at any magnitude; a merge
either returns a finite Δ equal to the float64 reference (to float32 rounding) or raises
``CoreError`` saying it overflowed: it never returns NaN/Inf and never zeroes a real update.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dd_queue.core.codec import CodecSpec, DecodeLimits, decode, decode_delta, encode
from dd_queue.core.fragments import Fragment, Segment
from dd_queue.core.merge import merge_weighted
from dd_queue.errors import CoreError
from tests.unit.test_merge import reference_merge, well_conditioned

F32_MAX = float(np.finfo(np.float32).max)
SUBNORMAL = float(np.finfo(np.float32).smallest_subnormal)
EXPONENTS = st.integers(-44, 38)  # 10^e·x with |x| ≤ 1: subnormal to near float32 max
RULES = st.sampled_from(["rda", "mean"])


def fragment_of(n: int, *, cut: int | None = None) -> Fragment:
    """One segment, or two (``cut``) so that two scales meet in one merge."""
    if cut is None or not 0 < cut < n:
        return Fragment(index=0, segments=(Segment("w", 0, n, (n,), False),), size=n)
    segs = (Segment("a", 0, cut, (cut,), False), Segment("b", cut, n, (n - cut,), False))
    return Fragment(index=0, segments=segs, size=n)


def scaled(seed: int, n: int, exponent: int) -> np.ndarray:
    """A random direction with max |x| = 1, times 10^exponent, as float32 (may hold
    subnormals, or zeros where a component underflows)."""
    x = np.random.default_rng(seed).standard_normal(n)
    with np.errstate(over="ignore", under="ignore"):
        return (x / np.abs(x).max() * 10.0**exponent).astype(np.float32)


def assert_close_to(delta: np.ndarray, expected: np.ndarray) -> None:
    """float32 rounding of a float64 result: relative to its largest element, plus the
    absolute granularity of subnormals."""
    assert np.isfinite(delta).all()
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(
        delta.astype(np.float64), expected, rtol=0, atol=3e-6 * scale + 4 * SUBNORMAL
    )


@settings(max_examples=150, deadline=None)
@given(
    exponent=EXPONENTS,
    n=st.integers(1, 300),
    seed=st.integers(0, 2**32 - 1),
    rule=RULES,
)
def test_one_contribution_merges_to_itself_at_any_magnitude(
    exponent: int, n: int, seed: int, rule: str
) -> None:
    delta = scaled(seed, n, exponent)
    assume(delta.any())
    result = merge_weighted([delta], [3.0], fragment_of(n), rule=rule)  # type: ignore[arg-type]
    assert result.kind == "merged" and result.fallback_segments == ()
    assert_close_to(result.delta, delta.astype(np.float64))
    norm = float(np.linalg.norm(delta.astype(np.float64)))
    assert result.delta_norm == pytest.approx(norm, rel=1e-5)


@settings(max_examples=200, deadline=None)
@given(
    exponents=st.lists(EXPONENTS, min_size=2, max_size=4),
    n=st.integers(2, 200),
    cut=st.integers(1, 199),
    seed=st.integers(0, 2**32 - 1),
    weights=st.lists(st.floats(0.01, 100.0), min_size=4, max_size=4),
    rule=RULES,
)
def test_contributions_of_any_magnitudes_merge_to_the_float64_reference_or_refuse(
    exponents: list[int], n: int, cut: int, seed: int, weights: list[float], rule: str
) -> None:
    """Mixed scales within one merge and one segment. The result is the float64 reference
    to float32 rounding; a reference beyond float32 is refused in words, never returned."""
    frag = fragment_of(n, cut=cut)
    vectors = [scaled(seed + i, n, e) for i, e in enumerate(exponents)]
    w = weights[: len(vectors)]
    assume(all(v.any() for v in vectors))
    if rule == "rda":
        assume(well_conditioned(vectors, w, frag))
    expected = reference_merge(vectors, w, frag, rule)
    if np.abs(expected).max() > 0.999 * F32_MAX:
        with pytest.raises(CoreError, match=r"overflowed float32"):
            merge_weighted(vectors, w, frag, rule=rule)  # type: ignore[arg-type]
        return
    result = merge_weighted(vectors, w, frag, rule=rule)  # type: ignore[arg-type]
    assert result.kind == "merged"
    assert_close_to(result.delta, expected)
    assert np.isfinite(result.delta_norm)


@pytest.mark.parametrize("exponent", [-44, -40, -38, -30, -20, 0, 20, 30, 37, 38])
@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_opposite_contributions_cancel_to_zero_at_any_magnitude(exponent: int, rule: str) -> None:
    """Degenerate directions: Δ and −Δ with equal weights. RDA falls back to the mean
    (listed as such); both rules give an exact zero, finite, not NaN."""
    delta = scaled(7, 64, exponent)
    result = merge_weighted([delta, -delta], [1.0, 1.0], fragment_of(64), rule=rule)  # type: ignore[arg-type]
    assert result.kind == "merged"
    assert not result.delta.any() and result.delta_norm == 0.0
    assert result.fallback_segments == (("w",) if rule == "rda" else ())


@pytest.mark.parametrize("exponent", [-44, -38, -25, 25, 37])
def test_rda_of_far_apart_magnitudes_keeps_the_radius_and_the_direction(exponent: int) -> None:
    """Δ_1 at 10^e and Δ_2 at 1, partly aligned: the radius is Σ a_m ‖Δ_m‖ and the result is
    the float64 reference, however far apart the two norms (a coefficient a_m/‖Δ_m‖ beyond
    float32's range is merged in float64)."""
    small, base = scaled(3, 50, exponent), scaled(4, 50, 0) + scaled(3, 50, 0)
    assert small.any()
    result = merge_weighted([small, base], [1.0, 1.0], fragment_of(50), rule="rda")
    norms = [np.linalg.norm(v.astype(np.float64)) for v in (small, base)]
    assert result.delta_norm == pytest.approx(0.5 * sum(norms), rel=1e-5)
    assert_close_to(
        result.delta, reference_merge([small, base], [1.0, 1.0], fragment_of(50), "rda")
    )


def test_rda_of_huge_contributions_keeps_each_element_finite() -> None:
    """The arithmetic of issue #21: 3e38 everywhere. The radius (4.2e38) exceeds float32 max,
    yet every element of the result fits: it is returned exactly, not as Inf."""
    delta = np.full(2, 3e38, np.float32)
    result = merge_weighted([delta], [1.0], fragment_of(2), rule="rda")
    assert np.isfinite(result.delta).all()
    np.testing.assert_allclose(result.delta, delta, rtol=1e-6)


def test_a_merged_delta_beyond_float32_is_refused_in_words() -> None:
    """[3e38, ±3e38]: the directions average to [1, 0] and the radius is ‖Δ‖ = 4.2e38, so
    the first element of the RDA exceeds float32 max."""
    one, two = np.array([3e38, 3e38], np.float32), np.array([3e38, -3e38], np.float32)
    with pytest.raises(CoreError, match=r"overflowed float32"):
        merge_weighted([one, two], [1.0, 1.0], fragment_of(2), rule="rda")


@settings(max_examples=40, deadline=None)
@given(
    exponent=st.integers(-30, 36),
    codec=st.sampled_from([("int8", 256), ("int8", 8), ("int4", 64)]),
    rule=RULES,
    seed=st.integers(0, 2**32 - 1),
)
def test_codes_and_float32_merges_agree_at_any_magnitude(
    exponent: int, codec: tuple[str, int], rule: str, seed: int
) -> None:
    """The int8/int4 path (codes summed, norms from exact integer sums) against merging the
    decoded float32 vectors, from tiny to huge outer gradients."""
    n = 700
    frag = fragment_of(n, cut=300)
    limits = DecodeLimits()
    codes: list[object] = []
    floats: list[np.ndarray] = []
    for i in range(3):
        x = scaled(seed + i, n, exponent - i)
        e = encode(x, CodecSpec(codec[0], block_size=codec[1]))
        codes.append(decode_delta(e.header, e.payload, limits=limits))
        floats.append(decode(e.header, e.payload, limits=limits))
    assume(all(f.any() for f in floats))
    w = [1.0, 2.0, 3.0]
    if rule == "rda":
        assume(well_conditioned(floats, w, frag))
    a = merge_weighted(codes, w, frag, rule=rule)  # type: ignore[arg-type]
    b = merge_weighted(floats, w, frag, rule=rule)  # type: ignore[arg-type]
    assert np.isfinite(a.delta).all() and np.isfinite(b.delta).all()
    np.testing.assert_allclose(
        a.delta, b.delta, rtol=0, atol=2e-6 * float(np.abs(b.delta).max()) + 4 * SUBNORMAL
    )
    assert a.delta_norm == pytest.approx(b.delta_norm, rel=1e-5)
    assert a.fallback_segments == b.fallback_segments


@pytest.mark.parametrize("value", [0.0, -1e-3, float("nan"), float("inf")])
def test_min_direction_norm_must_be_finite_and_positive(value: float) -> None:
    delta = np.ones(4, np.float32)
    with pytest.raises(CoreError, match=r"min_direction_norm must be finite and > 0"):
        merge_weighted([delta, -delta], [1.0, 1.0], fragment_of(4), min_direction_norm=value)
