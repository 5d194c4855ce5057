"""Turn the control plane's model into the response models (``schemas``): pure conversions."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter

from dd_queue.control.actions import Actions
from dd_queue.control.chaos import ChaosRun
from dd_queue.control.faultbook import FaultRecord
from dd_queue.control.members import LearnerObs
from dd_queue.control.plane import ControlPlane
from dd_queue.control.schemas import (
    AlertRuleView,
    AlertsView,
    AlertView,
    ChaosSchedule,
    ChaosView,
    Contributions,
    DecisionView,
    EffectView,
    EvalPoint,
    EventView,
    FaultView,
    FragmentView,
    GoodputView,
    LearnerView,
    QuorumView,
    RefusedView,
    RoundView,
    StateView,
    SynchronizerView,
    TokenFateView,
)
from dd_queue.control.tails import Tally
from dd_queue.core.alerts import RULES
from dd_queue.core.policy import Ema, grace_window
from dd_queue.core.tallies import (
    dead_letters,
    merged_token_share,
    run_token_fates,
    summed,
    tokens_merged,
)
from dd_queue.fragment_state import fragment_of
from dd_queue.messages import RoundRecord

__all__ = [
    "chaos_view",
    "fault_view",
    "learner_view",
    "refused_view",
    "round_view",
    "state_view",
    "token_fate_views",
]


def learner_view(plane: ControlPlane, obs: LearnerObs) -> LearnerView:
    """One learner, with its tallies and open faults."""
    hb, tally = obs.beat, plane.log.tallies.get(obs.learner_id, Tally())
    return LearnerView(
        learner_id=obs.learner_id,
        state=obs.state,
        reason=obs.reason,
        heartbeat_age_s=obs.heartbeat_age_s,
        process_state=hb.state,
        step=hb.step,
        n_tokens=hb.n_tokens,
        step_time_s=hb.step_time_ema_s,
        train_loss=hb.train_loss,
        contributions=Contributions(
            sent=tally.sent,
            merged=tally.merged,
            dropped=tally.unmerged,
            dead_lettered=tally.dead_lettered,
        ),
        last_weights={str(p): w for p, w in sorted(tally.last_weights.items())},
        versions={str(p): v for p, v in sorted(hb.versions.items())},
        queue_depths=dict(hb.queue_depths),
        host=hb.host,
        pid=hb.pid,
        device=hb.device,
        restarts=obs.restarts,
        active_faults=[f for f, w in plane.watches.items() if w.target_id == obs.learner_id],
    )


def token_fate_views(plane: ControlPlane) -> list[TokenFateView]:
    """Every learner's token fate, in tokens (token·fragments ÷ P) with the exact counts."""
    n = max(1, plane.cfg.synchronizer.n_fragments)
    counters = summed(st.counters for st in plane.states.values())
    views = []
    for lid, fate in run_token_fates(plane.tokens, counters).items():
        parts = fate.parts()
        views.append(
            TokenFateView(
                learner_id=lid,
                computed=fate.computed / n,
                fates={k: v / n for k, v in parts.items()},
                balanced=fate.balanced,
                reason=fate.verdict(n),
                token_fragments={"computed": fate.computed, **parts},
            )
        )
    return views


def _step_time_s(plane: ControlPlane) -> float | None:
    steps = [o.beat.step_time_ema_s for o in plane.members.learners if o.live]
    known = [s for s in steps if s]
    return statistics.median(known) if known else None


def _fragments(plane: ControlPlane, step_s: float | None) -> list[FragmentView]:
    params = plane.cfg.synchronizer.policy_params()
    merged_at: dict[int, float] = {}
    for record in plane.log.rounds:
        if record.decision == "merge":
            merged_at[record.fragment_id] = record.closed_at_s
    views = []
    for p, st in sorted(plane.states.items()):
        grace = grace_window(params, st.estimates(Ema(step_s, 1 if step_s else 0)))
        views.append(
            FragmentView(
                fragment_id=p,
                version=st.version,
                last_merged_round_id=st.last_merged_round_id,
                last_reason=st.last_reason,
                committed_by=st.committed_by,
                quorum_ema_s=st.quorum_ema_s,
                sync_ema_s=st.sync_ema_s,
                grace_window_s=grace.seconds,
                grace_note=grace.note,
                last_merge_at_s=merged_at.get(p),
                counters=dict(st.counters),
            )
        )
    return views


