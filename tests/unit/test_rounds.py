"""Contribution bookkeeping: learner counters and the synchronizer's round state."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dd_queue.core.rounds import ContributionMeta, FragmentCounters, RoundState
from dd_queue.errors import CoreError

MAX_STALENESS = 2


def meta(
    learner: str, round_id: int = 4, base: int = 7, *, fragment_id: int = 0, n_tokens: int = 1000
) -> ContributionMeta:
    return ContributionMeta(
        learner_id=learner,
        fragment_id=fragment_id,
        round_id=round_id,
        base_version=base,
        n_steps=10,
        n_tokens=n_tokens,
    )


def fresh(round_id: int = 4, version: int = 7, opened_at_s: float = 0.0) -> RoundState:
    return RoundState.open(
        fragment_id=0, round_id=round_id, opened_at_s=opened_at_s, current_version=version
    )


def admit_all(state: RoundState, *offers: tuple[ContributionMeta, float]) -> RoundState:
    for c, now in offers:
        state, _ = state.admit(c, now=now, max_staleness=MAX_STALENESS)
    return state


# ----------------------------------------------------------------------------- learner counters


def test_counters_count_steps_and_tokens_until_receipt() -> None:
    counters = FragmentCounters(base_version=3).after_step(100).after_step(50)
    assert counters == FragmentCounters(steps=2, tokens=150, base_version=3)
    assert counters.after_receive(5) == FragmentCounters(steps=0, tokens=0, base_version=5)


@pytest.mark.parametrize("version", [2, 3], ids=["older", "same"])
def test_counters_refuse_a_version_that_is_not_newer(version: int) -> None:
    message = (
        rf"^global version {version} is not newer than base version 3; "
        r"skip it instead of applying it$"
    )
    with pytest.raises(CoreError, match=message):
        FragmentCounters(steps=4, tokens=9, base_version=3).after_receive(version)


def test_counters_reject_negative_tokens() -> None:
    with pytest.raises(CoreError, match=r"^tokens must be an integer ≥ 0, got -1$"):
        FragmentCounters().after_step(-1)


def test_counters_reject_a_negative_received_version() -> None:
    with pytest.raises(CoreError, match=r"^version must be an integer ≥ 0, got -1$"):
        FragmentCounters().after_receive(-1)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"steps": -1}, r"^steps must be an integer ≥ 0, got -1$"),
        ({"tokens": -2}, r"^tokens must be an integer ≥ 0, got -2$"),
        ({"base_version": True}, r"^base_version must be an integer ≥ 0, got True$"),
    ],
    ids=["negative-steps", "negative-tokens", "bool-version"],
)
def test_counters_errors_name_the_field_and_value(bad: dict[str, object], message: str) -> None:
    with pytest.raises(CoreError, match=message):
        FragmentCounters(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"learner_id": ""}, r"^learner_id must be a non-empty string$"),
        ({"n_tokens": -1}, r"^n_tokens must be an integer ≥ 0, got -1$"),
        ({"round_id": -2}, r"^round_id must be an integer ≥ 0, got -2$"),
        ({"base_version": True}, r"^base_version must be an integer ≥ 0, got True$"),
    ],
    ids=["empty-learner", "negative-tokens", "negative-round", "bool-version"],
)
def test_contribution_meta_validates(bad: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "learner_id": "L0",
        "fragment_id": 0,
        "round_id": 1,
        "base_version": 0,
        "n_steps": 1,
        "n_tokens": 1,
        **bad,
    }
    with pytest.raises(CoreError, match=message):
        ContributionMeta(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"fragment_id": -1}, r"^fragment_id must be an integer ≥ 0, got -1$"),
        ({"round_id": -3}, r"^round_id must be an integer ≥ 0, got -3$"),
        ({"current_version": True}, r"^current_version must be an integer ≥ 0, got True$"),
    ],
    ids=["negative-fragment", "negative-round", "bool-version"],
)
def test_open_errors_name_the_field_and_value(bad: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"fragment_id": 0, "round_id": 0, "current_version": 0, **bad}
    with pytest.raises(CoreError, match=message):
        RoundState.open(opened_at_s=0.0, **fields)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- admission


def test_first_contribution_is_accepted() -> None:
    state, adm = fresh().admit(meta("L0"), now=1.0, max_staleness=MAX_STALENESS)
    assert (adm.kind, adm.admitted, adm.staleness) == ("accepted", True, 0)
    assert adm.reason == "L0 round 4 accepted"
    assert state.held == (meta("L0"),)


def test_newer_round_from_same_learner_replaces_older() -> None:
    state = admit_all(fresh(round_id=4), (meta("L0", round_id=4, n_tokens=10), 1.0))
    state = state.reopened(round_id=6, opened_at_s=30.0)
    newer = meta("L0", round_id=6, n_tokens=99)
    state, adm = state.admit(newer, now=31.0, max_staleness=MAX_STALENESS)
    assert adm.kind == "replaced" and adm.admitted
    assert adm.replaced == meta("L0", round_id=4, n_tokens=10)
    assert "replaces its round 4 contribution" in adm.reason
    assert state.held == (newer,)
    assert state.view().arrivals == (("L0", 1.0),), "a replacement keeps the first arrival"


def test_replacement_reports_its_own_staleness() -> None:
    state = admit_all(fresh(round_id=4, version=7), (meta("L0", round_id=4, base=7), 1.0))
    state = state.reopened(round_id=6, opened_at_s=30.0)
    _, adm = state.admit(meta("L0", round_id=6, base=6), now=31.0, max_staleness=MAX_STALENESS)
    assert (adm.kind, adm.staleness) == ("replaced", 1)
    assert adm.reason == "L0 round 6 replaces its round 4 contribution (1 version stale)"


def test_older_round_after_newer_is_superseded() -> None:
    state = fresh(round_id=4).reopened(round_id=6, opened_at_s=30.0)
    state = admit_all(state, (meta("L0", round_id=6), 31.0))
    same, adm = state.admit(meta("L0", round_id=4), now=32.0, max_staleness=MAX_STALENESS)
    assert adm.kind == "superseded" and not adm.admitted and same is state
    assert adm.staleness == 0
    assert "superseded by its round 6 contribution" in adm.reason


def test_duplicate_identity_is_reported_and_not_applied() -> None:
    state = admit_all(fresh(), (meta("L0"), 1.0))
    same, adm = state.admit(meta("L0", n_tokens=5), now=2.0, max_staleness=MAX_STALENESS)
    assert (adm.kind, adm.staleness) == ("duplicate", 0) and same is state
    assert adm.reason == "L0 round 4 is a duplicate; already received"


def test_replaced_identity_redelivered_is_a_duplicate() -> None:
    state = admit_all(fresh(round_id=4), (meta("L0", round_id=4), 1.0))
    state = state.reopened(round_id=6, opened_at_s=30.0)
    state = admit_all(state, (meta("L0", round_id=6), 31.0))
    _, adm = state.admit(meta("L0", round_id=4), now=32.0, max_staleness=MAX_STALENESS)
    assert adm.kind == "duplicate"


def test_redelivery_after_merge_is_a_duplicate_and_other_old_rounds_are_late() -> None:
    state = admit_all(fresh(round_id=4, version=7), (meta("L0"), 1.0))
    state = state.after_merge(round_id=5, opened_at_s=2.0)
    _, dup = state.admit(meta("L0"), now=3.0, max_staleness=MAX_STALENESS)
    assert (dup.kind, dup.staleness) == ("duplicate", 1)
    assert "already counted in version 8" in dup.reason
    _, late = state.admit(meta("L1"), now=3.0, max_staleness=MAX_STALENESS)
    assert late.kind == "late" and not late.admitted and late.staleness == 1
    assert late.reason == "L1 round 4 is late: fragment 0 merged round 4 without it"


@pytest.mark.parametrize(
    ("contribution", "kind", "words", "staleness"),
    [
        (meta("L0", round_id=5, base=6), "invalid", "round 4 is the newest opened", 1),
        (meta("L0", base=8), "invalid", "base version 8 is newer than version 7", -1),
        (meta("L0", base=4), "stale", "3 behind version 7 > max_staleness 2", 3),
    ],
    ids=["future-round", "base-ahead", "too-stale"],
)
def test_rejections(contribution: ContributionMeta, kind: str, words: str, staleness: int) -> None:
    state = fresh(round_id=4, version=7)
    same, adm = state.admit(contribution, now=1.0, max_staleness=MAX_STALENESS)
    assert adm.kind == kind and not adm.admitted and same is state
    assert words in adm.reason
    assert adm.staleness == staleness


def test_one_version_stale_is_singular() -> None:
    _, adm = fresh(version=7).admit(meta("L0", base=6), now=1.0, max_staleness=2)
    assert adm.reason == "L0 round 4 accepted (1 version stale)"


def test_slightly_stale_contribution_still_counts() -> None:
    _, adm = fresh(version=7).admit(meta("L0", base=5), now=1.0, max_staleness=2)
    assert adm.kind == "accepted" and adm.staleness == 2
    assert adm.reason == "L0 round 4 accepted (2 versions stale)"


def test_contribution_for_another_fragment_is_a_routing_error() -> None:
    with pytest.raises(CoreError, match="route contributions by fragment"):
        fresh().admit(meta("L0", fragment_id=1), now=1.0, max_staleness=MAX_STALENESS)


# ----------------------------------------------------------------------------- view and lifecycle


def test_quorum_time_is_when_the_kth_distinct_learner_arrived() -> None:
    state = admit_all(
        fresh(),
        (meta("L2"), 3.0),
        (meta("L0"), 1.0),
        (meta("L1", base=6), 2.0),
    )
    view = state.view()
    assert (view.fragment_id, view.round_id, view.opened_at_s, view.current_version) == (
        0,
        4,
        0.0,
        7,
    )
    assert view.arrivals == (("L0", 1.0), ("L1", 2.0), ("L2", 3.0))
    assert view.first_arrival_s == 1.0
    assert [view.quorum_at_s(k) for k in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, None]
    assert view.staleness == (("L0", 0), ("L1", 1), ("L2", 0))
    assert view.contributors == frozenset({"L0", "L1", "L2"})
    with pytest.raises(CoreError, match=r"^quorum must be ≥ 1, got 0$"):
        view.quorum_at_s(0)


def test_reopen_keeps_contributions_and_merge_clears_them() -> None:
    state = admit_all(fresh(round_id=4, version=7), (meta("L0"), 1.0))
    reopened = state.reopened(round_id=6, opened_at_s=30.0)
    assert (reopened.round_id, reopened.opened_at_s, reopened.held) == (6, 30.0, state.held)
    merged = reopened.after_merge(round_id=8, opened_at_s=31.0)
    assert (merged.current_version, merged.last_merged_round_id, merged.held) == (8, 6, ())
    assert (merged.round_id, merged.opened_at_s) == (8, 31.0)
    assert merged.view().first_arrival_s is None


@pytest.mark.parametrize("round_id", [3, 4], ids=["earlier", "same"])
def test_lifecycle_rounds_must_move_forward(round_id: int) -> None:
    state = admit_all(fresh(round_id=4), (meta("L0"), 1.0))
    with pytest.raises(CoreError, match=rf"^reopened round {round_id} must be after round 4$"):
        state.reopened(round_id=round_id, opened_at_s=1.0)
    with pytest.raises(CoreError, match=rf"^next round {round_id} must be after merged round 4$"):
        state.after_merge(round_id=round_id, opened_at_s=1.0)


def test_merging_nothing_is_refused() -> None:
    with pytest.raises(CoreError, match="nothing to merge"):
        fresh().after_merge(round_id=5, opened_at_s=1.0)


# ----------------------------------------------------------------------------- properties

LEARNERS = ("L0", "L1", "L2", "L3")
events = st.lists(
    st.one_of(
        st.tuples(
            st.just("offer"), st.sampled_from(LEARNERS), st.integers(0, 3), st.integers(0, 3)
        ),
        st.tuples(st.just("reopen"), st.just(""), st.just(0), st.just(0)),
        st.tuples(st.just("merge"), st.just(""), st.just(0), st.just(0)),
    ),
    max_size=40,
)


@given(events)
def test_one_contribution_per_learner_and_none_applied_twice(
    script: list[tuple[str, str, int, int]],
) -> None:
    state = fresh(round_id=0, version=0)
    applied: list[tuple[str, int, int]] = []
    now = 0.0
    for action, learner, round_back, base_back in script:
        now += 1.0
        if action == "offer":
            c = meta(
                learner,
                round_id=max(0, state.round_id - round_back),
                base=max(0, state.current_version - base_back),
            )
            state, _ = state.admit(c, now=now, max_staleness=MAX_STALENESS)
        elif action == "reopen":
            state = state.reopened(round_id=state.round_id + 1, opened_at_s=now)
        elif state.held:
            applied.extend(h.identity for h in state.held)
            state = state.after_merge(round_id=state.round_id + 1, opened_at_s=now)
        held = [h.learner_id for h in state.held]
        assert len(held) == len(set(held)), held
        assert all(state.current_version - h.base_version <= MAX_STALENESS for h in state.held)
    assert len(applied) == len(set(applied)), "a contribution was applied twice"


@given(st.permutations(LEARNERS), st.lists(st.integers(0, 2), min_size=4, max_size=4))
def test_arrival_order_of_distinct_learners_does_not_change_the_set(
    order: list[str], bases: list[int]
) -> None:
    contributions = {
        learner: meta(learner, base=7 - b) for learner, b in zip(LEARNERS, bases, strict=True)
    }
    in_order = admit_all(fresh(), *((contributions[x], 1.0) for x in LEARNERS))
    shuffled = admit_all(fresh(), *((contributions[x], 1.0) for x in order))
    assert shuffled.held == in_order.held
    assert shuffled.view().staleness == in_order.view().staleness


# ----------------------------------------------------------------------- refusal after admission


@given(
    arrivals=st.dictionaries(
        st.sampled_from(["L0", "L1", "L2", "L3"]),
        st.floats(0.0, 100.0, allow_nan=False),
        min_size=1,
    ),
    refused=st.sets(st.sampled_from(["L0", "L1", "L2", "L3", "L9"])),
)
def test_without_drops_exactly_the_refused_and_keeps_them_seen(
    arrivals: dict[str, float], refused: set[str]
) -> None:
    state = admit_all(fresh(), *((meta(who), t) for who, t in sorted(arrivals.items())))
    after = state.without(frozenset(refused))
    kept = sorted(set(arrivals) - refused)
    assert [h.learner_id for h in after.held] == kept
    assert after.first_arrivals == tuple(sorted((arrivals[w], w) for w in kept))
    assert after.view().contributors == frozenset(kept)  # quorum counts only these
    assert after.seen == state.seen  # a redelivery of a refused one stays a duplicate
    same = ("fragment_id", "round_id", "opened_at_s", "current_version", "last_merged_round_id")
    assert all(getattr(after, f) == getattr(state, f) for f in same)
    assert after.merged == state.merged
    for who in refused & set(arrivals):
        _, again = after.admit(meta(who), now=200.0, max_staleness=MAX_STALENESS)
        assert again.kind == "duplicate"


# ------------------------------------------------------------- answers refused before admission


def test_a_refused_answer_to_the_open_round_marks_the_learner_refused_until_it_closes() -> None:
    state = admit_all(fresh(round_id=4), (meta("L0"), 1.0))
    assert state.refusing("L1", 4).refused == {"L1"}  # answered round 4, nothing held
    assert state.refusing("L1", 4).view().refused == {"L1"}  # the policy sees it
    assert state.refusing("L1", 2) is state  # another round's answer: L1 may still answer 4
    assert state.refusing("L0", 4) is state  # L0 holds one: a contributor, not refused
    later = state.refusing("L1", 4)
    accepted, admission = later.admit(meta("L1", base=6), now=2.0, max_staleness=MAX_STALENESS)
    assert admission.admitted and accepted.refused == frozenset()  # held now
    assert later.reopened(round_id=6, opened_at_s=3.0).refused == frozenset()
    assert later.after_merge(round_id=6, opened_at_s=3.0).refused == frozenset()


def test_without_marks_refused_only_those_that_answered_the_open_round() -> None:
    carried = admit_all(fresh(round_id=2), (meta("L0", round_id=2), 1.0))
    state = admit_all(carried.reopened(round_id=4, opened_at_s=2.0), (meta("L1"), 3.0))
    after = state.without(frozenset({"L0", "L1"}))
    assert after.refused == {"L1"}  # L0's was round 2's, carried: it may still answer round 4
