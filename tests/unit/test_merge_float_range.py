"""The merge over the whole float32 range: subnormal to near ``float32`` max, degenerate
directions, and the int8/int4 code path against the float32 one.

The claims (issue #21): norms, the RDA radius and direction and the scale factors neither
overflow nor underflow; RDA of one contribution is that contribution at any magnitude; a merge
either returns a finite Δ equal to the float64 reference (to float32 rounding) or raises
``CoreError`` saying it overflowed: it never returns NaN/Inf and never zeroes a real update.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dd_queue.core.codec import CodecSpec, DecodeLimits, decode, decode_delta, encode
from dd_queue.core.fragments import Fragment, Segment
from dd_queue.core.merge import CHUNK_ELEMENTS, merge_weighted, segment_sq_norms
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


# ---------------------------------------------------------------------------------------------
# The edges of float32's comfortable range [2^-100, 2^100]: which path a segment takes
# ---------------------------------------------------------------------------------------------


def f32_of(*xs: float) -> np.ndarray:
    return np.array(xs, np.float32)


def orthogonal_pair(t1: float, t2: float, n: int = 2) -> list[np.ndarray]:
    """t1·e_0 and t2·e_1 in n elements: norms t1 and t2 exactly, directions orthogonal."""
    x, y = np.zeros(n, np.float32), np.zeros(n, np.float32)
    x[0], y[1] = t1, t2
    return [x, y]


# (t1, t2) of an orthogonal pair with equal weights: each coefficient a_m/‖Δ_m‖ and the
# rescaling r/‖u‖ lie within [2^-100, 2^100], some of them on its very edge.
EDGES = [
    pytest.param(1.0, 1.0, id="unit"),
    pytest.param(2.0**-101, 2.0**-99, id="coefficient-2^100"),
    pytest.param(2.0**99, 2.0**99, id="coefficient-2^-100"),
    pytest.param(1.5 * 2.0**98, 1.5 * 2.0**98, id="coefficient-below-2^-99"),
    pytest.param(2.0**-100, 2.0**-100, id="scale-below-2^-99"),
]


@pytest.mark.parametrize(("t1", "t2"), EDGES)
def test_rda_within_float32_range_reports_its_radius_exactly(t1: float, t2: float) -> None:
    """‖Δ‖ of an RDA segment merged in float32 is its radius r = Σ a_m ‖Δ_m‖, exactly: not
    the norm re-measured from the rounded float32 result (which reads 0.99999997·r here)."""
    vectors = orthogonal_pair(t1, t2)
    result = merge_weighted(vectors, [1.0, 1.0], fragment_of(2), rule="rda")
    assert result.fallback_segments == ()
    assert result.delta_norm == 0.5 * (t1 + t2)
    assert_close_to(result.delta, reference_merge(vectors, [1.0, 1.0], fragment_of(2), "rda"))


def test_a_wide_segment_leaves_the_other_segments_in_float32() -> None:
    """Segment "a" holds norms of 1e-35 (merged in float64); segment "b" is ordinary and
    keeps the float32 path: the radius it reports is exact."""
    x, y = f32_of(1e-35, 0, 1, 0), f32_of(0, 1e-35, 0, 1)
    frag = fragment_of(4, cut=2)
    result = merge_weighted([x, y], [1.0, 1.0], frag, rule="rda")
    assert result.delta_norm == 1.0  # √(1² + (1e-35)²)
    assert_close_to(result.delta, reference_merge([x, y], [1.0, 1.0], frag, "rda"))


def peak_bytes_of_merge(vectors: list[np.ndarray], frag: Fragment) -> int:
    """Peak memory allocated by one RDA merge into a given buffer, its norms given."""
    out = np.empty(frag.size, np.float32)
    known = [segment_sq_norms(v, frag) for v in vectors]
    merge_weighted(vectors, [1.0, 1.0], frag, rule="rda", out=out, sq_norms=known)  # warm up
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        merge_weighted(vectors, [1.0, 1.0], frag, rule="rda", out=out, sq_norms=known)
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        if started:
            tracemalloc.stop()


@pytest.mark.parametrize(("t1", "t2"), EDGES)
def test_rda_within_float32_range_makes_no_float64_copy(t1: float, t2: float) -> None:
    """The module's speed claim: a piece is merged in one float32 scratch of CHUNK_ELEMENTS
    beside ``out``. Norms and rescaling factors within [2^-100, 2^100] stay on that path,
    so a merge of one full piece allocates one scratch (256 KiB), not float64 copies of it."""
    vectors = orthogonal_pair(t1, t2, CHUNK_ELEMENTS)
    assert peak_bytes_of_merge(vectors, fragment_of(CHUNK_ELEMENTS)) < 1.5 * 4 * CHUNK_ELEMENTS


def test_a_wide_segment_makes_no_float64_copy_of_the_others() -> None:
    n = CHUNK_ELEMENTS + 2
    x, y = orthogonal_pair(1e-35, 1e-35, n)  # segment "a": merged in float64 (2 elements)
    x[2], y[3] = 1.0, 1.0  # segment "b": one full piece, ordinary norms
    assert peak_bytes_of_merge([x, y], fragment_of(n, cut=2)) < 1.5 * 4 * CHUNK_ELEMENTS


def test_a_huge_contribution_with_a_tiny_weight_is_not_zeroed() -> None:
    """a_1 = 1e-7 and ‖Δ_1‖ = 3e38: a_1/‖Δ_1‖ = 3e-46 rounds to 0 in float32, so the segment
    is merged in float64 and Δ_1's direction keeps its share (3e24 of a 3e31 radius)."""
    vectors = [f32_of(3e38, 0), f32_of(0, 1)]
    weights = [1.0, 1e7]
    result = merge_weighted(vectors, weights, fragment_of(2), rule="rda")
    expected = reference_merge(vectors, weights, fragment_of(2), "rda")
    assert expected[0] > 1e24
    np.testing.assert_allclose(result.delta, expected, rtol=1e-6)


