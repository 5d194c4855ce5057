"""Fault injection: what is armed against one process, and whether it fires at a safe point.

Learners and synchronizers ask ``injector.effect(point)`` at their safe points and get an
``Effect``: what happens there (kill, stall for s, offline until t, drop, corrupt, an extra
wait, a slow-down factor), as data. Each loop applies it in a line. The kind → effect mapping
is one pure function, ``effect_of``; which point a kind fires at is ``DEFAULT_POINTS``.
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

import dataclasses
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


@dataclass(frozen=True, slots=True)
class Effect:
    """What the fault that fires at one point does there (``NONE``: nothing; it is falsy).

    Attributes:
        fault_id: The fault ("" for none).
        kind: Its kind (None for none).
        point: Where it fired.
        kill: Exit at once.
        stall_s: Freeze this long (a stall), or None.
        offline_until_s: Act as if the bus were unreachable until this clock time, or None.
        drop: Lose what would be sent (or received) here.
        corrupt: Send it with flipped payload bytes.
        wait_s: Wait this long before going on (a delay).
        slow_factor: The step takes this many times as long (1.0: as long as it takes).
        reason: The effect in words, for logs and reports (``fault <id>: <kind>``).
    """

    fault_id: str = ""
    kind: FaultKind | None = None
    point: str = ""
    kill: bool = False
    stall_s: float | None = None
    offline_until_s: float | None = None
    drop: bool = False
    corrupt: bool = False
    wait_s: float = 0.0
    slow_factor: float = 1.0
    reason: str = "no fault"

    def __bool__(self) -> bool:
        return self.kind is not None


NONE = Effect()


def effect_of(fault: Fault | None, point: str, now: float) -> Effect:
    """What ``fault`` does at ``point`` at clock time ``now`` (pure).

    A fault with a duration lasts ``remaining_s``. Without one it fires once:
    - a stall freezes for ``params["seconds"]`` (default 1 s);
    - a disconnect ends at once.
    ``slow`` takes ``params["factor"]`` (default 2) and ``delay`` takes ``params["delay_s"]``
    (default 1 s).
    """
    if fault is None:
        return NONE
    reason = f"fault {fault.fault_id}: {fault.kind}"
    base = Effect(fault_id=fault.fault_id, kind=fault.kind, point=point, reason=reason)
    remaining = fault.remaining_s(now)
    match fault.kind:
        case "kill":
            return dataclasses.replace(base, kill=True)
        case "stall":
            return dataclasses.replace(base, stall_s=remaining or fault.number("seconds", 1.0))
        case "disconnect":
            return dataclasses.replace(base, offline_until_s=now + remaining)
        case "drop":
            return dataclasses.replace(base, drop=True)
        case "corrupt":
            return dataclasses.replace(base, corrupt=True)
        case "delay":
            return dataclasses.replace(base, wait_s=fault.number("delay_s", 1.0))
        case "slow":
            return dataclasses.replace(base, slow_factor=fault.number("factor", 2.0))


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

    def effect(self, point: str) -> Effect:
        """What happens at ``point`` now (``check`` then ``effect_of``); ``NONE`` if nothing."""
        return effect_of(self.check(point), point, self._clock.now())

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


__all__ = ["DEFAULT_POINTS", "NONE", "Effect", "Fault", "FaultInjector", "FaultKind", "effect_of"]
