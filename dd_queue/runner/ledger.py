"""Where each learner's virtual time went, summarised with the core goodput ledger.

Kinds (``core.goodput``): ``training`` (steps that completed), ``waiting`` (a synchronous
learner held until a fragment's new version arrives), ``down`` (failed, until repaired) and
``restarting`` (rejoining after a repair, and the partial step a failure threw away).
Goodput = training chip-seconds ÷ allocated chip-seconds over the run's window.
"""

from __future__ import annotations

from dataclasses import dataclass

from dd_queue.core.goodput import ChipInterval, GoodputSummary, IntervalKind, summarize

__all__ = ["IntervalLog", "goodput_of"]


@dataclass
class IntervalLog:
    """The intervals of one learner slot (``chips`` chips), appended in time order.

    Attributes:
        group_id: The learner id.
        chips: Chips of the slot (data-parallel: M).
        intervals: What was recorded so far.
    """

    group_id: str
    chips: int = 1
    intervals: list[ChipInterval] | None = None

    def add(self, kind: IntervalKind, start_s: float, end_s: float) -> None:
        """Record ``kind`` from ``start_s`` to ``end_s`` (empty spans are skipped)."""
        if end_s <= start_s:
            return
        if self.intervals is None:
            self.intervals = []
        self.intervals.append(
            ChipInterval(
                group_id=self.group_id, kind=kind, start_s=start_s, end_s=end_s, chips=self.chips
            )
        )

    def seconds(self, kind: IntervalKind) -> float:
        """Total seconds recorded as ``kind``."""
        return sum(iv.end_s - iv.start_s for iv in self.intervals or () if iv.kind == kind)


def goodput_of(logs: list[IntervalLog], window_s: tuple[float, float]) -> GoodputSummary:
    """The goodput summary of every slot's intervals, clipped to ``window_s`` (seconds)."""
    intervals = [iv for log in logs for iv in log.intervals or ()]
    return summarize(intervals, window_s=window_s)
