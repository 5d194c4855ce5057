"""Seeded models of when things happen: step times, failures, repairs, and the event queue.

Every learner slot owns two random streams, ``numpy.random.default_rng([seed, slot, stream])``:
one for its step times, one for its failures. They are independent, so turning failures on does
not change the step times a run draws, and adding learners does not change the first ones'.

- Step time of learner m: ``step_time_s × factor_m × max(0.1, 1 + jitter · N(0, 1))``; a
  data-parallel job of C chips waits for the slowest chip at every step (the max of C draws).
- Failures: a Poisson process with mean time between failures ``mtbf_s``, measured from each
  (re)start; repair time ``repair_min_s + Exp(repair_mean_s − repair_min_s)``.

The event queue pops the earliest event; ties are broken by a fixed kind priority, then the
slot number, then insertion order, so a run is the same for the same seed.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from dd_queue.runner.spec import FailureSpec

__all__ = ["EventKind", "EventQueue", "FailureClock", "StepTimer"]

_STEP_STREAM, _FAILURE_STREAM = 1, 2
_MIN_JITTER_FACTOR = 0.1


class StepTimer:
    """Virtual duration of each inner step of one learner slot.

    Args:
        seed: The run's seed.
        slot: The learner slot number.
        base_s: Base step time, virtual seconds.
        factor: This learner's speed factor (> 1 is slower).
        jitter: Relative standard deviation of one step's time.
        chips: Chips stepping in lock-step (data-parallel: the step waits for the slowest).
    """

    def __init__(
        self, seed: int, slot: int, *, base_s: float, factor: float, jitter: float, chips: int = 1
    ) -> None:
        self._rng = np.random.default_rng([seed, slot, _STEP_STREAM])
        self.base_s, self.factor, self.jitter, self.chips = base_s, factor, jitter, chips

    @property
    def mean_s(self) -> float:
        """The step time without jitter, seconds."""
        return self.base_s * self.factor

    def next_s(self) -> float:
        """Draw the next step's duration, seconds."""
        if self.jitter == 0:
            return self.mean_s
        draws = 1.0 + self.jitter * self._rng.standard_normal(self.chips)
        return self.mean_s * max(_MIN_JITTER_FACTOR, float(draws.max()))


class FailureClock:
    """When one learner slot fails next and how long its repair takes.

    Args:
        seed: The run's seed.
        slot: The learner slot number.
        spec: The failure model (None: the slot never fails).
    """

    def __init__(self, seed: int, slot: int, spec: FailureSpec | None) -> None:
        self._rng = np.random.default_rng([seed, slot, _FAILURE_STREAM])
        self.spec = spec

    def next_failure_s(self, now: float) -> float | None:
        """Time of the next failure after a (re)start at ``now``, or None (no failures)."""
        if self.spec is None:
            return None
        return now + float(self._rng.exponential(self.spec.mtbf_s))

    def repair_s(self) -> float:
        """Draw a repair duration, seconds."""
        if self.spec is None:
            return 0.0
        extra = self.spec.repair_mean_s - self.spec.repair_min_s
        drawn = float(self._rng.exponential(extra)) if extra > 0 else 0.0
        return self.spec.repair_min_s + drawn


class EventKind(IntEnum):
    """Kinds of events; the value is the tie-break priority at equal times (lowest first)."""

    REJOIN = 0
    FAIL = 1
    STEP = 2
    SYNC = 3
    EVAL = 4


@dataclass(order=True, frozen=True, slots=True)
class _Entry:
    at_s: float
    kind: EventKind
    slot: int
    seq: int
    token: int = field(compare=False)


class EventQueue:
    """A heap of (time, kind, slot) events with cancellation by token.

    Each (kind, slot) pair has at most one live event: ``schedule`` replaces the previous one
    (its entry stays in the heap and is skipped when popped).
    """

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._live: dict[tuple[EventKind, int], int] = {}

    def schedule(self, at_s: float, kind: EventKind, slot: int = -1) -> None:
        """Schedule ``kind`` for ``slot`` at ``at_s`` (replacing one already scheduled)."""
        seq = next(self._seq)
        self._live[(kind, slot)] = seq
        heapq.heappush(self._heap, _Entry(at_s, kind, slot, seq, seq))

    def cancel(self, kind: EventKind, slot: int = -1) -> None:
        """Forget the scheduled ``kind`` event of ``slot`` (if any)."""
        self._live.pop((kind, slot), None)

    def scheduled(self, kind: EventKind, slot: int = -1) -> bool:
        """Whether ``kind`` is scheduled for ``slot``."""
        return (kind, slot) in self._live

    def pop(self) -> tuple[float, EventKind, int] | None:
        """The earliest live event as (time, kind, slot), removed; None when empty."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            key = (entry.kind, entry.slot)
            if self._live.get(key) == entry.token:
                del self._live[key]
                return entry.at_s, entry.kind, entry.slot
        return None
