"""A learner's background work, steppable: everything that touches the bus.

Two halves, each safe to call from its own thread (the service runs one thread per half, so a
snapshot is published as soon as it is taken while the receiver waits for round openings) or
both from one thread (``Learner.pump``; the in-process runner calls it with ``block_ms=0``):

- ``receive``: fault commands → round openings (the only blocking read) → new global versions
  (fetched, verified, queued in the ``Inbox``) → heartbeat when due → periodic realignment.
- ``send``: snapshots from the ``Outbox`` → Δ_p, error feedback, codec → ``send_contribution``.

Neither half ever raises a ``BusError``: Redis being down (``BusUnavailable`` after the bus's
bounded retries) or a ``disconnect`` fault puts the pump *offline*. Offline, it retries every
``retry_s``; snapshots keep waiting in the outbox (latest wins, so at most one per fragment),
and training goes on. When the bus answers again the pump realigns every stream and catches up
on every fragment by its newest version (docs/protocol.md; research/redis-pipeline.md on what
a Redis restart without persistence loses).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from dd_queue.auth import Auth
from dd_queue.bus import Bus, ops
from dd_queue.clock import Clock
from dd_queue.errors import BusError, NonFiniteValues
from dd_queue.faults import Effect, FaultInjector
from dd_queue.learner import publisher
from dd_queue.learner.exchange import Inbox, Outbox, RoundBook, Snapshot
from dd_queue.learner.receiver import Follower
from dd_queue.learner.tokens import TokenBook
from dd_queue.messages import Event, FaultCommand, Heartbeat

log = logging.getLogger("dd_queue.learner")

Pair = tuple[int, int]


@dataclass(frozen=True, slots=True)
class PumpReport:
    """What one pump call did.

    Attributes:
        sent: (fragment, round) of each contribution published.
        dropped: (fragment, round) of snapshots not published (``drop`` fault, NaN/Inf).
        received: (fragment, version) of each verified global queued for the training thread.
        rounds: (fragment, round) of each round opening seen.
        commands: Fault commands armed.
        heartbeat: Whether a heartbeat was sent.
        online: Whether the bus answered (False while Redis is down or disconnected).
    """

    sent: tuple[Pair, ...] = ()
    dropped: tuple[Pair, ...] = ()
    received: tuple[Pair, ...] = ()
    rounds: tuple[Pair, ...] = ()
    commands: int = 0
    heartbeat: bool = False
    online: bool = True

    def __add__(self, other: PumpReport) -> PumpReport:
        return PumpReport(
            self.sent + other.sent,
            self.dropped + other.dropped,
            self.received + other.received,
            self.rounds + other.rounds,
            self.commands + other.commands,
            self.heartbeat or other.heartbeat,
            self.online and other.online,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PumpSettings:
    """Timing and mode of the pump.

    Attributes:
        heartbeat_interval_s: Seconds between heartbeats.
        heartbeat_ttl_s: A heartbeat's lifetime (``membership.dead_after_s``).
        resync_interval_s: Seconds between realignments of every stream.
        sweep_interval_s: Seconds between reads of every ``down`` and control stream (in
            between, only fragments with a round in flight are read).
        watch_s: How long a fragment is read after its round opened, at most (until a version
            of that round or a later one arrives).
        retry_s: Seconds between attempts while offline.
        request_rounds: Round openings ask for a snapshot (synchronizer-paced mode).
        faults_enabled: Arm fault commands read from the control streams.
    """

    heartbeat_interval_s: float
    heartbeat_ttl_s: float
    resync_interval_s: float
    sweep_interval_s: float
    watch_s: float
    retry_s: float
    request_rounds: bool
    faults_enabled: bool


class Pump:
    """The bus side of one learner (rank 0 of a torchrun group).

    Args:
        bus: The run's bus.
        follower: Stream positions (already started by the join).
        publish: What every contribution shares.
        encoder: Δ_p + error feedback + codec.
        outbox, inbox, rounds: Shared with the training thread.
        injector: Faults at ``on_receive`` and ``before_publish``.
        clock: Time for schedules and offline waits.
        status: Builds this learner's heartbeat.
        settings: Timing and mode.
        tokens: The learner's token counts (reported before each send, with each heartbeat
            and at ``flush``).
    """

    def __init__(
        self,
        *,
        bus: Bus,
        follower: Follower,
        publish: publisher.PublishSettings,
        encoder: publisher.ContributionEncoder,
        outbox: Outbox,
        inbox: Inbox,
        rounds: RoundBook,
        injector: FaultInjector,
        clock: Clock,
        status: Callable[[], Heartbeat],
        settings: PumpSettings,
        tokens: TokenBook,
    ) -> None:
        self.bus, self.follower, self.publish, self.encoder = bus, follower, publish, encoder
        self.tokens = tokens
        self.outbox, self.inbox, self.rounds = outbox, inbox, rounds
        self.injector, self.clock, self._status, self.settings = injector, clock, status, settings
        self._lock = threading.Lock()  # guards the offline state shared by both halves
        self._offline_until: float | None = None
        self._realign_due = False
        self.killed = False  # a kill fault fired at before_publish: the learner dies at once
        now = clock.now()
        self._next_beat = self._next_sweep = now
        self._next_realign = now + settings.resync_interval_s
        self._watch: dict[int, tuple[int, float]] = {}  # fragment → (round, watch until)

    @property
    def auth(self) -> Auth:
        """The learner's key and the run's keyring (signs its heartbeats and contributions)."""
        return self.publish.auth

    # ── connection state ─────────────────────────────────────────────────────────────────
    @property
    def online(self) -> bool:
        """False from a bus failure (or ``disconnect`` fault) until the bus answers again."""
        with self._lock:
            return self._offline_until is None

    def _go_offline(self, why: str, until_s: float) -> None:
        with self._lock:
            first = self._offline_until is None
            self._offline_until = until_s
            self._realign_due = True
        if first:
            log.warning("learner.offline %s; training continues on local state", why)

    def _wait_offline(self, block_ms: int) -> bool:
        """If offline and not yet time to retry, wait (≤ block_ms) and return True."""
        with self._lock:
            until = self._offline_until
        if until is None:
            return False
        remaining_s = until - self.clock.now()
        if remaining_s <= 0:
            return False
        self.clock.sleep(min(remaining_s, block_ms / 1000))
        return True

    def _back_online(self) -> None:
        with self._lock:
            was_offline = self._offline_until is not None
            self._offline_until = None
        if was_offline:
            log.info("learner.online the bus answers again; resynchronising every fragment")

    # ── receive ──────────────────────────────────────────────────────────────────────────
    def receive(self, *, block_ms: int = 0) -> PumpReport:
        """Commands, round openings (waits ≤ ``block_ms`` for one), new globals, heartbeat."""
        if self.killed:  # a dead process is silent
            return PumpReport(online=False)
        effect = self.injector.effect("on_receive")
        if effect.offline_until_s is not None:
            self._go_offline(effect.reason, effect.offline_until_s)
        if self._wait_offline(block_ms):
            return PumpReport(online=False)
        try:
            report = self._receive(block_ms, effect)
        except BusError as exc:
            self._go_offline(f"bus failed: {exc}", self.clock.now() + self.settings.retry_s)
            return PumpReport(online=False)
        self._back_online()
        return report

    def _receive(self, block_ms: int, effect: Effect) -> PumpReport:
        now = self.clock.now()
        if self._realign_due or now >= self._next_realign:
            self.follower.realign()
            self._realign_due, self._next_realign = False, now + self.settings.resync_interval_s
            self._next_sweep = now
        # A sweep reads every stream; between sweeps only the round openings and the `down`
        # streams of fragments with a round in flight (a new version follows a round), so a
        # pass costs ~3 reads instead of P + 3 (the pump's Python time competes with training
        # for the GIL).
        sweep = now >= self._next_sweep
        if sweep:
            self._next_sweep = now + self.settings.sweep_interval_s
        beat = self.beat_if_due()
        commands = sum(self._arm(cmd) for cmd in self.follower.read_commands()) if sweep else 0
        rounds = self._read_rounds(block_ms)
        watched = None if sweep else [p for p, (_, until) in self._watch.items() if until > now]
        found = self.follower.read_globals(self.inbox.known_version, watched)
        for r in found:
            if r.round_id >= self._watch.get(r.fragment_id, (-1, 0.0))[0]:
                self._watch.pop(r.fragment_id, None)
        if effect.drop and found:
            log.warning(
                "fault.injected %s: dropped %d received globals", effect.fault_id, len(found)
            )
            found = []
        if effect.wait_s:
            self.clock.sleep(effect.wait_s)
        received = [(r.fragment_id, r.version) for r in found if self.inbox.put(r)]
        return PumpReport(
            received=tuple(received), rounds=tuple(rounds), commands=commands, heartbeat=beat
        )

    def _read_rounds(self, block_ms: int) -> list[Pair]:
        """New round openings (waits ≤ ``block_ms``); their fragments are watched."""
        rounds: list[Pair] = []
        for opening in self.follower.read_opens(block_ms=block_ms):
            p, round_id = opening.fragment_id, opening.round_id
            request = self.settings.request_rounds
            if self.rounds.announce(p, round_id, request=request, opened_at_s=opening.opened_at_s):
                rounds.append((p, round_id))
                self._watch[p] = (round_id, self.clock.now() + self.settings.watch_s)
        return rounds

    def beat_if_due(self, *, force: bool = False) -> bool:
        """Send a heartbeat when one is due (or ``force``); returns whether one was sent.

        Raises:
            BusError: The bus failed (``receive`` turns it into the offline state).
        """
        now = self.clock.now()
        if not force and now < self._next_beat:
            return False
        self._next_beat = now + self.settings.heartbeat_interval_s
        ops.heartbeat(self.bus, self._status(), ttl_s=self.settings.heartbeat_ttl_s, auth=self.auth)
        self.report_tokens()
        return True

    def report_tokens(self) -> None:
        """Add what the token counts rose by to the run's ``tokens`` counters.

        Raises:
            BusError: The bus failed (the counts are reported with the next call).
        """
        due = self.tokens.claim()
        if not any(due.values()):
            return
        try:
            ops.report_tokens(self.bus, self.publish.learner_id, due)
        except BusError:
            self.tokens.unclaim(due)
            raise

    def _arm(self, cmd: FaultCommand) -> int:
        if not self.injector.applies_to(cmd.target):
            return 0
        if not self.settings.faults_enabled:
            log.warning("fault.ignored %s (%s): faults.enabled is false", cmd.fault_id, cmd.kind)
            return 0
        self.injector.arm(
            cmd.kind, fault_id=cmd.fault_id, duration_s=cmd.duration_s, params=cmd.params
        )
        log.warning(
            "fault.armed %s: %s for %s s",
            cmd.fault_id,
            cmd.kind,
            cmd.duration_s,
            extra={"ddq": {"params": cmd.params}},
        )
        # Acknowledge on the run's event stream: the control plane's fault record turns "sent"
        # into "armed" (the synchronizer does the same in members.py).
        event = Event(
            run_id=self.publish.run_id,
            kind="fault.armed",
            message=f"{cmd.kind} armed on {self.publish.learner_id}",
            fields={"fault": cmd.fault_id, "member": self.publish.learner_id},
            at_s=self.bus.server_time_s(),
        )
        ops.emit_event(self.bus, event.to_fields())
        return 1

    def flush(self, timeout_s: float) -> int:
        """Publish waiting snapshots for up to ``timeout_s`` (while online); returns how many
        are left unsent."""
        deadline = self.clock.now() + timeout_s
        while self.outbox.depth() and self.online and self.clock.now() < deadline:
            self.send(block_ms=0)
        try:
            self.report_tokens()
        except BusError as exc:
            log.warning("learner.leave could not report its token counts: %s", exc)
        return self.outbox.depth()

    def deregister(self) -> None:
        """Remove this learner's heartbeat (a clean leave); a dead bus is only logged."""
        try:
            self.bus.remove_heartbeat(self.publish.learner_id)
        except BusError as exc:
            log.warning("learner.leave could not remove the heartbeat: %s", exc)

    # ── send ─────────────────────────────────────────────────────────────────────────────
    def send(self, *, block_ms: int = 0) -> PumpReport:
        """Publish every waiting snapshot (waits ≤ ``block_ms`` for the first)."""
        if self.killed or self._wait_offline(block_ms):
            return PumpReport(online=False)
        report = PumpReport()
        wait_ms = block_ms
        while (snapshot := self.outbox.take(block_ms=wait_ms)) is not None:
            wait_ms = 0
            report += self._send_one(snapshot)
            if not report.online:
                break
        return report

    def _send_one(self, snapshot: Snapshot) -> PumpReport:
        pair = (snapshot.fragment_id, snapshot.round_id)
        effect = self.injector.effect("before_publish")
        if effect.kill:  # the contribution in hand dies with the process
            log.warning("fault.injected %s: kill while publishing %s", effect.fault_id, pair)
            self.killed = True
            return PumpReport(online=False)
        if effect.offline_until_s is not None:
            self._go_offline(effect.reason, effect.offline_until_s)
            self.outbox.restore(snapshot)
            return PumpReport(online=False)
        span = (snapshot.fragment_id, snapshot.base_version, snapshot.n_tokens)
        if effect.drop:
            log.warning("fault.injected %s: dropped contribution %s", effect.fault_id, pair)
            self.tokens.dropped(*span)
            self.outbox.done(snapshot, published=False)
            return PumpReport(dropped=(pair,))
        if effect.wait_s:
            self.clock.sleep(effect.wait_s)
        try:
            encoded, residual = self.encoder.encode(snapshot)
        except NonFiniteValues as exc:
            log.error("contribution.non_finite fragment %d round %d: %s; not sent", *pair, exc)
            self.tokens.dropped(*span)
            self.outbox.done(snapshot, published=False)
            return PumpReport(dropped=(pair,))
        corrupted = effect.corrupt
        if corrupted:
            encoded = publisher.corrupt(encoded)
        new_tokens = self.tokens.new_tokens(*span)
        self.tokens.sending(*span)
        due = self.tokens.claim()  # counted in the send's own round trip, just before the entry
        try:
            entry_id = publisher.send(self.bus, self.publish, snapshot, encoded, new_tokens, due)
        except BusError as exc:
            self.tokens.unclaim(due)
            self.outbox.restore(snapshot)
            self._go_offline(f"bus failed: {exc}", self.clock.now() + self.settings.retry_s)
            return PumpReport(online=False)
        self._back_online()
        self.tokens.sent(*span)
        if not corrupted:
            self.encoder.commit(snapshot.fragment_id, residual)
        self.outbox.done(snapshot, published=True)
        log.debug(
            "contribution.sent fragment %d round %d entry %s",
            *pair,
            entry_id,
            extra={
                "ddq": {
                    "n_steps": snapshot.n_steps,
                    "n_tokens": snapshot.n_tokens,
                    "base_version": snapshot.base_version,
                }
            },
        )
        return PumpReport(sent=(pair,))


__all__ = ["Pump", "PumpReport", "PumpSettings"]
