"""Watching a run through the Bus: round records, events and heartbeats → progress + summary.

Goodput and uptime are the control plane's: a ``GoodputLedger`` fed with every learner's
observed state at each poll (training / waiting / down), from the first poll on.

Reads only (``Bus.read`` of the ``rounds``/``dlq``/``events`` streams through the control
plane's :class:`~dd_queue.control.tails.RunLog`, ``Bus.heartbeats`` through
:class:`~dd_queue.control.members.Members`); key names come from ``dd_queue.keys``.
"""

from __future__ import annotations

from dd_queue.bus import Bus
from dd_queue.config import DDQConfig
from dd_queue.control.ledger import GoodputLedger, interval_kind
from dd_queue.control.members import Members
from dd_queue.control.tails import RunLog
from dd_queue.up.summary import Summary

__all__ = ["RunWatch"]


class RunWatch:
    """Accumulates what a run did, one ``poll`` at a time.

    Args:
        cfg: The run's config.
        bus: A bus on the run's Redis.
        summary: Filled in place by every poll.
    """

    def __init__(self, cfg: DDQConfig, bus: Bus, summary: Summary) -> None:
        limits = cfg.wire.message_limits()
        self.bus, self.summary = bus, summary
        self.runlog = RunLog(bus, cfg.synchronizer.n_fragments, limits)
        self.members = Members(cfg.run.run_id, cfg.membership.params(), limits)
        self._tokens: dict[tuple[str, int], int] = {}
        self._ledger: GoodputLedger | None = None

    def poll(self, now: float) -> None:
        """Read what is new (rounds, events, heartbeats) and update the summary."""
        s = self.summary
        rounds, events = self.runlog.poll()
        for record in rounds:
            if record.decision != "merge":
                s.rounds_abandoned += 1
                continue
            s.rounds_merged += 1
            s.versions[record.fragment_id] = max(
                s.versions.get(record.fragment_id, 0), record.version_after
            )
            for c in record.contributors:
                s.contributions[c.learner_id] = s.contributions.get(c.learner_id, 0) + 1
                s.tokens_merged += c.n_tokens
        for _, event in events:
            if event.kind == "fault.injected":
                s.faults_injected += 1
            elif event.kind == "eval.done" and isinstance(event.fields.get("loss"), float):
                loss = float(event.fields["loss"])  # type: ignore[arg-type]
                if s.eval_loss_start is None:
                    s.eval_loss_start = loss
                s.eval_loss_end, s.evals = loss, s.evals + 1
        self.members.update(now, self.bus.heartbeats())
        for obs in self.members.learners:
            key = (obs.learner_id, obs.beat.pid)
            self._tokens[key] = max(self._tokens.get(key, 0), obs.beat.n_tokens)
        s.tokens_trained = sum(self._tokens.values())
        self._account(now)

    def _account(self, now: float) -> None:
        """Goodput and uptime so far (from the first poll that saw a learner)."""
        kinds = {o.learner_id: interval_kind(o.state, o.beat.state) for o in self.members.learners}
        if self._ledger is None:
            if not kinds:
                return
            self._ledger = GoodputLedger(now)
        self._ledger.sample(now, kinds)
        totals = self._ledger.summary(now)
        if totals.allocated_chip_s > 0:  # an empty window has no goodput yet
            self.summary.goodput, self.summary.uptime = totals.goodput, totals.uptime

    def line(self) -> str:
        """One progress line: rounds, versions, eval loss, learner states."""
        s = self.summary
        versions = "/".join(str(v) for _, v in sorted(s.versions.items())) or "-"
        states = " ".join(f"{o.learner_id}:{o.state}@{o.beat.step}" for o in self.members.learners)
        loss = f"{s.eval_loss_end:.3f}" if s.eval_loss_end is not None else "-"
        goodput = f"{s.goodput:.0%}" if s.goodput is not None else "-"
        return (
            f"[{s.wall_s:5.0f}s] rounds {s.rounds_merged} versions {versions} eval loss {loss} "
            f"tokens {s.tokens_trained:,} goodput {goodput} sync {self.sync_state()} "
            f"learners {states or '(joining)'}"
        )

    def sync_state(self) -> str:
        """``up`` while a synchronizer heartbeat is under 5 s old, else ``down``."""
        return "up" if any(x.heartbeat_age_s < 5 for x in self.members.synchronizers) else "down"
