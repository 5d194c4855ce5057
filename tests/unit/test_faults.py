"""Fault injector: faults fire at their points, once or for their duration, and are counted."""

from __future__ import annotations

import pytest

from dd_queue.clock import FakeClock
from dd_queue.errors import ConfigError
from dd_queue.faults import FaultInjector


def test_one_shot_fault_fires_exactly_once_at_its_point():
    inj = FaultInjector("L0", clock=FakeClock())
    inj.arm("drop", fault_id="f1")
    assert inj.check("before_step") is None
    fault = inj.check("before_publish")
    assert fault is not None and fault.kind == "drop"
    assert inj.check("before_publish") is None
    assert inj.fired["f1"] == 1


def test_fault_with_duration_stays_active_until_it_ends():
    clock = FakeClock()
    inj = FaultInjector("L0", clock=clock)
    inj.arm("slow", fault_id="s", duration_s=5.0, params={"factor": 3})
    clock.advance(4.9)
    fault = inj.check("before_step")
    assert fault is not None
    assert fault.number("factor", 1.0) == 3.0
    assert fault.remaining_s(clock.now()) == pytest.approx(0.1)
    clock.advance(0.2)
    assert inj.check("before_step") is None
    assert inj.active() == ()
    assert inj.fired["s"] == 1


def test_point_parameter_overrides_the_default_points():
    inj = FaultInjector("synchronizer", clock=FakeClock())
    inj.arm("kill", fault_id="k", params={"point": "before_commit"})
    assert inj.check("before_round") is None
    assert inj.check("before_commit") is not None


def test_targets_and_bad_input():
    inj = FaultInjector("L1", clock=FakeClock())
    assert inj.applies_to("L1") and inj.applies_to("*") and not inj.applies_to("L2")
    with pytest.raises(ConfigError, match="unknown fault kind"):
        inj.arm("melt", fault_id="x")  # type: ignore[arg-type]
    fault = inj.arm("delay", fault_id="d", params={"delay_s": "soon"})
    with pytest.raises(ConfigError, match="must be a number"):
        fault.number("delay_s", 0.0)
    assert inj.clear() == 1
