"""The exact tallies a commit adds to a fragment's counters, read back: property tests."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dd_queue.core.tallies import (
    HISTOGRAMS,
    Observed,
    dead_letter_increments,
    dead_letters,
    histogram,
    learner_counts,
    reason_tag,
    round_increments,
    summed,
    token_fates,
)

learners = st.sampled_from(["L0", "L1", "a/b", "?"])
outcomes = st.sampled_from(["merged", "late", "stale", "superseded", "dropped", "carried"])
seconds = st.floats(0, 500, allow_nan=False)
durations = st.fixed_dictionaries(
    {name: st.none() | seconds for name in HISTOGRAMS if name.endswith("_s")}
)
rounds = st.builds(
    Observed,
    entries=st.lists(st.tuples(learners, outcomes), max_size=8).map(tuple),
    contributors=st.lists(
        st.tuples(learners, st.integers(0, 10**6), st.integers(0, 40)), max_size=6
    ).map(tuple),
    durations_s=durations,
)


@given(st.lists(rounds, max_size=12))
def test_counters_read_back_what_the_rounds_saw(observed: list[Observed]):
    counters = summed(round_increments(o) for o in observed)
    per = learner_counts(counters)
    for learner in {lid for o in observed for lid, _ in o.entries}:
        for outcome in ("merged", "late", "stale", "superseded", "dropped"):
            n = sum((lid, oc) == (learner, outcome) for o in observed for lid, oc in o.entries)
            assert per.get(learner, {}).get(outcome, 0) == n
        assert "carried" not in per.get(learner, {})
    tokens = {lid: 0 for o in observed for lid, _, _ in o.contributors}
    for o in observed:
        for lid, n, _ in o.contributors:
            tokens[lid] += n
    for lid, n in tokens.items():
        assert per[lid].get("tokens_merged", 0) == n
    stale = histogram(counters, "staleness_versions")
    values = [s for o in observed for _, _, s in o.contributors]
    assert stale.count == len(values) and stale.total == pytest.approx(sum(values))
    for bound, below in zip(stale.bounds, stale.cumulative, strict=False):
        assert below == sum(v <= bound for v in values)
    for name in ("open_to_quorum_s", "quorum_to_merge_s", "merge_to_commit_s"):
        h = histogram(counters, name)
        seen = [o.durations_s[name] for o in observed if o.durations_s[name] is not None]
        assert h.count == len(seen)
        assert h.total == pytest.approx(sum(seen), abs=1e-6 * (1 + len(seen)))
        assert list(h.cumulative) == sorted(h.cumulative)  # cumulative: never falls


def test_an_empty_histogram_reads_as_zeros_and_bad_values_are_refused():
    h = histogram({}, "open_to_quorum_s")
    assert h.count == 0 and h.total == 0 and len(h.cumulative) == len(h.bounds) + 1
    with pytest.raises(ValueError, match="not finite"):
        round_increments(Observed(durations_s={"open_to_quorum_s": math.nan}))
    with pytest.raises(KeyError):
        round_increments(Observed(durations_s={"nap_s": 1.0}))


def test_dead_letters_count_by_learner_and_reason_tag():
    counters = dead_letter_increments(
        [
            ("L0", "non_finite: NaN", 30),
            ("?", "corrupt: bad msgpack", 0),
            ("L0", "non_finite: Inf", 12),
        ]
    )
    assert dead_letters(counters) == {"non_finite": 2, "corrupt": 1}
    assert learner_counts(counters) == {"L0": {"dead_lettered": 2}, "?": {"dead_lettered": 1}}
    assert token_fates(counters) == {"L0": {"dead_lettered": 42}}
    assert reason_tag("") == "?" and reason_tag("late") == "late"


def test_merged_token_share_is_per_fragment_and_none_before_any_training() -> None:
    from dd_queue.core.tallies import merged_token_share

    assert merged_token_share(1200, 2, 1000) == 0.6
    assert merged_token_share(0, 4, 0) is None and merged_token_share(10, 0, 10) is None
