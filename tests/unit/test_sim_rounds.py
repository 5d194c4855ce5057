"""The simulator's rounds: the vectorised closed form agrees with the core decide()."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dd_queue.core.policy import Ema, Estimates, PolicyParams, grace_window
from dd_queue.sim import load_sim_config, simulate
from dd_queue.sim.config import DecoupledSpec, ElasticSpec
from dd_queue.sim.failures import SliceFailures
from dd_queue.sim.rounds import closed_form_rounds, exact_round, learner_arrivals, simulate_rounds
from dd_queue.sim.timeline import elastic_timeline

ARRIVAL = st.one_of(
    st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 61.0, math.inf]), st.floats(0.0, 80.0)
)


@settings(max_examples=300, deadline=None)
@given(
    arrivals=st.lists(ARRIVAL, min_size=1, max_size=6),
    live_bits=st.lists(st.booleans(), min_size=6, max_size=6),
    quorum=st.integers(1, 7),
    policy=st.sampled_from(["wait", "shrink"]),
    gamma=st.sampled_from([0.0, 0.5, 1.0]),
    step=st.sampled_from([None, 0.5, 1.0, 4.0]),
    quorum_s=st.sampled_from([None, 0.1, 2.0]),
)
def test_closed_form_equals_decide(
    arrivals: list[float],
    live_bits: list[bool],
    quorum: int,
    policy: str,
    gamma: float,
    step: float | None,
    quorum_s: float | None,
) -> None:
    m = len(arrivals)
    params = PolicyParams(
        quorum=quorum,
        quorum_policy=policy,  # type: ignore[arg-type]
        grace_gamma=gamma,
        overlap_steps=2.0,
        round_timeout_s=60.0,
    )
    estimates = Estimates(
        step_s=Ema(step, 1) if step else Ema(),
        quorum_s=Ema(quorum_s, 1) if quorum_s else Ema(),
        sync_s=Ema(0.3, 1),
    )
    names = [f"L{i}" for i in range(m)]
    live = np.array(live_bits[:m])
    offset = np.array(arrivals)
    merged, at, who = closed_form_rounds(
        offset[None, :], live[None, :], params, grace_window(params, estimates).seconds
    )
    alive = frozenset(n for n, ok in zip(names, live, strict=True) if ok)
    exact_at, exact_who = exact_round(
        {n: t for n, t, ok in zip(names, arrivals, live, strict=True) if ok},
        alive,
        params=params,
        estimates=estimates,
    )
    assert bool(merged[0]) == (exact_at is not None)
    if exact_at is not None:
        assert at[0] == exact_at
        assert {n for n, w in zip(names, who[0], strict=True) if w} == exact_who


def timeline(name: str, at: list[float], repair: list[float], step_s: float = 1.0):  # type: ignore[no-untyped-def]
    f = SliceFailures(np.zeros(len(at), dtype=np.int64), np.array(at), np.array(repair))
    return elastic_timeline(
        name,
        n_slices=1,
        chips_per_slice=2,
        failures=f,
        spec=ElasticSpec(detection_s=1, downscale_s=1, upscale_s=1),
        step_s=step_s,
        busy_fraction=1.0,
        duration_s=100.0,
    )


def test_arrivals_follow_step_boundaries_and_outages() -> None:
    tls = [timeline("L0", [], []), timeline("L1", [10.2], [20.0]), timeline("L2", [], [], 0.8)]
    offset, live, chips = learner_arrivals(tls, np.array([0.5, 15.0, 31.5]), transfer_s=0.25)
    assert offset[0].tolist() == pytest.approx([0.75, 0.75, 0.55])
    # L1 is out at 15 s (fails 10.2, back 30.2): not live; L0 is on a boundary: answers now.
    assert live[1].tolist() == [True, False, True] and chips[1].tolist() == [2, 0, 2]
    assert offset[1][0] == pytest.approx(0.25) and math.isinf(offset[1][1])
    # At 31.5 s L1 is live but re-adding (upscale until 31.2 → steps from 31.2): 32.2 + 0.25.
    assert offset[2][1] == pytest.approx(32.45 - 31.5)


def test_simulate_rounds_uses_the_core_grace_window() -> None:
    tls = [timeline(f"L{i}", [], [], step_s=1.0 + 0.01 * i) for i in range(4)]
    spec = DecoupledSpec(learners=4, policy_rounds=500)
    stats = simulate_rounds(tls, spec, 100.0)
    expected = grace_window(
        spec.policy_params(),
        Estimates(step_s=Ema(1.015, 1), quorum_s=Ema(stats.quorum_wait_s, 1), sync_s=Ema(0.5, 1)),
    )
    assert stats.grace_window_s == pytest.approx(expected.seconds)
    assert stats.abandoned_share == 0 and 1 <= stats.mean_quorum <= 4
    assert sum(stats.token_share) == pytest.approx(1.0)
    exact = simulate_rounds(tls, spec.model_copy(update={"policy_mode": "exact"}), 100.0)
    assert exact.mean_quorum == pytest.approx(stats.mean_quorum)
    assert exact.token_share == pytest.approx(stats.token_share)


def test_quorum_above_live_learners_waits_then_shrinks() -> None:
    base = {
        "cluster.chips": "4096",
        "run.duration_days": "0.2",
        "run.regimes": "[decoupled]",
        "decoupled.learners": "4",
        "decoupled.quorum": "4",
        "decoupled.policy_rounds": "3000",
        "cluster.chip_mtbi_days": "2",
    }
    wait = simulate(load_sim_config(None, base))[0]
    shrink = simulate(load_sim_config(None, base | {"decoupled.quorum_policy": "shrink"}))[0]
    assert wait.global_downtime_s > 0  # fewer than K = 4 learners training
    assert wait.merges_per_hour is not None and shrink.merges_per_hour is not None
    assert shrink.merges_per_hour > wait.merges_per_hour
