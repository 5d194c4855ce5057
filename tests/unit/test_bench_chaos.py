"""The chaos scenario's schedule and figures (``bench/chaos_schedule.py``) on hand-made data."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import itertools

import chaos_schedule as ch


def step(pid: int, t: float) -> dict[str, Any]:
    return {"ev": "step", "pid": pid, "step": int(t), "t": t}


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kills=st.integers(0, 24), syncs=st.integers(0, 5))
def test_a_schedule_is_a_function_of_its_seed_and_spaces_its_kills(
    seed: int, kills: int, syncs: int
) -> None:
    plan = ch.plan_chaos(seed, 600, ["L1", "L0"], learner_kills=kills, sync_kills=syncs)
    assert plan == ch.plan_chaos(seed, 600, ["L0", "L1"], learner_kills=kills, sync_kills=syncs)
    count = Counter(e.kind for e in plan)
    assert (count["kill"], count["sync-kill"], count["stall"], count["slow"]) == (
        kills,
        syncs,
        10,
        6,
    )
    assert [e.at_s for e in plan] == sorted(e.at_s for e in plan)
    assert all(e.at_s >= 20 and e.at_s + e.duration_s <= 580 for e in plan)
    for who, gap in (("L0", 15), ("L1", 15), ("synchronizer", 60)):
        times = [e.at_s for e in plan if e.target == who and e.kind in ("kill", "sync-kill")]
        assert all(b - a >= gap - 1e-6 for a, b in itertools.pairwise(times))
    assert {e.target for e in plan if e.kind == "kill"} <= {"L0", "L1"}
    assert abs(count["kill"] - 2 * sum(e.target == "L0" for e in plan if e.kind == "kill")) <= 1


def test_stalls_and_slowdowns_scale_with_the_run_unless_given() -> None:
    def counts(duration: float, **kw: int) -> tuple[int, int]:
        plan = ch.plan_chaos(0, duration, ["L0", "L1"], learner_kills=4, sync_kills=1, **kw)
        return sum(e.kind == "stall" for e in plan), sum(e.kind == "slow" for e in plan)

    assert counts(600) == (10, 6)
    assert counts(1200) == (20, 12)
    assert counts(120) == (2, 1)  # 10 and 6 per 600 s, at least one each
    assert counts(120, stalls=0, slowdowns=3) == (0, 3)


def test_a_schedule_that_cannot_fit_says_why() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        ch.plan_chaos(0, 100, ["L0"], learner_kills=10)
    with pytest.raises(ValueError, match="synchronizer kills"):
        ch.plan_chaos(0, 200, ["L0"], learner_kills=1, sync_kills=5)
    with pytest.raises(ValueError, match="at least one learner"):
        ch.plan_chaos(0, 600, [])


def test_useful_steps_end_at_each_incarnations_last_merged_send() -> None:
    first = [step(1, t) for t in range(10)]  # killed after step 9; its last merged send at 6.5
    second = [{"ev": "start", "pid": 2, "t": 12.0}, *(step(2, t) for t in range(13, 20))]
    sends = [3.2, 6.5, 16.0]  # 16.0: the second incarnation's only merged contribution
    assert ch.useful_steps([first, second], sends, 0.0, 100.0) == 7 + 4  # 0..6 and 13..16
    assert ch.useful_steps([first, second], sends, 4.0, 100.0) == 3 + 4  # from the window's start
    assert ch.useful_steps([first, second], [], 0.0, 100.0) == 0
    assert ch.useful_steps([second], [3.2, 6.5], 0.0, 100.0) == 0  # not sent in its lifetime


def test_uptime_counts_only_gaps_longer_than_three_median_steps() -> None:
    times = [0.5 * i for i in range(21)]  # 0 .. 10 s every 0.5 s
    assert ch.uptime(times, 0.0, 10.0, 0.5) == 1.0
    gap = [t for t in times if not 2.0 < t < 6.0]  # a 4 s hole
    assert ch.uptime(gap, 0.0, 10.0, 0.5) == pytest.approx(0.6)
    assert ch.uptime(gap, 0.0, 10.0, 2.0) == 1.0  # 4 s < 3 × 2 s
    assert ch.uptime([], 0.0, 10.0, 0.5) == 0.0


def test_downtime_finds_empty_windows_outside_the_excused_spans() -> None:
    merges = [float(t) for t in range(0, 101, 5)]
    assert ch.downtime(merges, 0, 100, 10, [])["windows_without_merge"] == 0
    holed = [t for t in merges if not 40 < t < 70]  # no merge from 40 to 70
    got = ch.downtime(holed, 0, 100, 10, [])
    assert got["windows_without_merge"] > 0 and got["longest_merge_gap_s"] == 30
    excused = ch.downtime(holed, 0, 100, 10, [(40.0, 70.0)])
    assert excused["windows_without_merge"] == 0 and excused["longest_merge_gap_s"] == 5


def test_stopped_at_stalls_and_duty_cycles() -> None:
    assert ch.stopped_at(5.0, [(4.0, 7.0)], [])
    assert not ch.stopped_at(7.0, [(4.0, 7.0)], [])
    slow = [(10.0, 20.0, 3.0)]  # 0.1 s running, then 0.2 s stopped
    states = [ch.stopped_at(10.0 + 0.01 * i + 0.005, [], slow) for i in range(30)]
    assert states.count(False) == 10 and states.count(True) == 20
    assert not ch.stopped_at(25.0, [], slow)


def test_interpolation_and_tokens() -> None:
    pts = [(0.0, 5.0), (10.0, 3.0), (20.0, 2.0)]
    assert ch.at_x(pts, 5.0) == 4.0 and ch.at_x(pts, 20.0) == 2.0
    assert ch.at_x(pts, 25.0) is None and ch.at_x([], 1.0) is None
    assert ch.tokens_by([1.0, 2.0, 3.0], 2.0, 100) == 200
