"""The quorum + grace-window policy: one table row per decision path, plus the estimates."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dd_queue.clock import FakeClock
from dd_queue.core.policy import (
    Decision,
    Ema,
    Estimates,
    PolicyParams,
    decide,
    grace_window,
)
from dd_queue.core.rounds import ContributionMeta, RoundState, RoundView
from dd_queue.errors import CoreError

A = 0.5  # ema alpha used to build estimates (first samples are taken as they are)
NO_EST = Estimates()
# ξ_step 1, ξ_quorum 0.2, ξ_sync 0.2; with τ = 2: slack 1.6 s, grace 0.5·1.6 = 0.8 s (cap 1 s)
EST = Estimates().observe(alpha=A, step_s=1.0, quorum_s=0.2, sync_s=0.2)
STEP_ONLY = Estimates().observe(alpha=A, step_s=1.0)
NO_SLACK = Estimates().observe(alpha=A, step_s=1.0, quorum_s=0.6, sync_s=0.6)
ROOMY = Estimates().observe(alpha=A, step_s=1.0, quorum_s=0.0, sync_s=0.0)


def view(
    *arrivals: tuple[str, float],
    staleness: dict[str, int] | None = None,
    refused: frozenset[str] = frozenset(),
) -> RoundView:
    """A round of fragment 0 opened at t = 0 with the given first arrivals (and learners whose
    answer to it was refused)."""
    ordered = tuple(sorted(arrivals, key=lambda a: (a[1], a[0])))
    stale = staleness or {}
    return RoundView(
        fragment_id=0,
        round_id=8,
        opened_at_s=0.0,
        current_version=3,
        arrivals=ordered,
        staleness=tuple(sorted((learner, stale.get(learner, 0)) for learner, _ in arrivals)),
        refused=refused,
    )


def live(*learners: str) -> frozenset[str]:
    return frozenset(learners)


@dataclass(frozen=True)
class Case:
    now: float
    view: RoundView
    live: frozenset[str]
    kind: str
    wake_at: float | None
    says: tuple[str, ...]
    params: dict[str, Any] = field(default_factory=dict)
    estimates: Estimates = EST
    unacked: int = 0


BASE: dict[str, Any] = {"quorum": 1, "overlap_steps": 2.0, "round_timeout_s": 30.0}

CASES = {
    "fast-path-all-live-contributed": Case(
        3.0,
        view(("L0", 1.0), ("L1", 2.0), ("L2", 3.0)),
        live("L0", "L1", "L2"),
        "merge",
        None,
        ("all live learners contributed (L0, L1, L2); merging at once",),
        {"quorum": 2},
    ),
    "below-quorum-waits-naming-missing": Case(
        2.0,
        view(("L0", 1.0)),
        live("L0", "L1", "L2"),
        "wait",
        30.0,
        ("waiting for quorum 2: 1/3 contributed (L0); missing L1, L2; round timeout in 28 s",),
        {"quorum": 2},
    ),
    "quorum-then-grace-wait": Case(
        1.5,
        view(("L0", 1.0)),
        live("L0", "L1"),
        "wait",
        1.8,
        (
            "quorum 1 reached 0.5 s ago",
            "grace window 0.8 s (0.5 × slack 1.6 s)",
            "ends in 0.3 s; waiting on L1",
        ),
    ),
    "grace-elapsed-merges": Case(
        1.8,
        view(("L0", 1.0)),
        live("L0", "L1"),
        "merge",
        None,
        ("quorum 1 reached 0.8 s ago", "grace window 0.8 s", "elapsed", "missing L1"),
    ),
    "before-estimates-uses-configured-cap": Case(
        2.0,
        view(("L0", 1.0)),
        live("L0", "L1"),
        "wait",
        3.0,
        ("grace window 2 s (cap grace_cap_s: no ξ_step, ξ_quorum, ξ_sync estimate yet)",),
        {"grace_cap_s": 2.0},
        NO_EST,
    ),
    "before-estimates-uses-step-time-cap": Case(
        1.5,
        view(("L0", 1.0)),
        live("L0", "L1"),
        "wait",
        2.0,
        ("grace window 1 s (cap ξ_step: no ξ_quorum, ξ_sync estimate yet)",),
        {},
        STEP_ONLY,
    ),
    "no-estimate-and-no-cap-means-no-grace": Case(
        1.0,
        view(("L0", 1.0)),
        live("L0", "L1"),
        "merge",
        None,
        ("grace window 0 s (no ξ_step estimate and no grace_cap_s yet) elapsed",),
        {},
        NO_EST,
    ),
    "zero-slack-means-no-grace": Case(
        1.0,
        view(("L0", 1.0)),
        live("L0", "L1"),
        "merge",
        None,
        ("grace window 0 s (no slack: τ·ξ_step 1 s ≤ ξ_quorum + ξ_sync 1.2 s)",),
        {"overlap_steps": 1.0},
        NO_SLACK,
    ),
    "grace-capped-at-step-time": Case(
        1.5,
        view(("L0", 1.0)),
        live("L0", "L1"),
        "wait",
        2.0,
        ("grace window 1 s (capped at ξ_step; γ·slack = 2 s)",),
        {"overlap_steps": 4.0},
        ROOMY,
    ),
    "quorum-above-live-wait-policy": Case(
        3.0,
        view(("L0", 1.0), ("L1", 2.0)),
        live("L0", "L1"),
        "wait",
        30.0,
        ("quorum 3 unreachable", "only 2 learners live", "quorum_policy wait", "timeout in 27 s"),
        {"quorum": 3, "quorum_policy": "wait"},
    ),
    "quorum-above-live-shrink-policy": Case(
        3.0,
        view(("L0", 1.0), ("L1", 2.0)),
        live("L0", "L1"),
        "merge",
        None,
        ("quorum shrunk 3 → 2 (only 2 learners", "all live learners contributed (L0, L1)"),
        {"quorum": 3, "quorum_policy": "shrink"},
    ),
    "shrunk-quorum-still-waits-for-it": Case(
        1.2,
        view(("L0", 1.0)),
        live("L0", "L1"),
        "wait",
        30.0,
        ("quorum shrunk 3 → 2", "waiting for quorum 2", "missing L1"),
        {"quorum": 3, "quorum_policy": "shrink"},
    ),
    "all-dead-nothing-held-waits-forever": Case(
        100.0,
        view(),
        live(),
        "wait",
        None,
        ("no live learners", "waiting for one to join", "0/0 contributed"),
        {"quorum": 2},
    ),
    "all-dead-below-quorum-waits-forever": Case(
        100.0,
        view(("L0", 1.0)),
        live(),
        "wait",
        None,
        ("no live learners", "1/1 contributed (L0)"),
        {"quorum": 2},
    ),
    "all-dead-with-settled-entries-waits-until-the-timeout": Case(
        10.0,
        view(("L0", 1.0)),
        live(),
        "wait",
        30.0,
        ("no live learners", "1/1 contributed (L0)", "3 settled entries acknowledged at the round"),
        {"quorum": 2},
        unacked=3,
    ),
    "all-dead-with-settled-entries-abandons-at-the-timeout-to-ack-them": Case(
        30.0,
        view(("L0", 1.0)),
        live(),
        "abandon",
        None,
        (
            "no live learners and round timeout 30 s passed: closing the round to acknowledge 3 "
            "settled entries; held contributions stay for the fragment's next round",
        ),
        {"quorum": 2},
        unacked=3,
    ),
    "all-dead-quorum-met-merges-what-is-held": Case(
        2.0,
        view(("L0", 1.0)),
        live(),
        "merge",
        None,
        ("quorum 1 met and no live learner left to wait for; 1/1 contributed (L0)",),
    ),
    "timeout-without-contributions-abandons": Case(
        30.0,
        view(),
        live("L0", "L1"),
        "abandon",
        None,
        ("round timeout 30 s passed without quorum 1: 0/2 contributed; missing L0, L1; none held",),
    ),
    "timeout-with-partial-contributions-abandons-and-keeps-them": Case(
        31.0,
        view(("L0", 1.0)),
        live("L0", "L1", "L2"),
        "abandon",
        None,
        (
            "without quorum 3: 1/3 contributed (L0); missing L1, L2",
            "held contributions stay for the fragment's next round",
        ),
        {"quorum": 3},
    ),
    "timeout-cuts-grace-short": Case(
        5.0,
        view(("L0", 1.0)),
        live("L0", "L1"),
        "merge",
        None,
        ("quorum 1 reached 4 s ago", "cut short by round timeout 5 s", "missing L1"),
        {"grace_cap_s": 10.0, "round_timeout_s": 5.0},
        NO_EST,
    ),
    "grace-wait-wakes-at-timeout-if-sooner": Case(
        3.0,
        view(("L0", 1.0)),
        live("L0", "L1"),
        "wait",
        5.0,
        ("grace window 10 s", "ends in 8 s"),
        {"grace_cap_s": 10.0, "round_timeout_s": 5.0},
        NO_EST,
    ),
    "joiner-mid-round-is-waited-for": Case(
        1.2,
        view(("L0", 1.0), ("L1", 1.1)),
        live("L0", "L1", "L2"),
        "wait",
        1.9,
        ("quorum 2 reached 0.1 s ago; 2/3 contributed (L0, L1)", "waiting on L2"),
        {"quorum": 2},
    ),
    "joiner-contributes-and-completes-fast-path": Case(
        1.3,
        view(("L0", 1.0), ("L1", 1.1), ("L2", 1.3)),
        live("L0", "L1", "L2"),
        "merge",
        None,
        ("all live learners contributed (L0, L1, L2)",),
        {"quorum": 2},
    ),
    "dead-contributor-still-counts": Case(
        1.0,
        view(("L0", 0.5), ("L9", 0.2)),
        live("L0"),
        "merge",
        None,
        ("all live learners contributed (L0, L9)",),
        {"quorum": 2},
    ),
    "merge-reason-names-stale-learners": Case(
        2.0,
        view(("L0", 1.0), ("L1", 1.5), staleness={"L1": 2}),
        live("L0", "L1"),
        "merge",
        None,
        ("merging at once; stale versions: L1 2 behind",),
    ),
    "long-learner-lists-are-truncated": Case(
        2.0,
        view(("L0", 1.0)),
        live(*(f"L{i}" for i in range(10))),
        "merge",
        None,
        ("missing L1, L2, L3, L4, L5, L6 +3 more",),
    ),
    "every-live-learner-answered-below-quorum-abandons-at-once": Case(
        2.0,
        view(("L0", 1.0), refused=frozenset({"L1"})),
        live("L0", "L1"),
        "abandon",
        None,
        (
            "every live learner answered round 8 without quorum 2: 1/2 contributed (L0); "
            "refused L1; nothing more to wait for; held contributions stay",
        ),
        {"quorum": 2},
    ),
    "a-refused-learner-is-not-waited-for": Case(
        2.0,
        view(refused=frozenset({"L1"})),
        live("L0", "L1"),
        "wait",
        30.0,
        ("0/2 contributed; refused L1; missing L0; round timeout in 28 s",),
    ),
    "quorum-met-and-the-rest-refused-merges-at-once": Case(
        2.0,
        view(("L0", 1.0), refused=frozenset({"L1"})),
        live("L0", "L1"),
        "merge",
        None,
        ("every live learner answered: 1/2 contributed (L0); refused L1; merging at once",),
    ),
    "refused-and-all-dead-waits-for-a-joiner": Case(
        2.0,
        view(refused=frozenset({"L1"})),
        live(),
        "wait",
        None,
        ("no live learners; waiting for one to join",),
    ),
}


def decide_case(case: Case) -> Decision:
    params = PolicyParams(**{**BASE, **case.params})
    return decide(
        case.now,
        case.view,
        case.live,
        params=params,
        estimates=case.estimates,
        unacked=case.unacked,
    )


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_decide(case: Case) -> None:
    decision = decide_case(case)
    assert decision.kind == case.kind, decision.reason
    if case.wake_at is None:
        assert decision.wake_at is None
    else:
        assert decision.wake_at == pytest.approx(case.wake_at)
    for words in case.says:
        assert words in decision.reason, f"{words!r} not in {decision.reason!r}"


FULL_REASONS = {
    "fast-path-without-stale-learners-has-no-suffix": Case(
        2.0,
        view(("L0", 1.0), ("L1", 1.5)),
        live("L0", "L1"),
        "merge",
        None,
        ("all live learners contributed (L0, L1); merging at once",),
    ),
    "shrink-policy-keeps-a-quorum-equal-to-the-reachable-learners": Case(
        2.0,
        view(("L0", 1.0), ("L1", 1.5)),
        live("L0", "L1"),
        "merge",
        None,
        ("all live learners contributed (L0, L1); merging at once",),
        {"quorum": 2, "quorum_policy": "shrink"},
    ),
    "stale-learners-listed-from-one-version-behind": Case(
        2.0,
        view(("L0", 1.0), ("L1", 1.5), ("L2", 1.6), staleness={"L0": 1, "L2": 2}),
        live("L0", "L1", "L2"),
        "merge",
        None,
        (
            "all live learners contributed (L0, L1, L2); merging at once; "
            "stale versions: L0 1 behind, L2 2 behind",
        ),
    ),
    "all-dead-with-settled-entries-and-nothing-held-abandons": Case(
        30.0,
        view(),
        live(),
        "abandon",
        None,
        (
            "no live learners and round timeout 30 s passed: closing the round to acknowledge 2 "
            "settled entries; none held",
        ),
        unacked=2,
    ),
    "timeout-with-every-live-learner-held-names-none-missing": Case(
        30.0,
        view(("L0", 1.0)),
        live("L0"),
        "abandon",
        None,
        (
            "round timeout 30 s passed without quorum 2: 1/1 contributed (L0); missing none; "
            "held contributions stay for the fragment's next round",
        ),
        {"quorum": 2},
    ),
    "six-missing-learners-are-all-named": Case(
        1.8,
        view(("L0", 1.0)),
        live(*(f"L{i}" for i in range(7))),
        "merge",
        None,
        (
            "quorum 1 reached 0.8 s ago; 1/7 contributed (L0); grace window 0.8 s "
            "(0.5 × slack 1.6 s) elapsed; missing L1, L2, L3, L4, L5, L6",
        ),
    ),
    "seven-missing-learners-truncate-one": Case(
        1.8,
        view(("L0", 1.0)),
        live(*(f"L{i}" for i in range(8))),
        "merge",
        None,
        (
            "quorum 1 reached 0.8 s ago; 1/8 contributed (L0); grace window 0.8 s "
            "(0.5 × slack 1.6 s) elapsed; missing L1, L2, L3, L4, L5, L6 +1 more",
        ),
    ),
}


@pytest.mark.parametrize("case", list(FULL_REASONS.values()), ids=list(FULL_REASONS))
def test_decide_reason_reads_in_full(case: Case) -> None:
    decision = decide_case(case)
    assert (decision.kind, decision.reason) == (case.kind, case.says[0])


@pytest.mark.parametrize(
    ("now", "live_set", "params", "estimates", "grace_s"),
    [
        (1.5, live("L0"), {}, EST, 0.8),
        (1.5, live(), {}, EST, 0.8),
        (1.8, live("L0", "L1"), {}, EST, 0.8),
        (5.0, live("L0", "L1"), {"grace_cap_s": 10.0, "round_timeout_s": 5.0}, NO_EST, 10.0),
    ],
    ids=["fast-path", "no-live-learner-left", "grace-elapsed", "cut-short-by-timeout"],
)
def test_every_merge_reports_the_grace_window(
    now: float,
    live_set: frozenset[str],
    params: dict[str, Any],
    estimates: Estimates,
    grace_s: float,
) -> None:
    decision = decide(
        now,
        view(("L0", 1.0)),
        live_set,
        params=PolicyParams(**{**BASE, **params}),
        estimates=estimates,
    )
    assert decision.kind == "merge", decision.reason
    assert decision.grace_window_s == pytest.approx(grace_s)


def test_decide_without_settled_entries_waits_for_a_joiner_past_the_timeout() -> None:
    params = PolicyParams(**{**BASE, "quorum": 2})
    decision = decide(100.0, view(("L0", 1.0)), live(), params=params, estimates=EST)
    assert (decision.kind, decision.wake_at) == ("wait", None)
    assert decision.reason == (
        "no live learners; waiting for one to join; quorum 2, 1/1 contributed (L0)"
    )


def test_decide_refuses_a_view_whose_arrival_has_no_time() -> None:
    broken = RoundView(
        fragment_id=0,
        round_id=8,
        opened_at_s=0.0,
        current_version=3,
        arrivals=(("L0", None),),  # type: ignore[arg-type]
    )
    with pytest.raises(
        CoreError, match=r"^quorum met but no quorum time; RoundView\.arrivals is inconsistent$"
    ):
        decide(1.0, broken, live("L0", "L1"), params=PolicyParams(**BASE), estimates=EST)


def test_decision_carries_structured_fields() -> None:
    params = PolicyParams(**BASE, quorum_policy="shrink")
    decision = decide(
        1.5, view(("L1", 1.0), ("L0", 1.2)), live("L0", "L1", "L2"), params=params, estimates=EST
    )
    assert (decision.kind, decision.contributors, decision.missing) == (
        "wait",
        ("L0", "L1"),
        ("L2",),
    )
    assert (decision.quorum, decision.quorum_reached_at_s) == (1, 1.0)
    assert decision.wake_at == pytest.approx(1.8)
    assert decision.grace_window_s == pytest.approx(0.8)
    below = decide(0.5, view(), live("L0"), params=params, estimates=EST)
    assert (below.quorum_reached_at_s, below.grace_window_s) == (None, None)


def test_decision_carries_the_quorum_it_applied() -> None:
    """K = 2 kept as asked (no shrink): the decision reports 2, not the default 1."""
    params = PolicyParams(**{**BASE, "quorum": 2})
    waiting = decide(0.5, view(("L0", 0.2)), live("L0", "L1", "L2"), params=params, estimates=EST)
    assert (waiting.kind, waiting.quorum, waiting.quorum_reached_at_s) == ("wait", 2, None)
    grace = decide(
        1.5, view(("L0", 0.2), ("L1", 1.0)), live("L0", "L1", "L2"), params=params, estimates=EST
    )
    assert (grace.kind, grace.quorum, grace.quorum_reached_at_s) == ("wait", 2, 1.0)


def test_a_learner_listed_twice_in_arrivals_does_not_make_a_quorum_time() -> None:
    """A hand-built view naming L0 twice holds one learner: below K = 2 there is no quorum
    time, although the arrivals have two entries."""
    twice = RoundView(
        fragment_id=0,
        round_id=8,
        opened_at_s=0.0,
        current_version=3,
        arrivals=(("L0", 1.0), ("L0", 2.0)),
    )
    params = PolicyParams(**{**BASE, "quorum": 2})
    d = decide(2.5, twice, live("L0", "L1"), params=params, estimates=EST)
    assert (d.kind, d.contributors, d.missing) == ("wait", ("L0",), ("L1",))
    assert (d.quorum, d.quorum_reached_at_s, d.grace_window_s) == (2, None, None)


def test_fake_clock_walkthrough_follows_wake_at() -> None:
    """A round driven as the synchronizer does: admit, decide, sleep until wake_at, merge."""
    clock = FakeClock()
    params = PolicyParams(**{**BASE, "quorum": 2})
    state = RoundState.open(fragment_id=0, round_id=0, opened_at_s=clock.now(), current_version=0)
    members = live("L0", "L1", "L2")

    def offer(learner: str) -> None:
        nonlocal state
        meta = ContributionMeta(
            learner_id=learner, fragment_id=0, round_id=0, base_version=0, n_steps=5, n_tokens=50
        )
        state, admission = state.admit(meta, now=clock.now(), max_staleness=1)
        assert admission.admitted

    clock.advance(0.5)
    offer("L0")
    first = decide(clock.now(), state.view(), members, params=params, estimates=EST)
    assert (first.kind, first.wake_at) == ("wait", 30.0)
    clock.advance(0.25)
    offer("L2")
    second = decide(clock.now(), state.view(), members, params=params, estimates=EST)
    assert second.kind == "wait" and second.missing == ("L1",)
    assert second.wake_at is not None and second.wake_at == pytest.approx(0.75 + 0.8)
    clock.sleep(second.wake_at - clock.now())
    third = decide(clock.now(), state.view(), members, params=params, estimates=EST)
    assert third.kind == "merge" and third.contributors == ("L0", "L2")


FINITE = "must be finite and within"


@pytest.mark.parametrize(
    ("field_name", "value", "message"),
    [
        ("quorum", 0, r"^quorum must be an integer ≥ 1, got 0$"),
        ("quorum", True, r"^quorum must be an integer ≥ 1, got True$"),
        ("quorum_policy", "drop", r"^quorum_policy must be 'wait' or 'shrink', got 'drop'$"),
        ("grace_gamma", -0.1, rf"^grace_gamma {FINITE} \[0\.0, 1\.0\], got -0\.1$"),
        ("grace_gamma", 1.5, rf"^grace_gamma {FINITE} \[0\.0, 1\.0\], got 1\.5$"),
        ("grace_cap_s", -1.0, rf"^grace_cap_s {FINITE} \[0\.0, inf\], got -1\.0$"),
        ("grace_cap_s", math.inf, rf"^grace_cap_s {FINITE} \[0\.0, inf\], got inf$"),
        ("overlap_steps", -1.0, rf"^overlap_steps {FINITE} \[0\.0, inf\], got -1\.0$"),
        ("round_timeout_s", 0.0, r"^round_timeout_s must be > 0$"),
        ("round_timeout_s", math.nan, rf"^round_timeout_s {FINITE} \[0\.0, inf\], got nan$"),
        ("ema_alpha", 0.0, r"^ema_alpha must be > 0 \(0 would never learn\)$"),
        ("ema_alpha", 1.01, rf"^ema_alpha {FINITE} \[0\.0, 1\.0\], got 1\.01$"),
        ("max_staleness", -1, r"^max_staleness must be an integer ≥ 0, got -1$"),
    ],
    ids=lambda v: str(v),
)
def test_params_reject_invalid_values_naming_field_and_value(
    field_name: str, value: object, message: str
) -> None:
    with pytest.raises(CoreError, match=message):
        PolicyParams(**{field_name: value})  # type: ignore[arg-type]


def test_params_accept_edges() -> None:
    PolicyParams(grace_gamma=0.0, grace_cap_s=0.0, overlap_steps=0.0, ema_alpha=1.0)
    PolicyParams(grace_gamma=1.0, max_staleness=0, quorum_policy="shrink")
    assert PolicyParams(round_timeout_s=0.5).round_timeout_s == 0.5


def test_ema_first_sample_then_moves_by_alpha() -> None:
    ema = Ema().update(2.0, 0.25)
    assert (ema.value, ema.n_samples) == (2.0, 1)
    ema = ema.update(6.0, 0.25)
    assert (ema.value, ema.n_samples) == (3.0, 2)
    with pytest.raises(CoreError):
        ema.update(math.nan, 0.25)
    with pytest.raises(CoreError):
        ema.update(1.0, 0.0)


@pytest.mark.parametrize(
    ("sample", "alpha", "message"),
    [
        (math.nan, 0.25, rf"^sample {FINITE} \[-inf, inf\], got nan$"),
        (1.0, 1.5, rf"^alpha {FINITE} \[0\.0, 1\.0\], got 1\.5$"),
        (1.0, -0.5, rf"^alpha {FINITE} \[0\.0, 1\.0\], got -0\.5$"),
        (1.0, 0.0, r"^alpha must be > 0$"),
    ],
    ids=["nan-sample", "alpha-above-one", "negative-alpha", "zero-alpha"],
)
def test_ema_errors_name_the_bad_argument(sample: float, alpha: float, message: str) -> None:
    with pytest.raises(CoreError, match=message):
        Ema(value=1.0, n_samples=1).update(sample, alpha)


@given(st.lists(st.floats(0.0, 1e3), min_size=1, max_size=30), st.floats(0.01, 1.0))
def test_ema_stays_within_sample_range(samples: list[float], alpha: float) -> None:
    ema = Ema()
    for x in samples:
        ema = ema.update(x, alpha)
    assert ema.value is not None
    assert min(samples) - 1e-9 <= ema.value <= max(samples) + 1e-9


def test_estimates_observe_updates_only_given_samples() -> None:
    est = Estimates().observe(alpha=0.5, step_s=1.0)
    est = est.observe(alpha=0.5, step_s=3.0, sync_s=0.4)
    assert est.step_s.value == 2.0 and est.sync_s.value == 0.4 and est.quorum_s.value is None
    with pytest.raises(CoreError, match="quorum_s"):
        est.observe(alpha=0.5, quorum_s=-1.0)


@given(
    step=st.floats(0.01, 100.0),
    quorum=st.floats(0.0, 100.0),
    sync=st.floats(0.0, 100.0),
    tau=st.floats(0.0, 10.0),
    gamma=st.floats(0.0, 1.0),
    cap=st.one_of(st.none(), st.floats(0.0, 50.0)),
)
def test_grace_window_is_clamped_formula(
    step: float, quorum: float, sync: float, tau: float, gamma: float, cap: float | None
) -> None:
    params = PolicyParams(overlap_steps=tau, grace_gamma=gamma, grace_cap_s=cap)
    est = Estimates().observe(alpha=0.5, step_s=step, quorum_s=quorum, sync_s=sync)
    limit = step if cap is None else cap
    expected = min(max(gamma * (tau * step - quorum - sync), 0.0), limit)
    assert grace_window(params, est).seconds == pytest.approx(expected)


@pytest.mark.parametrize(
    ("estimates", "tau", "seconds", "note"),
    [
        (
            Estimates().observe(alpha=A, step_s=1.0, quorum_s=0.5, sync_s=0.5),
            1.0,
            0.0,
            "no slack: τ·ξ_step 1 s ≤ ξ_quorum + ξ_sync 1 s",
        ),
        (ROOMY, 2.0, 1.0, "capped at ξ_step; γ·slack = 1 s"),
        (
            Estimates().observe(alpha=A, step_s=1.0, quorum_s=0.25, sync_s=0.25),
            1.0,
            0.25,
            "0.5 × slack 0.5 s",
        ),
    ],
    ids=["slack-exactly-zero", "wanted-exactly-the-cap", "slack-under-a-second"],
)
def test_grace_window_boundaries_pick_the_clamp(
    estimates: Estimates, tau: float, seconds: float, note: str
) -> None:
    window = grace_window(PolicyParams(overlap_steps=tau, grace_gamma=0.5), estimates)
    assert (window.seconds, window.note) == (seconds, note)


def test_a_zero_gamma_says_so_instead_of_claiming_there_is_no_slack() -> None:
    """γ = 0 with real slack (τ·ξ_step 2 s > 0.4 s): the window is 0 because of γ."""
    est = Estimates().observe(alpha=A, step_s=1.0, quorum_s=0.2, sync_s=0.2)
    window = grace_window(PolicyParams(overlap_steps=2.0, grace_gamma=0.0), est)
    assert (window.seconds, window.note) == (0.0, "γ = 0: no grace window (slack 1.6 s unused)")


NAMES = ("L0", "L1", "L2", "L3", "L4")


@given(
    arrivals=st.dictionaries(st.sampled_from(NAMES), st.floats(0.0, 20.0), max_size=5),
    alive=st.frozensets(st.sampled_from(NAMES)),
    answered=st.frozensets(st.sampled_from(NAMES)),
    quorum=st.integers(1, 6),
    policy=st.sampled_from(["wait", "shrink"]),
    now=st.floats(0.0, 40.0),
    estimates=st.sampled_from([NO_EST, EST, STEP_ONLY, NO_SLACK]),
)
def test_decide_invariants(
    arrivals: dict[str, float],
    alive: frozenset[str],
    answered: frozenset[str],
    quorum: int,
    policy: str,
    now: float,
    estimates: Estimates,
) -> None:
    params = PolicyParams(**{**BASE, "quorum": quorum, "quorum_policy": policy})
    refused = answered - arrivals.keys()  # a learner holding a contribution is not refused
    r = view(*arrivals.items(), refused=refused)
    d = decide(now, r, alive, params=params, estimates=estimates)
    assert d.reason
    assert d.contributors == tuple(sorted(arrivals))
    assert d.missing == tuple(sorted(alive - arrivals.keys() - refused))
    assert 1 <= d.quorum <= quorum
    if d.kind == "merge":
        assert len(d.contributors) >= d.quorum
        assert d.wake_at is None
    elif d.kind == "abandon":
        every_live_answered = bool(alive) and bool(refused) and not d.missing
        assert len(d.contributors) < d.quorum
        assert now >= params.round_timeout_s or every_live_answered
    else:
        assert d.wake_at is None or d.wake_at > now
        assert d.wake_at is not None or not alive