def _quorum(plane: ControlPlane, step_s: float | None) -> QuorumView:
    cfg, sync = plane.cfg, plane.cfg.synchronizer
    return QuorumView(
        quorum=sync.quorum,
        quorum_policy=sync.quorum_policy,
        live_learners=len(plane.members.live_learner_ids()),
        expected_learners=cfg.membership.expected_learners,
        step_time_s=step_s,
        grace_gamma=sync.grace_gamma,
        grace_cap_s=sync.grace_cap_s,
        round_timeout_s=sync.round_timeout_s,
    )


def _goodput(plane: ControlPlane) -> GoodputView:
    g = plane.goodput
    return GoodputView(
        goodput=g.goodput,
        uptime=g.uptime,
        observed_s=g.wall_s,
        training_s=g.training_chip_s,
        waiting_s=g.waiting_chip_s,
        down_s=g.down_chip_s,
        history=[(p.at_s, p.goodput, p.uptime) for p in plane.ledger.history][-600:],
    )


def _evals(plane: ControlPlane) -> list[EvalPoint]:
    points = []
    for e in plane.log.evals:
        loss = _number(e.fields.get("loss"))
        if loss is not None:
            points.append(
                EvalPoint(
                    at_s=e.at_s,
                    loss=loss,
                    accuracy=_number(e.fields.get("accuracy")),
                    min_version=_int(e.fields.get("min_version")),
                )
            )
    return points


def _synchronizers(plane: ControlPlane) -> list[SynchronizerView]:
    return [
        SynchronizerView(
            synchronizer_id=s.synchronizer_id,
            state=s.beat.state,
            heartbeat_age_s=s.heartbeat_age_s,
            fragments={str(p): v for p, v in sorted(s.beat.versions.items())},
            held=s.beat.queue_depths.get("held", 0),
            host=s.beat.host,
            pid=s.beat.pid,
        )
        for s in plane.members.synchronizers
    ]


_OUTCOMES = ("merged", "superseded", "duplicate", "late", "stale", "invalid", "dropped")


def state_view(plane: ControlPlane, *, writes_enabled: bool) -> StateView:
    """The run's state: fragments, totals, quorum figures, decisions, eval, goodput."""
    cfg = plane.cfg
    totals: Counter[str] = Counter()
    for st in plane.states.values():
        totals.update(st.counters)
    step_s = _step_time_s(plane)
    return StateView(
        run_id=cfg.run.run_id,
        config_digest=cfg.digest,
        run_digest=cfg.run_digest,
        fragments=_fragments(plane, step_s),
        rounds_merged=totals["rounds_merged"],
        rounds_abandoned=totals["rounds_abandoned"],
        contributions={k: totals[k] for k in (*_OUTCOMES, "dead_lettered")},
        bytes_in=totals["bytes_in"],
        bytes_out=totals["bytes_out"],
        quorum=_quorum(plane, step_s),
        last_decisions=[
            DecisionView(
                fragment_id=r.fragment_id,
                round_id=r.round_id,
                decision=r.decision,
                reason=r.reason,
                closed_at_s=r.closed_at_s,
            )
            for r in plane.log.newest_rounds(10)
        ],
        eval=_evals(plane),
        goodput=_goodput(plane),
        uptime_s=plane.clock.now() - plane.started_s,
        synchronizers=_synchronizers(plane),
        chaos=chaos_view(plane),
        faults_enabled=cfg.faults.enabled,
        writes_enabled=writes_enabled,
        refused=refused_view(plane),
        merged_token_share=_merged_token_share(plane),
    )


def _merged_token_share(plane: ControlPlane) -> float | None:
    """Mean over fragments of the tokens merged ÷ the tokens the learners report trained."""
    trained = sum(obs.beat.n_tokens for obs in plane.members.learners)
    merged = sum(tokens_merged(st.counters) for st in plane.states.values())
    return merged_token_share(merged, len(plane.states), trained)


