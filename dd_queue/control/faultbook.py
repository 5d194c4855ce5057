"""The record of every injected fault: who, when, what, and what was observed.

The record lives in the run's event stream (Redis), so it survives the control plane and any
process can read it: ``fault.injected`` (who asked, target, kind, parameters, the control-stream
entry ids), ``fault.armed`` (a target acknowledged it at a safe point; the synchronizer emits
it, learners may), ``fault.observed`` (an effect the control plane saw, e.g. "L1 went dead
after 2.1 s"; ``final`` closes the record). :class:`FaultBook` folds those events into
:class:`FaultRecord` values, newest last.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field

from dd_queue.messages import Event, Scalar

__all__ = ["Effect", "FaultBook", "FaultRecord", "injected_fields"]


@dataclass(frozen=True, slots=True)
class Effect:
    """One observation about a fault, at a wall time (seconds since the epoch)."""

    at_s: float
    note: str


@dataclass(slots=True)
class FaultRecord:
    """Everything known about one fault.

    Attributes:
        fault_id: Its id (also the ``FaultCommand``'s).
        target: A learner id or ``synchronizer``.
        kind: The fault kind.
        duration_s: How long it lasts (None: fires once).
        params: Kind parameters (``factor``, ``delay_s``, ``count``).
        by: Who asked (operator name, and the client address for the API).
        issued_at_s: Wall time it was sent.
        command_ids: Control-stream entries that carry it.
        chaos: The chaos schedule that fired it, if any.
        armed_at_s: When the target acknowledged it (None: no acknowledgement seen).
        effects: What was observed, in order.
        final: True once the observation window closed.
        effective: Whether an effect was seen.
    """

    fault_id: str
    target: str
    kind: str
    duration_s: float | None
    params: dict[str, Scalar]
    by: str
    issued_at_s: float
    command_ids: list[str]
    chaos: str | None = None
    armed_at_s: float | None = None
    effects: list[Effect] = field(default_factory=list)
    final: bool = False
    effective: bool = False

    @property
    def status(self) -> str:
        """sent → armed → effective → done (or "no effect" when closed without one)."""
        if self.final:
            return "done" if self.effective else "no effect"
        if self.effects:
            return "effective"
        return "armed" if self.armed_at_s is not None else "sent"


def injected_fields(record: FaultRecord) -> dict[str, Scalar]:
    """Fields of the ``fault.injected`` event that stores ``record``."""
    return {
        "fault": record.fault_id,
        "target": record.target,
        "kind": record.kind,
        "duration_s": record.duration_s,
        "params": json.dumps(record.params, sort_keys=True),
        "by": record.by,
        "commands": ",".join(record.command_ids),
        "chaos": record.chaos,
    }


def _text(fields: dict[str, Scalar], name: str) -> str:
    value = fields.get(name)
    return value if isinstance(value, str) else ""


def _number(fields: dict[str, Scalar], name: str) -> float | None:
    value = fields.get(name)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class FaultBook:
    """Fault records folded from events (at most ``keep`` newest)."""

    def __init__(self, keep: int = 500) -> None:
        self._keep = keep
        self.records: OrderedDict[str, FaultRecord] = OrderedDict()

    def apply(self, event: Event) -> FaultRecord | None:
        """Fold one event in; returns the record it touched (None for other events)."""
        fields = event.fields
        fault_id = _text(fields, "fault")
        if not event.kind.startswith("fault.") or not fault_id:
            return None
        if event.kind == "fault.injected":
            return self._injected(event, fault_id)
        record = self.records.get(fault_id) or self.records.get(fault_id.rpartition("-")[0])
        if record is None:
            return None
        if event.kind == "fault.armed" and record.armed_at_s is None:
            record.armed_at_s = event.at_s
        elif event.kind == "fault.observed":
            record.effects.append(Effect(event.at_s, event.message))
            record.final = record.final or fields.get("final") is True
            record.effective = record.effective or fields.get("effective") is True
        return record

    def _injected(self, event: Event, fault_id: str) -> FaultRecord:
        fields = event.fields
        try:
            params = json.loads(_text(fields, "params") or "{}")
        except ValueError:
            params = {}
        record = FaultRecord(
            fault_id=fault_id,
            target=_text(fields, "target"),
            kind=_text(fields, "kind"),
            duration_s=_number(fields, "duration_s"),
            params=params if isinstance(params, dict) else {},
            by=_text(fields, "by"),
            issued_at_s=event.at_s,
            command_ids=[c for c in _text(fields, "commands").split(",") if c],
            chaos=_text(fields, "chaos") or None,
        )
        self.records[fault_id] = record
        while len(self.records) > self._keep:
            self.records.popitem(last=False)
        return record

    def newest(self, limit: int) -> list[FaultRecord]:
        """The ``limit`` newest records, newest first."""
        return list(reversed(self.records.values()))[:limit]
