"""Each modelling option of the simulator (docs/simulator.md) on a tiny case computed by hand.
(``spmd.waits_for_repair`` has its own in test_sim_model.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dd_queue.sim import load_sim_config, simulate
from dd_queue.sim.config import ElasticSpec, SimConfig, SpmdSpec
from dd_queue.sim.failures import SliceFailures
from dd_queue.sim.ledger import summarize_timelines
from dd_queue.sim.regimes import _busy, checkpoint_interval_s
from dd_queue.sim.timeline import absorb_intervals, elastic_timeline, spmd_timeline


def fails(at: list[float], repair: list[float], slices: list[int] | None = None) -> SliceFailures:
    ids = np.array(slices if slices is not None else [0] * len(at), dtype=np.int64)
    return SliceFailures(ids, np.array(at), np.array(repair))


def cfg(**overrides: object) -> SimConfig:
    return load_sim_config(None, {k.replace("__", "."): str(v) for k, v in overrides.items()})


# ── accounting.failure_during_stall ─────────────────────────────────────────────────────────
def test_absorb_intervals_by_hand() -> None:
    """Blocks open at an event outside the previous block and last that event's cost."""
    s, e = absorb_intervals(np.array([10.0, 0.0, 3.0, 12.0, 4.0]), np.array([11, 5, 20, 13, 4.5]))
    # 0 opens [0, 5] (3 and 4 inside it are absorbed, 3's long cost too); 10 opens [10, 11];
    # 12 opens [12, 13]
    assert s.tolist() == [0.0, 10.0, 12.0] and e.tolist() == [5.0, 11.0, 13.0]
    assert absorb_intervals(np.empty(0), np.empty(0))[0].size == 0
    s, e = absorb_intervals(np.array([1.0, 1.0]), np.array([1.0, 1.0]))  # zero cost: no hang
    assert s.tolist() == [1.0, 1.0]


def _spmd(absorb: bool) -> float:
    """Failures at 100 and 110; detection 5 + restart 30: a stall of 45 s (extends) or 35 s."""
    tl = spmd_timeline(
        "dp",
        chips=8,
        failures=fails([100.0, 110.0], [1e9, 1e9], [0, 1]),
        spec=SpmdSpec(restart_s=30.0, checkpoint_cost_s=0.0),
        detection_s=5.0,
        checkpoint_interval_s=1.0,
        step_s=1.0,
        busy_fraction=1.0,
        duration_s=200.0,
        absorb=absorb,
    )
    return summarize_timelines([tl], 200.0).uptime


def test_failure_during_a_plain_dp_stall_extends_it_or_is_absorbed() -> None:
    assert _spmd(absorb=False) == pytest.approx((200 - 45) / 200)
    assert _spmd(absorb=True) == pytest.approx((200 - 35) / 200)


def _elastic(absorb: bool) -> float:
    """Slices 0 and 1 fail at 100 and 105 (out for ever); detection 5 + downscale 5."""
    tl = elastic_timeline(
        "g",
        n_slices=4,
        chips_per_slice=1,
        failures=fails([100.0, 105.0], [1e9, 1e9], [0, 1]),
        spec=ElasticSpec(detection_s=5, downscale_s=5, upscale_s=5),
        step_s=1.0,
        busy_fraction=1.0,
        duration_s=200.0,
        absorb=absorb,
    )
    return summarize_timelines([tl], 200.0).uptime


def test_failure_during_an_elastic_stall_extends_it_or_is_absorbed() -> None:
    assert _elastic(absorb=False) == pytest.approx((200 - 15) / 200)  # stalled [100, 115]
    assert _elastic(absorb=True) == pytest.approx((200 - 10) / 200)  # stalled [100, 110]


def test_the_option_reaches_every_regime() -> None:
    base = cfg(cluster__chips=65_536, run__duration_days=1, cluster__speed_sigma=0)
    absorbed = cfg(
        cluster__chips=65_536,
        run__duration_days=1,
        cluster__speed_sigma=0,
        accounting__failure_during_stall="absorbed",
    )
    for a, b in zip(simulate(base), simulate(absorbed), strict=True):
        assert b.goodput > a.goodput, a.label  # fewer, shorter stalls on the same history


# ── accounting.barrier_wait ─────────────────────────────────────────────────────────────────
def test_barrier_wait_busy_share_by_hand() -> None:
    """Slices of mean speed 1.0 and 1.0, slowest chips 1.0 and 1.25: busy 1/1.25 = 0.8."""
    mean, slowest = np.array([1.0, 1.0]), np.array([1.0, 1.25])
    assert _busy(cfg(), mean, slowest) == pytest.approx(0.8)
    assert _busy(cfg(accounting__barrier_wait="goodput"), mean, slowest) == 1.0


def test_barrier_wait_is_lost_or_counted() -> None:
    """No failures, σ = 5%: the barrier wait is the whole loss, or nothing."""
    common = {"cluster__chip_mtbi_days": ".inf", "cluster__chips": 4096, "run__duration_days": 0.1}
    lost = simulate(cfg(cluster__speed_sigma=0.05, **common))
    counted = simulate(cfg(cluster__speed_sigma=0.05, accounting__barrier_wait="goodput", **common))
    for r in lost:
        assert 0.8 < r.goodput < 0.99, r.label  # mean/max chip speed of 4096 chips, ~e^{-3.5σ}
        assert r.shares["waiting"] == pytest.approx(1 - r.goodput)
    assert [r.goodput for r in counted] == [1.0] * len(counted)


# ── spmd.checkpoint_rule ────────────────────────────────────────────────────────────────────
def test_checkpoint_rules_by_hand() -> None:
    # 1 chip per slice, 100 slices, chip MTBI 10 000 s: M = 100 s; δ = 0.5 s
    common = {
        "cluster__chips": 100,
        "cluster__chips_per_slice": 1,
        "cluster__chip_mtbi_days": 10_000 / 86_400,
        "cluster__step_s": 0.1,
    }
    young = checkpoint_interval_s(cfg(**common))
    daly = checkpoint_interval_s(cfg(spmd__checkpoint_rule="daly", **common))
    assert young == pytest.approx(10.0)
    assert daly == pytest.approx(10.0 * (1 + math.sqrt(0.5 / 200) / 3 + 0.5 / 1800) - 0.5)
    fixed = cfg(spmd__checkpoint_interval_s=7, spmd__checkpoint_rule="daly", **common)
    assert checkpoint_interval_s(fixed) == 7.0  # a configured interval wins over any rule
    huge = cfg(spmd__checkpoint_rule="daly", spmd__checkpoint_cost_s=500, **common)
    assert checkpoint_interval_s(huge) == pytest.approx(100.0)  # δ ≥ 2M: checkpoint every M
