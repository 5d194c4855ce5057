"""Fault injector: faults fire at their points, once or for their duration, and are counted."""

from __future__ import annotations

import pytest

from dd_queue.clock import FakeClock
from dd_queue.errors import ConfigError
from dd_queue.faults import NONE, Effect, FaultInjector, effect_of


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


# ── effects: what a fault does at a point, as data ─────────────────────────────────────────


FIELDS = ("kill", "stall_s", "offline_until_s", "drop", "corrupt", "wait_s", "slow_factor")


def _armed(kind, *, duration_s=None, **params):
    clock = FakeClock(100.0)
    inj = FaultInjector("L0", clock=clock)
    inj.arm(kind, fault_id="f", duration_s=duration_s, params=params or None)
    return inj, clock


@pytest.mark.parametrize(
    ("kind", "point", "expected"),
    [
        ("kill", "before_step", {"kill": True}),
        ("kill", "before_round", {"kill": True}),
        ("stall", "before_step", {"stall_s": 1.0}),
        ("stall", "before_round", {"stall_s": 1.0}),
        ("drop", "before_publish", {"drop": True}),
        ("corrupt", "before_publish", {"corrupt": True}),
        ("delay", "before_publish", {"wait_s": 1.0}),
        ("slow", "before_step", {"slow_factor": 2.0}),
        ("disconnect", "before_step", {"offline_until_s": 100.0}),
        ("disconnect", "before_publish", {"offline_until_s": 100.0}),
        ("disconnect", "on_receive", {"offline_until_s": 100.0}),
        ("disconnect", "before_round", {"offline_until_s": 100.0}),
    ],
)
def test_every_kind_at_each_default_point_has_its_one_effect(kind, point, expected):
    inj, _ = _armed(kind)
    effect = inj.effect(point)
    assert effect and effect.kind == kind and effect.point == point and effect.fault_id == "f"
    assert effect.reason == f"fault f: {kind}"
    nothing = Effect()
    changed = {
        name: getattr(effect, name)
        for name in FIELDS
        if getattr(effect, name) != getattr(nothing, name)
    }
    assert changed == expected
    assert not inj.effect(point)  # a one-shot fault is consumed


def test_a_kind_has_no_effect_at_a_point_it_does_not_fire_at():
    inj, _ = _armed("drop")
    assert inj.effect("before_step") is NONE and not NONE and NONE.reason == "no fault"


def test_effects_with_a_duration_and_parameters():
    inj, clock = _armed("disconnect", duration_s=5.0)
    clock.advance(2.0)
    assert inj.effect("before_step").offline_until_s == 105.0  # the fault's own end
    inj, clock = _armed("stall", duration_s=3.0)
    clock.advance(1.0)
    assert inj.effect("before_step").stall_s == 2.0  # what is left of it
    assert _armed("stall", seconds=7)[0].effect("before_round").stall_s == 7.0
    assert _armed("slow", factor=3.5)[0].effect("before_step").slow_factor == 3.5
    assert _armed("delay", delay_s=0.25)[0].effect("before_publish").wait_s == 0.25
    with pytest.raises(ConfigError, match="parameter factor must be a number"):
        _armed("slow", factor="fast")[0].effect("before_step")


def test_effect_of_nothing_is_none():
    assert effect_of(None, "before_step", 0.0) is NONE


def test_effect_of_is_pure_and_its_reason_is_data():
    inj, _ = _armed("disconnect", duration_s=4.0)
    (fault,) = inj.active()
    first = effect_of(fault, "on_receive", 101.0)
    assert first == effect_of(fault, "on_receive", 101.0)  # same answer, nothing consumed
    assert inj.active() == (fault,) and not inj.fired
    assert first.offline_until_s == 104.0 and first.reason == "fault f: disconnect"
    assert first == Effect(
        fault_id="f",
        kind="disconnect",
        point="on_receive",
        offline_until_s=104.0,
        reason="fault f: disconnect",
    )
    assert effect_of(fault, "on_receive", 105.0).offline_until_s == 105.0  # ended: at once
