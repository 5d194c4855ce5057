"""The chaos scenario's schedule and its figures, as pure functions (``bench_resilience.py``
runs it: ``--scenarios chaos``).

A schedule is planned up front from a seed, so every system runs the very same one: learner
kills (kill -9, relaunched at once), synchronizer kills (kill -9, restarted at once), stalls
(SIGSTOP, SIGCONT ``stall_s`` later) and slowdowns (SIGSTOP/SIGCONT in a duty cycle that makes
the process ``factor`` times slower for ``slow_s``). Every fault is a real signal, so it lands
on any system the same way. Kills of one learner are at least ``min_gap_s`` apart (time to
relaunch and rejoin), synchronizer kills ``4 × min_gap_s``; the rest are uniform in the run.

Figures, from the processes' own records (step lines, round records, ``eval.done`` events):

- **useful steps**: a learner's inner steps that reached the global model, i.e. of each
  incarnation, the steps up to the send time of its last merged contribution (Δ is measured
  from the fragment it last received, so a dropped or late contribution's steps travel in the
  next one; the steps after an incarnation's last merged contribution died with it).
- **goodput**: useful steps ÷ what the fault-free plain processes compute in the same wall time
  (their steps/s, measured in the same invocation, × learners × the run's length).
- **uptime**: the share of learner-time spent training: the run's length minus every gap
  between two steps longer than ``3 ×`` the median step (and the open ends), per learner.
- **global downtime**: windows of ``2 ×`` the round time (H × the median step) without a merge,
  except while a killed synchronizer is being replaced (kill → its first merge after).
- **loss**: the held-out loss of the global model at equal wall time (interpolated at the end
  of the run) and at equal tokens (interpolated where every system has computed as many).
"""

from __future__ import annotations

import bisect
import itertools
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["kill", "sync-kill", "stall", "slow"]


@dataclass(frozen=True, slots=True)
class ChaosEvent:
    """One fault: when (seconds after the start), what, whom, and for how long (stall, slow)."""

    at_s: float
    kind: Kind
    target: str
    duration_s: float = 0.0
    factor: float = 1.0


