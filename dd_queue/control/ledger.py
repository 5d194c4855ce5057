"""Goodput and uptime so far, from the learner states the control plane observes.

Each refresh samples every known learner's state and extends its timeline
(``core.goodput`` intervals, one chip group per learner): ``training`` while it is active or
straggling and reports training, ``waiting`` while stalled (or joining), ``down`` while dead;
a learner that left is no longer allocated. Goodput and uptime are ``core.goodput.summarize``
over the window since the control plane first observed a learner (Decoupled DiLoCo's
definitions, arXiv 2604.21428): a control plane restart starts a new window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from dd_queue.core.goodput import ChipInterval, GoodputSummary, IntervalKind, summarize

__all__ = ["GoodputLedger", "GoodputPoint", "interval_kind"]

_MAX_INTERVALS = 20_000


def interval_kind(state: str, process_state: str) -> IntervalKind | None:
    """The ledger kind of a learner in liveness ``state`` whose heartbeat says
    ``process_state``; None when it is not allocated (it left)."""
    if state == "left":
        return None
    if state == "dead":
        return "down"
    if state == "stalled" or process_state != "training":
        return "waiting"
    return "training"


@dataclass(frozen=True, slots=True)
class GoodputPoint:
    """Goodput and uptime at one wall-clock time (seconds since the epoch)."""

    at_s: float
    goodput: float
    uptime: float


class GoodputLedger:
    """Timelines of every learner since ``started_s`` (clock seconds)."""

    def __init__(self, started_s: float, *, keep_points: int = 3600) -> None:
        self.started_s = started_s
        self._open: dict[str, tuple[IntervalKind, float]] = {}
        self._closed: deque[ChipInterval] = deque(maxlen=_MAX_INTERVALS)
        self.history: deque[GoodputPoint] = deque(maxlen=keep_points)

    def sample(self, now: float, kinds: Mapping[str, IntervalKind | None]) -> None:
        """Record that each learner is in ``kinds[learner]`` from ``now`` on. The window
        starts at the first sample with an allocated learner: time before any learner existed
        is no one's (it would only lower uptime below goodput)."""
        if not self._open and not self._closed and any(k is not None for k in kinds.values()):
            self.started_s = max(self.started_s, now)
        for learner in sorted(self._open.keys() | kinds.keys()):
            kind = kinds.get(learner)
            current = self._open.get(learner)
            if current is not None and current[0] == kind:
                continue
            if current is not None:
                self._closed.append(
                    ChipInterval(
                        group_id=learner, kind=current[0], start_s=current[1], end_s=now, chips=1
                    )
                )
                del self._open[learner]
            if kind is not None:
                self._open[learner] = (kind, now)

    def summary(self, now: float) -> GoodputSummary:
        """Totals from ``started_s`` to ``now``."""
        intervals = list(self._closed)
        intervals += [
            ChipInterval(group_id=lid, kind=kind, start_s=start, end_s=max(start, now), chips=1)
            for lid, (kind, start) in self._open.items()
        ]
        begin = min([self.started_s, *(iv.start_s for iv in intervals)])
        return summarize(intervals, window_s=(begin, max(begin, now)))

    def record(self, now: float, wall_s: float) -> GoodputSummary:
        """``summary(now)``, also appended to ``history`` at wall time ``wall_s``."""
        totals = self.summary(now)
        self.history.append(GoodputPoint(wall_s, totals.goodput, totals.uptime))
        return totals
