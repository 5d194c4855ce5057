"""Round pacing (synchronizer-paced) and fragment offsets (learner-paced)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dd_queue.core.schedule import (
    due_fragments,
    fragment_for_round,
    fragment_offsets,
    fragment_round_index,
    next_round,
    round_interval_s,
)
from dd_queue.errors import CoreError


def test_fragment_is_round_mod_p() -> None:
    assert [fragment_for_round(r, 3) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [fragment_round_index(r, 3) for r in range(7)] == [0, 0, 0, 1, 1, 1, 2]


@pytest.mark.parametrize(
    ("h", "p", "interval"),
    [(24, 24, 0.5), (24, 12, 1.0), (12, 24, 0.25)],
    ids=["paper-P-equals-H", "fewer-fragments", "more-fragments"],
)
def test_interval_is_step_time_times_h_over_p(h: int, p: int, interval: float) -> None:
    assert round_interval_s(0.5, sync_every_steps=h, n_fragments=p) == interval


def test_first_round_opens_at_once() -> None:
    opening = next_round(
        5.0,
        last_opened_at_s=None,
        last_round_id=None,
        step_time_s=1.0,
        sync_every_steps=4,
        n_fragments=4,
    )
    assert (opening.open_now, opening.round_id, opening.fragment_id) == (True, 0, 0)
    assert (opening.due_at_s, opening.interval_s) == (5.0, 1.0)
    assert opening.reason == "first round: opening round 0 (fragment 0)"


PACE = "one round per 1 s (ξ_step 1 s × H/P = 4/4)"


@pytest.mark.parametrize(
    ("now", "open_now", "reason"),
    [
        (10.4, False, f"round 6 (fragment 2) due in 0.6 s: {PACE}"),
        (11.0, True, f"round 6 (fragment 2) due: {PACE}"),
        (11.5, True, f"round 6 (fragment 2) due: {PACE}"),
        (12.0, True, f"round 6 (fragment 2) due: {PACE}, 1 s behind pace"),
        (14.0, True, f"round 6 (fragment 2) due: {PACE}, 3 s behind pace"),
    ],
    ids=["early", "on-time", "late-by-less-than-an-interval", "one-interval-behind", "behind"],
)
def test_next_round_paces_and_explains(now: float, open_now: bool, reason: str) -> None:
    opening = next_round(
        now,
        last_opened_at_s=10.0,
        last_round_id=5,
        step_time_s=1.0,
        sync_every_steps=4,
        n_fragments=4,
    )
    assert opening.open_now is open_now
    assert (opening.round_id, opening.fragment_id, opening.due_at_s) == (6, 2, 11.0)
    assert opening.reason == reason


@pytest.mark.parametrize(
    ("now", "takeover", "open_now"),
    [(10.4, True, False), (10.5, True, True), (10.9, True, True), (10.9, False, False)],
    ids=["takeover-too-soon", "takeover-half-interval", "takeover-later", "no-takeover"],
)
def test_after_a_takeover_the_next_round_opens_once_half_an_interval_passed(
    now: float, takeover: bool, open_now: bool
) -> None:
    opening = next_round(
        now,
        last_opened_at_s=10.0,
        last_round_id=5,
        step_time_s=1.0,
        sync_every_steps=4,
        n_fragments=4,
        takeover=takeover,
    )
    assert opening.open_now is open_now
    assert (opening.round_id, opening.due_at_s, opening.interval_s) == (6, 11.0, 1.0)
    if open_now:
        since, left = f"{now - 10.0:.1f}", f"{11.0 - now:.1f}"
        assert opening.reason == (
            f"round 6 (fragment 2) opens at once after a takeover: the last opening was {since} s "
            f"ago (≥ half the interval), on pace it was due in {left} s: {PACE}"
        )
    else:
        assert "due in" in opening.reason and "takeover" not in opening.reason


@pytest.mark.parametrize(("opened_at", "round_id"), [(1.0, None), (None, 3)])
def test_next_round_needs_both_or_neither_previous_fields(
    opened_at: float | None, round_id: int | None
) -> None:
    with pytest.raises(CoreError) as err:
        next_round(
            0.0,
            last_opened_at_s=opened_at,
            last_round_id=round_id,
            step_time_s=1.0,
            sync_every_steps=1,
            n_fragments=1,
        )
    assert str(err.value) == "last_opened_at_s and last_round_id must both be None or both be set"


@pytest.mark.parametrize(
    ("step_s", "h", "p"),
    [(0.0, 4, 2), (float("nan"), 4, 2), (1.0, 0, 2), (1.0, 4, 0)],
    ids=["zero-step", "nan-step", "zero-h", "zero-p"],
)
def test_interval_rejects_bad_arguments(step_s: float, h: int, p: int) -> None:
    with pytest.raises(CoreError):
        round_interval_s(step_s, sync_every_steps=h, n_fragments=p)


@given(st.integers(1, 64), st.integers(1, 64), st.floats(0.01, 10.0))
def test_each_fragment_merges_once_per_h_steps(p: int, h: int, step_s: float) -> None:
    """Over P rounds every fragment opens once, and P rounds last H step times."""
    interval = round_interval_s(step_s, sync_every_steps=h, n_fragments=p)
    assert interval * p == pytest.approx(h * step_s)
    start = 17 * p + 3
    assert sorted(fragment_for_round(r, p) for r in range(start, start + p)) == list(range(p))


def test_offsets_spread_evenly() -> None:
    assert fragment_offsets(4, 24) == (0, 6, 12, 18)
    assert fragment_offsets(3, 10) == (0, 3, 6)
    assert fragment_offsets(4, 2) == (0, 0, 1, 1)


def test_due_fragments_follow_offsets() -> None:
    offsets = fragment_offsets(4, 8)  # (0, 2, 4, 6)
    assert due_fragments(0, offsets, 8) == ()
    assert due_fragments(2, offsets, 8) == (1,)
    assert due_fragments(8, offsets, 8) == (0,)
    assert due_fragments(9, offsets, 8) == ()
    assert due_fragments(14, offsets, 8) == (3,)


@pytest.mark.parametrize(
    ("step", "offsets"),
    [(-1, (0,)), (1, (4,)), (1, (-1,))],
    ids=["negative-step", "offset-too-big", "negative-offset"],
)
def test_due_fragments_validate(step: int, offsets: tuple[int, ...]) -> None:
    with pytest.raises(CoreError):
        due_fragments(step, offsets, 4)


@given(st.integers(1, 32), st.integers(1, 32), st.integers(1, 200))
def test_learner_paced_sends_each_fragment_once_per_h_steps(p: int, h: int, window: int) -> None:
    offsets = fragment_offsets(p, h)
    assert len(offsets) == p and all(0 <= o < h for o in offsets)
    start = window * h + 1  # any H consecutive steps after the first
    sent = Counter(f for step in range(start, start + h) for f in due_fragments(step, offsets, h))
    assert sent == Counter(range(p))
    per_step = Counter(offsets).most_common(1)[0][1]
    assert per_step == -(-p // h), "fragments per step stay balanced (ceil(P/H) at most)"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fragment_for_round(0, 0), "n_fragments must be an integer ≥ 1, got 0"),
        (lambda: fragment_for_round(0, True), "n_fragments must be an integer ≥ 1, got True"),
        (
            lambda: fragment_for_round(0, 2.0),  # type: ignore[arg-type]
            "n_fragments must be an integer ≥ 1, got 2.0",
        ),
        (lambda: fragment_for_round(-1, 2), "round_id must be an integer ≥ 0, got -1"),
        (
            lambda: fragment_for_round(1.5, 2),  # type: ignore[arg-type]
            "round_id must be an integer ≥ 0, got 1.5",
        ),
        (lambda: fragment_for_round(True, 2), "round_id must be an integer ≥ 0, got True"),
        (lambda: fragment_round_index(0, 0), "n_fragments must be an integer ≥ 1, got 0"),
        (
            lambda: round_interval_s(0.0, sync_every_steps=1, n_fragments=1),
            "step_time_s must be a finite number of seconds > 0, got 0.0",
        ),
        (
            lambda: round_interval_s(float("inf"), sync_every_steps=1, n_fragments=1),
            "step_time_s must be a finite number of seconds > 0, got inf",
        ),
        (
            lambda: round_interval_s(1.0, sync_every_steps=0, n_fragments=1),
            "sync_every_steps must be an integer ≥ 1, got 0",
        ),
        (
            lambda: round_interval_s(1.0, sync_every_steps=1, n_fragments=0),
            "n_fragments must be an integer ≥ 1, got 0",
        ),
        (lambda: fragment_offsets(0, 4), "n_fragments must be an integer ≥ 1, got 0"),
        (lambda: fragment_offsets(4, 0), "sync_every_steps must be an integer ≥ 1, got 0"),
        (lambda: due_fragments(1, (0,), 0), "sync_every_steps must be an integer ≥ 1, got 0"),
        (lambda: due_fragments(-1, (0,), 4), "step must be an integer ≥ 0, got -1"),
        (
            lambda: due_fragments(1.5, (0,), 4),  # type: ignore[arg-type]
            "step must be an integer ≥ 0, got 1.5",
        ),
        (lambda: due_fragments(True, (0,), 4), "step must be an integer ≥ 0, got True"),
        (lambda: due_fragments(1, (0, 4, -1), 4), "offsets must lie in [0, H=4); got [4, -1]"),
    ],
    ids=[
        "zero-p",
        "bool-p",
        "float-p",
        "negative-round",
        "float-round",
        "bool-round",
        "index-zero-p",
        "zero-step-time",
        "infinite-step-time",
        "zero-h",
        "interval-zero-p",
        "offsets-zero-p",
        "offsets-zero-h",
        "due-zero-h",
        "negative-step",
        "float-step",
        "bool-step",
        "offsets-out-of-range",
    ],
)
def test_errors_name_the_argument_and_its_value(call: Callable[[], object], message: str) -> None:
    with pytest.raises(CoreError) as err:
        call()
    assert str(err.value) == message
