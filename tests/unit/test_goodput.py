"""Goodput ledger arithmetic: goodput, uptime, union of training time, validation."""

from __future__ import annotations

import itertools

import numpy as np
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
