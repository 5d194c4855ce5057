"""Prometheus exposition of the run: the control plane is the run's exporter.

Who exposes what: the control plane reads everything a run has from Redis (heartbeats, the
fragments' states, the run's counters, the streams), so one scrape target per run covers every
learner and synchronizer on every host, and no training machine opens a port for Prometheus.
Scrape each control plane (one per run; a second one serves the same numbers).

Every counter is derived from counts kept in Redis, never from what this process has seen:
the fragments' exact counters (``core.tallies``; they change only in commits), the run's
``faults`` and ``refused`` counters, and the learners' own step and token counts in their
heartbeats. A restarted control plane therefore exports the same totals, and a counter goes
down only when the process that counts it restarts (a learner without a checkpoint), which
Prometheus treats as a counter reset.

``CATALOGUE`` names every metric with its type, help and labels; the collector emits exactly
those (a test holds the two together, and the README lists the catalogue).
"""

from __future__ import annotations

import platform
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Literal

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

import dd_queue
from dd_queue.control.plane import ControlPlane
from dd_queue.control.views import refused_view, state_view, token_fate_views
from dd_queue.core.alerts import METRICS as ALERT_METRICS
from dd_queue.core.alerts import Labels, Sample, labels_of
from dd_queue.core.tallies import dead_letters, histogram, learner_counts, summed
from dd_queue.keys import SYNC_GROUP

__all__ = ["CATALOGUE", "MetricSpec", "RunCollector", "alert_sample", "registry_for"]

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric: name (counters with their ``_total``), type, help and labels."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()


def _m(name: str, kind: Kind, help_: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, kind, help_, labels)


_FRAGMENT_HISTOGRAMS = {
    "ddq_round_open_to_quorum_seconds": "open_to_quorum_s",
    "ddq_round_quorum_to_merge_seconds": "quorum_to_merge_s",
    "ddq_round_merge_to_commit_seconds": "merge_to_commit_s",
    "ddq_contribution_staleness_versions": "staleness_versions",
}

