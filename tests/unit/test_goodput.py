"""Goodput ledger arithmetic: goodput, uptime, union of training time, validation."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dd_queue.core.goodput import (
    INTERVAL_KINDS,
    ChipInterval,
    IntervalKind,
    summarize,
    summarize_arrays,
    union_length_s,
)
from dd_queue.errors import CoreError


def iv(group: str, kind: IntervalKind, start: float, end: float, chips: int = 1) -> ChipInterval:
    return ChipInterval(group_id=group, kind=kind, start_s=start, end_s=end, chips=chips)


def test_two_learners_one_failure() -> None:
    """L0 trains throughout; L1 fails for 3 s and restarts for 1 s: training never stops."""
    ledger = [
        iv("L0", "training", 0, 10, chips=4),
        iv("L1", "training", 0, 5, chips=4),
        iv("L1", "down", 5, 8, chips=4),
        iv("L1", "restarting", 8, 9, chips=4),
        iv("L1", "training", 9, 10, chips=4),
    ]
    s = summarize(ledger)
    assert (s.wall_s, s.allocated_chip_s, s.training_chip_s) == (10.0, 80.0, 64.0)
    assert (s.down_chip_s, s.restarting_chip_s, s.waiting_chip_s) == (12.0, 4.0, 0.0)
    assert s.goodput == pytest.approx(0.8)
    assert s.uptime == 1.0


def test_spmd_stall_costs_uptime() -> None:
    """Data-parallel: one failure stops every slice, so uptime drops with goodput."""
    timeline: list[tuple[IntervalKind, float, float]] = [
        ("training", 0, 6),
        ("waiting", 6, 8),
        ("training", 8, 10),
    ]
    ledger = [iv(g, kind, a, b, chips=2) for g in ("S0", "S1") for kind, a, b in timeline]
    s = summarize(ledger)
    assert (s.uptime, s.training_union_s) == (0.8, 8.0)
    assert s.goodput == pytest.approx(0.8)


def test_window_clips_intervals() -> None:
    ledger = [iv("L0", "training", 0, 10), iv("L0", "down", 10, 20)]
    s = summarize(ledger, window_s=(5.0, 15.0))
    assert (s.wall_s, s.training_chip_s, s.down_chip_s, s.goodput, s.uptime) == (
        10.0,
        5.0,
        5.0,
        0.5,
        0.5,
    )


def test_empty_window_and_zero_length_intervals() -> None:
    assert summarize([], window_s=(0.0, 1.0)).goodput == 0.0
    s = summarize([iv("L0", "training", 3, 3), iv("L0", "down", 3, 3)])
    assert (s.wall_s, s.goodput, s.uptime) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("ledger", "words"),
    [
        ([iv("L0", "training", 0, 5), iv("L0", "down", 4, 6)], "L0: intervals [0, 5] and [4, 6]"),
        ([iv("L0", "training", 0, 5), iv("L0", "waiting", 1, 2)], "overlap"),
        ([iv("L1", "training", 5, 4)], "ends before it starts"),
        ([iv("L1", "training", 0, float("inf"))], "finite"),
        ([iv("L1", "training", 0, 1, chips=0)], "chips"),
        ([iv("L1", "idle", 0, 1)], "unknown interval kinds ['idle']"),  # type: ignore[arg-type]
        ([], "empty ledger"),
    ],
    ids=["overlap", "nested", "negative", "infinite", "no-chips", "unknown-kind", "empty"],
)
def test_invalid_ledgers_are_refused(ledger: list[ChipInterval], words: str) -> None:
    with pytest.raises(CoreError) as err:
        summarize(ledger)
    assert words in str(err.value)


def test_touching_and_other_groups_may_share_time() -> None:
    ledger = [iv("L0", "training", 0, 5), iv("L0", "down", 5, 6), iv("L1", "training", 2, 6)]
    assert summarize(ledger).uptime == 1.0


def test_bad_window_and_array_shapes() -> None:
    with pytest.raises(CoreError, match="window_s"):
        summarize([iv("L0", "training", 0, 1)], window_s=(2.0, 1.0))
    with pytest.raises(CoreError, match="equal length"):
        summarize_arrays(
            group=np.zeros(2, np.int64),
            kind=np.zeros(1, np.int64),
            start_s=np.zeros(2),
            end_s=np.ones(2),
            chips=np.ones(2, np.int64),
        )


# ----------------------------------------------------------------------------- properties


@st.composite
def ledgers(draw: st.DrawFn, *, full_cover: bool = False) -> tuple[list[ChipInterval], int]:
    """Per-group timelines on an integer grid over [0, span]; with gaps unless ``full_cover``."""
    span = draw(st.integers(1, 30))
    ledger = []
    for g in range(draw(st.integers(1, 4))):
        chips = draw(st.integers(1, 8))
        cuts = sorted(set(draw(st.lists(st.integers(1, span - 1), max_size=6)) if span > 1 else []))
        bounds = [0, *cuts, span]
        for a, b in itertools.pairwise(bounds):
            kind = draw(st.sampled_from(INTERVAL_KINDS))
            if full_cover or draw(st.booleans()):
                ledger.append(iv(f"L{g}", kind, a, b, chips))
    return ledger, span


@given(ledgers())
def test_goodput_and_uptime_are_shares(case: tuple[list[ChipInterval], int]) -> None:
    ledger, span = case
    s = summarize(ledger, window_s=(0.0, float(span)))
    assert 0.0 <= s.goodput <= 1.0 and 0.0 <= s.uptime <= 1.0
    total = s.training_chip_s + s.waiting_chip_s + s.down_chip_s + s.restarting_chip_s
    assert s.allocated_chip_s == pytest.approx(total)


@given(ledgers(full_cover=True))
def test_uptime_bounds_goodput_when_ledger_covers_the_window(
    case: tuple[list[ChipInterval], int],
) -> None:
    """Goodput is a chip-weighted mean of per-group training shares; uptime ≥ the largest."""
    ledger, span = case
    s = summarize(ledger, window_s=(0.0, float(span)))
    assert s.uptime >= s.goodput - 1e-12


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 10)), max_size=25))
def test_union_matches_brute_force_cells(spans: list[tuple[int, int]]) -> None:
    starts = np.array([a for a, _ in spans], dtype=np.float64)
    ends = np.array([a + d for a, d in spans], dtype=np.float64)
    covered = {cell for a, d in spans for cell in range(a, a + d)}
    assert union_length_s(starts, ends) == len(covered)


def test_union_is_fast_enough_for_a_simulator() -> None:
    rng = np.random.default_rng(0)
    start = rng.uniform(0, 1e6, 200_000)
    end = start + rng.exponential(5.0, start.size)
    assert 0 < union_length_s(start, end) <= end.max() - start.min()


# ----------------------------------------------------------------------------- edges


def arrays(
    group: list[int],
    kind: list[int],
    start: list[float],
    end: list[float],
    chips: list[int] | None = None,
) -> dict[str, Any]:
    return {
        "group": np.array(group, np.int64),
        "kind": np.array(kind, np.int64),
        "start_s": np.array(start, np.float64),
        "end_s": np.array(end, np.float64),
        "chips": np.array(chips if chips is not None else [1] * len(group), np.int64),
    }


@pytest.mark.parametrize(
    ("ledger", "message"),
    [
        (
            {**arrays([0], [0], [0], [1]), "group": np.zeros((1, 1), np.int64)},
            "group, kind, start_s, end_s and chips must be 1-D and of equal length",
        ),
        (arrays([0], [0], [float("nan")], [1]), "interval times must be finite"),
        (arrays([0], [0], [0], [1], chips=[0]), "chips must be integers ≥ 1"),
        (
            arrays([0], [4], [0], [1]),
            "kind codes must index INTERVAL_KINDS ('training', 'waiting', 'down', 'restarting')",
        ),
        (
            arrays([0], [-1], [0], [1]),
            "kind codes must index INTERVAL_KINDS ('training', 'waiting', 'down', 'restarting')",
        ),
        (arrays([], [], [], []), "empty ledger: pass window_s to summarise no intervals"),
        (
            arrays([0, 1, 1], [0, 0, 2], [0, 0, 4], [1, 5, 6]),
            "group 1: intervals [0, 5] and [4, 6] overlap; a group is in one state at a time",
        ),
        (
            arrays([0, 0, 0], [0, 1, 2], [0, 1, 4], [1, 5, 6]),
            "group 0: intervals [1, 5] and [4, 6] overlap; a group is in one state at a time",
        ),
    ],
    ids=[
        "2-d",
        "nan",
        "no-chips",
        "kind-past-the-end",
        "negative-kind",
        "empty",
        "overlap-in-a-later-group",
        "overlap-after-a-touching-pair",
    ],
)
def test_array_ledger_errors_say_what_is_wrong(ledger: dict[str, Any], message: str) -> None:
    with pytest.raises(CoreError) as err:
        summarize_arrays(**ledger)
    assert str(err.value) == message


def test_overlap_message_uses_the_group_name() -> None:
    ledger = [iv("L0", "training", 0, 1), iv("L1", "training", 0, 5), iv("L1", "down", 4, 6)]
    with pytest.raises(CoreError) as err:
        summarize(ledger)
    assert str(err.value) == (
        "L1: intervals [0, 5] and [4, 6] overlap; a group is in one state at a time"
    )


def test_zero_length_interval_inside_another_of_its_group_is_no_overlap() -> None:
    s = summarize([iv("L0", "training", 0, 5), iv("L0", "down", 2, 2)])
    assert (s.training_chip_s, s.down_chip_s, s.goodput) == (5.0, 0.0, 1.0)


def test_intervals_wholly_outside_the_window_count_nothing() -> None:
    ledger = [
        iv("L0", "waiting", -10, -5),
        iv("L0", "training", 0, 5),
        iv("L0", "down", 20, 30),
    ]
    s = summarize(ledger, window_s=(0.0, 10.0))
    assert (s.waiting_chip_s, s.training_chip_s, s.down_chip_s) == (0.0, 5.0, 0.0)
    assert (s.allocated_chip_s, s.goodput, s.uptime) == (5.0, 1.0, 0.5)


def test_a_window_of_zero_length_is_accepted() -> None:
    s = summarize([iv("L0", "training", 0, 5)], window_s=(2.0, 2.0))
    assert (s.wall_s, s.allocated_chip_s, s.goodput, s.uptime) == (0.0, 0.0, 0.0, 0.0)


def test_goodput_of_a_ledger_shorter_than_one_chip_second() -> None:
    s = summarize([iv("L0", "training", 0, 0.25), iv("L0", "down", 0.25, 0.5)])
    assert (s.allocated_chip_s, s.goodput, s.uptime) == (0.5, 0.5, 0.5)


def test_uptime_is_exactly_one_when_training_covers_the_window_despite_rounding() -> None:
    s = summarize([iv("L0", "training", 0, 0.3), iv("L0", "training", 0.3, 0.9)])
    assert s.training_union_s > s.wall_s == 0.9  # 0.3 + (0.9 - 0.3) rounds up
    assert s.uptime == 1.0


@pytest.mark.parametrize(
    ("start_s", "end_s", "chips"),
    [(-1e308, 1e308, 1), (0.0, 1e308, 10), (0.0, 1.7e308, 2)],
)
def test_chip_seconds_beyond_float64_are_refused_not_reported_as_full_goodput(
    start_s: float, end_s: float, chips: int
) -> None:
    """Finite times whose chip-seconds overflow would give ``min(1, nan) == 1``: refused."""
    with pytest.raises(CoreError) as err:
        summarize(
            [
                ChipInterval(
                    group_id="L0", kind="training", start_s=start_s, end_s=end_s, chips=chips
                )
            ]
        )
    assert str(err.value) == (
        "chip-seconds overflow float64: the times or chip counts are too large"
    )


@pytest.mark.parametrize(
    ("first", "second"), [("training", "training"), ("training", "down"), ("waiting", "down")]
)
def test_totals_beyond_float64_are_refused_though_each_interval_fits(
    first: str, second: str
) -> None:
    """Two intervals of 1e308 chip-seconds each: every one is finite, their sum is not. It
    used to read goodput 1.0 (two training) or 0.0 (training and down, really 0.5)."""
    intervals = [
        ChipInterval(group_id="L0", kind=first, start_s=0.0, end_s=1e308, chips=1),
        ChipInterval(group_id="L1", kind=second, start_s=0.0, end_s=1e308, chips=1),
    ]
    with pytest.raises(CoreError, match="chip-seconds overflow float64"):
        summarize(intervals)
    half = [dataclasses.replace(i, end_s=5e307) for i in intervals]  # the sum still fits
    summary = summarize(half)
    assert summary.allocated_chip_s == pytest.approx(1e308)
    assert summary.goodput == pytest.approx(
        {"training": 1.0, "down": 0.5}[second] if first == "training" else 0.0
    )


@pytest.mark.parametrize("codes", [[0.5], [-0.5], [True], [0.0]])
@pytest.mark.parametrize("field", ["group", "kind"])
def test_fractional_or_boolean_codes_are_refused_not_truncated(
    field: str, codes: list[float]
) -> None:
    arrays = {
        "group": np.zeros(1, np.int64),
        "kind": np.zeros(1, np.int64),
        "start_s": np.zeros(1),
        "end_s": np.ones(1),
        "chips": np.ones(1, np.int64),
    }
    arrays[field] = np.array(codes)
    with pytest.raises(CoreError, match=rf"{field} codes must be integers, not "):
        summarize_arrays(**arrays)


@pytest.mark.parametrize("chips", [2.5, 2.0, 0.5, True])
def test_a_chip_interval_with_a_fractional_chip_count_is_refused(chips: float) -> None:
    with pytest.raises(CoreError, match=r"chips must be integers ≥ 1"):
        summarize(
            [ChipInterval(group_id="L0", kind="training", start_s=0.0, end_s=1.0, chips=chips)]
        )  # type: ignore[arg-type]


def test_float32_times_are_clipped_and_summed_in_float64() -> None:
    """A simulator may store times in float32; the window bounds are not rounded to float32."""
    s = summarize_arrays(
        group=np.zeros(1, np.int64),
        kind=np.zeros(1, np.int64),
        start_s=np.array([0.0], np.float32),
        end_s=np.array([1.0], np.float32),
        chips=np.ones(1, np.int64),
        window_s=(0.1, 0.7),
    )
    assert s.training_chip_s == s.training_union_s == 0.7 - 0.1
    whole = summarize_arrays(
        group=np.zeros(1, np.int64),
        kind=np.zeros(1, np.int64),
        start_s=np.array([1.0], np.float32),
        end_s=np.array([1e8], np.float32),
        chips=np.ones(1, np.int64),
    )
    assert whole.training_chip_s == 99_999_999.0  # float32 arithmetic would round to 1e8


def test_group_numbers_beyond_float64_precision_stay_distinct() -> None:
    """Group numbers may be 64-bit ids (hashes): 2^53 and 2^53 + 1 are two groups, not one."""
    big = 2**53
    s = summarize_arrays(**arrays([big, big + 1], [0, 1], [0, 0], [4, 4]))
    assert (s.training_chip_s, s.waiting_chip_s, s.goodput) == (4.0, 4.0, 0.5)
    with pytest.raises(CoreError) as err:
        summarize_arrays(**arrays([big + 1, big + 1], [0, 1], [0, 2], [4, 6]))
    assert str(err.value) == (
        f"group {big + 1}: intervals [0, 4] and [2, 6] overlap; a group is in one state at a time"
    )


def extended(values: list[tuple[float, float]]) -> npt.NDArray[np.longdouble]:
    """``whole + tiny`` in long double, finer than float64 can hold."""
    return np.array([np.longdouble(whole) + np.longdouble(tiny) for whole, tiny in values])


@pytest.mark.skipif(
    np.finfo(np.longdouble).eps == np.finfo(np.float64).eps,
    reason="long double is float64 here",
)
@pytest.mark.parametrize(
    ("start", "end", "length"),
    [
        ([(1.0, 0.0)], [(1.0, 2.0**-60)], 0.0),  # an end just past its start: rounds onto it
        ([(1.0, -(2.0**-62))], [(1.0, 0.0)], 0.0),  # a start just before its end: likewise
        ([(0.0, 0.0), (1.0, -(2.0**-62))], [(1.0, 2.0**-60), (2.0, 0.0)], 2.0),
    ],
    ids=["end", "start", "two-intervals"],
)
def test_union_length_is_taken_in_float64_whatever_the_input_dtype(
    start: list[tuple[float, float]], end: list[tuple[float, float]], length: float
) -> None:
    """``union_length_s`` reads times as float64, as ``summarize_arrays`` does: long double
    times give the length of their float64 values, the same as the ledger's training union."""
    start_s, end_s = extended(start), extended(end)
    as_f64 = union_length_s(start_s.astype(np.float64), end_s.astype(np.float64))
    assert as_f64 == length  # not a sliver of 2^-60 s more
    assert union_length_s(start_s, end_s) == as_f64
    s = summarize_arrays(
        group=np.arange(start_s.size),
        kind=np.zeros(start_s.size, np.int64),
        start_s=start_s,
        end_s=end_s,
        chips=np.ones(start_s.size, np.int64),
    )
    assert s.training_union_s == as_f64
