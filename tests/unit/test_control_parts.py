"""The control plane's pieces without HTTP: chaos planning, liveness memory, the goodput ledger,
fault records folded from events, and the watches that observe a fault's effect."""

from __future__ import annotations

import statistics

import pytest

from dd_queue.bus import HeartbeatInfo
from dd_queue.control.chaos import ChaosRun, plan_schedule
from dd_queue.control.faultbook import FaultBook
from dd_queue.control.ledger import GoodputLedger, interval_kind
from dd_queue.control.members import Members
from dd_queue.control.observe import Target, Watch
from dd_queue.control.requests import ChaosStart
from dd_queue.control.tails import Tally
from dd_queue.core.membership import MembershipParams
from dd_queue.messages import Event, Heartbeat, MessageLimits

SPEC = ChaosStart(action="start", duration_s=600, rates_per_min={"stall": 2.0, "kill": 0.5})
PARAMS = MembershipParams(straggling_after_s=1.0, stalled_after_s=2.0, dead_after_s=4.0)
LIMITS = MessageLimits()


def test_a_schedule_is_a_pure_function_of_seed_spec_and_targets():
    a = plan_schedule(SPEC, ["L1", "L0"], seed=3)
    assert a == plan_schedule(SPEC, ["L0", "L1"], seed=3)
    assert a != plan_schedule(SPEC, ["L0", "L1"], seed=4)
    assert [f.at_s for f in a] == sorted(f.at_s for f in a)
    assert all(0 <= f.at_s < 600 and f.target in ("L0", "L1") for f in a)


def test_poisson_counts_match_the_rates():
    counts = [len(plan_schedule(SPEC, ["L0"], seed=s)) for s in range(200)]
    assert statistics.mean(counts) == pytest.approx(2.5 * 10, rel=0.1)  # λ · duration


def test_a_run_hands_out_due_faults_once_and_stops_at_its_end():
    run = ChaosRun(
        schedule_id="c1",
        seed=1,
        spec=SPEC,
        targets=("L0",),
        planned=plan_schedule(SPEC, ["L0"], 1),
        started_s=100.0,
        started_at_s=0.0,
    )
    first = run.planned[0].at_s
    assert run.due(100.0 + first - 0.01) == [] and run.next_at_s() == first
    assert run.due(100.0 + first) == [run.planned[0]]
    assert len(run.due(100.0 + 600)) == len(run.planned) - 1 and run.stopped
    assert run.due(2000.0) == [] and run.next_at_s() is None


def test_planned_faults_become_valid_requests():
    for planned in plan_schedule(SPEC, ["L0"], seed=5)[:5]:
        req = planned.request(SPEC, by="chaos-c1")
        assert req.kind == planned.kind and (req.duration_s is None) == (req.kind == "kill")


def beat(member: str, *, state: str = "training", pid: int = 1, step_s: float = 0.1) -> bytes:
    return Heartbeat(
        run_id="r",
        config_digest="d",
        role="learner",
        member_id=member,
        state=state,
        step=1,
        n_tokens=1,
        step_time_ema_s=step_s,
        versions={},
        queue_depths={},
        device="cpu",
        host="h",
        pid=pid,
        sent_at_s=0.0,
    ).to_bytes()


def test_members_tell_left_from_dead_and_count_restarts():
    members = Members("r", PARAMS, LIMITS)
    members.update(
        10.0, {"L0": HeartbeatInfo(beat("L0"), 0.1), "L1": HeartbeatInfo(beat("L1"), 0.1)}
    )
    members.update(10.5, {"L1": HeartbeatInfo(beat("L1"), 1.5)})  # L0 removed while fresh
    assert members.learner("L0").state == "left"  # type: ignore[union-attr]
    assert members.learner("L1").state == "straggling"  # type: ignore[union-attr]
    members.update(13.0, {"L1": HeartbeatInfo(beat("L1"), 3.5)})
    members.update(14.5, {})  # expired
    l1 = members.learner("L1")
    assert l1 is not None and l1.state == "dead" and "expired" in l1.reason
    members.update(20.0, {"L1": HeartbeatInfo(beat("L1", pid=2), 0.0)})
    l1 = members.learner("L1")
    assert l1 is not None and l1.state == "active" and l1.restarts == 1
    assert members.live_learner_ids() == ["L1"]


def test_members_ignore_other_runs_and_broken_payloads():
    members = Members("other", PARAMS, LIMITS)
    members.update(1.0, {"L0": HeartbeatInfo(beat("L0"), 0.0), "x": HeartbeatInfo(b"junk", 0.0)})
    assert members.learners == ()