CATALOGUE: tuple[MetricSpec, ...] = (
    _m("ddq_build_info", "gauge", "Always 1: versions of the exporter.", "version", "python",
       "torch"),
    _m("ddq_run_info", "gauge", "Always 1: the run exported, with its digests.", "run_id",
       "config_digest", "run_digest"),
    # ── rounds and fragments (the fragments' exact counters) ──
    _m("ddq_rounds_total", "counter", "Rounds closed, by decision (merge, abandon).",
       "fragment", "decision"),
    _m("ddq_contributions_total", "counter",
       "Contributions settled, by outcome (merged, late, stale, ..., dead_lettered).",
       "fragment", "outcome"),
    _m("ddq_dead_letters_total", "counter", "Contributions dead-lettered, by reason tag.",
       "fragment", "reason"),
    _m("ddq_payload_bytes_total", "counter",
       "Payload bytes through the synchronizers: in (contributions read), out (versions "
       "published).", "fragment", "direction"),
    _m("ddq_global_version", "gauge", "Global version of the fragment.", "fragment"),
    _m("ddq_grace_window_seconds", "gauge", "Grace window the next round gets.", "fragment"),
    _m("ddq_quorum_contributors", "gauge", "Contributors of the fragment's last merge.",
       "fragment"),
    _m("ddq_quorum_required", "gauge", "Minimum quorum K."),
    _m("ddq_round_expected_seconds", "gauge",
       "Expected time between merges: sync_every_steps × the median step time.", "fragment"),
    _m("ddq_last_merge_age_seconds", "gauge", "Seconds since the fragment's last merge.",
       "fragment"),
    _m("ddq_round_open_to_quorum_seconds", "histogram",
       "From a round's opening to its quorum.", "fragment"),
    _m("ddq_round_quorum_to_merge_seconds", "histogram",
       "From the quorum to the merge decision (the grace window used).", "fragment"),
    _m("ddq_round_merge_to_commit_seconds", "histogram",
       "From the merge decision to the commit written (decode, merge, outer step, staging).",
       "fragment"),
    _m("ddq_contribution_staleness_versions", "histogram",
       "Versions between a merged contribution's base and the merge.", "fragment"),
    # ── learners (their heartbeats, and their counts in the fragments' states) ──
    _m("ddq_learners", "gauge", "Learners by state.", "state"),
    _m("ddq_learner_state", "gauge", "1 for the learner's state now, 0 for the others.",
       "learner", "state"),
    _m("ddq_learner_steps_total", "counter", "Inner steps since the learner started.",
       "learner"),
    _m("ddq_tokens_total", "counter", "Tokens trained since the learner started.", "learner"),
    _m("ddq_learner_step_seconds", "gauge", "Moving average of one inner step.", "learner"),
    _m("ddq_learner_train_loss", "gauge", "Loss of the learner's latest inner step.", "learner"),
    _m("ddq_learner_heartbeat_age_seconds", "gauge", "Seconds since the learner's heartbeat.",
       "learner"),
    _m("ddq_learner_queue_depth", "gauge", "Items waiting in a learner's background queue.",
       "learner", "queue"),
    _m("ddq_learner_contributions_total", "counter",
       "The learner's contributions settled, by outcome (all fragments).", "learner",
       "outcome"),
    _m("ddq_learner_merged_tokens_total", "counter",
       "Tokens of the learner's merged contributions, summed over fragments.", "learner"),
    _m("ddq_learner_computed_tokens_total", "counter",
       "Tokens the learner reports it computed (its token-fate counts in Redis).", "learner"),
    _m("ddq_learner_token_fate_tokens", "gauge",
       "The learner's computed tokens by fate: the outcome of each token's first carrier, "
       "dropped_at_learner, unsent, in_flight; they sum to the computed tokens.", "learner",
       "fate"),
    _m("ddq_learner_token_fate_balanced", "gauge",
       "1 when the learner's token fates are all ≥ 0 and sum to its computed tokens.",
       "learner"),
    # ── synchronizers ──
    _m("ddq_synchronizers_active", "gauge",
       "Synchronizers whose heartbeat is younger than membership.dead_after_s."),
    _m("ddq_synchronizer_heartbeat_age_seconds", "gauge",
       "Seconds since the synchronizer's heartbeat.", "synchronizer"),
    # ── faults, refusals (the run's counters in Redis) ──
    _m("ddq_faults_total", "counter", "Faults sent, by kind.", "kind"),
    _m("ddq_refused_messages_total", "counter",
       "Messages refused (unsigned, forged, malformed, replayed), by reader, kind and reason.",
       "reader", "kind", "reason"),
    # ── training ──
    _m("ddq_goodput_ratio", "gauge", "Training chip time ÷ allocated chip time, so far."),
    _m("ddq_uptime_ratio", "gauge", "Share of wall time with some training, so far."),
    _m("ddq_merged_token_share_ratio", "gauge",
       "Tokens in merged contributions ÷ tokens trained, per fragment."),
    _m("ddq_eval_loss", "gauge", "Latest held-out loss of the global model."),
    # ── Redis ──
    _m("ddq_stream_entries", "gauge",
       "Entries in a stream (trimmed near redis.stream_maxlen); fragment empty for run-wide "
       "streams.", "fragment", "stream"),
    _m("ddq_stream_pending_entries", "gauge",
       "Contributions delivered to the synchronizers and not yet acked.", "fragment"),
    _m("ddq_redis_memory_used_bytes", "gauge", "Redis used_memory."),
    _m("ddq_redis_memory_max_bytes", "gauge", "Redis maxmemory (0: no limit)."),
)  # fmt: skip
"""Every metric the exporter emits."""

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


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


