"""Plain and elastic DP goodput against chips follow the closed forms of their models
(docs/simulator.md, "Closed forms"), at three sizes, for both ``failure_during_stall`` options.

Identical chips (σ = 0, so no barrier wait) and a fixed repair time keep the forms exact up to
the second-order terms that docs/simulator.md names; each tolerance below is that bound plus
the sampling noise of a week of failures (a few hundred to ~20 000 interruptions).
"""

from __future__ import annotations

import math

import pytest

from dd_queue.sim import load_sim_config, simulate
from dd_queue.sim.config import SimConfig
from dd_queue.sim.regimes import checkpoint_interval_s

SIZES = (65_536, 262_144, 1_199_872)


def cfg(chips: int, regime: str, stall: str) -> SimConfig:
    return load_sim_config(
        None,
        {
            "cluster.chips": str(chips),
            "cluster.speed_sigma": "0",
            "repair.distribution": "fixed",
            "repair.fixed_s": "1500",
            "accounting.failure_during_stall": stall,
            "run.duration_days": "7",
            "run.regimes": f"[{regime}]",
        },
    )


def accepted_rate(c: SimConfig) -> float:
    """Interruptions per second of the whole job: each slice alternates up ~ Exp(r) and out
    for the repair time R, so it fails at r / (1 + r·R)."""
    r = c.cluster.slice_failure_rate_per_s
    return c.cluster.n_slices * r / (1 + r * c.repair.fixed_s)


def plain_dp_closed_form(c: SimConfig) -> float:
    """Runs between stalls are Exp(Λ); one keeps C per completed cycle of C + δ, i.e.
    C·p/(1 − p) on average with p = e^{−Λ(C+δ)}. A stall lasts w = detection + restart, or,
    when failures during it start it again, (e^{Λw} − 1)/Λ on average."""
    lam = accepted_rate(c)
    C, delta = checkpoint_interval_s(c), c.spmd.checkpoint_cost_s
    w = c.elastic.detection_s + c.spmd.restart_s
    p = math.exp(-lam * (C + delta))
    kept = C * p / (1 - p)
    stall = w if c.accounting.failure_during_stall == "absorbed" else math.expm1(lam * w) / lam
    return kept / (1 / lam + stall)


def elastic_closed_form(c: SimConfig) -> float:
    """With failures and returns each starting the reconfiguration again (``extends``), the
    group trains when no failure came in the last detection + downscale seconds and no return
    in the last upscale seconds; returns come at the failure rate. Chips out: the share of
    slices in repair, r·R/(1 + r·R). A failure that hits a training group throws away the step
    in flight, half a step on average."""
    lam = accepted_rate(c)
    r, e = c.cluster.slice_failure_rate_per_s, c.elastic
    trains = math.exp(-lam * (e.detection_s + e.downscale_s + e.upscale_s))
    out = r * c.repair.fixed_s / (1 + r * c.repair.fixed_s)
    lost_step = lam * c.cluster.step_s / 2
    return trains * (1 - out) * (1 - lost_step)


@pytest.mark.parametrize("stall", ["extends", "absorbed"])
@pytest.mark.parametrize("chips", SIZES)
def test_plain_dp_follows_its_closed_form(chips: int, stall: str) -> None:
    c = cfg(chips, "plain_dp", stall)
    (result,) = simulate(c)
    expected = plain_dp_closed_form(c)
    # second order: a finite week (the last run keeps all its work), ≤ 0.1 point; noise
    assert result.goodput == pytest.approx(expected, abs=0.008 + 0.01 * (1 - expected))


@pytest.mark.parametrize("chips", SIZES)
def test_elastic_dp_follows_its_closed_form(chips: int) -> None:
    c = cfg(chips, "elastic_dp", "extends")
    (result,) = simulate(c)
    expected = elastic_closed_form(c)
    # second order: chips out and stalls are correlated (both follow a failure), the step lost
    # is shorter when the group resumed less than a step before, returns are not exactly Poisson
    assert result.goodput == pytest.approx(expected, abs=0.008 + 0.01 * (1 - expected))


def test_the_closed_forms_fall_with_chips_as_the_simulator_does() -> None:
    for closed, regime in ((plain_dp_closed_form, "plain_dp"), (elastic_closed_form, "elastic_dp")):
        forms = [closed(cfg(n, regime, "extends")) for n in SIZES]
        assert forms == sorted(forms, reverse=True) and forms[0] - forms[-1] > 0.1
