"""The operator actions: inject a fault, start / stop / replay a chaos schedule.

A fault becomes one ``FaultCommand`` on the target's control stream (``corrupt`` with
``count`` N: N one-shot commands, ids ``<fault>-1`` … ``<fault>-N``), then a ``fault.injected``
event that records who asked, and a :class:`~dd_queue.control.observe.Watch` that reports the
effect. A chaos schedule is planned from its seed (``dd_queue.control.chaos``), stored as a
``chaos.started`` event (seed, spec, targets: enough to replay it) and fired by the ticker.
"""

from __future__ import annotations

import json
import logging
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from dd_queue.auth import Auth
from dd_queue.bus import Bus, ops
from dd_queue.clock import Clock
from dd_queue.config import DDQConfig
from dd_queue.control.chaos import ChaosRun, plan_schedule
from dd_queue.control.faultbook import FaultBook, FaultRecord, injected_fields
from dd_queue.control.members import Members
from dd_queue.control.observe import Target, Watch
from dd_queue.control.requests import RANDOM, SYNCHRONIZER, ChaosStart, FaultRequest
from dd_queue.errors import Conflict, NotFound, Refused
from dd_queue.messages import Event, FaultCommand, RoundRecord, Scalar

__all__ = ["Actions", "Surroundings"]

log = logging.getLogger("dd_queue.control")


class Surroundings(Protocol):
    """What the actions read and write of the control plane that owns them, and nothing else
    (``ControlPlane`` is one)."""

    cfg: DDQConfig
    bus: Bus
    auth: Auth  # signs the fault commands
    clock: Clock
    wall: Callable[[], float]
    rng: random.Random
    members: Members
    book: FaultBook
    watches: dict[str, Watch]

    def emit(self, kind: str, message: str, /, **fields: Scalar) -> str: ...

    def poll_log(self) -> list[RoundRecord]: ...

    def target_now(self, target_id: str) -> Target: ...