@pytest.mark.parametrize(
    ("norm", "copies"),
    [
        pytest.param(1.2 * 2.0**-101, 2, id="2x4.7e-31"),
        pytest.param(1.9 * 2.0**-101, 2, id="2x7.5e-31"),
        pytest.param(1.2 * 2.0**-102, 4, id="4x2.4e-31"),
        pytest.param(1.9 * 2.0**-101, 4, id="4x7.5e-31"),
    ],
)
def test_equal_tiny_contributions_merge_to_themselves(norm: float, copies: int) -> None:
    """M equal contributions of norm in [2^-100/M, 2^-100): each coefficient (1/M)/‖Δ‖ is
    within float32's range, but the rescaling r/‖u‖ = ‖Δ‖ is below 2^-100 and is applied in
    float64. The result is the contribution itself."""
    x = np.random.default_rng(5).standard_normal(40)
    delta = (x / np.linalg.norm(x) * norm).astype(np.float32)
    result = merge_weighted([delta] * copies, [1.0] * copies, fragment_of(40), rule="rda")
    assert result.fallback_segments == ()
    assert_close_to(result.delta, delta.astype(np.float64))
    assert result.delta_norm == pytest.approx(norm, rel=1e-5)


def test_nearly_opposite_huge_contributions_keep_their_radius() -> None:
    """[1e29, ±1e27]: each coefficient 0.5/‖Δ‖ is within range, but the directions average
    to (0, 0.01), so r/‖u‖ = 1e31 exceeds 2^100 and the rescaling is applied in float64."""
    vectors = [f32_of(1e29, 1e27), f32_of(-1e29, 1e27)]
    result = merge_weighted(vectors, [1.0, 1.0], fragment_of(2), rule="rda")
    assert result.fallback_segments == ()
    norm = float(np.hypot(1e29, 1e27))
    np.testing.assert_allclose(result.delta, [0.0, norm], rtol=1e-6, atol=0)
    assert result.delta_norm == pytest.approx(norm, rel=1e-6)


