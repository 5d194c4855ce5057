"""The learner on MemoryBus + FakeClock, everything called from one thread (as the runner does).

A scripted synchronizer stand-in (``test_learner_standin.StandIn``) publishes globals and opens
rounds; the learner's ``step`` and ``pump(block_ms=0)`` are called in a chosen order, so every
assertion is about a known state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from dd_queue.bus import ops
from dd_queue.bus.memory import MemoryBus
from dd_queue.clock import FakeClock
from dd_queue.config import DDQConfig
from dd_queue.errors import BusError, ConfigError, CorruptPayload
from dd_queue.keys import blob_chunk_key
from dd_queue.learner import Identity, Learner
from dd_queue.messages import Event, FaultCommand, Heartbeat
from tests.unit.test_learner_standin import (
    LIMITS,
    StandIn,
    plan_of,
    random_batches,
    tiny_config,
    tiny_model,
)

TOKENS_PER_STEP = 2 * 16  # batch 2 × seq_len 16


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@dataclass
class Rig:
    cfg: DDQConfig
    bus: MemoryBus
    clock: FakeClock
    standin: StandIn
    learner: Learner

    def params(self, p: int) -> np.ndarray:
        return self.learner.params.read(p)

    def sweep(self):
        """Pump once the sweep interval has passed: every ``down`` stream is read."""
        self.clock.advance(self.cfg.membership.heartbeat_interval_s)
        return self.learner.pump()


def make_rig(
    cfg: DDQConfig | None = None, *, publish: bool = True, join: bool = True, **learner_kw: Any
) -> Rig:
    cfg = cfg or tiny_config()
    clock = FakeClock(1000.0)
    bus = MemoryBus(cfg.run.run_id, clock=clock)
    global_model = tiny_model(cfg, seed=7)  # the synchronizer's model differs from the learner's
    standin = StandIn(bus, plan_of(cfg, global_model))
    if publish:
        standin.publish_model(global_model)
    learner = Learner(
        cfg,
        learner_id="L0",
        model=tiny_model(cfg, seed=1),
        loader=random_batches(cfg),
        bus=bus,
        clock=clock,
        **learner_kw,
    )
    rig = Rig(cfg, bus, clock, standin, learner)
    if join:
        learner.join()
    return rig


def test_join_loads_every_global_fragment_bit_exactly():
    rig = make_rig()
    assert rig.learner.versions == dict.fromkeys(range(4), 0)
    for p in range(4):
        np.testing.assert_array_equal(
            rig.params(p).view(np.uint32), rig.standin.theta(p, 0).view(np.uint32)
        )
    assert all(c.steps == 0 and c.base_version == 0 for c in rig.learner.counters)


def test_join_waits_with_a_timeout_and_says_why():
    rig = make_rig(publish=False, join=False)
    with pytest.raises(BusError, match=r"0/4 fragments published.*synchronizer"):
        rig.learner.join(timeout_s=1.0)  # FakeClock: the polling sleeps advance time
    assert "L0" not in rig.bus.heartbeats()  # it registered while waiting, then left


def test_join_refuses_a_live_learner_id_of_another_process():
    rig = make_rig()
    rig.learner.pump()  # heartbeat
    twin = Learner(
        rig.cfg,
        learner_id="L0",
        model=tiny_model(rig.cfg, seed=1),
        loader=random_batches(rig.cfg),
        bus=rig.bus,
        clock=rig.clock,
        identity=Identity("L0", "elsewhere", 4242),
    )
    with pytest.raises(ConfigError, match=r"'L0' is live on .* pick another --learner-id"):
        twin.join()


def test_join_refuses_a_global_model_of_another_plan():
    rig = make_rig(publish=False, join=False)
    for p in range(4):
        rig.standin.publish(p, np.zeros(rig.learner.plan.fragments[p].size + (p == 2), np.float32))
    with pytest.raises(ConfigError, match="plan"):
        rig.learner.join()


def test_contribution_carries_counters_base_version_and_round():
    rig = make_rig()
    learner, standin = rig.learner, rig.standin
    learner.step()
    learner.step()
    _, round_id = standin.open_round(2)
    learner.pump()  # sees the round
    report = learner.step()  # the snapshot is taken at this step boundary
    assert report.snapshots == ((2, round_id),)
    theta = rig.params(2)
    assert learner.pump().sent == ((2, round_id),)
    [(msg, delta)] = standin.contributions()
    assert (msg.learner_id, msg.fragment_id, msg.round_id) == ("L0", 2, round_id)
    assert (msg.base_version, msg.n_steps, msg.n_tokens) == (0, 3, 3 * TOKENS_PER_STEP)
    np.testing.assert_array_equal(delta, standin.theta(2, 0) - theta)  # fp32: exact
    assert msg.config_digest == rig.cfg.run_digest


def test_a_round_opened_before_the_learner_joined_is_answered():
    rig = make_rig(join=False)
    _, first = rig.standin.open_round(1)
    _, second = rig.standin.open_round(3)
    rig.learner.join()  # no state key: both rounds count as open
    assert rig.learner.step().snapshots == ((1, first), (3, second))
    assert sorted(rig.learner.pump().sent) == [(1, first), (3, second)]
    assert sorted((m.fragment_id, m.round_id) for m, _ in rig.standin.contributions()) == [
        (1, first),
        (3, second),
    ]


def test_latest_wins_replaces_a_snapshot_not_yet_sent():
    rig = make_rig()
    learner, standin = rig.learner, rig.standin
    standin.open_round(1)
    learner.pump_receive()
    learner.step()
    _, second = standin.open_round(1)
    learner.pump_receive()
    learner.step()  # replaces the unsent snapshot of round `first`
    assert learner.outbox.replaced == 1
    learner.pump_send()
    [(msg, _)] = standin.contributions()
    assert msg.round_id == second and msg.n_steps == 2


def test_globals_are_applied_in_order_bit_exactly_and_reset_counters():
    rig = make_rig()
    learner, standin = rig.learner, rig.standin
    learner.step()
    new = rig.params(0) + 1.0
    standin.publish(0, new)  # version 1
    assert learner.pump().received == ((0, 1),)
    report = learner.step()
    assert report.applied == ((0, 1),)
    np.testing.assert_array_equal(rig.params(0).view(np.uint32), new.view(np.uint32))
    assert learner.counters[0].steps == 0 and learner.counters[0].base_version == 1
    assert learner.counters[1].steps == 2 and learner.counters[1].base_version == 0
    standin.publish(0, new * 2)  # version 2
    standin.publish(0, new * 3)  # version 3: only the newest is fetched and applied
    assert rig.sweep().received == ((0, 3),)
    assert learner.step().applied == ((0, 3),)
    standin.publish(0, new * 2, version=2)  # v2 announced again: versions only move forward
    assert rig.sweep().received == ()
    assert learner.versions[0] == 3


def test_a_round_in_flight_is_followed_between_sweeps():
    rig = make_rig()
    learner, standin = rig.learner, rig.standin
    learner.pump()
    standin.publish(1, rig.params(1) * 2)  # no round: seen at the next sweep only
    assert learner.pump().received == ()
    standin.open_round(3)
    learner.pump()  # fragment 3 is watched from now on
    standin.publish(3, rig.params(3) * 2)  # the version of that round
    assert learner.pump().received == ((3, 1),)
    assert rig.sweep().received == ((1, 1),)


def test_mix_alpha_blends_local_and_global():
    rig = make_rig(tiny_config(learner={"mix_alpha": 0.25}))
    rig.learner.step()
    rig.standin.publish(3, np.ones(rig.learner.plan.fragments[3].size, np.float32))
    rig.sweep()
    before = rig.params(3)
    torch.manual_seed(0)
    # The step trains first, then mixes: compare against the parameters right after training.
    theta = {}
    original_apply = rig.learner._apply

    def spy(applied):
        theta["trained"] = rig.params(3)
        return original_apply(applied)

    rig.learner._apply = spy  # type: ignore[method-assign]
    rig.learner.step()
    np.testing.assert_allclose(rig.params(3), 0.25 * theta["trained"] + 0.75, rtol=1e-6)
    assert not np.array_equal(before, rig.params(3))


def test_bad_global_payloads_are_rejected_without_touching_the_model():
    rig = make_rig()
    learner, standin, bus = rig.learner, rig.standin, rig.bus
    learner.step()
    size = learner.plan.fragments[1].size
    standin.publish(1, np.full(size, 5.0, np.float32))  # v1, then corrupted in Redis
    ref = ops.blob_ref(ops.latest_global(bus, 1))
    chunk = blob_chunk_key(ref.key, ref.n_chunks - 1)
    value = bytearray(bus.get(chunk) or b"")
    value[-3] ^= 0x40
    bus.set(chunk, bytes(value))
    before = rig.params(1)
    assert rig.sweep().received == ()
    learner.step()
    assert learner.versions[1] == 0
    assert learner.bus_pump.follower.rejections[-1].reason == "corrupt"
    standin.publish(1, np.full(size + 1, 5.0, np.float32))  # v2 of another plan: refused
    rig.sweep()
    assert learner.bus_pump.follower.rejections[-1].reason == "incompatible"
    trained = rig.params(1)
    assert not np.array_equal(before, trained)  # it kept training, on its own state
    good = np.full(size, 6.0, np.float32)
    standin.publish(1, good)  # v3
    rig.sweep()
    assert learner.step().applied == ((1, 3),)
    np.testing.assert_array_equal(rig.params(1), good)


def test_learner_paced_mode_sends_at_offsets_tagged_with_the_latest_round():
    cfg = tiny_config(synchronizer={"schedule": "learner", "n_fragments": 2, "sync_every_steps": 4})
    rig = make_rig(cfg, join=False)
    rig.standin.open_round(0)  # round 0 → fragment 0, announced before the learner joins
    rig.learner.join()
    rig.standin.open_round(1)
    rig.learner.pump()
    sent = []
    for _ in range(8):
        report = rig.learner.step()
        sent += [(report.step, *s) for s in report.snapshots]
    # offsets: fragment 0 at step ≡ 0 (mod 4), fragment 1 at step ≡ 2
    assert sent == [(2, 1, 1), (4, 0, 0), (6, 1, 1), (8, 0, 0)]
    rig.learner.pump()
    assert sorted((m.fragment_id, m.n_steps) for m, _ in rig.standin.contributions()) == [
        (0, 8),
        (1, 6),
    ]


def test_stalled_learner_applies_the_newest_missed_versions_when_resumed():
    rig = make_rig()
    learner, standin = rig.learner, rig.standin
    learner.step()
    learner.injector.arm("stall", fault_id="s1", duration_s=5.0)
    report = learner.step()
    assert report.action == "stalled" and report.wait_s == pytest.approx(5.0)
    for version in (1, 2, 3):
        standin.publish(2, np.full(learner.plan.fragments[2].size, version, np.float32))
        rig.sweep()  # the pump keeps running while training is stalled
    assert learner.step().action == "stalled"
    rig.clock.advance(5.0)
    report = learner.step()
    assert report.action == "trained" and report.applied == ((2, 3),)
    np.testing.assert_array_equal(rig.params(2), standin.theta(2, 3))


def test_kill_fault_ends_the_learner():
    rig = make_rig()
    rig.learner.injector.arm("kill", fault_id="k1")
    assert rig.learner.step().action == "killed"
    assert rig.learner.step().stop
    rig.bus.remove_heartbeat("L0")
    rig.clock.advance(1.0)
    assert not rig.learner.pump().heartbeat and "L0" not in rig.bus.heartbeats()  # silent


def test_drop_and_corrupt_faults_at_publish():
    rig = make_rig()
    learner, standin = rig.learner, rig.standin
    learner.injector.arm("drop", fault_id="d1")
    standin.open_round(0)
    learner.pump()
    learner.step()
    assert learner.pump().dropped == ((0, 0),)
    learner.injector.arm("corrupt", fault_id="c1")
    standin.open_round(0)
    learner.pump()
    learner.step()
    assert learner.pump().sent == ((0, 1),)
    with pytest.raises(CorruptPayload):
        standin.contributions()


def test_disconnect_keeps_training_then_resynchronises():
    rig = make_rig()
    learner, standin = rig.learner, rig.standin
    learner.injector.arm("disconnect", fault_id="x1", duration_s=2.0)
    standin.open_round(3)
    assert not learner.pump().online
    standin.publish(3, np.zeros(learner.plan.fragments[3].size, np.float32))
    for _ in range(3):
        assert learner.step().action == "trained"
        assert not learner.pump().online
    rig.clock.advance(2.5)
    report = learner.pump()
    assert report.online and report.received == ((3, 1),) and report.rounds == ((3, 0),)
    learner.step()
    assert learner.versions[3] == 1


def test_fault_commands_arrive_through_the_control_stream():
    rig = make_rig()
    cmd = FaultCommand(
        run_id="tl",
        fault_id="f9",
        target="L0",
        kind="slow",
        params={"factor": 3.0},
        duration_s=10.0,
        issued_at_s=0.0,
    )
    other = FaultCommand(
        run_id="tl",
        fault_id="f10",
        target="L1",
        kind="kill",
        params={},
        duration_s=None,
        issued_at_s=0.0,
    )
    ops.send_command(rig.bus, "L0", cmd.to_fields())
    ops.send_command(rig.bus, "all", other.to_fields())
    assert rig.learner.pump().commands == 1
    assert [f.fault_id for f in rig.learner.injector.active()] == ["f9"]
    assert rig.learner.step().wait_s >= 0.0
    events = [
        Event.from_fields(e.fields, run_id="tl", limits=LIMITS)
        for e in rig.bus.read(rig.bus.keys.events())
    ]
    armed = [e.fields for e in events if e.kind == "fault.armed"]
    assert armed == [{"fault": "f9", "member": "L0"}]  # acknowledged once, only its own


def test_heartbeat_reports_progress_and_leave_removes_it():
    rig = make_rig()
    rig.learner.step()
    rig.standin.open_round(1)
    rig.clock.advance(1.0)
    rig.learner.pump_receive()
    beat = Heartbeat.from_bytes(rig.bus.heartbeats()["L0"].payload, run_id="tl", limits=LIMITS)
    assert (beat.role, beat.member_id, beat.state, beat.step) == ("learner", "L0", "training", 1)
    assert beat.versions == dict.fromkeys(range(4), 0)
    assert beat.n_tokens == TOKENS_PER_STEP
    rig.learner.step()  # snapshot waits in the outbox
    rig.learner.leave()
    assert "L0" not in rig.bus.heartbeats()
    assert [m.fragment_id for m, _ in rig.standin.contributions()] == [1]  # flushed


def test_max_steps_stops():
    rig = make_rig(tiny_config(learner={"max_steps": 2}))
    assert not rig.learner.step().stop
    assert rig.learner.step().stop
    assert rig.learner.step().action == "finished"


def test_still_open_names_the_newest_round_of_each_fragment_not_yet_merged():
    from types import SimpleNamespace

    from dd_queue.learner.join import still_open
    from dd_queue.messages import RoundOpen

    def opening(p: int, r: int) -> RoundOpen:
        return RoundOpen(run_id="t", fragment_id=p, round_id=r, opened_at_s=0.0, reason="x")

    openings = [opening(0, 4), opening(1, 5), opening(0, 8), opening(2, 6), opening(1, 9)]
    states = {
        0: SimpleNamespace(last_merged_round_id=8),  # round 8 merged: nothing open
        1: SimpleNamespace(last_merged_round_id=5),  # 9 is newer than the last merge
        2: SimpleNamespace(last_merged_round_id=None),  # never merged
    }
    assert still_open(openings, states) == {1: 9, 2: 6}  # type: ignore[arg-type]
    assert still_open(openings, {}) == {0: 8, 1: 9, 2: 6}  # no states: all open


def test_a_forged_command_beyond_the_bounds_is_refused_by_the_learner(caplog):
    """A 1e9 s stall written straight into Redis (the HTTP API would refuse it) is not armed:
    the learner logs why and keeps training."""
    import msgpack

    from dd_queue.messages import ENTRY_FIELD

    rig = make_rig()
    good = FaultCommand(
        run_id="tl", fault_id="f-forged", target="L0", kind="stall", params={},
        duration_s=5.0, issued_at_s=0.0,
    )  # fmt: skip
    body = msgpack.unpackb(good.to_bytes(), strict_map_key=False)
    body["duration_s"] = 1e9
    ops.send_command(rig.bus, "L0", {ENTRY_FIELD: msgpack.packb(body)})
    with caplog.at_level("WARNING", logger="dd_queue"):
        assert rig.learner.pump().commands == 0
    assert list(rig.learner.injector.active()) == []
    assert any(
        "duration_s 1000000000.0 is outside (0, 3600]" in r.getMessage() for r in caplog.records
    )
    assert rig.learner.step().action != "stalled"