class Actions:
    """Fault injection and chaos for one control plane (called under its lock)."""

    def __init__(self, plane: Surroundings) -> None:
        self.plane = plane
        self.chaos: ChaosRun | None = None
        self.stored: OrderedDict[str, ChaosRun] = OrderedDict()

    # ── faults ────────────────────────────────────────────────────────────────────────────
    def inject(self, req: FaultRequest, *, who: str, chaos: str | None = None) -> FaultRecord:
        """Send one fault and record it.

        Raises:
            NotFound: Unknown learner id.
            Conflict: Faults are disabled, or the target is not live.
            BusError: Redis failed.
        """
        plane = self.plane
        if not plane.cfg.faults.enabled:
            raise Conflict("faults.enabled is false in the config: members ignore fault commands")
        target = self._target(req.target)
        wall = plane.wall()
        fault_id = f"f{int(wall * 1000):x}{plane.rng.getrandbits(16):04x}"
        commands, params = self._send(req, target, fault_id, wall)
        record = FaultRecord(
            fault_id=fault_id,
            target=target,
            kind=req.kind,
            duration_s=req.duration_s,
            params=params,
            by=who,
            issued_at_s=wall,
            command_ids=commands,
            chaos=chaos,
        )
        what = f"{req.kind} {target}" + (f" for {req.duration_s:g} s" if req.duration_s else "")
        plane.emit("fault.injected", f"{what} by {who}", **injected_fields(record))
        plane.watches[fault_id] = Watch(
            fault_id=fault_id,
            target_id=target,
            kind=req.kind,
            duration_s=req.duration_s,
            now=plane.clock.now(),
            before=plane.target_now(target),
            settle_s=max(30.0, 3 * plane.cfg.membership.dead_after_s),
        )
        plane.poll_log()
        return plane.book.records.get(fault_id, record)

    def _send(
        self, req: FaultRequest, target: str, fault_id: str, wall: float
    ) -> tuple[list[str], dict[str, Scalar]]:
        """Append the fault's command(s) to the target's control stream; returns their entry
        ids and the fault's parameters (``corrupt`` × N: N one-shot commands)."""
        params: dict[str, Scalar] = {}
        if req.factor is not None or req.kind == "slow":
            params["factor"] = req.factor or 3.0
        if req.delay_s is not None or req.kind == "delay":
            params["delay_s"] = req.delay_s or 1.0
        if req.point is not None:
            params["point"] = req.point
        shots = (req.count or 1) if req.kind == "corrupt" and req.duration_s is None else 1
        ids = [fault_id] if shots == 1 else [f"{fault_id}-{i + 1}" for i in range(shots)]
        commands = []
        for fid in ids:
            cmd = FaultCommand(
                run_id=self.plane.cfg.run.run_id,
                fault_id=fid,
                target=target,
                kind=req.kind,
                params=params,
                duration_s=req.duration_s,
                issued_at_s=wall,
            )
            fields = cmd.to_fields()
            commands.append(ops.send_command(self.plane.bus, target, fields, auth=self.plane.auth))
        ops.count_fault(self.plane.bus, req.kind)
        if req.count is not None:
            params = {**params, "count": req.count}
        return commands, params

    def _target(self, name: str) -> str:
        members = self.plane.members
        if name == SYNCHRONIZER:
            if not members.synchronizers:
                raise Conflict("no synchronizer heartbeat: a command would wait unread")
            return name
        live = members.live_learner_ids()
        if name == RANDOM:
            if not live:
                raise Conflict("no live learner to pick at random")
            return self.plane.rng.choice(live)
        obs = members.learner(name)
        if obs is None:
            known = ", ".join(o.learner_id for o in members.learners) or "none"
            raise NotFound(
                f"unknown learner {name!r} (known: {known}); targets are a learner "
                "id, 'synchronizer' or 'random'"
            )
        if not obs.live:
            raise Conflict(
                f"learner {name!r} is {obs.state} ({obs.reason}): it would not read "
                "the command; restart it first"
            )
        return name

    # ── chaos ─────────────────────────────────────────────────────────────────────────────
    def start(self, spec: ChaosStart, *, who: str, replay_of: str | None = None) -> ChaosRun:
        """Plan, store and start a schedule.

        Raises:
            Conflict: One is running, or there is no live learner to target.
            NotFound: A named target is unknown.
        """
        plane = self.plane
        if self.chaos is not None and not self.chaos.stopped:
            raise Conflict(f"chaos schedule {self.chaos.schedule_id} is running; stop it first")
        for name in spec.targets or ():
            if plane.members.learner(name) is None:
                raise NotFound(f"unknown chaos target {name!r}")
        targets = tuple(sorted(spec.targets or plane.members.live_learner_ids()))
        if not targets:
            raise Conflict("no live learner to target; name targets or start learners first")
        seed = spec.seed if spec.seed is not None else plane.rng.randrange(2**32)
        wall = plane.wall()
        run = ChaosRun(
            schedule_id=f"c{int(wall * 1000):x}",
            seed=seed,
            spec=spec,
            targets=targets,
            planned=plan_schedule(spec, targets, seed),
            started_s=plane.clock.now(),
            started_at_s=wall,
            replay_of=replay_of,
        )
        body = spec.model_dump(mode="json", exclude={"by", "seed"})
        plane.emit(
            "chaos.started",
            f"chaos {run.schedule_id}: {len(run.planned)} faults planned "
            f"over {spec.duration_s:g} s (seed {seed}) by {who}",
            schedule=run.schedule_id,
            seed=seed,
            spec=json.dumps(body),
            targets=json.dumps(list(targets)),
            planned=len(run.planned),
            by=who,
            replay_of=replay_of,
        )
        self.chaos = run
        plane.poll_log()
        return run

    def stop(self, *, who: str) -> ChaosRun:
        """Stop the running schedule.

        Raises:
            Conflict: None is running.
        """
        run = self.chaos
        if run is None or run.stopped:
            raise Conflict("no chaos schedule is running")
        run.stopped = True
        self._stopped(run, f"stopped by {who}")
        return run

    def replay(self, schedule_id: str | None, *, who: str) -> ChaosRun:
        """Start a stored schedule again (same seed, spec and targets).

        Raises:
            NotFound: No such stored schedule (or none at all).
        """
        if not self.stored:
            raise NotFound("no chaos schedule is stored yet; start one first")
        sid = schedule_id or next(reversed(self.stored))
        old = self.stored.get(sid)
        if old is None:
            raise NotFound(f"unknown chaos schedule {sid!r} (stored: {', '.join(self.stored)})")
        spec = old.spec.model_copy(update={"seed": old.seed, "targets": list(old.targets)})
        return self.start(spec, who=who, replay_of=sid)

    def fire_due(self, now: float) -> None:
        """Inject the running schedule's faults that are due (a target not live is skipped)."""
        run = self.chaos
        if run is None or run.stopped:
            return
        for planned in run.due(now):
            try:
                req = planned.request(run.spec, by=f"chaos-{run.schedule_id}")
                self.inject(req, who=req.by, chaos=run.schedule_id)
            except Refused as exc:
                run.skipped.append(f"{planned.kind} {planned.target} at {planned.at_s:g} s: {exc}")
                log.warning("chaos.skipped %s %s: %s", planned.kind, planned.target, exc)
        if run.stopped:
            self._stopped(run, f"finished after {run.spec.duration_s:g} s")

    def _stopped(self, run: ChaosRun, why: str) -> None:
        self.plane.emit(
            "chaos.stopped",
            f"chaos {run.schedule_id} {why}",
            schedule=run.schedule_id,
            fired=run.fired,
        )

    def apply(self, event: Event) -> None:
        """Fold a ``chaos.started`` event into the stored schedules."""
        if event.kind != "chaos.started":
            return
        f = event.fields
        try:
            spec = ChaosStart.model_validate_json(str(f.get("spec")))
            targets = tuple(json.loads(str(f.get("targets"))))
            seed, sid = int(f.get("seed") or 0), str(f.get("schedule"))
        except (ValueError, TypeError) as exc:
            log.warning("control.bad_chaos_event: %s", exc)
            return
        replay_of = f.get("replay_of")
        self.stored[sid] = ChaosRun(
            schedule_id=sid,
            seed=seed,
            spec=spec,
            targets=targets,
            planned=plan_schedule(spec, targets, seed) if targets else (),
            started_s=0.0,
            started_at_s=event.at_s,
            stopped=True,
            replay_of=replay_of if isinstance(replay_of, str) else None,
        )
        while len(self.stored) > 50:
            self.stored.popitem(last=False)
