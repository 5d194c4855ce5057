"""Seeded chaos schedules: Poisson fault arrivals planned up front, so a schedule can be replayed.

Each fault kind with rate λ (faults per minute) is its own Poisson process: inter-arrival times
are exponential with mean 60/λ s, drawn from ``random.Random(seed)`` kind by kind in sorted
order, and each arrival picks its target from the sorted target list with the same generator.
The plan is therefore a pure function of (seed, spec, targets): replaying a stored schedule
re-plans it and gets the same faults at the same offsets. Firing is the control plane's job
(:meth:`ChaosRun.due` on each tick); a target that is not live when its fault is due is skipped
and the skip is recorded.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from dd_queue.control.requests import TIMED_KINDS, ChaosStart, FaultKind, FaultRequest

__all__ = ["ChaosRun", "PlannedFault", "plan_schedule"]


@dataclass(frozen=True, slots=True)
class PlannedFault:
    """One fault of a schedule: when (seconds after the start), what and whom."""

    at_s: float
    kind: FaultKind
    target: str

    def request(self, spec: ChaosStart, *, by: str) -> FaultRequest:
        """The fault request this planned fault becomes when it fires."""
        timed = self.kind in TIMED_KINDS
        return FaultRequest(
            target=self.target,
            kind=self.kind,
            duration_s=spec.fault_duration_s if timed else None,
            factor=spec.factor if self.kind == "slow" else None,
            delay_s=spec.delay_s if self.kind == "delay" else None,
            count=1 if self.kind == "corrupt" else None,
            by=by,
        )


def plan_schedule(spec: ChaosStart, targets: Sequence[str], seed: int) -> tuple[PlannedFault, ...]:
    """Plan every fault of a schedule.

    Args:
        spec: Duration, per-kind rates (faults per minute) and fault parameters.
        targets: Learner ids to choose from (sorted here; at least one).
        seed: Seed of the generator.

    Returns:
        The faults in time order.

    Raises:
        ValueError: No target to choose from.
    """
    pool = sorted(targets)
    if not pool:
        raise ValueError("a chaos schedule needs at least one target learner")
    rng = random.Random(seed)
    planned: list[PlannedFault] = []
    for kind, rate in sorted(spec.rates_per_min.items()):
        if rate <= 0:
            continue
        at_s = rng.expovariate(rate / 60.0)
        while at_s < spec.duration_s:
            planned.append(PlannedFault(round(at_s, 3), kind, rng.choice(pool)))
            at_s += rng.expovariate(rate / 60.0)
    return tuple(sorted(planned, key=lambda f: (f.at_s, f.kind, f.target)))


@dataclass(slots=True)
class ChaosRun:
    """A schedule being played: where it started and how far it got.

    Attributes:
        schedule_id: Its id (events and fault records name it).
        seed: The seed it was planned with.
        spec: Its parameters.
        targets: The learners it picks from.
        planned: The faults, in time order.
        started_s: Clock time it started (monotonic seconds).
        started_at_s: Wall time it started, seconds since the epoch.
        fired: How many planned faults were handed out by ``due``.
        stopped: True once stopped or finished.
        replay_of: The schedule this one replays, if any.
    """

    schedule_id: str
    seed: int
    spec: ChaosStart
    targets: tuple[str, ...]
    planned: tuple[PlannedFault, ...]
    started_s: float
    started_at_s: float
    fired: int = 0
    stopped: bool = False
    replay_of: str | None = None
    skipped: list[str] = field(default_factory=list)

    def due(self, now: float) -> list[PlannedFault]:
        """Planned faults whose time has come since the last call (none once stopped)."""
        if self.stopped:
            return []
        elapsed = now - self.started_s
        start = self.fired
        while self.fired < len(self.planned) and self.planned[self.fired].at_s <= elapsed:
            self.fired += 1
        if elapsed >= self.spec.duration_s:
            self.stopped = True
        return list(self.planned[start : self.fired])

    def next_at_s(self) -> float | None:
        """Offset of the next planned fault, seconds after the start (None: no more)."""
        if self.stopped or self.fired >= len(self.planned):
            return None
        return self.planned[self.fired].at_s
