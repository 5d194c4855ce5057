"""Liveness from heartbeat age, slow-step stragglers, and joins/leaves between snapshots."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dd_queue.core.membership import (
    Heartbeat,
    Liveness,
    MembershipParams,
    classify,
    diff_members,
    live_learners,
)
from dd_queue.errors import CoreError

PARAMS = MembershipParams(straggling_after_s=2.0, stalled_after_s=5.0, dead_after_s=30.0)


@pytest.mark.parametrize(
    ("age", "state", "reason"),
    [
        (0.4, "active", "last heartbeat 0.4 s ago ≤ straggling_after_s 2 s"),
        (2.0, "active", "last heartbeat 2 s ago ≤ straggling_after_s 2 s"),
        (3.5, "straggling", "last heartbeat 3.5 s ago > straggling_after_s 2 s"),
        (5.0, "straggling", "last heartbeat 5 s ago > straggling_after_s 2 s"),
        (7.2, "stalled", "last heartbeat 7.2 s ago > stalled_after_s 5 s"),
        (30.0, "stalled", "last heartbeat 30 s ago > stalled_after_s 5 s"),
        (31.0, "dead", "last heartbeat 31 s ago > dead_after_s 30 s"),
        (-3.0, "active", "last heartbeat 0 s ago ≤ straggling_after_s 2 s"),
    ],
    ids=[
        "active",
        "at-threshold",
        "straggling",
        "at-stalled-threshold",
        "stalled",
        "at-dead-threshold",
        "dead",
        "clock-skew",
    ],
)
def test_state_by_heartbeat_age(age: float, state: str, reason: str) -> None:
    (lv,) = classify(100.0, [Heartbeat(learner_id="L0", last_seen_s=100.0 - age)], PARAMS)
    assert (lv.state, lv.reason) == (state, reason)
    assert lv.live is (state != "dead")
    assert lv.heartbeat_age_s == pytest.approx(max(0.0, age))


def test_classify_sorts_and_live_excludes_only_dead() -> None:
    beats = [
        Heartbeat(learner_id=f"L{i}", last_seen_s=100.0 - age)
        for i, age in enumerate([40.0, 1.0, 6.0, 3.0])
    ]
    statuses = classify(100.0, reversed(beats), PARAMS)
    assert [(s.learner_id, s.state) for s in statuses] == [
        ("L0", "dead"),
        ("L1", "active"),
        ("L2", "stalled"),
        ("L3", "straggling"),
    ]
    assert live_learners(statuses) == frozenset({"L1", "L2", "L3"})


def test_slow_step_time_makes_a_fresh_learner_straggling() -> None:
    params = MembershipParams(
        straggling_after_s=2.0, stalled_after_s=5.0, dead_after_s=30.0, slow_step_factor=2.0
    )
    beats = [
        Heartbeat(learner_id="L0", last_seen_s=10.0, step_time_s=1.0),
        Heartbeat(learner_id="L1", last_seen_s=10.0, step_time_s=1.2),
        Heartbeat(learner_id="L2", last_seen_s=10.0, step_time_s=2.5),
        Heartbeat(learner_id="L3", last_seen_s=10.0),
        Heartbeat(learner_id="L9", last_seen_s=-50.0, step_time_s=0.01),  # dead: not in median
    ]
    by_id = {lv.learner_id: lv for lv in classify(10.0, beats, params)}
    assert by_id["L2"].state == "straggling"
    assert by_id["L2"].reason.startswith("step time 2.5 s > 2 × median 1.2 s; last heartbeat")
    assert by_id["L0"].state == by_id["L1"].state == by_id["L3"].state == "active"


INCREASE = (
    "liveness thresholds must increase: straggling_after_s < stalled_after_s < dead_after_s, got "
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"straggling_after_s": 5.0, "stalled_after_s": 5.0, "dead_after_s": 30.0},
            INCREASE + "(5.0, 5.0, 30.0)",
        ),
        (
            {"straggling_after_s": 2.0, "stalled_after_s": 30.0, "dead_after_s": 30.0},
            INCREASE + "(2.0, 30.0, 30.0)",
        ),
        (
            {"straggling_after_s": 2.0, "stalled_after_s": 40.0, "dead_after_s": 30.0},
            INCREASE + "(2.0, 40.0, 30.0)",
        ),
        (
            {"straggling_after_s": 0.0, "stalled_after_s": 5.0, "dead_after_s": 30.0},
            "liveness thresholds must be finite seconds > 0, got (0.0, 5.0, 30.0)",
        ),
        (
            {"straggling_after_s": 1.0, "stalled_after_s": 5.0, "dead_after_s": float("inf")},
            "liveness thresholds must be finite seconds > 0, got (1.0, 5.0, inf)",
        ),
        (
            {
                "straggling_after_s": 1.0,
                "stalled_after_s": 2.0,
                "dead_after_s": 3.0,
                "slow_step_factor": 1.0,
            },
            "slow_step_factor must be None or finite and > 1, got 1.0",
        ),
    ],
    ids=["equal", "stalled-equals-dead", "decreasing", "zero", "infinite", "factor-not-above-1"],
)
def test_params_validate(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(CoreError) as err:
        MembershipParams(**kwargs)
    assert str(err.value) == message


def test_slow_step_threshold_uses_the_mean_of_the_middle_two_of_an_even_count() -> None:
    params = MembershipParams(
        straggling_after_s=2.0, stalled_after_s=5.0, dead_after_s=30.0, slow_step_factor=2.0
    )
    beats = [
        Heartbeat(learner_id=f"L{i}", last_seen_s=9.0, step_time_s=step)
        for i, step in enumerate([1.0, 2.0, 3.0, 9.0])
    ]
    statuses = classify(10.0, beats, params)
    assert [lv.state for lv in statuses] == ["active", "active", "active", "straggling"]
    slow = statuses[3]
    assert slow.reason == (
        "step time 9 s > 2 × median 2.5 s; last heartbeat 1 s ago ≤ straggling_after_s 2 s"
    )
    assert slow.heartbeat_age_s == 1.0


def test_a_step_time_of_exactly_factor_times_median_is_not_slow() -> None:
    params = MembershipParams(
        straggling_after_s=2.0, stalled_after_s=5.0, dead_after_s=30.0, slow_step_factor=2.0
    )
    beats = [
        Heartbeat(learner_id=f"L{i}", last_seen_s=10.0, step_time_s=step)
        for i, step in enumerate([1.0, 2.0, 2.0, 4.0])
    ]
    assert all(lv.state == "active" for lv in classify(10.0, beats, params))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"learner_id": "", "last_seen_s": 1.0}, "learner_id must be a non-empty string"),
        ({"learner_id": "L0", "last_seen_s": float("nan")}, "L0: last_seen_s must be finite"),
        (
            {"learner_id": "L0", "last_seen_s": 1.0, "step_time_s": 0.0},
            "L0: step_time_s must be finite and > 0, got 0.0",
        ),
        (
            {"learner_id": "L0", "last_seen_s": 1.0, "step_time_s": -1.0},
            "L0: step_time_s must be finite and > 0, got -1.0",
        ),
        (
            {"learner_id": "L0", "last_seen_s": 1.0, "step_time_s": float("inf")},
            "L0: step_time_s must be finite and > 0, got inf",
        ),
        (
            {"learner_id": "L0", "last_seen_s": 1.0, "step_time_s": float("nan")},
            "L0: step_time_s must be finite and > 0, got nan",
        ),
    ],
    ids=["no-id", "nan-time", "zero-step", "negative-step", "infinite-step", "nan-step"],
)
def test_heartbeats_validate(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(CoreError) as err:
        Heartbeat(**kwargs)
    assert str(err.value) == message


def test_duplicate_heartbeats_are_refused() -> None:
    beat = Heartbeat(learner_id="L0", last_seen_s=1.0)
    with pytest.raises(CoreError, match="repeated: L0"):
        classify(1.0, [beat, beat], PARAMS)
    other = Heartbeat(learner_id="L1", last_seen_s=1.0)
    with pytest.raises(CoreError) as err:
        classify(1.0, [other, beat, other, beat], PARAMS)
    assert str(err.value) == "one heartbeat per learner expected; repeated: L0, L1"


def lv(learner: str, state: str, reason: str = "r") -> Liveness:
    return Liveness(learner_id=learner, state=state, heartbeat_age_s=0.0, reason=reason)  # type: ignore[arg-type]


def test_diff_reports_joins_leaves_and_changes() -> None:
    before = [lv("L0", "active"), lv("L1", "active"), lv("L2", "dead"), lv("L4", "active")]
    after = [
        lv("L0", "stalled"),
        lv("L1", "dead", "last heartbeat 31 s ago > dead_after_s 30 s"),
        lv("L2", "active"),
        lv("L3", "active"),
    ]
    diff = diff_members(before, after)
    assert diff.joined == ("L2", "L3")
    assert diff.left == ("L1", "L4")
    assert diff.changed == (
        ("L0", "active", "stalled"),
        ("L1", "active", "dead"),
        ("L2", "dead", "active"),
        ("L3", None, "active"),
        ("L4", "active", None),
    )
    assert diff.reason == (
        "L2 joined; L3 joined; L1 left (last heartbeat 31 s ago > dead_after_s 30 s); "
        "L4 left (no longer reported); L0 active → stalled"
    )


def test_diff_of_equal_snapshots_is_no_change() -> None:
    snap = [lv("L0", "active")]
    diff = diff_members(snap, snap)
    assert (diff.joined, diff.left, diff.changed, diff.reason) == ((), (), (), "no change")


@given(st.lists(st.floats(-10.0, 100.0), min_size=1, max_size=8), st.floats(0.0, 50.0))
def test_state_never_improves_as_time_passes(last_seen: list[float], later: float) -> None:
    order = {"active": 0, "straggling": 1, "stalled": 2, "dead": 3}
    beats = [Heartbeat(learner_id=f"L{i}", last_seen_s=t) for i, t in enumerate(last_seen)]
    now = classify(50.0, beats, PARAMS)
    then = classify(50.0 + later, beats, PARAMS)
    assert all(order[b.state] >= order[a.state] for a, b in zip(now, then, strict=True))
    assert live_learners(then) <= live_learners(now)