def refused_view(plane: ControlPlane) -> list[RefusedView]:
    """Refused messages by reader, kind and reason: the run's counters (every reader's
    reports) and the synchronizers' dead letters by reason tag, from the fragments' states."""
    counts = Counter(plane.refused)
    for st in plane.states.values():
        for tag, n in dead_letters(st.counters).items():
            counts["synchronizer", "contribution", tag] += n
    return [
        RefusedView(reader=reader, kind=kind, reason=reason, count=n)
        for (reader, kind, reason), n in sorted(counts.items())
    ]


def _number(value: object) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else None  # type: ignore[arg-type]


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}


def round_view(plane: ControlPlane, r: RoundRecord) -> RoundView:
    """One round record, with the bytes it moved."""
    state = plane.states.get(r.fragment_id)
    n = fragment_of(state).size if state is not None else 0
    wire = plane.cfg.wire
    per_param = _BYTES_PER_PARAM.get(wire.codec, 4.0)
    per_param += 4.0 / wire.block_size if wire.codec in ("int8", "int4") else 0.0
    merged = r.decision == "merge"
    return RoundView(
        **{f.name: getattr(r, f.name) for f in dataclasses.fields(r)},
        bytes_out=4 * n if merged else 0,
        bytes_in_estimate=int(per_param * n * len(r.contributors)) if merged else 0,
    )


def fault_view(record: FaultRecord) -> FaultView:
    """One fault record."""
    return FaultView(
        fault_id=record.fault_id,
        target=record.target,
        kind=record.kind,
        duration_s=record.duration_s,
        params=dict(record.params),
        by=record.by,
        issued_at_s=record.issued_at_s,
        command_ids=list(record.command_ids),
        chaos=record.chaos,
        armed_at_s=record.armed_at_s,
        status=record.status,
        effects=[EffectView(at_s=e.at_s, note=e.note) for e in record.effects],
    )


def _schedule(run: ChaosRun) -> ChaosSchedule:
    return ChaosSchedule(
        schedule_id=run.schedule_id,
        seed=run.seed,
        started_at_s=run.started_at_s,
        duration_s=run.spec.duration_s,
        rates_per_min=dict(run.spec.rates_per_min),
        targets=list(run.targets),
        planned=len(run.planned),
        by=run.spec.by,
        replay_of=run.replay_of,
    )


def chaos_view(plane: ControlPlane) -> ChaosView:
    """The running (or last) chaos schedule and the stored ones."""
    actions: Actions = plane.actions
    run = actions.chaos
    next_at = run.next_at_s() if run is not None else None
    return ChaosView(
        active=run is not None and not run.stopped,
        schedule=_schedule(run) if run is not None else None,
        fired=run.fired if run is not None else 0,
        skipped=list(run.skipped[-20:]) if run is not None else [],
        next_at_s=run.started_at_s + next_at if run is not None and next_at is not None else None,
        stored=[_schedule(s) for s in reversed(actions.stored.values())],
    )


def event_views(plane: ControlPlane, limit: int) -> list[EventView]:
    """The newest events, newest first."""
    return [
        EventView(id=eid, kind=e.kind, message=e.message, at_s=e.at_s, fields=dict(e.fields))
        for eid, e in list(plane.log.events)[::-1][:limit]
    ]


def alert_views(plane: ControlPlane) -> list[AlertView]:
    """The alerts of the last evaluation, their start as wall-clock time."""
    offset = plane.alerting.wall_offset_s
    return [
        AlertView(
            name=a.name,
            severity=a.severity,
            state=a.state,
            since_s=a.since_s + offset,
            subject=a.subject,
            link=a.link,
            value=a.value if math.isfinite(a.value) else None,
            summary=a.summary,
            description=a.description,
        )
        for a in plane.alerting.alerts
    ]


def alerts_view(plane: ControlPlane) -> AlertsView:
    """The alerts now and every rule (``core.alerts.RULES``)."""
    history = plane.alerting.history
    offset = plane.alerting.wall_offset_s
    return AlertsView(
        alerts=alert_views(plane),
        rules=[
            AlertRuleView(
                name=r.name, severity=r.severity, for_s=r.for_s, description=r.description
            )
            for r in RULES
        ],
        evaluated_at_s=history[-1].at_s + offset if history else None,
    )
