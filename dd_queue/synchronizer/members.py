"""Who is alive, how fast learners step, the synchronizer's own heartbeat and its fault commands.

- ``Learners`` reads every heartbeat (rate-limited to the heartbeat interval), classifies the
  learners with ``core.membership`` (active / straggling / stalled are live, dead are not) and
  keeps ξ_step, the EMA of the live learners' median step time, for the policy and the pace.
- ``beat`` writes this synchronizer's heartbeat: the fragments it owns with their versions and
  how many contributions it holds, for the control plane's ``/readyz`` and dashboard.
- ``Commands`` follows the ``control:synchronizer`` and ``control:all`` streams from where they
  stood at start (an old ``kill`` must not fire again after a restart) and arms each
  ``FaultCommand`` meant for this synchronizer on its ``FaultInjector``.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
from collections.abc import Mapping

from dd_queue.auth import FreshCommands
from dd_queue.bus import ops
from dd_queue.core.membership import Heartbeat as Beat
from dd_queue.core.membership import Liveness, classify, diff_members, live_learners
from dd_queue.core.policy import Ema
from dd_queue.errors import ProtocolError
from dd_queue.messages import Heartbeat
from dd_queue.synchronizer.context import Context

__all__ = ["Commands", "Learners", "beat"]

log = logging.getLogger("dd_queue.synchronizer")


class Learners:
    """The learners' liveness and step time, refreshed from heartbeats."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self.live: frozenset[str] = frozenset()
        self.statuses: tuple[Liveness, ...] = ()
        self.peers: frozenset[str] = frozenset()  # other synchronizers with a fresh heartbeat
        self.versions_held: dict[int, list[int]] = {}  # fragment → versions learners report
        self.step = Ema()
        self.next_at = float("-inf")

    @property
    def step_time_s(self) -> float:
        """ξ_step, seconds: the estimate, or ``initial_step_time_s`` before the first one."""
        value = self.step.value
        return value if value is not None and value > 0 else self._ctx.sync.initial_step_time_s

    def refresh(self, now: float) -> None:
        """Re-read heartbeats when the interval has passed; log joins and losses."""
        if now < self.next_at:
            return
        ctx = self._ctx
        self.next_at = now + ctx.cfg.membership.heartbeat_interval_s
        ctx.flush_refusals()
        beats: dict[str, Beat] = {}
        peers: set[str] = set()
        held: dict[int, list[int]] = {}
        fresh_s = 3 * ctx.cfg.membership.heartbeat_interval_s  # a stale peer is gone (sharing)
        for member, info in ctx.bus.heartbeats().items():
            try:
                hb = ops.read_heartbeat(
                    member, info.payload, run_id=ctx.run_id, limits=ctx.limits, auth=ctx.auth
                )
            except ProtocolError as exc:  # not a member of ours: never counted as a learner
                ctx.refused("heartbeat", member, exc)
                continue
            if hb.role == "synchronizer" and hb.member_id != ctx.owner and info.age_s <= fresh_s:
                peers.add(hb.member_id)
            if hb.role == "learner":
                for fragment, version in hb.versions.items():
                    held.setdefault(fragment, []).append(version)
                step = hb.step_time_ema_s if hb.step_time_ema_s else None
                beats[hb.member_id] = Beat(
                    learner_id=hb.member_id, last_seen_s=now - info.age_s, step_time_s=step
                )
        statuses = classify(now, beats.values(), ctx.membership)
        change = diff_members(self.statuses, statuses)
        if change.joined or change.left:
            log.info("learners.changed %s", change.reason)
        self.statuses, self.live = statuses, live_learners(statuses)
        self.peers = frozenset(peers)
        self.versions_held = held
        steps = [b.step_time_s for b in beats.values() if b.learner_id in self.live]
        known = [s for s in steps if s is not None]
        if known:
            self.step = self.step.update(statistics.median(known), ctx.sync.ema_alpha)


def beat(ctx: Context, *, versions: Mapping[int, int], held: int, merged: int) -> None:
    """Write this synchronizer's heartbeat (expires after ``membership.dead_after_s``)."""
    payload = Heartbeat(
        run_id=ctx.run_id,
        config_digest=ctx.digest,
        role="synchronizer",
        member_id=ctx.owner,
        state="running" if versions else "standby",
        step=merged,
        n_tokens=0,
        step_time_ema_s=None,
        versions=dict(versions),
        queue_depths={"held": held, "fragments": len(versions)},
        device="cpu",
        host=socket.gethostname(),
        pid=os.getpid(),
        sent_at_s=ctx.wall(),
    )
    ops.heartbeat(ctx.bus, payload, ttl_s=ctx.cfg.membership.dead_after_s, auth=ctx.auth)


class Commands:
    """Fault commands for this synchronizer, read from its control streams."""

    TARGETS = ("synchronizer", "all")

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._fresh = FreshCommands(ctx.cfg.auth.max_command_age_s)
        self._after: dict[str, str] = {}
        for target in self.TARGETS:
            latest = ctx.bus.read_latest(ctx.bus.keys.control(target))
            self._after[target] = latest.id if latest is not None else "0-0"

    def poll(self) -> None:
        """Arm every new fault command addressed to this synchronizer."""
        ctx = self._ctx
        for target in self.TARGETS:
            entries = ops.read_commands(ctx.bus, target, after_id=self._after[target])
            if entries:
                self._after[target] = entries[-1].id
            for cmd in ops.accepted_commands(
                entries,
                run_id=ctx.run_id,
                limits=ctx.limits,
                auth=ctx.auth,
                fresh=self._fresh,
                now_s=ctx.wall(),
                refused=lambda entry, exc: ctx.refused("fault", entry.id, exc),
            ):
                if cmd.target not in (ctx.owner, "synchronizer", "*", "all"):
                    continue
                if not ctx.cfg.faults.enabled:
                    log.warning(
                        "fault.ignored %s (%s): faults.enabled is false", cmd.fault_id, cmd.kind
                    )
                    ctx.emit("fault.ignored", "faults.enabled is false", fault=cmd.fault_id)
                    continue
                ctx.injector.arm(
                    cmd.kind,
                    fault_id=cmd.fault_id,
                    duration_s=cmd.duration_s,
                    params=cmd.params,
                )
                log.warning("fault.armed %s %s: %s", cmd.kind, cmd.fault_id, cmd.params)
                ctx.emit("fault.armed", f"{cmd.kind} armed", fault=cmd.fault_id)
