"""Prometheus exposition of the run, collected from the control plane at scrape time.

One ``CollectorRegistry`` per app (no global registry): the collector refreshes the plane and
turns what it holds into metric families. Counters mirror the synchronizer's exact counters in
each fragment's ``state``; the staleness histogram counts contributors of the round records
this control plane has read; stream lengths and pending counts are read at scrape time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from dd_queue.control.plane import ControlPlane
from dd_queue.control.tails import STALENESS_BUCKETS
from dd_queue.control.views import refused_view, state_view
from dd_queue.keys import SYNC_GROUP

__all__ = ["RunCollector", "registry_for"]

_OUTCOMES = (
    "merged",
    "superseded",
    "duplicate",
    "late",
    "stale",
    "invalid",
    "dropped",
    "dead_lettered",
)
_STATES = ("active", "straggling", "stalled", "dead", "left")


class RunCollector(Collector):
    """Collects the run's metrics from a control plane."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    def collect(self) -> Iterator[Metric]:
        """Refresh the plane and yield every metric family (called at each scrape)."""
        plane = self.plane
        plane.refresh()
        with plane.lock:
            yield from self._rounds(plane)
            yield from self._learners(plane)
            yield from self._streams(plane)

    def _rounds(self, plane: ControlPlane) -> Iterator[Metric]:
        state = state_view(plane, writes_enabled=False)
        rounds = CounterMetricFamily(
            "ddq_rounds", "Rounds closed.", labels=["fragment", "decision"]
        )
        merges = CounterMetricFamily("ddq_merges", "Merged rounds (new global versions).")
        version = GaugeMetricFamily("ddq_global_version", "Global version.", labels=["fragment"])
        grace = GaugeMetricFamily("ddq_grace_window_seconds", "ξ_grace now.", labels=["fragment"])
        for f in state.fragments:
            p = str(f.fragment_id)
            rounds.add_metric([p, "merge"], f.counters.get("rounds_merged", 0))
            rounds.add_metric([p, "abandon"], f.counters.get("rounds_abandoned", 0))
            version.add_metric([p], f.version)
            grace.add_metric([p], f.grace_window_s)
        merges.add_metric([], state.rounds_merged)
        contributions = CounterMetricFamily(
            "ddq_contributions", "Contributions settled, by outcome.", labels=["outcome"]
        )
        for outcome in _OUTCOMES:
            contributions.add_metric([outcome], state.contributions.get(outcome, 0))
        moved = CounterMetricFamily("ddq_bytes", "Payload bytes moved.", labels=["direction"])
        moved.add_metric(["in"], state.bytes_in)
        moved.add_metric(["out"], state.bytes_out)
        quorum = GaugeMetricFamily(
            "ddq_quorum_size", "Contributors of the last merge.", labels=["fragment"]
        )
        for fragment_id, record in sorted(plane.log.last_round.items()):
            quorum.add_metric([str(fragment_id)], len(record.contributors))
        required = GaugeMetricFamily("ddq_quorum_required", "Minimum quorum K.")
        required.add_metric([], state.quorum.quorum)
        yield from (rounds, merges, version, grace, contributions, moved, quorum, required)
        yield self._staleness(plane)
        goodput = GaugeMetricFamily("ddq_goodput", "Training ÷ allocated chip time so far.")
        goodput.add_metric([], state.goodput.goodput)
        uptime = GaugeMetricFamily("ddq_uptime", "Share of wall time with training so far.")
        uptime.add_metric([], state.goodput.uptime)
        loss = GaugeMetricFamily("ddq_eval_loss", "Latest held-out loss.")
        if state.eval:
            loss.add_metric([], state.eval[-1].loss)
        yield from (goodput, uptime, loss)

    def _staleness(self, plane: ControlPlane) -> Metric:
        counts: Counter[int] = plane.log.staleness
        buckets, total = [], 0
        for bound in STALENESS_BUCKETS:
            buckets.append((str(bound), sum(n for s, n in counts.items() if s <= bound)))
        total = sum(counts.values())
        buckets.append(("+Inf", total))
        return HistogramMetricFamily(
            "ddq_contribution_staleness",
            "Versions between a merged contribution's base and the merge.",
            buckets=buckets,
            sum_value=sum(s * n for s, n in counts.items()),
        )

    def _learners(self, plane: ControlPlane) -> Iterator[Metric]:
        states = GaugeMetricFamily("ddq_learners", "Learners by state.", labels=["state"])
        seen = Counter(obs.state for obs in plane.members.learners)
        for name in _STATES:
            states.add_metric([name], seen[name])
        faults = CounterMetricFamily("ddq_faults", "Faults injected.", labels=["kind"])
        for kind, n in sorted(Counter(r.kind for r in plane.book.records.values()).items()):
            faults.add_metric([kind], n)
        refused = CounterMetricFamily(
            "ddq_refused_messages",
            "Messages refused (unsigned, forged, malformed, replayed), by reader, kind, reason.",
            labels=["reader", "kind", "reason"],
        )
        for view in refused_view(plane):
            refused.add_metric([view.reader, view.kind, view.reason], view.count)
        yield from (states, faults, refused)

    def _streams(self, plane: ControlPlane) -> Iterator[Metric]:
        bus, keys = plane.bus, plane.bus.keys
        length = GaugeMetricFamily("ddq_stream_length", "Entries in a stream.", labels=["stream"])
        pending = GaugeMetricFamily(
            "ddq_stream_pending", "Delivered, unacked entries.", labels=["stream"]
        )
        for p in range(plane.cfg.synchronizer.n_fragments):
            for name, key in (
                ("up", keys.up(p)),
                ("down", keys.down(p)),
                ("rounds", keys.rounds(p)),
                ("dlq", keys.dlq(p)),
            ):
                length.add_metric([f"f{p}.{name}"], bus.stream_length(key))
            pending.add_metric([f"f{p}.up"], bus.pending_summary(keys.up(p), SYNC_GROUP).count)
        for name, key in (("events", keys.events()), ("open", keys.opened_rounds())):
            length.add_metric([name], bus.stream_length(key))
        yield from (length, pending)


def registry_for(plane: ControlPlane) -> CollectorRegistry:
    """A registry holding only this plane's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(plane))
    return registry