class _Families:
    """The catalogue's families, filled by the collector and yielded in catalogue order."""

    def __init__(self) -> None:
        self.by_name: dict[str, Metric] = {}
        for spec in CATALOGUE:
            family: Metric
            base = spec.name.removesuffix("_total")
            if spec.kind == "counter":
                family = CounterMetricFamily(base, spec.help, labels=spec.labels)
            elif spec.kind == "gauge":
                family = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
            else:
                family = HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
            self.by_name[spec.name] = family

    def add(self, name: str, labels: tuple[str, ...], value: float) -> None:
        family = self.by_name[name]
        assert isinstance(family, CounterMetricFamily | GaugeMetricFamily)
        family.add_metric(list(labels), value)

    def histogram(self, name: str, labels: tuple[str, ...], counters: Mapping[str, int]) -> None:
        family = self.by_name[name]
        assert isinstance(family, HistogramMetricFamily)
        h = histogram(counters, _FRAGMENT_HISTOGRAMS[name])
        bounds = [*(f"{b:g}" for b in h.bounds), "+Inf"]
        family.add_metric(list(labels), list(zip(bounds, h.cumulative, strict=True)), h.total)


class RunCollector(Collector):
    """Collects the run's metrics from a control plane."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    def collect(self) -> Iterator[Metric]:
        """Refresh the plane and yield every catalogue family (called at each scrape)."""
        self.plane.refresh()
        yield from self.gather().by_name.values()

    def gather(self, *, streams: bool = True) -> _Families:
        """Every catalogue family, from the plane as it is (no refresh); ``streams`` False
        skips the stream lengths and pending counts (one Redis call each, no alert reads
        them)."""
        plane = self.plane
        out = _Families()
        with plane.lock:
            self._info(plane, out)
            self._fragments(plane, out)
            self._learners(plane, out)
            self._run(plane, out)
        if streams:
            self._streams(plane, out)
        self._memory(plane, out)
        return out

    def _info(self, plane: ControlPlane, out: _Families) -> None:
        out.add(
            "ddq_build_info",
            (dd_queue.__version__, platform.python_version(), _version("torch")),
            1,
        )
        cfg = plane.cfg
        out.add("ddq_run_info", (cfg.run.run_id, cfg.digest, cfg.run_digest), 1)

    def _fragments(self, plane: ControlPlane, out: _Families) -> None:
        state = state_view(plane, writes_enabled=False)
        step_s = state.quorum.step_time_s
        now = plane.wall()
        every = plane.cfg.synchronizer.sync_every_steps
        for f in state.fragments:
            p = (str(f.fragment_id),)
            counters = plane.states[f.fragment_id].counters
            out.add("ddq_rounds_total", (*p, "merge"), counters.get("rounds_merged", 0))
            out.add("ddq_rounds_total", (*p, "abandon"), counters.get("rounds_abandoned", 0))
            for outcome in _OUTCOMES:
                out.add("ddq_contributions_total", (*p, outcome), counters.get(outcome, 0))
            for reason, n in sorted(dead_letters(counters).items()):
                out.add("ddq_dead_letters_total", (*p, reason), n)
            out.add("ddq_payload_bytes_total", (*p, "in"), counters.get("bytes_in", 0))
            out.add("ddq_payload_bytes_total", (*p, "out"), counters.get("bytes_out", 0))
            out.add("ddq_global_version", p, f.version)
            out.add("ddq_grace_window_seconds", p, f.grace_window_s)
            if step_s:
                out.add("ddq_round_expected_seconds", p, every * step_s)
            if f.last_merge_at_s is not None:
                out.add("ddq_last_merge_age_seconds", p, max(0.0, now - f.last_merge_at_s))
            for name in _FRAGMENT_HISTOGRAMS:
                out.histogram(name, p, counters)
        for fragment_id, record in sorted(plane.log.last_round.items()):
            if record.decision == "merge":
                contributors = len(record.contributors)
                out.add("ddq_quorum_contributors", (str(fragment_id),), contributors)
        out.add("ddq_quorum_required", (), state.quorum.quorum)
        out.add("ddq_goodput_ratio", (), state.goodput.goodput)
        out.add("ddq_uptime_ratio", (), state.goodput.uptime)
        if state.merged_token_share is not None:
            out.add("ddq_merged_token_share_ratio", (), state.merged_token_share)
        if state.eval:
            out.add("ddq_eval_loss", (), state.eval[-1].loss)
        for view in refused_view(plane):
            out.add("ddq_refused_messages_total", (view.reader, view.kind, view.reason), view.count)

    def _learners(self, plane: ControlPlane, out: _Families) -> None:
        seen = dict.fromkeys(_STATES, 0)
        for obs in plane.members.learners:
            seen[obs.state] = seen.get(obs.state, 0) + 1
            learner, beat = (obs.learner_id,), obs.beat
            for name in _STATES:
                out.add("ddq_learner_state", (*learner, name), float(obs.state == name))
            out.add("ddq_learner_steps_total", learner, beat.step)
            out.add("ddq_tokens_total", learner, beat.n_tokens)
            if beat.step_time_ema_s is not None:
                out.add("ddq_learner_step_seconds", learner, beat.step_time_ema_s)
            if beat.train_loss is not None:
                out.add("ddq_learner_train_loss", learner, beat.train_loss)
            if obs.heartbeat_age_s is not None:
                out.add("ddq_learner_heartbeat_age_seconds", learner, obs.heartbeat_age_s)
            for queue, depth in sorted(beat.queue_depths.items()):
                out.add("ddq_learner_queue_depth", (*learner, queue), depth)
        for name, n in seen.items():
            out.add("ddq_learners", (name,), n)
        per_learner = learner_counts(summed(st.counters for st in plane.states.values()))
        for learner_id, counts in sorted(per_learner.items()):
            for outcome in _OUTCOMES:
                out.add(
                    "ddq_learner_contributions_total", (learner_id, outcome), counts.get(outcome, 0)
                )
            out.add(
                "ddq_learner_merged_tokens_total", (learner_id,), counts.get("tokens_merged", 0)
            )
        for view in token_fate_views(plane):
            learner = (view.learner_id,)
            out.add("ddq_learner_computed_tokens_total", learner, view.computed)
            for fate, tokens in view.fates.items():
                out.add("ddq_learner_token_fate_tokens", (*learner, fate), tokens)
            out.add("ddq_learner_token_fate_balanced", learner, float(view.balanced))

    def _run(self, plane: ControlPlane, out: _Families) -> None:
        fresh_s = plane.cfg.membership.dead_after_s
        syncs = plane.members.synchronizers
        out.add("ddq_synchronizers_active", (), sum(s.heartbeat_age_s <= fresh_s for s in syncs))
        for s in syncs:
            out.add(
                "ddq_synchronizer_heartbeat_age_seconds", (s.synchronizer_id,), s.heartbeat_age_s
            )
        for kind, n in sorted(plane.faults_sent.items()):
            out.add("ddq_faults_total", (kind,), n)

    def _streams(self, plane: ControlPlane, out: _Families) -> None:
        bus, keys = plane.bus, plane.bus.keys
        for p in range(plane.cfg.synchronizer.n_fragments):
            for name, key in (
                ("up", keys.up(p)),
                ("down", keys.down(p)),
                ("rounds", keys.rounds(p)),
                ("dlq", keys.dlq(p)),
            ):
                out.add("ddq_stream_entries", (str(p), name), bus.stream_length(key))
            pending = bus.pending_summary(keys.up(p), SYNC_GROUP).count
            out.add("ddq_stream_pending_entries", (str(p),), pending)
        for name, key in (("events", keys.events()), ("open", keys.opened_rounds())):
            out.add("ddq_stream_entries", ("", name), bus.stream_length(key))

    def _memory(self, plane: ControlPlane, out: _Families) -> None:
        memory = plane.bus.memory_info()
        if memory is not None:
            out.add("ddq_redis_memory_used_bytes", (), memory.used_bytes)
            out.add("ddq_redis_memory_max_bytes", (), memory.max_bytes)


def alert_sample(plane: ControlPlane) -> Sample:
    """The values the alert rules read (``core.alerts.METRICS``), as ``/metrics`` would export
    them now (no refresh)."""
    values: dict[str, dict[Labels, float]] = {name: {} for name in ALERT_METRICS}
    for family in RunCollector(plane).gather(streams=False).by_name.values():
        for sample in family.samples:
            if sample.name in values:
                values[sample.name][labels_of(**sample.labels)] = sample.value
    return Sample(at_s=plane.clock.now(), values=values)


def registry_for(plane: ControlPlane) -> CollectorRegistry:
    """A registry holding only this plane's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(plane))
    return registry