def test_one_contribution_of_norm_exactly_2_pow_100_merges_to_itself() -> None:
    """‖Δ‖ = 2^100 exactly (3² + 2² + 1 + 1 + 1 = 4²): the radius sits on the edge of the
    range, where the stored result is measured rather than assumed."""
    delta = (np.array([3, 2, 1, 1, 1], np.float64) * 2.0**98).astype(np.float32)
    result = merge_weighted([delta], [1.0], fragment_of(5), rule="rda")
    assert result.delta.tobytes() == delta.tobytes()
    assert result.delta_norm == 2.0**100


@pytest.mark.parametrize("magnitude", [1e-35, 1e35])
def test_wide_fallback_threshold_weighs_only_contributions_nonzero_on_the_segment(
    magnitude: float,
) -> None:
    """The float64 path's version of the threshold ‖u‖ < min_direction_norm · Σ_{Δ_m,s ≠ 0}
    a_m (test_merge_edges has the float32 one): a = 0.5 on a zero vector, so the sum is 0.5
    and ‖u‖ = 0.354 lies between 0.6 · 0.5 and 0.8 · 0.5. The zero vector is no direction."""
    vectors = [np.zeros(2, np.float32), f32_of(magnitude, 0), f32_of(0, magnitude)]
    weights = [2.0, 1.0, 1.0]
    kept = merge_weighted(vectors, weights, fragment_of(2), rule="rda", min_direction_norm=0.6)
    assert kept.fallback_segments == ()
    np.testing.assert_allclose(kept.delta, [0.5 * 0.5**0.5 * magnitude] * 2, rtol=1e-6)
    cancelled = merge_weighted(vectors, weights, fragment_of(2), rule="rda", min_direction_norm=0.8)
    assert cancelled.fallback_segments == ("w",)
    np.testing.assert_allclose(cancelled.delta, [0.25 * magnitude] * 2, rtol=1e-6)


def test_wide_fallback_threshold_is_strict() -> None:
    """‖Δ‖ = 2^-110 (merged in float64): u = (1, 0) exactly, ‖u‖ = Σ a_m = 1, not below it."""
    v = f32_of(2.0**-110, 0)
    result = merge_weighted([v, v], [1.0, 1.0], fragment_of(2), rule="rda", min_direction_norm=1.0)
    assert result.fallback_segments == ()
    assert result.delta.tobytes() == v.tobytes()


def test_a_wide_segment_of_several_pieces_after_another_segment() -> None:
    """A float64-merged segment that starts past 0 and spans two pieces of CHUNK_ELEMENTS."""
    n = CHUNK_ELEMENTS + 100
    frag = fragment_of(n + 3, cut=3)
    vectors = [scaled(11, n + 3, 0), scaled(12, n + 3, 0)]
    for v, seed in zip(vectors, (13, 14), strict=True):
        v[3:] = scaled(seed, n, -36)  # norms ~1e-34: coefficients beyond 2^100
    result = merge_weighted(vectors, [1.0, 3.0], frag, rule="rda")
    assert result.fallback_segments == ()
    expected = reference_merge(vectors, [1.0, 3.0], frag, "rda")
    assert_close_to(result.delta[3:], expected[3:])
    assert_close_to(result.delta[:3], expected[:3])


def test_fp32_squared_norms_are_trusted_from_2_pow_minus_100_up() -> None:
    """A piece's squared norm is its float32 dot unless that dot is below 2^-100 (squares may
    have underflowed): then it is redone in float64. 2^-100 itself is a float32 dot (the
    2^-128 of the second element is below its rounding); 2^-102 is redone, exactly."""
    frag = fragment_of(2)
    assert segment_sq_norms(f32_of(2.0**-50, 2.0**-64), frag)[0] == 2.0**-100
    assert segment_sq_norms(f32_of(2.0**-51, 2.0**-64), frag)[0] == 2.0**-102 + 2.0**-128
