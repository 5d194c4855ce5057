"""Merging contributions at the edges: error messages, result fields, thresholds, dtypes.

The companion of test_merge.py: where that file checks the merge against a float64 reference,
this one pins what a caller reads besides the merged vector (the reason line, the fields of a
``no_update``, the words of each error), the RDA fallback threshold at its boundaries, the
float32 arithmetic of the mean, and the paths codes take (``CodesSum`` or dequantising).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from dd_queue.core.blockwise import MAX_FOLDED_BLOCK, Blockwise, CodesSum, as_float32
from dd_queue.core.fragments import Fragment, plan_fragments
from dd_queue.core.merge import (
    ContributionData,
    Rule,
    merge_fragment,
    merge_weighted,
    segment_sq_norms,
    token_weights,
    weighted_mean,
)
from dd_queue.errors import CoreError

BOTH: tuple[Rule, ...] = ("rda", "mean")
F32_MAX = float(np.finfo(np.float32).max)


def one_tensor(n: int, name: str = "w") -> Fragment:
    return plan_fragments({name: (n,)}, 1).fragments[0]


def f32(*xs: float) -> np.ndarray:
    return np.array(xs, np.float32)


def blockwise(n: int, block: int, seed: int) -> Blockwise:
    rng = np.random.default_rng(seed)
    codes = rng.integers(-127, 128, size=n).astype(np.int8)
    scales = rng.uniform(1e-3, 1e-2, size=-(-n // block)).astype(np.float32)
    return Blockwise(codes, scales, block)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def test_token_weight_errors_name_the_bad_list_and_show_it() -> None:
    with pytest.raises(CoreError, match=r"^steps must be finite and ≥ 0, got \[1, -3\]$"):
        token_weights([1, 1], [1, -3])
    with pytest.raises(CoreError, match=r"^tokens must be finite and ≥ 0, got \[-1, 2\]$"):
        token_weights([-1, 2], [1, 1])


def test_token_weights_are_flat_float64_whatever_the_dtype_and_shape_of_the_counts() -> None:
    w = token_weights(np.array([1000, 300], np.float32), np.array([10, 3], np.float32))
    assert w.dtype == np.float64
    np.testing.assert_array_equal(w, [100_000.0, 30_000.0])
    nested = token_weights(np.array([[1000, 300]]), np.array([[10, 3]]))
    assert nested.shape == (2,) and nested.dtype == np.float64


def test_float32_weights_are_normalised_in_float64() -> None:
    v = np.ones(3, np.float32)
    result = merge_weighted([v, v], np.array([1.0, 2.0], np.float32), one_tensor(3))
    assert result.weights == (1 / 3, 2 / 3)


def test_a_single_vector_may_take_a_scalar_weight() -> None:
    v = f32(1, 2, 3)
    result = merge_weighted([v], 2.0, one_tensor(3), rule="mean")
    assert result.kind == "merged" and result.weights == (1.0,)
    np.testing.assert_array_equal(result.delta, v)


# ---------------------------------------------------------------------------------------------
# weighted_mean
# ---------------------------------------------------------------------------------------------


def test_weighted_mean_of_no_vectors_is_an_empty_float32_vector() -> None:
    got = weighted_mean([], [])
    assert got.shape == (0,) and got.dtype == np.float32


def test_weighted_mean_of_one_vector_is_that_vector() -> None:
    v = f32(1, -2, 3)
    np.testing.assert_array_equal(weighted_mean([v], [5.0]), v)


def test_weighted_mean_averages_orthogonal_vectors_without_rescaling() -> None:
    got = weighted_mean([f32(1, 0), f32(0, 1)], [1.0, 1.0])
    np.testing.assert_allclose(got, [0.5, 0.5])  # RDA would give norm 1: [0.707, 0.707]


# ---------------------------------------------------------------------------------------------
# MergeResult fields and the reason line
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", BOTH)
def test_a_no_update_keeps_ids_and_rule_and_has_no_fallback_and_zero_norm(rule: Rule) -> None:
    v = np.ones(3, np.float32)
    result = merge_weighted([v, v], [0.0, 0.0], one_tensor(3), rule=rule, learner_ids=["A", "B"])
    assert result.kind == "no_update" and result.learner_ids == ("A", "B")
    assert result.rule == rule and result.fallback_segments == ()
    assert result.delta_norm == 0.0 and isinstance(result.delta_norm, float)
    assert result.reason == "all 2 contributions have zero weight"


@pytest.mark.parametrize("rule", BOTH)
def test_a_merged_result_records_its_rule(rule: Rule) -> None:
    result = merge_weighted([f32(1, 2)], [1.0], one_tensor(2), rule=rule)
    assert result.kind == "merged" and result.rule == rule


def test_reason_lists_each_learners_share() -> None:
    vs = [f32(1, 0), f32(0, 1)]
    result = merge_weighted(vs, [3.0, 1.0], one_tensor(2), rule="mean", learner_ids=["L0", "L1"])
    assert result.reason == "mean merge of 2 contributions (L0 0.750, L1 0.250)"


@pytest.mark.parametrize(
    ("n", "more"), [(7, ""), (8, ""), (9, ", +1 more"), (10, ", +2 more"), (12, ", +4 more")]
)
def test_reason_shows_the_first_eight_shares_and_counts_the_rest(n: int, more: str) -> None:
    vs = [np.ones(2, np.float32)] * n
    result = merge_weighted(vs, [1.0] * n, one_tensor(2), rule="mean")
    shares = ", ".join(f"{i} {1 / n:.3f}" for i in range(min(n, 8)))
    assert result.reason == f"mean merge of {n} contributions ({shares}{more})"


def test_reason_counts_embedding_segments_only_under_rda() -> None:
    fragment = plan_fragments({"embed.w": (2,), "w": (2,)}, 1).fragments[0]
    vs = [f32(1, 2, 3, 4), f32(2, 1, 4, 3)]
    rda = merge_weighted(vs, [1.0, 1.0], fragment, rule="rda")
    assert rda.reason == (
        "rda merge of 2 contributions (0 0.500, 1 0.500); 1 embedding segments by weighted mean"
    )
    mean = merge_weighted(vs, [1.0, 1.0], fragment, rule="mean")
    assert mean.reason == "mean merge of 2 contributions (0 0.500, 1 0.500)"
    plain = merge_weighted([f32(1, 2), f32(2, 1)], [1.0, 1.0], one_tensor(2), rule="rda")
    assert plain.reason == "rda merge of 2 contributions (0 0.500, 1 0.500)"


def test_reason_names_every_segment_whose_directions_cancelled() -> None:
    fragment = plan_fragments({"a": (2,), "b": (2,), "c": (2,)}, 1).fragments[0]
    x = f32(1, 2, 3, 4, 5, 6)
    y = f32(-1, -2, -3, -4, 5, 6)
    result = merge_weighted([x, y], [1.0, 1.0], fragment, rule="rda")
    assert result.fallback_segments == ("a", "b")
    assert result.reason == (
        "rda merge of 2 contributions (0 0.500, 1 0.500); "
        "weighted mean where directions cancelled: a, b"
    )


# ---------------------------------------------------------------------------------------------
# The RDA fallback threshold ‖u_s‖ < min_direction_norm · Σ_{m: Δ_m,s ≠ 0} a_m
# ---------------------------------------------------------------------------------------------


def test_merge_fragment_passes_min_direction_norm_to_the_merge() -> None:
    fragment = one_tensor(2)
    contribs = [
        ContributionData("L0", f32(1, 0), 10, 1, 0),
        ContributionData("L1", f32(0, 1), 10, 1, 0),
    ]
    default = merge_fragment(contribs, fragment, rule="rda")  # ‖u‖ = 0.707 ≥ 1e-3
    assert default.fallback_segments == ()
    np.testing.assert_allclose(default.delta, [0.5**0.5] * 2, rtol=1e-6)
    strict = merge_fragment(contribs, fragment, rule="rda", min_direction_norm=0.9)
    assert strict.fallback_segments == ("w",)
    np.testing.assert_allclose(strict.delta, [0.5, 0.5], rtol=1e-6)


def test_fallback_threshold_weighs_only_contributions_nonzero_on_the_segment() -> None:
    vs = [np.zeros(2, np.float32), f32(1, 0), f32(0, 1)]
    weights = [2.0, 1.0, 1.0]  # a = 0.5 on the zero vector: Σ a_m over non-zero ones is 0.5
    # ‖u‖ = ‖0.25·(1, 0) + 0.25·(0, 1)‖ = 0.354: above 0.6 · 0.5, below 0.8 · 0.5
    kept = merge_weighted(vs, weights, one_tensor(2), rule="rda", min_direction_norm=0.6)
    assert kept.fallback_segments == ()
    np.testing.assert_allclose(kept.delta, [0.5 * 0.5**0.5] * 2, rtol=1e-6)
    cancelled = merge_weighted(vs, weights, one_tensor(2), rule="rda", min_direction_norm=0.8)
    assert cancelled.fallback_segments == ("w",)
    np.testing.assert_allclose(cancelled.delta, [0.25, 0.25], rtol=1e-6)


def test_fallback_threshold_is_strict() -> None:
    v = f32(2, 0)  # a = 0.5, 1/‖v‖ = 0.5: u = (1, 0) exactly, ‖u‖ = Σ a_m = 1
    result = merge_weighted([v, v], [1.0, 1.0], one_tensor(2), rule="rda", min_direction_norm=1.0)
    assert result.fallback_segments == ()
    np.testing.assert_array_equal(result.delta, v)


@pytest.mark.parametrize("n_segments", [64, 256, 1024])
def test_a_contribution_that_is_zero_everywhere_changes_no_segments_path(n_segments: int) -> None:
    """Its coefficient a_m/‖Δ_m,s‖ is 0 on every segment (0/0 is no direction), so each
    segment stays a float32 RDA of the two others: the exact radius 0.5 each (‖Δ‖ = 0.5·√S),
    no fallback, and the direction (1, 1)/√2."""
    fragment = plan_fragments({f"w{i}": (2,) for i in range(n_segments)}, 1).fragments[0]
    x = np.tile(f32(1, 0), n_segments)
    y = np.tile(f32(0, 1), n_segments)
    zero = np.zeros(2 * n_segments, np.float32)
    result = merge_weighted([zero, x, y], [2.0, 1.0, 1.0], fragment, rule="rda")
    assert result.fallback_segments == ()
    assert result.delta_norm == 0.5 * n_segments**0.5
    np.testing.assert_allclose(result.delta, 0.5 * 0.5**0.5, rtol=1e-6)


def test_small_contributions_that_cancel_fall_back_to_the_mean() -> None:
    x = f32(0.5, 0.25)  # ‖x‖ < 1
    result = merge_weighted([x, -x], [1.0, 1.0], one_tensor(2), rule="rda")
    assert result.fallback_segments == ("w",)
    assert not result.delta.any() and result.delta_norm == 0.0


def test_precomputed_norms_are_used_as_given() -> None:
    fragment = one_tensor(2)
    v = f32(3, 4)
    four_times = 4.0 * segment_sq_norms(v, fragment)  # claims ‖v‖ = 10, not 5
    result = merge_weighted([v], [1.0], fragment, rule="rda", sq_norms=[four_times])
    np.testing.assert_allclose(result.delta, [6.0, 8.0], rtol=1e-6)
    assert result.delta_norm == pytest.approx(10.0)


# ---------------------------------------------------------------------------------------------
# Arithmetic and the paths of codes
# ---------------------------------------------------------------------------------------------


def test_the_mean_sums_float32_products_of_float32_shares() -> None:
    rng = np.random.default_rng(7)
    vs = [rng.standard_normal(1000).astype(np.float32) for _ in range(2)]
    result = merge_weighted(vs, [1.0, 2.0], one_tensor(1000), rule="mean")
    expected = vs[0] * np.float32(1 / 3) + vs[1] * np.float32(2 / 3)
    assert expected.dtype == np.float32
    assert result.delta.tobytes() == expected.tobytes()


def test_codes_of_the_largest_folded_block_size_are_summed_by_codes_sum() -> None:
    n = MAX_FOLDED_BLOCK + 904
    codes = [blockwise(n, MAX_FOLDED_BLOCK, seed) for seed in (1, 2)]
    result = merge_weighted(codes, [1.0, 2.0], one_tensor(n), rule="mean")
    expected = np.empty(n, np.float32)
    CodesSum(codes).into(expected, np.array([1 / 3, 2 / 3], np.float32), 0, n, add=False)
    assert result.delta.tobytes() == expected.tobytes()


def test_codes_of_a_block_size_too_large_to_fold_are_dequantised() -> None:
    code = blockwise(100, 2 * MAX_FOLDED_BLOCK, seed=3)
    result = merge_weighted([code], [1.0], one_tensor(100), rule="mean")
    assert result.delta.tobytes() == as_float32(code).tobytes()


# ---------------------------------------------------------------------------------------------
# Non-finite values and overflow
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", BOTH)
def test_zero_weight_contributions_are_never_read(rule: Rule) -> None:
    nan = f32(np.nan, 1.0)
    result = merge_weighted([nan, f32(1, 2)], [0.0, 1.0], one_tensor(2), rule=rule)
    np.testing.assert_allclose(result.delta, [1.0, 2.0], rtol=1e-6)
    inf = f32(np.inf, 1.0)
    with pytest.raises(CoreError, match=r"^contribution of L1 has NaN or Inf"):
        merge_weighted([nan, inf], [0.0, 1.0], one_tensor(2), rule=rule, learner_ids=["L0", "L1"])


def test_opposite_infinities_in_a_mean_are_rejected_without_a_float_warning() -> None:
    x, y = f32(1, np.inf), f32(1, -np.inf)  # inf − inf: an invalid operation, silenced
    with pytest.raises(CoreError, match=r"^contribution of L0 has NaN or Inf"):
        merge_weighted([x, y], [1.0, 1.0], one_tensor(2), rule="mean", learner_ids=["L0", "L1"])


def test_a_mean_of_finite_values_that_overflows_float32_says_so() -> None:
    top = np.full(2, F32_MAX, np.float32)  # float32(1/10) rounds up: Σ exceeds the maximum
    msg = r"^the merged delta overflowed float32; contributions are far too large$"
    with pytest.raises(CoreError, match=msg):
        merge_weighted([top] * 10, [1.0] * 10, one_tensor(2), rule="mean")


def test_segment_norms_of_huge_or_non_finite_codes_raise_no_float_warning() -> None:
    huge = np.full(4, 1e20, np.float32)  # an fp32 dot overflows: redone in fp64
    np.testing.assert_allclose(segment_sq_norms(huge, one_tensor(4)), [4e40], rtol=1e-6)
    fragment = plan_fragments({"a": (1,), "b": (4,)}, 1).fragments[0]
    code = Blockwise(np.array([0, 1, 0, 2, 0], np.int8), f32(np.inf, 1, 1), 2)  # 0 · inf
    norms = segment_sq_norms(code, fragment)
    assert np.isnan(norms[0]) and norms[1] == np.inf


# ---------------------------------------------------------------------------------------------
# The words of each error
# ---------------------------------------------------------------------------------------------


def test_unknown_weighting_and_rule_are_named_in_the_error() -> None:
    fragment = one_tensor(2)
    contrib = ContributionData("L0", f32(1, 2), 1, 1, 0)
    with pytest.raises(CoreError, match=r"^weighting must be 'tokens' or 'uniform', got 'equal'$"):
        merge_fragment([contrib], fragment, weighting="equal")  # type: ignore[arg-type]
    with pytest.raises(CoreError, match=r"^rule must be 'rda' or 'mean', got 'median'$"):
        merge_weighted([f32(1, 2)], [1.0], fragment, rule="median")  # type: ignore[arg-type]


def test_a_misfit_contribution_is_described_by_dtype_and_shape_or_type() -> None:
    fragment = one_tensor(4)
    with pytest.raises(CoreError, match=re.escape("of 0 must be float32 of shape (4,), got list")):
        merge_weighted([[1.0, 2.0, 3.0, 4.0]], [1.0], fragment)  # type: ignore[list-item]
    with pytest.raises(CoreError, match=re.escape("got float64 (4,)")):
        merge_weighted([np.ones(4)], [1.0], fragment)
    with pytest.raises(CoreError, match=re.escape("got blockwise codes of 3 elements")):
        merge_weighted([blockwise(3, 2, seed=0)], [1.0], fragment)


def test_segment_norms_of_a_misfit_delta_say_what_it_is() -> None:
    msg = "segment norms need a float32 vector of shape (4,), got float32 (5,)"
    with pytest.raises(CoreError, match=f"^{re.escape(msg)}$"):
        segment_sq_norms(np.ones(5, np.float32), one_tensor(4))


@pytest.mark.parametrize(
    ("bad", "got"),
    [(np.ones(1), "float64 (1,)"), (np.ones(2, np.float32), "float32 (2,)"), ([1.0, 1.0], "list")],
)
def test_misshapen_precomputed_norms_are_described(bad: object, got: str) -> None:
    fragment = plan_fragments({"w": (4,), "b": (2,)}, 1).fragments[0]
    contrib = ContributionData("L0", np.ones(6, np.float32), 1, 1, 0, sq_norms=bad)  # type: ignore[arg-type]
    msg = f"segment norms of L0 must be float64 of shape (2,), got {got}"
    with pytest.raises(CoreError, match=f"^{re.escape(msg)}$"):
        merge_fragment([contrib], fragment)


def test_an_out_buffer_overlapping_a_contribution_is_refused_in_words() -> None:
    v = np.ones(4, np.float32)
    msg = r"^out overlaps a contribution; pass a separate buffer$"
    with pytest.raises(CoreError, match=msg):
        merge_weighted([v], [1.0], one_tensor(4), out=v)
