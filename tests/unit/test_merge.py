"""Merging contributions: properties of the weighted mean and RDA, weights, anchoring.

Every property is checked against a float64 reference written here from the formulas of
algorithm.md; the library computes in float32, hence the relative tolerances of ~1e-5.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dd_queue.core.anchor import VersionRing, anchor_contributions, re_anchor
from dd_queue.core.fragments import Fragment, plan_fragments
from dd_queue.core.merge import (
    CHUNK_ELEMENTS,
    ContributionData,
    Rule,
    merge_fragment,
    merge_weighted,
    segment_sq_norms,
    token_weights,
    weighted_mean,
)
from dd_queue.errors import CoreError

RTOL = 2e-5
BOTH: tuple[Rule, ...] = ("rda", "mean")
Round = tuple[Fragment, list[Any], list[float]]

# ---------------------------------------------------------------------------------------------
# A float64 reference and the hypothesis strategies
# ---------------------------------------------------------------------------------------------


def reference_merge(
    vectors: Sequence[np.ndarray], weights: Sequence[float], fragment: Fragment, rule: str
) -> np.ndarray:
    a = np.asarray(weights, np.float64) / np.sum(weights)
    out = np.zeros(fragment.size)
    for seg in fragment.segments:
        v = np.stack([x[seg.start : seg.stop].astype(np.float64) for x in vectors])
        norms = np.linalg.norm(v, axis=1)
        if rule == "mean" or seg.is_embedding or not norms.any():
            out[seg.start : seg.stop] = a @ v
            continue
        u = a @ np.divide(v, norms[:, None], out=np.zeros_like(v), where=norms[:, None] > 0)
        out[seg.start : seg.stop] = (a @ norms) * u / np.linalg.norm(u)
    return out


def well_conditioned(
    vectors: Sequence[np.ndarray], weights: Sequence[float], fragment: Fragment
) -> bool:
    """False when RDA directions nearly cancel (‖u_s‖ < 5%): there fp32 rounding is amplified
    by 1/‖u_s‖ and tight float64 comparisons are not meaningful (the fallback covers < 0.1%)."""
    a = np.asarray(weights, np.float64) / np.sum(weights)
    for seg in fragment.segments:
        v = np.stack([x[seg.start : seg.stop].astype(np.float64) for x in vectors])
        norms = np.linalg.norm(v, axis=1)
        unit = np.divide(v, norms[:, None], out=np.zeros_like(v), where=norms[:, None] > 0)
        if np.linalg.norm(a @ unit) < 0.05 * a[norms > 0].sum():
            return False
    return True


@st.composite
def rounds(draw: st.DrawFn) -> Round:
    """A fragment of 1–4 tensors (one maybe an embedding) and 1–6 weighted contributions."""
    n_tensors = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(1, 40), min_size=n_tensors, max_size=n_tensors))
    shapes = {
        ("embed" if i == 0 and draw(st.booleans()) else f"w{i}"): (n,) for i, n in enumerate(sizes)
    }
    fragment = plan_fragments(shapes, 1).fragments[0]
    m = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scales = 10.0 ** rng.uniform(-3, 2, size=m)
    vectors = [(rng.standard_normal(fragment.size) * s).astype(np.float32) for s in scales]
    weights = draw(st.lists(st.floats(0.01, 100.0), min_size=m, max_size=m))
    return fragment, vectors, weights


def _close(a: np.ndarray, b: np.ndarray) -> None:
    scale = max(float(np.abs(b).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * scale)


# ---------------------------------------------------------------------------------------------
# Properties (hypothesis)
# ---------------------------------------------------------------------------------------------

PROPS = settings(max_examples=60, deadline=None)


@PROPS
@given(rounds(), st.sampled_from(BOTH))
def test_merge_matches_the_float64_reference(data: Round, rule: Rule) -> None:
    fragment, vectors, weights = data
    assume(rule == "mean" or well_conditioned(vectors, weights, fragment))
    result = merge_weighted(vectors, weights, fragment, rule=rule)
    _close(result.delta, reference_merge(vectors, weights, fragment, rule))
    assert result.kind == "merged" and np.isclose(sum(result.weights), 1.0)
    assert np.isclose(result.delta_norm, np.linalg.norm(result.delta.astype(np.float64)), rtol=1e-4)


@PROPS
@given(rounds(), st.sampled_from(BOTH), st.randoms(use_true_random=False))
def test_merge_is_invariant_to_the_order_of_learners(
    data: Round, rule: Rule, rnd: random.Random
) -> None:
    fragment, vectors, weights = data
    assume(rule == "mean" or well_conditioned(vectors, weights, fragment))
    order = list(range(len(vectors)))
    rnd.shuffle(order)
    ids = [f"L{i}" for i in range(len(vectors))]
    a = merge_weighted(vectors, weights, fragment, rule=rule, learner_ids=ids)
    b = merge_weighted(
        [vectors[i] for i in order],
        [weights[i] for i in order],
        fragment,
        rule=rule,
        learner_ids=[ids[i] for i in order],
    )
    _close(b.delta, a.delta)
    assert b.learner_ids == tuple(ids[i] for i in order)
    by_id = dict(zip(b.learner_ids, b.weights, strict=True))
    assert [by_id[i] for i in ids] == pytest.approx(a.weights, rel=1e-12)


@PROPS
@given(rounds(), st.sampled_from(BOTH), st.floats(1e-6, 1e6))
def test_scaling_every_weight_leaves_the_merge_unchanged(data: Round, rule: Rule, c: float) -> None:
    fragment, vectors, weights = data
    assume(rule == "mean" or well_conditioned(vectors, weights, fragment))
    a = merge_weighted(vectors, weights, fragment, rule=rule)
    b = merge_weighted(vectors, [c * w for w in weights], fragment, rule=rule)
    _close(b.delta, a.delta)
    np.testing.assert_allclose(b.weights, a.weights, rtol=1e-12)


@PROPS
@given(rounds())
def test_rda_output_norm_is_the_weighted_mean_of_input_norms(data: Round) -> None:
    fragment, vectors, weights = data
    result = merge_weighted(vectors, weights, fragment, rule="rda")
    a = np.asarray(weights) / np.sum(weights)
    for seg in fragment.segments:
        if seg.is_embedding or seg.name in result.fallback_segments:
            continue
        norms = [np.linalg.norm(v[seg.start : seg.stop].astype(np.float64)) for v in vectors]
        got = np.linalg.norm(result.delta[seg.start : seg.stop].astype(np.float64))
        assert got == pytest.approx(float(a @ norms), rel=RTOL)


@PROPS
@given(rounds(), st.sampled_from(BOTH))
def test_equal_inputs_merge_to_themselves(data: Round, rule: Rule) -> None:
    fragment, vectors, weights = data
    same = [vectors[0]] * len(vectors)
    result = merge_weighted(same, weights, fragment, rule=rule)
    assert not result.fallback_segments
    _close(result.delta, vectors[0].astype(np.float64))


@PROPS
@given(rounds(), st.sampled_from(BOTH), st.sampled_from(["tokens", "uniform"]))
def test_a_single_contributor_gets_its_own_delta_back(
    data: Round, rule: Rule, weighting: Literal["tokens", "uniform"]
) -> None:
    fragment, vectors, _ = data
    contrib = ContributionData("L0", vectors[0], tokens=512, steps=4, base_version=0)
    result = merge_fragment([contrib], fragment, rule=rule, weighting=weighting)
    assert result.weights == (1.0,) and result.learner_ids == ("L0",)
    if rule == "mean":
        assert np.array_equal(result.delta, vectors[0])  # a_0 = 1.0 exactly: bit-identical
    _close(result.delta, vectors[0].astype(np.float64))


# ---------------------------------------------------------------------------------------------
# Weights and degenerate cases
# ---------------------------------------------------------------------------------------------


def test_token_weights_are_tokens_times_tokens_per_step() -> None:
    w = token_weights([1000, 1000, 300, 0], [10, 0, 3, 5])
    np.testing.assert_array_equal(w, [1000 * 100, 1000 * 1000, 300 * 100, 0])
    for bad in ([-1, 2], [float("nan"), 2], [float("inf"), 1]):
        with pytest.raises(CoreError, match="tokens must be finite"):
            token_weights(bad, [1, 1])
    with pytest.raises(CoreError, match="steps"):
        token_weights([1, 1], [1, -3])
    with pytest.raises(CoreError, match="one of each"):
        token_weights([1, 1], [1])


def test_token_weighting_favours_more_and_faster_learners() -> None:
    fragment = plan_fragments({"w": (4,)}, 1).fragments[0]
    one, two = np.ones(4, np.float32), np.full(4, 2.0, np.float32)
    contribs = [ContributionData("L0", one, 300, 3, 0), ContributionData("L1", two, 100, 1, 0)]
    result = merge_fragment(contribs, fragment, rule="mean")
    assert result.weights == pytest.approx((0.75, 0.25))  # 300·100 vs 100·100
    np.testing.assert_allclose(result.delta, 1.25)
    uniform = merge_fragment(contribs, fragment, rule="mean", weighting="uniform")
    np.testing.assert_allclose(uniform.delta, 1.5)


def test_zero_weight_everywhere_is_no_update_not_nan() -> None:
    fragment = plan_fragments({"w": (3,)}, 1).fragments[0]
    out = np.full(3, np.nan, np.float32)
    contribs = [ContributionData(f"L{i}", np.ones(3, np.float32), 0, 5, 0) for i in range(2)]
    for rule in BOTH:
        result = merge_fragment(contribs, fragment, rule=rule, out=out)
        assert result.kind == "no_update" and "zero weight" in result.reason
        assert result.delta is out and not out.any() and result.weights == (0.0, 0.0)
    empty = merge_fragment([], fragment)
    assert empty.kind == "no_update" and empty.reason == "no contributions"


def test_zero_weight_contributions_are_ignored() -> None:
    fragment = plan_fragments({"w": (3,)}, 1).fragments[0]
    vs = [np.array([1, 2, 3], np.float32), np.array([9, 9, 9], np.float32)]
    result = merge_weighted(vs, [1.0, 0.0], fragment, rule="rda")
    np.testing.assert_allclose(result.delta, vs[0], rtol=1e-6)
    assert result.weights == (1.0, 0.0)


def test_rda_falls_back_to_the_mean_when_directions_cancel() -> None:
    shapes = {"w": (5,), "v": (5,)}
    fragment = plan_fragments(shapes, 1).fragments[0]
    x = np.arange(1, 11, dtype=np.float32)
    y = x.copy()
    y[5:] *= -2.0  # on segment "w" the two directions cancel exactly
    result = merge_weighted([x, y], [1.0, 1.0], fragment, rule="rda")
    assert result.fallback_segments == ("w",) and "cancelled: w" in result.reason
    np.testing.assert_allclose(result.delta[5:], (x[5:] + y[5:]) / 2)  # weighted mean on "w"
    np.testing.assert_allclose(result.delta[:5], x[:5], rtol=1e-6)  # "v": identical inputs


def test_rda_on_all_zero_segment_gives_zeros_without_fallback() -> None:
    fragment = plan_fragments({"w": (4,)}, 1).fragments[0]
    zeros = np.zeros(4, np.float32)
    result = merge_weighted([zeros, zeros], [1.0, 2.0], fragment, rule="rda")
    assert not result.fallback_segments and not result.delta.any() and result.delta_norm == 0.0


def test_embedding_segments_use_the_weighted_mean_under_rda() -> None:
    fragment = plan_fragments({"embed.w": (3,), "w": (3,)}, 1).fragments[0]
    x = np.array([1, 0, 0, 1, 0, 0], np.float32)
    y = np.array([0, 3, 0, 0, 3, 0], np.float32)
    result = merge_weighted([x, y], [1.0, 1.0], fragment, rule="rda")
    emb = fragment.segments[0]
    assert emb.is_embedding and "1 embedding segments" in result.reason
    np.testing.assert_allclose(result.delta[emb.start : emb.stop], [0.5, 1.5, 0])
    np.testing.assert_allclose(np.linalg.norm(result.delta[3:]), 2.0, rtol=1e-6)  # (1 + 3) / 2


def test_large_segments_span_several_chunks() -> None:
    rng = np.random.default_rng(1)
    shapes = {"big": (3 * CHUNK_ELEMENTS + 17,), "embed": (CHUNK_ELEMENTS + 3,), "small": (5,)}
    fragment = plan_fragments(shapes, 1).fragments[0]
    vectors = [rng.standard_normal(fragment.size).astype(np.float32) for _ in range(4)]
    weights = [1.0, 2.0, 0.5, 3.0]
    for rule in BOTH:
        result = merge_weighted(vectors, weights, fragment, rule=rule)
        _close(result.delta, reference_merge(vectors, weights, fragment, rule))


def test_huge_but_finite_values_do_not_count_as_overflow() -> None:
    fragment = plan_fragments({"w": (4,)}, 1).fragments[0]
    v = np.full(4, 1e20, np.float32)  # ‖v‖² overflows float32, not float64
    result = merge_weighted([v, v], [1.0, 1.0], fragment, rule="rda")
    np.testing.assert_allclose(result.delta, v, rtol=1e-6)
    assert result.delta_norm == pytest.approx(2e20, rel=1e-6)


@PROPS
@given(rounds(), st.sampled_from(BOTH), st.data())
def test_precomputed_segment_norms_give_a_bit_identical_merge(
    data: Round, rule: Rule, draw: st.DataObject
) -> None:
    fragment, vectors, weights = data
    norms = [segment_sq_norms(v, fragment) for v in vectors]
    # Some contributions bring their norms, the others leave them to the merge.
    given_ = [k if draw.draw(st.booleans()) else None for k in norms]
    a = merge_weighted(vectors, weights, fragment, rule=rule, sq_norms=given_)
    b = merge_weighted(vectors, weights, fragment, rule=rule)
    assert a.delta.tobytes() == b.delta.tobytes()
    assert (a.delta_norm, a.fallback_segments, a.weights) == (
        b.delta_norm,
        b.fallback_segments,
        b.weights,
    )


def test_segment_norms_are_the_squared_norms_of_each_segment() -> None:
    shapes = {"big": (2 * CHUNK_ELEMENTS + 5,), "embed": (7,), "small": (3,)}
    fragment = plan_fragments(shapes, 1).fragments[0]
    v = np.random.default_rng(4).standard_normal(fragment.size).astype(np.float32)
    expected = [np.sum(v[s.start : s.stop].astype(np.float64) ** 2) for s in fragment.segments]
    np.testing.assert_allclose(segment_sq_norms(v, fragment), expected, rtol=1e-6)
    with pytest.raises(CoreError, match="float32 vector"):
        segment_sq_norms(v[:-1], fragment)


def test_non_finite_values_are_rejected_with_precomputed_norms() -> None:
    fragment = plan_fragments({"w": (4,)}, 1).fragments[0]
    v, w = np.ones(4, np.float32), np.ones(4, np.float32)
    w[1] = np.nan
    contribs = [
        ContributionData(f"L{m}", x, 10, 1, 0, sq_norms=segment_sq_norms(x, fragment))
        for m, x in enumerate((v, w))
    ]
    with pytest.raises(CoreError, match="L1 has NaN or Inf"):
        merge_fragment(contribs, fragment, rule="rda")


def test_misshapen_precomputed_norms_raise_core_error() -> None:
    fragment = plan_fragments({"w": (4,), "b": (2,)}, 1).fragments[0]
    v = np.ones(fragment.size, np.float32)
    for bad in (np.ones(1), np.ones(2, np.float32), [1.0, 1.0]):
        contrib = ContributionData("L0", v, 1, 1, 0, sq_norms=bad)  # type: ignore[arg-type]
        with pytest.raises(CoreError, match="segment norms of L0"):
            merge_fragment([contrib], fragment)
    with pytest.raises(CoreError, match="1 sets of segment norms for 2"):
        merge_weighted([v, v], [1, 1], fragment, sq_norms=[None])


# ---------------------------------------------------------------------------------------------
# Invalid input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", BOTH)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_contributions_are_rejected(rule: Rule, bad: float) -> None:
    fragment = plan_fragments({"w": (4,)}, 1).fragments[0]
    v = np.ones(4, np.float32)
    w = v.copy()
    w[2] = bad
    with pytest.raises(CoreError, match="L1 has NaN or Inf"):
        merge_fragment(
            [ContributionData("L0", v, 10, 1, 0), ContributionData("L1", w, 10, 1, 0)],
            fragment,
            rule=rule,
        )


def test_invalid_inputs_raise_core_error() -> None:
    fragment = plan_fragments({"w": (4,)}, 1).fragments[0]
    v = np.ones(4, np.float32)
    with pytest.raises(CoreError, match="more than once"):
        merge_fragment([ContributionData("L0", v, 1, 1, 0)] * 2, fragment)
    with pytest.raises(CoreError, match="weights must be finite"):
        merge_weighted([v], [-1.0], fragment)
    with pytest.raises(CoreError, match="weights must be finite"):
        merge_weighted([v], [float("nan")], fragment)
    with pytest.raises(CoreError, match="one of each"):
        merge_weighted([v, v], [1.0], fragment)
    with pytest.raises(CoreError, match="float32 of shape"):
        merge_weighted([v.astype(np.float64)], [1.0], fragment)
    with pytest.raises(CoreError, match="float32 of shape"):
        merge_weighted([v[:3]], [1.0], fragment)
    with pytest.raises(CoreError, match="overlaps"):
        merge_weighted([v], [1.0], fragment, out=v)
    with pytest.raises(CoreError, match="out must be"):
        merge_weighted([v], [1.0], fragment, out=np.zeros(5, np.float32))


def test_weighted_mean_of_whole_vectors() -> None:
    vs = [np.array([1.0, 2.0], np.float32), np.array([3.0, 6.0], np.float32)]
    np.testing.assert_allclose(weighted_mean(vs, [3.0, 1.0]), [1.5, 3.0])
    out = np.empty(2, np.float32)
    assert weighted_mean(vs, [1.0, 1.0], out=out) is out


# ---------------------------------------------------------------------------------------------
# Version ring and re-anchoring
# ---------------------------------------------------------------------------------------------


def _ring_with(versions: dict[int, np.ndarray], capacity: int) -> VersionRing:
    ring = VersionRing(capacity=capacity, size=next(iter(versions.values())).size)
    for v, params in versions.items():
        ring.push(v, params)
    return ring


def test_version_ring_keeps_the_newest_versions() -> None:
    params = {v: np.full(3, float(v), np.float32) for v in range(5)}
    ring = _ring_with(params, capacity=3)
    assert ring.versions == (2, 3, 4) and ring.latest_version == 4
    assert ring.get(1) is None and ring.get(7) is None
    got = ring.get(3)
    assert got is not None and np.array_equal(got, params[3])
    with pytest.raises(ValueError):
        got[0] = 1.0  # read-only view
    params[4][0] = 99.0
    assert ring.get(4)[0] == 4.0  # type: ignore[index]  # the ring holds copies
    with pytest.raises(CoreError, match="not newer"):
        ring.push(4, params[4])
    with pytest.raises(CoreError, match="shape"):
        ring.push(5, np.zeros(4, np.float32))
    with pytest.raises(CoreError, match="capacity"):
        VersionRing(capacity=0, size=3)
    assert VersionRing(capacity=2, size=3).latest_version is None


def test_re_anchor_moves_the_delta_to_the_current_version() -> None:
    rng = np.random.default_rng(3)
    theta = {v: rng.standard_normal(6).astype(np.float32) for v in range(3)}
    ring = _ring_with(theta, capacity=4)
    learner_model = rng.standard_normal(6).astype(np.float32)
    stale = ContributionData("L2", theta[0] - learner_model, 10, 2, base_version=0)
    outcome = re_anchor(stale, ring)
    assert not outcome.dropped and outcome.reason == "L2: re-anchored from v0 to v2"
    assert outcome.contribution is not None and outcome.contribution.base_version == 2
    # Θ(now) − Θ(b) + Δ = Θ(now) − θ_m: the paper's anchor at the current global version.
    np.testing.assert_allclose(outcome.contribution.delta, theta[2] - learner_model, atol=1e-6)
    out = np.empty(6, np.float32)
    assert re_anchor(stale, ring, out=out).contribution.delta is out  # type: ignore[union-attr]
    with pytest.raises(CoreError, match="separate float32 buffer"):
        re_anchor(stale, ring, out=stale.delta)  # Θ(now) − Θ(b) would overwrite Δ first
    current = ContributionData("L0", stale.delta, 10, 2, base_version=2)
    assert re_anchor(current, ring).contribution is current


def test_re_anchoring_drops_the_norms_of_the_old_delta() -> None:
    theta = {v: np.full(3, float(v), np.float32) for v in range(2)}
    ring = _ring_with(theta, capacity=2)
    norms = np.array([3.0])
    stale = ContributionData("L0", np.ones(3, np.float32), 1, 1, base_version=0, sq_norms=norms)
    moved = re_anchor(stale, ring).contribution
    assert moved is not None and moved.sq_norms is None
    current = ContributionData("L0", np.ones(3, np.float32), 1, 1, base_version=1, sq_norms=norms)
    assert re_anchor(current, ring).contribution is current  # unchanged Δ keeps its norms


def test_too_stale_or_future_contributions_are_dropped_with_a_reason() -> None:
    ring = _ring_with({v: np.full(2, v, np.float32) for v in range(4)}, capacity=2)
    delta = np.ones(2, np.float32)
    evicted = re_anchor(ContributionData("L1", delta, 1, 1, base_version=1), ring)
    assert evicted.dropped and "left the ring (holds v2..v3)" in evicted.reason
    future = re_anchor(ContributionData("L1", delta, 1, 1, base_version=9), ring)
    assert future.dropped and "newer than current v3" in future.reason
    with pytest.raises(CoreError, match="empty"):
        re_anchor(ContributionData("L1", delta, 1, 1, 0), VersionRing(capacity=1, size=2))
    with pytest.raises(CoreError, match="shape"):
        re_anchor(ContributionData("L1", np.ones(3, np.float32), 1, 1, 2), ring)


def test_anchor_contributions_keeps_mergeable_ones_and_reports_all() -> None:
    ring = _ring_with({v: np.full(2, v, np.float32) for v in range(3)}, capacity=2)
    delta = np.ones(2, np.float32)
    contribs = [ContributionData(f"L{b}", delta, 1, 1, base_version=b) for b in range(3)]
    kept, outcomes = anchor_contributions(contribs, ring)
    assert [c.learner_id for c in kept] == ["L1", "L2"]
    assert [o.dropped for o in outcomes] == [True, False, False]
    np.testing.assert_array_equal(kept[0].delta, [2.0, 2.0])  # 2 − 1 + 1
    kept_l, outcomes_l = anchor_contributions(contribs, None, anchor="learner")
    assert kept_l == tuple(contribs) and all("learner anchoring" in o.reason for o in outcomes_l)
    with pytest.raises(CoreError, match="VersionRing"):
        anchor_contributions(contribs, None)
