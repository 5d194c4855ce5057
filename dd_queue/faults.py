"""Fault injection: what is armed against one process, and whether it fires at a safe point.

Learners and synchronizers call ``injector.check(point)`` at their safe points and apply the
effect themselves (sleep, drop, corrupt, exit), because the effect depends on where they are.
Faults arrive as ``FaultCommand`` messages (from the control plane through Redis, or from a
config schedule) or are armed directly by tests.

Points (strings, so a caller can add its own):

=================  ====================================================================
point              where
=================  ====================================================================
``before_step``    learner, before an inner step
``before_publish`` learner, before a contribution goes to the bus
``on_receive``     learner, before a received global fragment is applied
``before_round``   synchronizer, before it handles a fragment's round
``after_merge``    synchronizer, after merge + outer step, before the commit
``before_commit``  synchronizer, right before the fenced commit
``after_commit``   synchronizer, right after the fenced commit (nothing else written yet)
=================  ====================================================================

Kinds and their default points (``params["point"]`` overrides): ``stall`` (freeze for the
duration), ``slow`` (``params["factor"]`` × step time), ``drop`` (lose the contribution),
``delay`` (``params["delay_s"]`` before publishing), ``corrupt`` (flip payload bytes),
``disconnect`` (act as if Redis were unreachable for the duration), ``kill`` (exit at once).
A fault with a duration stays active until it ends; one without fires once.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from dd_queue.clock import Clock
from dd_queue.errors import ConfigError

FaultKind = Literal["stall", "slow", "drop", "delay", "corrupt", "disconnect", "kill"]
Scalar = str | int | float | bool | None

DEFAULT_POINTS: Mapping[str, frozenset[str]] = {
    "stall": frozenset({"before_step", "before_round"}),
    "slow": frozenset({"before_step"}),
    "drop": frozenset({"before_publish"}),
    "delay": frozenset({"before_publish"}),
    "corrupt": frozenset({"before_publish"}),
    "disconnect": frozenset({"before_step", "before_publish", "on_receive", "before_round"}),
    "kill": frozenset({"before_step", "before_round"}),
}


@dataclass(frozen=True, slots=True)
class Fault:
    """One armed fault.

    Attributes:
        fault_id: Unique id (for the record and the "fired once" checks).
        kind: What happens.
        points: Safe points at which it fires.
        params: Kind-specific numbers (``factor``, ``delay_s``, ...).
        armed_at_s: Clock time it was armed.
        until_s: Clock time it ends; None fires once.
    """

    fault_id: str
    kind: FaultKind
    points: frozenset[str]
    params: Mapping[str, Scalar] = field(default_factory=dict)
    armed_at_s: float = 0.0
    until_s: float | None = None

    def remaining_s(self, now: float) -> float:
        """Seconds until the fault ends (0 for a one-shot fault)."""
        return 0.0 if self.until_s is None else max(0.0, self.until_s - now)

    def number(self, name: str, default: float) -> float:
        """A numeric parameter, or ``default``; a non-number is a clear error."""
        value = self.params.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"fault {self.fault_id}: parameter {name} must be a number")
        return float(value)


class FaultInjector:
    """The faults armed against one member (a learner id or ``synchronizer``). Thread-safe."""

    def __init__(self, member_id: str, *, clock: Clock) -> None:
        self.member_id = member_id
        self._clock = clock
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.fired: Counter[str] = Counter()

    def arm(
        self,
        kind: FaultKind,
        *,
        fault_id: str,
        duration_s: float | None = None,
        params: Mapping[str, Scalar] | None = None,
    ) -> Fault:
        """Arm a fault now; ``duration_s`` None or 0 makes it fire once."""
        if kind not in DEFAULT_POINTS:
            raise ConfigError(f"unknown fault kind {kind!r}; known: {sorted(DEFAULT_POINTS)}")
        params = dict(params or {})
        point = params.get("point")
        points = frozenset({str(point)}) if point is not None else DEFAULT_POINTS[kind]
        now = self._clock.now()
        until = now + duration_s if duration_s else None
        fault = Fault(fault_id, kind, points, params, now, until)
        with self._lock:
            self._faults.append(fault)
        return fault

    def applies_to(self, target: str) -> bool:
        """Whether a command for ``target`` is meant for this member."""
        return target in (self.member_id, "*")

    def check(self, point: str) -> Fault | None:
        """The first active fault that fires at ``point``, or None. One-shot faults are consumed."""
        now = self._clock.now()
        with self._lock:
            self._faults = [f for f in self._faults if f.until_s is None or f.until_s > now]
            for fault in self._faults:
                if point in fault.points:
                    if fault.until_s is None:
                        self._faults.remove(fault)
                    self.fired[fault.fault_id] += 1
                    return fault
        return None

    def active(self) -> tuple[Fault, ...]:
        """Faults still armed (for heartbeats and the dashboard)."""
        now = self._clock.now()
        with self._lock:
            return tuple(f for f in self._faults if f.until_s is None or f.until_s > now)

    def clear(self) -> int:
        """Disarm everything; returns how many faults were armed."""
        with self._lock:
            n = len(self._faults)
            self._faults.clear()
        return n


__all__ = ["DEFAULT_POINTS", "Fault", "FaultInjector", "FaultKind"]
