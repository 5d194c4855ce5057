"""The control plane's model of the run: refreshed from Redis, plus fault and chaos actions.

One :class:`ControlPlane` per app (built by ``create_app``, held in ``app.state``; no module
globals). ``refresh`` reads heartbeats, the new round records, dead letters and events, every
fragment's ``state`` and the run's counters of faults and refusals; it samples the goodput
ledger and advances the fault watches. It is incremental and guarded by one lock, so routes,
the SSE stream and the background ticker can all call it. The only writes are fault commands
(``ops.send_command``), the events that record them (``fault.injected``, ``fault.observed``,
``chaos.started``, ``chaos.stopped``) and the counters of faults sent and heartbeats refused.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable

from dd_queue.auth import CONTROL, Auth
from dd_queue.bus import Bus, ops
from dd_queue.clock import Clock
from dd_queue.config import DDQConfig
from dd_queue.control.actions import Actions
from dd_queue.control.alerting import Alerting
from dd_queue.control.faultbook import FaultBook
from dd_queue.control.ledger import GoodputLedger, interval_kind
from dd_queue.control.members import Members
from dd_queue.control.observe import Target, Watch
from dd_queue.control.tails import RunLog, Tally
from dd_queue.core.goodput import GoodputSummary
from dd_queue.errors import DDQError
from dd_queue.fragment_state import FragmentState
from dd_queue.messages import Event, RoundRecord, Scalar

__all__ = ["ControlPlane"]

log = logging.getLogger("dd_queue.control")


class ControlPlane:
    """What the routes read and the actions they take.

    Args:
        cfg: The run's config.
        bus: The run's bus.
        clock: Monotonic seconds (ages, goodput, schedules).
        wall: Wall-clock seconds since the epoch (records).
        seed: Seed of the random choices (``random`` targets, unseeded chaos).
    """

    def __init__(
        self,
        cfg: DDQConfig,
        bus: Bus,
        clock: Clock,
        *,
        wall: Callable[[], float] = time.time,
        seed: int | None = None,
    ) -> None:
        self.cfg, self.bus, self.clock, self.wall = cfg, bus, clock, wall
        self.limits = cfg.wire.message_limits()
        self.lock = threading.RLock()
        self.rng = random.Random(seed)
        self.auth = Auth.load(cfg.auth, cfg.run.run_id, CONTROL)  # signs fault commands
        self.members = Members(cfg.run.run_id, cfg.membership.params(), self.limits, auth=self.auth)
        self.log = RunLog(bus, cfg.synchronizer.n_fragments, self.limits)
        self.book = FaultBook()
        self.started_s, self.started_at_s = clock.now(), wall()
        self.ledger = GoodputLedger(self.started_s)
        self.goodput: GoodputSummary = self.ledger.summary(self.started_s)
        self.states: dict[int, FragmentState] = {}
        self.faults_sent: dict[str, int] = {}
        """Faults sent, by kind (the run's counters in Redis: every control plane's)."""
        self.refused: dict[tuple[str, str, str], int] = {}
        """Messages refused by ``(reader, kind, reason)`` (the run's counters in Redis)."""
        self.tokens: dict[str, dict[str, int]] = {}
        """Learner → its own token counts (``ops.token_counts``: computed, published, dropped)."""
        self.watches: dict[str, Watch] = {}
        self.refreshed_s = float("-inf")
        self.generation = 0
        self.actions = Actions(self)
        self.train_losses: dict[str, deque[tuple[float, int, float]]] = {}
        """Learner → (wall time, step, train loss) from its heartbeats, the last 600 steps seen
        (in memory: the dashboard's curves start afresh with the control plane)."""
        self.alerting = Alerting()
        """The alert rules' samples and the alerts now (fed by the ticker: ``app``)."""

    # ── refresh ───────────────────────────────────────────────────────────────────────────
    def refresh(self, max_age_s: float = 0.0) -> None:
        """Re-read Redis unless the last refresh is younger than ``max_age_s``.

        Raises:
            BusError: Redis failed (the routes answer 503).
        """
        with self.lock:
            now = self.clock.now()
            if now - self.refreshed_s >= max_age_s:
                self._refresh(now)

    def tick(self) -> None:
        """One background step: refresh, then fire the chaos faults that are due."""
        with self.lock:
            self._refresh(self.clock.now())
            self.actions.fire_due(self.clock.now())

    def _refresh(self, now: float) -> None:
        self.members.update(now, self.bus.heartbeats())
        self._note_losses()
        ops.report_refused(self.bus, "control", self.members.take_refusals(), at_s=self.wall())
        rounds = self.poll_log()
        self.states = self._read_states()
        self.faults_sent = ops.fault_counts(self.bus)
        self.refused = ops.refused_counts(self.bus)
        self.tokens = ops.token_counts(self.bus)
        kinds = {
            obs.learner_id: interval_kind(obs.state, obs.beat.state)
            for obs in self.members.learners
        }
        self.ledger.sample(now, kinds)
        self.goodput = self.ledger.record(now, self.wall())
        self._observe(now, rounds)
        self.refreshed_s = now
        self.generation += 1

    def _note_losses(self) -> None:
        """Each learner's train loss, once per new step its heartbeat reports."""
        for obs in self.members.learners:
            beat, curve = obs.beat, self.train_losses.setdefault(obs.learner_id, deque(maxlen=600))
            if beat.train_loss is not None and (not curve or curve[-1][1] != beat.step):
                curve.append((beat.sent_at_s, beat.step, beat.train_loss))

    def poll_log(self) -> list[RoundRecord]:
        """Read new records and events; fold the events into the fault book and chaos store.
        Returns the round records closed since the last poll."""
        rounds, events = self.log.poll()
        for _, event in events:
            self.book.apply(event)
            self.actions.apply(event)
        return rounds

    def _read_states(self) -> dict[int, FragmentState]:
        states: dict[int, FragmentState] = {}
        for p in range(self.cfg.synchronizer.n_fragments):
            raw = self.bus.get(self.bus.keys.state(p))
            if raw is None:
                continue
            try:
                states[p] = FragmentState.from_bytes(
                    raw, run_id=self.cfg.run.run_id, limits=self.limits
                )
            except DDQError as exc:
                log.warning("control.bad_state fragment %d: %s", p, exc)
        return states

    # ── fault watches ─────────────────────────────────────────────────────────────────────
    def target_now(self, target_id: str) -> Target:
        """The observation of a fault target at this refresh."""
        if target_id == "synchronizer":
            fresh_s = self.cfg.membership.stalled_after_s
            return Target.of_synchronizers(self.members.synchronizers, fresh_s)
        tally = self.log.tallies.get(target_id, Tally())
        return Target.of_learner(self.members.learner(target_id), tally)

    def _observe(self, now: float, rounds: list[RoundRecord]) -> None:
        for fault_id, watch in list(self.watches.items()):
            notes = watch.observe(now, self.target_now(watch.target_id), rounds)
            for i, note in enumerate(notes):
                final = watch.closed and i == len(notes) - 1
                self.emit(
                    "fault.observed", note, fault=fault_id, final=final, effective=watch.effective
                )
            if watch.closed:
                del self.watches[fault_id]

    def emit(self, kind: str, message: str, /, **fields: Scalar) -> str:
        """Append an event to the run's event stream; returns its id."""
        event = Event(
            run_id=self.cfg.run.run_id, kind=kind, message=message, fields=fields, at_s=self.wall()
        )
        log.info("%s %s", kind, message)
        return ops.emit_event(self.bus, event.to_fields(), maxlen=self.cfg.redis.stream_maxlen)
