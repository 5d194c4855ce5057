"""Who is in the run, as the control plane sees it: learners and synchronizers from heartbeats.

Liveness comes from ``core.membership.classify`` (heartbeat age against the thresholds), with
two additions only an observer that remembers can make:

- A learner whose heartbeat says it is ``stalled`` or ``killed`` (a fault at a safe point: its
  pump thread still beats) is shown in that state, with the reason "the learner reports ...".
- A heartbeat expires ``membership.dead_after_s`` after its last beat and then vanishes. A
  learner that vanished *before* that was removed on purpose (a clean leave): ``left``; one that
  vanished when due to expire is ``dead``. Both are remembered until the control plane restarts.

A learner that comes back under the same id with a new pid counts a restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from dd_queue.auth import OPEN, Auth, Refusals
from dd_queue.bus import HeartbeatInfo, ops
from dd_queue.core.membership import Heartbeat as Beat
from dd_queue.core.membership import MembershipParams, classify
from dd_queue.errors import DDQError, ProtocolError
from dd_queue.messages import Heartbeat, MessageLimits

__all__ = ["LearnerObs", "Members", "SyncObs"]

log = logging.getLogger("dd_queue.control")

_REPORTED = {"stalled": "stalled", "killed": "dead"}
"""Heartbeat states that override the age-based state (what a fault at a safe point reports)."""


@dataclass(frozen=True, slots=True)
class LearnerObs:
    """One learner now: liveness with its reason, and its last heartbeat.

    Attributes:
        learner_id: The learner.
        state: active / straggling / stalled / dead / left.
        reason: Why it is in that state.
        heartbeat_age_s: Seconds since its last heartbeat (None once it vanished).
        beat: Its last heartbeat.
        restarts: Times it came back with a new pid since the control plane started.
    """

    learner_id: str
    state: str
    reason: str
    heartbeat_age_s: float | None
    beat: Heartbeat
    restarts: int = 0

    @property
    def live(self) -> bool:
        """Whether it may still contribute (and read fault commands)."""
        return self.state in ("active", "straggling", "stalled")


@dataclass(frozen=True, slots=True)
class SyncObs:
    """One synchronizer's last heartbeat and its age, seconds."""

    synchronizer_id: str
    heartbeat_age_s: float
    beat: Heartbeat


@dataclass(slots=True)
class _Memory:
    obs: LearnerObs
    last_beat_s: float  # clock time of its last beat (now − age when seen)


class Members:
    """Remembers every learner seen and classifies them on each ``update``.

    Args:
        run_id: The run (heartbeats of other runs are ignored).
        params: Liveness thresholds.
        limits: Decode limits of heartbeats.
    """

    def __init__(
        self,
        run_id: str,
        params: MembershipParams,
        limits: MessageLimits,
        *,
        auth: Auth = OPEN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._run_id, self._params, self._limits = run_id, params, limits
        self._auth, self._clock = auth, clock
        self.refusals = Refusals()
        self._due: dict[tuple[str, str], int] = {}
        self._known: dict[str, _Memory] = {}
        self.learners: tuple[LearnerObs, ...] = ()
        self.synchronizers: tuple[SyncObs, ...] = ()

    def take_refusals(self) -> dict[tuple[str, str], int]:
        """The heartbeat refusals to report now, ``(kind, reason) → n``: what ``Refusals`` let
        through since the last call (a flood: once an interval)."""
        due, self._due = self._due, {}
        for pair, n in self.refusals.flush(self._clock()).items():
            due[pair] = due.get(pair, 0) + n
        return due

    def update(self, now: float, infos: dict[str, HeartbeatInfo]) -> None:
        """Classify every learner from the current heartbeats (``Bus.heartbeats()``)."""
        beats: dict[str, tuple[Heartbeat, float]] = {}
        syncs: list[SyncObs] = []
        for member, info in sorted(infos.items()):
            try:
                hb = ops.read_heartbeat(
                    member, info.payload, run_id=self._run_id, limits=self._limits, auth=self._auth
                )
            except DDQError as exc:  # never a member: not shown, not kept
                reason = exc.reason if isinstance(exc, ProtocolError) else type(exc).__name__
                due = self.refusals.add("heartbeat", reason, self._clock())
                for pair, n in due.items():
                    self._due[pair] = self._due.get(pair, 0) + n
                log.log(
                    logging.WARNING if due else logging.DEBUG,
                    "control.heartbeat_refused %s: %s",
                    member,
                    exc,
                )
                continue
            if hb.role == "learner":
                beats[hb.member_id] = (hb, info.age_s)
            elif hb.role == "synchronizer":
                syncs.append(SyncObs(hb.member_id, info.age_s, hb))
        self.synchronizers = tuple(syncs)
        statuses = classify(
            now,
            [
                Beat(learner_id=lid, last_seen_s=now - age, step_time_s=hb.step_time_ema_s or None)
                for lid, (hb, age) in beats.items()
            ],
            self._params,
        )
        for lv in statuses:
            hb, age = beats[lv.learner_id]
            self._seen(now, hb, age, lv.state, lv.reason)
        for lid, memory in self._known.items():
            if lid not in beats and memory.obs.heartbeat_age_s is not None:
                self._vanished(now, memory)
        self.learners = tuple(self._known[lid].obs for lid in sorted(self._known))

    def _seen(self, now: float, hb: Heartbeat, age: float, state: str, reason: str) -> None:
        before = self._known.get(hb.member_id)
        restarts = before.obs.restarts if before else 0
        if before is not None and before.obs.beat.pid != hb.pid:
            restarts += 1
            log.info("learner.restarted %s pid %d → %d", hb.member_id, before.obs.beat.pid, hb.pid)
        if hb.state in _REPORTED:
            state = _REPORTED[hb.state]
            reason = f"the learner reports {hb.state!r} (a fault); {reason}"
        obs = LearnerObs(hb.member_id, state, reason, age, hb, restarts)
        self._known[hb.member_id] = _Memory(obs, now - age)

    def _vanished(self, now: float, memory: _Memory) -> None:
        silent_s = now - memory.last_beat_s
        expires_s = self._params.dead_after_s
        if silent_s < expires_s * 0.8 and memory.obs.state == "active":
            state, reason = "left", f"heartbeat removed {silent_s:.1f} s after its last beat"
        else:
            state = "dead"
            reason = (
                f"heartbeat expired: last beat {silent_s:.1f} s ago ≥ dead_after_s {expires_s:g} s"
            )
        memory.obs = replace(memory.obs, state=state, reason=reason, heartbeat_age_s=None)

    def learner(self, learner_id: str) -> LearnerObs | None:
        """A learner seen since the control plane started, or None."""
        memory = self._known.get(learner_id)
        return memory.obs if memory else None

    def live_learner_ids(self) -> list[str]:
        """Ids of the learners that can receive a fault command now, sorted."""
        return [obs.learner_id for obs in self.learners if obs.live]
