"""The restart rule of ``ddq supervise`` (``dd_queue.core.restarts``), as properties: exit 0 and
give-up codes are never restarted, every other exit is, after a backoff in
``[backoff_s, max_backoff_s]`` that doubles with each quick failure and resets after a stable run;
exits are described by signal name; a policy that cannot work is refused."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dd_queue.core.restarts import RestartDecision, RestartPolicy, decide_restart, describe_exit
from dd_queue.errors import CoreError

# Exit codes as subprocess reports them: negative for "killed by a signal", 0..255 otherwise.
codes = st.integers(min_value=-64, max_value=255)
durations = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)
attempts = st.integers(min_value=0, max_value=200)


@st.composite
def policies(
    draw: st.DrawFn, *, positive_backoff: bool = False, min_give_up: int = 0
) -> RestartPolicy:
    """A valid policy: 0 <= backoff_s <= max_backoff_s, give-up codes that exclude 0."""
    low = 0.001 if positive_backoff else 0.0
    backoff = draw(st.floats(min_value=low, max_value=100.0, allow_nan=False))
    ceiling = draw(st.floats(min_value=backoff, max_value=1e4, allow_nan=False))
    stable = draw(st.floats(min_value=0.0, max_value=1e4, allow_nan=False))
    give_up = draw(
        st.frozensets(st.integers(min_value=1, max_value=255), min_size=min_give_up, max_size=4)
    )
    return RestartPolicy(
        backoff_s=backoff, max_backoff_s=ceiling, stable_after_s=stable, give_up_codes=give_up
    )


# ── who is restarted ────────────────────────────────────────────────────────────────────────


@given(policy=policies(), ran_s=durations, before=attempts)
def test_exit_zero_is_never_restarted(policy: RestartPolicy, ran_s: float, before: int) -> None:
    decision = decide_restart(policy, exit_code=0, ran_s=ran_s, attempt_before=before)
    assert decision == RestartDecision(False, 0.0, 0, decision.reason)
    assert "not restarting" in decision.reason and "finished" in decision.reason


@given(policy=policies(min_give_up=1), ran_s=durations, before=attempts, data=st.data())
def test_give_up_codes_are_never_restarted(
    policy: RestartPolicy, ran_s: float, before: int, data: st.DataObject
) -> None:
    code = data.draw(st.sampled_from(sorted(policy.give_up_codes)))
    decision = decide_restart(policy, exit_code=code, ran_s=ran_s, attempt_before=before)
    assert not decision.restart and decision.delay_s == 0.0
    assert decision.attempt == before + 1
    assert "not restarting" in decision.reason and f"code {code}" in decision.reason


def test_a_give_up_exit_says_not_restarting_and_why() -> None:
    decision = decide_restart(RestartPolicy(), exit_code=2, ran_s=1.5, attempt_before=3)
    assert decision == RestartDecision(
        False,
        0.0,
        4,
        "exited with code 2 after 1.5 s: code 2 means a misconfiguration that a restart would "
        "repeat; not restarting (fix what its log says)",
    )


def test_default_policy_gives_up_on_2_and_restarts_3_and_137() -> None:
    policy = RestartPolicy()
    assert not decide_restart(policy, exit_code=2, ran_s=0.1, attempt_before=0).restart
    assert decide_restart(policy, exit_code=3, ran_s=0.1, attempt_before=0).restart
    assert decide_restart(policy, exit_code=137, ran_s=0.1, attempt_before=0).restart
    assert decide_restart(policy, exit_code=-9, ran_s=0.1, attempt_before=0).restart


@given(policy=policies(positive_backoff=True), code=codes, ran_s=durations, before=attempts)
def test_every_other_code_restarts_within_the_backoff_bounds(
    policy: RestartPolicy, code: int, ran_s: float, before: int
) -> None:
    assume(code != 0 and code not in policy.give_up_codes)
    decision = decide_restart(policy, exit_code=code, ran_s=ran_s, attempt_before=before)
    assert decision.restart
    assert policy.backoff_s <= decision.delay_s <= policy.max_backoff_s
    assert decision.attempt >= 1
    assert "restart in" in decision.reason


@given(code=codes.filter(lambda c: c not in (0, 2)), ran_s=durations, before=attempts)
def test_zero_backoff_restarts_at_once(code: int, ran_s: float, before: int) -> None:
    policy = RestartPolicy(backoff_s=0.0, max_backoff_s=5.0)
    decision = decide_restart(policy, exit_code=code, ran_s=ran_s, attempt_before=before)
    assert decision.restart and decision.delay_s == 0.0


# ── the backoff ─────────────────────────────────────────────────────────────────────────────


@given(
    policy=policies(positive_backoff=True),
    code=codes.filter(lambda c: c not in (0, 2)),
    n=st.integers(min_value=2, max_value=40),
)
def test_delay_doubles_with_quick_failures_until_the_cap(
    policy: RestartPolicy, code: int, n: int
) -> None:
    policy = RestartPolicy(
        backoff_s=policy.backoff_s,
        max_backoff_s=policy.max_backoff_s,
        stable_after_s=max(policy.stable_after_s, 1.0),
        give_up_codes=frozenset({2}),
    )
    quick_s = policy.stable_after_s / 2
    attempt, delays = 0, []
    for _ in range(n):
        decision = decide_restart(policy, exit_code=code, ran_s=quick_s, attempt_before=attempt)
        assert decision.restart and decision.attempt == attempt + 1
        attempt = decision.attempt
        delays.append(decision.delay_s)
    assert delays[0] == policy.backoff_s
    for earlier, later in itertools.pairwise(delays):
        assert later == min(policy.max_backoff_s, 2 * earlier)
    assert delays == sorted(delays)


@pytest.mark.parametrize("before", [60, 61, 10**6])
def test_doubling_stops_after_60_so_an_uncapped_backoff_stays_finite(before: int) -> None:
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=math.inf)
    decision = decide_restart(policy, exit_code=3, ran_s=0.0, attempt_before=before)
    assert (decision.attempt, decision.delay_s) == (before + 1, 2.0**60)


def test_backoff_sequence_of_the_defaults() -> None:
    policy = RestartPolicy()  # 1 s doubling to 30 s
    attempt, delays = 0, []
    for _ in range(7):
        decision = decide_restart(policy, exit_code=137, ran_s=0.5, attempt_before=attempt)
        attempt = decision.attempt
        delays.append(decision.delay_s)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert attempt == 7


@given(
    policy=policies(positive_backoff=True),
    code=codes.filter(lambda c: c not in (0, 2)),
    before=attempts,
    extra_s=st.floats(min_value=0.0, max_value=1e5, allow_nan=False),
)
def test_a_stable_run_resets_the_backoff(
    policy: RestartPolicy, code: int, before: int, extra_s: float
) -> None:
    policy = RestartPolicy(
        backoff_s=policy.backoff_s,
        max_backoff_s=policy.max_backoff_s,
        stable_after_s=policy.stable_after_s,
        give_up_codes=frozenset({2}),
    )
    ran_s = policy.stable_after_s + extra_s
    decision = decide_restart(policy, exit_code=code, ran_s=ran_s, attempt_before=before)
    assert decision.restart and decision.attempt == 1 and decision.delay_s == policy.backoff_s
    assert "backoff reset" in decision.reason


def test_a_run_just_short_of_stable_does_not_reset() -> None:
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0, stable_after_s=60.0)
    short = decide_restart(policy, exit_code=3, ran_s=59.9, attempt_before=3)
    assert (short.attempt, short.delay_s) == (4, 8.0) and "failure 4 in a row" in short.reason
    stable = decide_restart(policy, exit_code=3, ran_s=60.0, attempt_before=3)
    assert (stable.attempt, stable.delay_s) == (1, 1.0)


@given(policy=policies(), code=codes, ran_s=durations, before=attempts)
def test_the_reason_names_how_it_exited(
    policy: RestartPolicy, code: int, ran_s: float, before: int
) -> None:
    decision = decide_restart(policy, exit_code=code, ran_s=ran_s, attempt_before=before)
    assert decision.reason.startswith(describe_exit(code))
    assert f"after {ran_s:.1f} s" in decision.reason


# ── describing exits ────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (-9, "SIGKILL"),
        (-15, "SIGTERM"),
        (-2, "SIGINT"),
        (-11, "SIGSEGV"),
        (-6, "SIGABRT"),
        (-1, "SIGHUP"),
        (-10, "signal 10"),
    ],
)
def test_negative_codes_name_the_signal(code: int, words: str) -> None:
    assert describe_exit(code) == f"was killed by {words}"


def test_shell_style_signal_codes_name_the_signal() -> None:
    assert describe_exit(137) == "exited with code 137 (as if killed by SIGKILL)"
    assert describe_exit(129) == "exited with code 129 (as if killed by SIGHUP)"
    assert "SIGTERM" in describe_exit(143)
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(128) == "exited with code 128"
    assert describe_exit(138) == "exited with code 138"  # 128 + 10: no name known


@given(code=st.integers(min_value=0, max_value=128))
def test_small_codes_are_just_codes(code: int) -> None:
    assert describe_exit(code) == f"exited with code {code}"


# ── invalid policies ────────────────────────────────────────────────────────────────────────


@given(
    backoff=st.floats(min_value=0.001, max_value=1e4, allow_nan=False),
    less=st.floats(min_value=0.0, max_value=0.999),
)
def test_backoff_above_the_cap_is_refused(backoff: float, less: float) -> None:
    ceiling = backoff * less
    assume(ceiling < backoff)
    with pytest.raises(CoreError, match="backoff_s"):
        RestartPolicy(backoff_s=backoff, max_backoff_s=ceiling)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"backoff_s": 5.0, "max_backoff_s": 1.0},
        {"backoff_s": -1.0, "max_backoff_s": 1.0},
        {"stable_after_s": -0.1},
        {"give_up_codes": frozenset({0})},
        {"give_up_codes": frozenset({2, 0})},
    ],
)
def test_invalid_policies_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(CoreError):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]


def test_zero_give_up_code_message_says_why() -> None:
    with pytest.raises(CoreError) as err:
        RestartPolicy(give_up_codes=frozenset({0}))
    assert str(err.value) == "exit code 0 means done; it cannot be a give-up code"


def test_edge_policies_are_accepted() -> None:
    RestartPolicy(backoff_s=0.0, max_backoff_s=0.0, stable_after_s=0.0, give_up_codes=frozenset())
    RestartPolicy(backoff_s=3.0, max_backoff_s=3.0)
