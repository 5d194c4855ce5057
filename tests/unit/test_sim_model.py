"""Goodput simulator building blocks: failures, return times, timelines, ledger."""

from __future__ import annotations

import numpy as np
import pytest

from dd_queue.sim.config import ElasticSpec, RepairSpec, SpmdSpec
from dd_queue.sim.failures import SliceFailures, _accepted, sample_repairs, slice_failures
from dd_queue.sim.ledger import summarize_timelines, time_below_s
from dd_queue.sim.timeline import elastic_timeline, merge_intervals, spmd_timeline


def fails(at: list[float], repair: list[float]) -> SliceFailures:
    return SliceFailures(np.zeros(len(at), dtype=np.int64), np.array(at), np.array(repair))


def test_thinning_matches_the_sequential_rule() -> None:
    rng = np.random.default_rng(7)
    sid = rng.integers(0, 5, 400).astype(np.int64)
    at = np.sort(rng.uniform(0, 1000, 400))
    rep = rng.exponential(30, 400)
    keep = _accepted(sid, at, rep, horizon_s=1000)
    expected = np.ones(400, dtype=bool)
    free = dict.fromkeys(range(5), -np.inf)
    for i in np.argsort(at, kind="stable"):
        if at[i] < free[int(sid[i])]:
            expected[i] = False
        else:
            free[int(sid[i])] = at[i] + rep[i]
    assert (keep == expected).all() and 0 < (~keep).sum() < 400


def test_slice_failures_never_overlap_and_have_the_poisson_rate() -> None:
    rng = np.random.default_rng(1)
    repair = RepairSpec(distribution="fixed", fixed_s=100.0)
    f = slice_failures(rng, n_slices=50, rate_per_slice_s=1e-3, duration_s=200_000, repair=repair)
    for s in range(50):
        mine = f.at_s[f.slice_id == s]
        assert (np.diff(mine) >= 100.0).all()
    # Alternating renewal: cycles of 1000 s up + 100 s out.
    assert f.at_s.size == pytest.approx(50 * 200_000 / 1100, rel=0.03)


def test_return_time_distributions() -> None:
    rng = np.random.default_rng(3)
    logn = sample_repairs(rng, RepairSpec(median_s=600, p99_s=14_400), 200_000)
    assert np.median(logn) == pytest.approx(600, rel=0.02)
    assert np.quantile(logn, 0.99) == pytest.approx(14_400, rel=0.05)
    spec = RepairSpec(distribution="exp_weibull", scale_s=600, shape_k=0.7, shape_alpha=1.5)
    ew = sample_repairs(rng, spec, 200_000)
    for x in (100.0, 600.0, 3000.0):
        cdf = (1 - np.exp(-((x / 600) ** 0.7))) ** 1.5
        assert (ew <= x).mean() == pytest.approx(cdf, abs=0.005)
    emp = sample_repairs(rng, RepairSpec(distribution="empirical", samples_s=(1.0, 2.0)), 1000)
    assert set(np.unique(emp)) == {1.0, 2.0}


def test_merge_intervals() -> None:
    s, e = merge_intervals(np.array([5.0, 0.0, 1.0, 9.0]), np.array([6.0, 2.0, 3.0, 9.0]))
    assert s.tolist() == [0.0, 5.0, 9.0] and e.tolist() == [3.0, 6.0, 9.0]


def test_elastic_timeline_by_hand() -> None:
    """2 slices × 4 chips; slice fails at 10.5 (lost 0.5 s of a 1 s step), out 20 s."""
    tl = elastic_timeline(
        "g",
        n_slices=2,
        chips_per_slice=4,
        failures=fails([10.5], [20.0]),
        spec=ElasticSpec(detection_s=1, downscale_s=2, upscale_s=3),
        step_s=1.0,
        busy_fraction=1.0,
        duration_s=100.0,
    )
    rows = list(zip(tl.start_s, tl.end_s, tl.kind, tl.active_chips, tl.down_chips, strict=True))
    assert rows == [
        (0.0, 10.0, 0, 8, 0),  # training
        (10.0, 10.5, 3, 8, 0),  # the step in flight, lost
        (10.5, 13.5, 3, 4, 4),  # detection + downscale
        (13.5, 30.5, 0, 4, 4),  # training on one slice
        (30.5, 33.5, 3, 8, 0),  # upscale
        (33.5, 100.0, 0, 8, 0),
    ]
    s = summarize_timelines([tl], 100.0)
    assert s.goodput == pytest.approx((10 * 8 + 17 * 4 + 66.5 * 8) / 800)
    assert s.uptime == pytest.approx(0.935)
    assert time_below_s([tl], 1, 100.0) == pytest.approx(6.5)


def test_straggler_barrier_is_waiting() -> None:
    tl = elastic_timeline(
        "g",
        n_slices=1,
        chips_per_slice=100,
        failures=fails([], []),
        spec=ElasticSpec(),
        step_s=1.0,
        busy_fraction=0.9,
        duration_s=10.0,
    )
    s = summarize_timelines([tl], 10.0)
    assert (s.goodput, s.uptime, s.waiting_chip_s) == (pytest.approx(0.9), 1.0, 100.0)


def test_spmd_timeline_by_hand() -> None:
    """Checkpoint every 5 s costing 1 s; failure at 20 loses 2 s; restart after 5 s."""
    tl = spmd_timeline(
        "dp",
        chips=8,
        failures=fails([20.0], [1000.0]),
        spec=SpmdSpec(restart_s=4.0, checkpoint_cost_s=1.0),
        detection_s=1.0,
        checkpoint_interval_s=5.0,
        step_s=1.0,
        busy_fraction=1.0,
        duration_s=50.0,
    )
    rows = list(zip(tl.start_s, tl.end_s, tl.kind, strict=True))
    assert rows == [(0, 15, 0), (15, 18, 1), (18, 20, 3), (20, 25, 3), (25, 46, 0), (46, 50, 1)]
    s = summarize_timelines([tl], 50.0)
    assert (s.goodput, s.uptime) == (pytest.approx(36 / 50), pytest.approx(36 / 50))


def test_spmd_waits_for_repair_without_spares() -> None:
    common = {
        "chips": 8,
        "failures": fails([20.0], [100.0]),
        "detection_s": 1.0,
        "checkpoint_interval_s": 1.0,
        "step_s": 1.0,
        "busy_fraction": 1.0,
        "duration_s": 200.0,
    }
    spare = spmd_timeline("dp", spec=SpmdSpec(restart_s=4, checkpoint_cost_s=0), **common)
    none = spmd_timeline(
        "dp", spec=SpmdSpec(restart_s=4, checkpoint_cost_s=0, waits_for_repair=True), **common
    )
    assert summarize_timelines([spare], 200).uptime == pytest.approx(195 / 200)
    assert summarize_timelines([none], 200).uptime == pytest.approx(96 / 200)