def plan_chaos(
    seed: int,
    duration_s: float,
    learners: Sequence[str],
    *,
    learner_kills: int = 20,
    sync_kills: int = 5,
    stalls: int | None = None,
    slowdowns: int | None = None,
    stall_s: float = 3.0,
    slow_s: float = 20.0,
    factor: float = 2.0,
    min_gap_s: float = 15.0,
    margin_s: float = 20.0,
) -> tuple[ChaosEvent, ...]:
    """The schedule, in time order: a pure function of its arguments. ``stalls`` and
    ``slowdowns`` default to 10 and 6 per 600 s of ``duration_s`` (at least one each).

    Raises:
        ValueError: No learner, or the kills cannot be spaced ``min_gap_s`` apart in the run.
    """
    if not learners:
        raise ValueError("a chaos schedule needs at least one learner")
    lo, hi = margin_s, duration_s - margin_s
    pool = sorted(learners)
    rng = random.Random(seed)
    per_learner = -(-learner_kills // len(pool))
    if hi <= lo or (hi - lo) / max(1, per_learner) < min_gap_s:
        raise ValueError(
            f"{learner_kills} learner kills do not fit {duration_s:g} s at {min_gap_s:g} s apart"
        )
    if sync_kills and (hi - lo) / sync_kills < 4 * min_gap_s:
        raise ValueError(f"{sync_kills} synchronizer kills do not fit {duration_s:g} s")
    events: list[ChaosEvent] = []
    kills = [pool[i % len(pool)] for i in range(learner_kills)]
    for lid in pool:
        n = kills.count(lid)
        events += [ChaosEvent(t, "kill", lid) for t in _spaced(rng, n, lo, hi, min_gap_s)]
    events += [
        ChaosEvent(t, "sync-kill", "synchronizer")
        for t in _spaced(rng, sync_kills, lo, hi, 4 * min_gap_s)
    ]
    per_600 = duration_s / 600.0
    stalls = max(1, round(10 * per_600)) if stalls is None else stalls
    slowdowns = max(1, round(6 * per_600)) if slowdowns is None else slowdowns
    timed: tuple[tuple[Kind, int, float, float], ...] = (
        ("stall", stalls, stall_s, 1.0),
        ("slow", slowdowns, slow_s, factor),
    )
    for kind, count, length, times in timed:
        for _ in range(count):
            at = round(rng.uniform(lo, hi - length), 3)
            events.append(ChaosEvent(at, kind, rng.choice(pool), length, times))
    return tuple(sorted(events, key=lambda e: (e.at_s, e.kind, e.target)))


def _spaced(rng: random.Random, n: int, lo: float, hi: float, gap: float) -> list[float]:
    """``n`` times in [lo, hi], at least ``gap`` apart: uniform points in the room the gaps
    leave, then shifted by their rank."""
    if n <= 0:
        return []
    room = (hi - lo) - gap * (n - 1)
    return [
        round(lo + x + i * gap, 3)
        for i, x in enumerate(sorted(rng.uniform(0, room) for _ in range(n)))
    ]


# ── figures (pure) ─────────────────────────────────────────────────────────────────────────
Record = Mapping[str, Any]


def useful_steps(
    incarnations: Iterable[Sequence[Record]], merged_sends: Sequence[float], lo: float, hi: float
) -> int:
    """Inner steps in [lo, hi] of one learner's incarnations that reached the global model:
    those up to the send time (wall s) of the incarnation's last merged contribution."""
    sends = sorted(merged_sends)
    total = 0
    for records in incarnations:
        trained = [r for r in records if r["ev"] == "step"]
        if not trained:
            continue
        first, last = records[0]["t"], records[-1]["t"]
        mine = [s for s in sends if first <= s <= last + 1.0]  # its sends, in its lifetime
        if not mine:
            continue
        until = min(mine[-1], hi)
        total += sum(1 for r in trained if lo <= r["t"] <= until)
    return total


def uptime(step_times: Sequence[float], lo: float, hi: float, median_s: float) -> float:
    """Share of [lo, hi] one learner spent training: all of it less each gap between steps
    (and the open ends) longer than ``3 × median_s``."""
    inside = sorted(t for t in step_times if lo <= t <= hi)
    if hi <= lo:
        return 0.0
    edges = [lo, *inside, hi]
    lost = sum(b - a for a, b in itertools.pairwise(edges) if b - a > 3 * median_s)
    return max(0.0, 1.0 - lost / (hi - lo))


def downtime(
    merges: Sequence[float],
    lo: float,
    hi: float,
    window_s: float,
    excused: Sequence[tuple[float, float]],
) -> dict[str, Any]:
    """Windows of ``window_s`` (sliding, in steps of a tenth of it) in [lo, hi] without a merge,
    not counting windows that overlap an ``excused`` span (a synchronizer being replaced); and
    the longest time between merges outside those spans."""
    times = sorted(merges)
    step = window_s / 10
    empty, checked = 0, 0
    t = lo
    while t + window_s <= hi:
        a, b = t, t + window_s
        if not any(x < b and y > a for x, y in excused):
            checked += 1
            i = bisect.bisect_left(times, a)
            if i >= len(times) or times[i] >= b:
                empty += 1
        t += step
    edges = [lo, *(m for m in times if lo <= m <= hi), hi]
    gaps = [
        b - a for a, b in itertools.pairwise(edges) if not any(x < b and y > a for x, y in excused)
    ]
    return {
        "windows": checked,
        "windows_without_merge": empty,
        "longest_merge_gap_s": max(gaps, default=0.0),
    }


def at_x(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """Linear interpolation of (x, y) points at ``x`` (None outside their range)."""
    pts = sorted(points)
    if not pts or x < pts[0][0] or x > pts[-1][0]:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def tokens_by(step_times: Sequence[float], t: float, tokens_per_step: int) -> int:
    """Tokens computed by the steps (all learners' step times, sorted) up to wall time ``t``."""
    return bisect.bisect_right(step_times, t) * tokens_per_step


def stopped_at(
    now: float,
    stalls: Sequence[tuple[float, float]],
    slows: Sequence[tuple[float, float, float]],
    period_s: float = 0.1,
) -> bool:
    """Whether a learner should be stopped (SIGSTOP) at ``now``: inside a stall (start, end),
    or in the off part of a slowdown's duty cycle (start, end, factor): ``period_s`` running,
    then ``(factor - 1) × period_s`` stopped, so its steps take ``factor`` times as long."""
    if any(a <= now < b for a, b in stalls):
        return True
    for a, b, factor in slows:
        if a <= now < b:
            return (now - a) % (period_s * factor) >= period_s
    return False


def median_of(values: Iterable[float]) -> float:
    got = list(values)
    return statistics.median(got) if got else float("nan")


__all__ = [
    "ChaosEvent",
    "at_x",
    "downtime",
    "median_of",
    "plan_chaos",
    "stopped_at",
    "tokens_by",
    "uptime",
    "useful_steps",
]
