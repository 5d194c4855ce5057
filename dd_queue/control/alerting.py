"""The dashboard's alerts: ``core.alerts``'s rules over the samples the exporter produces.

The control plane keeps the last hour of samples of the metrics the rules read
(``core.alerts.METRICS``), taken from the same families ``/metrics`` exports, once per tick;
each observation evaluates every rule. An alert that starts firing is logged as a warning
(``alert.firing``), one that ends as ``alert.resolved``. The history lives in memory: a
restarted control plane starts its windows afresh (Prometheus, reading the same counters, does
not need to).
"""

from __future__ import annotations

import logging
from collections import deque

from dd_queue.core.alerts import HISTORY_S, Alert, Sample, evaluate

__all__ = ["Alerting"]

log = logging.getLogger("dd_queue.control")


class Alerting:
    """Samples kept for the rules' windows, and the alerts of the last evaluation."""

    def __init__(self) -> None:
        self.history: deque[Sample] = deque()
        self.pending: dict[tuple[str, str], float] = {}
        self.alerts: list[Alert] = []
        self.wall_offset_s = 0.0
        """Wall-clock seconds minus the samples' clock, at the last evaluation (what turns an
        alert's ``since_s`` into a time of day)."""

    def observe(self, sample: Sample, wall_s: float | None = None) -> list[Alert]:
        """Add ``sample`` (now; ``wall_s``: the wall-clock time of it), drop what no window
        reads, evaluate; returns the alerts."""
        if wall_s is not None:
            self.wall_offset_s = wall_s - sample.at_s
        self.history.append(sample)
        while self.history and self.history[0].at_s < sample.at_s - HISTORY_S:
            self.history.popleft()
        before = {(a.name, a.subject) for a in self.alerts if a.state == "firing"}
        self.alerts, self.pending = evaluate(list(self.history), self.pending)
        now = {(a.name, a.subject): a for a in self.alerts if a.state == "firing"}
        for key in now.keys() - before:
            alert = now[key]
            log.warning("alert.firing %s %s: %s", alert.name, alert.subject, alert.summary)
        for name, subject in sorted(before - now.keys()):
            log.info("alert.resolved %s %s", name, subject)
        return self.alerts