def test_goodput_counts_training_waiting_and_down_time():
    ledger = GoodputLedger(0.0)
    ledger.sample(0.0, {"L0": "training", "L1": "training"})
    ledger.sample(10.0, {"L0": "training", "L1": "down"})
    ledger.sample(20.0, {"L0": "waiting", "L1": None})
    summary = ledger.record(30.0, wall_s=1.0)
    # L0: 20 s training + 10 s waiting; L1: 10 s training + 10 s down (then not allocated)
    assert summary.goodput == pytest.approx(30 / 50)
    assert summary.uptime == pytest.approx(20 / 30)
    assert ledger.history[-1].goodput == summary.goodput


@pytest.mark.parametrize(
    ("state", "process", "kind"),
    [
        ("active", "training", "training"),
        ("straggling", "training", "training"),
        ("active", "joining", "waiting"),
        ("stalled", "training", "waiting"),
        ("dead", "training", "down"),
        ("left", "training", None),
    ],
)
def test_interval_kinds(state, process, kind):
    assert interval_kind(state, process) == kind


def event(kind: str, at_s: float = 1.0, message: str = "m", /, **fields) -> Event:
    return Event(run_id="r", kind=kind, message=message, fields=fields, at_s=at_s)


def test_fault_book_folds_injected_armed_and_observed_events():
    book = FaultBook(keep=2)
    book.apply(
        event(
            "fault.injected",
            fault="f1",
            target="L0",
            kind="stall",
            duration_s=3.0,
            params='{"factor": 2}',
            by="me",
            commands="1-0,2-0",
            chaos=None,
        )
    )
    book.apply(event("fault.armed", 2.0, fault="f1-1"))
    book.apply(
        event("fault.observed", 1.0, "L0 went stalled", fault="f1", final=False, effective=True)
    )
    record = book.records["f1"]
    assert record.status == "effective" and record.armed_at_s == 2.0
    assert record.params == {"factor": 2} and record.command_ids == ["1-0", "2-0"]
    book.apply(event("fault.observed", 1.0, "closed", fault="f1", final=True, effective=True))
    assert record.status == "done"
    assert book.apply(event("round.merged", fault="f1")) is None
    for i in range(3):
        book.apply(event("fault.injected", fault=f"g{i}", target="L1", kind="kill"))
    assert list(book.records) == ["g1", "g2"] and book.newest(1)[0].fault_id == "g2"


def target(state: str = "active", *, pid: int = 1, step_s: float = 0.1, **tally: int) -> Target:
    return Target(state, "why", pid, step_s, Tally(**tally))


def watch(kind: str, duration_s: float | None = 5.0, before: Target | None = None) -> Watch:
    return Watch(
        fault_id="f",
        target_id="L0",
        kind=kind,
        duration_s=duration_s,
        now=0.0,
        before=before or target(),
        settle_s=30.0,
    )


def test_kill_watch_sees_death_and_restart():
    w = watch("kill", None)
    assert w.observe(1.0, target("straggling"), []) == ["L0 went straggling after 1.0 s (why)"]
    assert w.observe(5.0, target("dead"), [])[0].startswith("L0 went dead after 5.0 s")
    notes = w.observe(9.0, target(pid=2), [])
    assert notes[0] == "L0 active again after 9.0 s, restarted (pid 1 → 2)" and w.closed


def test_slow_watch_sees_step_time_rise_and_fall():
    w = watch("slow")
    assert w.observe(1.0, target(step_s=0.12), []) == []
    assert "0.1 s → 0.3 s (×3.0)" in w.observe(2.0, target(step_s=0.3), [])[0]
    assert w.observe(6.0, target(step_s=0.11), [])[0].startswith("step time of L0 back")
    assert w.closed


def test_corrupt_watch_counts_dead_letters_and_closes_empty_handed_otherwise():
    w = watch("corrupt", None)
    assert w.observe(1.0, target(dead_lettered=2), [])[0].startswith("2 contribution(s)")
    assert w.closed and w.effective
    idle = watch("delay")
    idle.observe(5.0, target(), [])
    notes = idle.observe(40.0, target(), [])
    assert idle.closed and "closed after 40.0 s" in notes[-1]


def test_the_goodput_window_starts_when_the_first_learner_is_seen() -> None:
    ledger = GoodputLedger(0.0)  # the control plane starts before any learner exists
    ledger.sample(5.0, {})
    ledger.sample(10.0, {"L0": "training"})
    summary = ledger.summary(20.0)
    assert summary.wall_s == 10.0
    assert summary.goodput == 1.0 and summary.uptime == 1.0  # not 0.5: nobody was allocated
