"""``core.rounds.implausible``: the sanity bounds on a contribution's counters (pure).

A learner counts steps and tokens from the moment it received its base version, which was no
earlier than that version's publication: tokens ≤ steps × the most one step carries, and steps ≤
the most steps a second × the window from the publication to the arrival (+ a slack second).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dd_queue.core.rounds import STEP_SLACK_S, ContributionClaim, implausible

pytestmark = pytest.mark.unit

counts = st.integers(min_value=0, max_value=2**63 - 1)
rates = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)
windows = st.floats(min_value=-1e3, max_value=1e7, allow_nan=False)


def claim(n_steps: int, n_tokens: int, base_version: int = 3) -> ContributionClaim:
    return ContributionClaim(
        learner_id="L1",
        fragment_id=0,
        round_id=7,
        base_version=base_version,
        n_steps=n_steps,
        n_tokens=n_tokens,
    )


@given(steps=counts, tokens=counts, per_step=st.integers(1, 2**40), rate=rates, window=windows)
def test_the_verdict_is_exactly_the_two_bounds(
    steps: int, tokens: int, per_step: int, rate: float, window: float
) -> None:
    why = implausible(
        claim(steps, tokens), max_tokens_per_step=per_step, max_steps_per_s=rate,
        trained_for_s=window,
    )  # fmt: skip
    too_many_tokens = tokens > max(steps, 1) * per_step
    too_many_steps = steps > rate * (max(window, 0.0) + STEP_SLACK_S)
    assert (why is None) == (not too_many_tokens and not too_many_steps), why
    if too_many_tokens:
        assert why is not None and why.startswith(f"{tokens} tokens in {steps} steps")
    elif too_many_steps:
        assert why is not None and why.startswith(f"{steps} steps since version 3")
        assert "synchronizer.max_steps_per_s" in why


@given(steps=counts, per_step=st.integers(1, 2**20))
def test_without_a_known_publication_only_the_token_bound_applies(
    steps: int, per_step: int
) -> None:
    honest = claim(steps, steps * per_step)
    assert (
        implausible(honest, max_tokens_per_step=per_step, max_steps_per_s=1e-3, trained_for_s=None)
        is None
    )


@given(rate=st.floats(min_value=1.0, max_value=1e5), window=st.floats(0.0, 1e6))
def test_a_learner_at_the_top_rate_is_never_refused(rate: float, window: float) -> None:
    """A learner that stepped at ``rate`` for the whole window (the best it can do) passes."""
    steps = math.floor(rate * (window + STEP_SLACK_S))
    assert (
        implausible(claim(steps, steps), max_tokens_per_step=1, max_steps_per_s=rate,
                    trained_for_s=window)
        is None
    )  # fmt: skip


def test_a_clock_that_runs_backwards_still_leaves_the_slack() -> None:
    """Arrival before publication (ids from a restored Redis): the window is the slack alone."""
    assert implausible(claim(10, 10), max_tokens_per_step=1, max_steps_per_s=10.0,
                       trained_for_s=-5.0) is None  # fmt: skip
    why = implausible(claim(11, 11), max_tokens_per_step=1, max_steps_per_s=10.0,
                      trained_for_s=-5.0)  # fmt: skip
    assert why == (
        "11 steps since version 3, published 0.000 s before it arrived: more than 10 steps per "
        "second (synchronizer.max_steps_per_s) over 1.000 s"
    )


def test_the_reported_forgery_is_refused_by_both_bounds() -> None:
    """The issue's contribution: 2^62 tokens. With an honest token rate but 2^62 steps, the
    step bound refuses it instead."""

    def why(c: ContributionClaim) -> str:
        reason = implausible(
            c, max_tokens_per_step=1024 * 16 * 64, max_steps_per_s=10_000.0, trained_for_s=60.0
        )
        assert reason is not None
        return reason

    assert why(claim(4, 2**62)).startswith("4611686018427387904 tokens in 4 steps")
    assert why(claim(2**62, 2**62)).startswith("4611686018427387904 steps since version 3")
