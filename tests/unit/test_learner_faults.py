"""How the learner applies each fault effect at its points (MemoryBus + FakeClock, one thread).

``test_faults`` checks what ``effect_of`` answers; these check what ``step``, ``receive`` and
``send`` do with the answer: the reports, the logs and the order (disconnect, then drop, then
delay, then corrupt at publish).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dd_queue.errors import CorruptPayload
from tests.unit.test_learner import Rig, make_rig


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _snapshot_waiting(rig: Rig, p: int = 0) -> None:
    """Open a round of ``p`` and train a step: its snapshot waits in the outbox."""
    rig.standin.open_round(p)
    rig.learner.pump_receive()
    rig.learner.step()
    assert rig.learner.outbox.depth() == 1


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_kill_at_before_step_logs_and_stops(caplog):
    rig = make_rig()
    rig.learner.step()
    rig.learner.injector.arm("kill", fault_id="k1")
    with caplog.at_level("WARNING", logger="dd_queue.learner"):
        report = rig.learner.step()
    assert (report.action, report.step, report.stop) == ("killed", 1, True)
    assert rig.learner.state == "killed"
    assert "fault.injected k1: kill at step 1" in _messages(caplog)


def test_one_shot_stall_waits_its_seconds_and_then_trains():
    rig = make_rig()
    rig.learner.injector.arm("stall", fault_id="s1", params={"seconds": 3.0})
    report = rig.learner.step()
    assert (report.action, report.wait_s, rig.learner.state) == ("stalled", 3.0, "stalled")
    assert rig.learner.inner.step_count == 0
    assert rig.learner.step().action == "trained"  # one-shot: consumed


def test_slow_adds_factor_minus_one_step_times():
    rig = make_rig()
    clock = rig.clock
    train_step = rig.learner.inner.train_step

    def timed(batches):  # the FakeClock does not move by itself: a step "takes" 0.5 s
        clock.advance(0.5)
        return train_step(batches)

    rig.learner.inner.train_step = timed  # type: ignore[method-assign]
    assert rig.learner.step().wait_s == 0.0
    rig.learner.injector.arm("slow", fault_id="w1", duration_s=10.0, params={"factor": 3.0})
    assert rig.learner.step().wait_s == pytest.approx(1.0)
    assert rig.learner.step().wait_s == pytest.approx(1.0)  # lasts its duration


def test_drop_at_publish_logs_and_reports_dropped(caplog):
    rig = make_rig()
    _snapshot_waiting(rig)
    rig.learner.injector.arm("drop", fault_id="d1")
    with caplog.at_level("WARNING", logger="dd_queue.learner"):
        report = rig.learner.pump_send()
    assert report.dropped == ((0, 0),) and report.sent == () and report.online
    assert "fault.injected d1: dropped contribution (0, 0)" in _messages(caplog)
    assert rig.learner.outbox.depth() == 0 and rig.standin.contributions() == []


def test_delay_at_publish_waits_then_sends():
    rig = make_rig()
    _snapshot_waiting(rig)
    rig.learner.injector.arm("delay", fault_id="y1", duration_s=60.0, params={"delay_s": 2.5})
    before = rig.clock.now()
    assert rig.learner.pump_send().sent == ((0, 0),)
    assert rig.clock.now() - before == pytest.approx(2.5)
    assert [m.fragment_id for m, _ in rig.standin.contributions()] == [0]


def test_corrupt_at_publish_sends_flipped_bytes_and_keeps_the_residual(monkeypatch):
    rig = make_rig()
    _snapshot_waiting(rig)
    assert rig.learner.bus_pump is not None
    committed: list[int] = []
    monkeypatch.setattr(
        rig.learner.bus_pump.encoder, "commit", lambda p, residual: committed.append(p)
    )
    rig.learner.injector.arm("corrupt", fault_id="c1")
    assert rig.learner.pump_send().sent == ((0, 0),)
    assert committed == []  # error feedback does not count a corrupted contribution
    with pytest.raises(CorruptPayload):
        rig.standin.contributions()


def test_disconnect_at_publish_keeps_the_snapshot_until_back_online(caplog):
    rig = make_rig()
    _snapshot_waiting(rig)
    rig.learner.injector.arm("disconnect", fault_id="x1", duration_s=2.0)
    with caplog.at_level("WARNING", logger="dd_queue.learner"):
        assert not rig.learner.pump_send().online
    assert any(m.startswith("learner.offline fault x1: disconnect;") for m in _messages(caplog))
    assert rig.learner.outbox.depth() == 1  # restored, not lost
    rig.learner.injector.clear()
    assert not rig.learner.pump_send().online  # offline until the fault's end
    rig.clock.advance(2.0)
    assert rig.learner.pump_send().sent == ((0, 0),)


def test_drop_at_on_receive_loses_the_received_globals(caplog):
    rig = make_rig()
    size = rig.learner.plan.fragments[1].size
    rig.standin.publish(1, np.full(size, 1.0, np.float32))
    rig.learner.injector.arm("drop", fault_id="d2", params={"point": "on_receive"})
    with caplog.at_level("WARNING", logger="dd_queue.learner"):
        assert rig.sweep().received == ()
    assert "fault.injected d2: dropped 1 received globals" in _messages(caplog)
    rig.standin.publish(1, np.full(size, 2.0, np.float32))
    assert rig.sweep().received == ((1, 2),)


def test_delay_at_on_receive_waits_before_queueing():
    rig = make_rig()
    rig.standin.publish(2, np.zeros(rig.learner.plan.fragments[2].size, np.float32))
    rig.learner.injector.arm("delay", fault_id="y2", params={"point": "on_receive"})
    rig.clock.advance(rig.cfg.membership.heartbeat_interval_s)
    before = rig.clock.now()
    assert rig.learner.pump_receive().received == ((2, 1),)
    assert rig.clock.now() - before == pytest.approx(1.0)  # delay_s defaults to 1 s


def test_a_one_shot_disconnect_at_on_receive_ends_at_once_and_realigns(caplog):
    rig = make_rig()
    rig.learner.injector.arm("disconnect", fault_id="x2", params={"point": "on_receive"})
    with caplog.at_level("INFO", logger="dd_queue.learner"):
        assert rig.learner.pump_receive().online  # offline until now: the read goes ahead
    offline, online = (m for m in _messages(caplog) if m.startswith("learner.o"))
    assert offline.startswith("learner.offline fault x2: disconnect;")
    assert online.startswith("learner.online ")


def test_kill_at_before_publish_loses_the_contribution_and_silences_the_learner(caplog):
    rig = make_rig()
    _snapshot_waiting(rig)
    rig.learner.injector.arm("kill", fault_id="k2", params={"point": "before_publish"})
    with caplog.at_level("WARNING", logger="dd_queue.learner"):
        report = rig.learner.pump_send()
    assert report.sent == () and not report.online
    assert "fault.injected k2: kill while publishing (0, 0)" in _messages(caplog)
    assert rig.standin.contributions() == []  # died with it in hand
    assert not rig.learner.pump_receive().online  # a dead process is silent
    assert not rig.learner.pump_send().online
    step = rig.learner.step()
    assert (step.action, step.stop, rig.learner.state) == ("killed", True, "killed")
    assert rig.learner.inner.step_count == 1  # no step after the kill
