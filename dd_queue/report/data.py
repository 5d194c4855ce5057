"""What a run's report shows, read from its Redis (the bus) and its ``summary.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dd_queue.bus import Bus, ops
from dd_queue.control.faultbook import FaultBook, FaultRecord
from dd_queue.control.tails import RunLog
from dd_queue.core.tallies import (
    TokenFate,
    dead_letters,
    learner_counts,
    merged_token_share,
    run_token_fates,
    summed,
    tokens_merged,
)
from dd_queue.errors import NotReady
from dd_queue.fragment_state import FragmentState
from dd_queue.messages import MessageLimits, RoundRecord

__all__ = ["EvalPoint", "RunReport", "read_report"]

MAX_FRAGMENTS = 4096
"""Fragments probed for a state (a run has far fewer)."""


@dataclass(frozen=True, slots=True)
class EvalPoint:
    """One evaluation of the global model."""

    at_s: float
    loss: float
    min_version: int | None


@dataclass(frozen=True, slots=True)
class RunReport:
    """A run, as its report shows it.

    Attributes:
        run_id: The run.
        summary: ``ddq up``'s summary (``summary.json``), or empty when the run has none.
        versions: Fragment → its global version at the end.
        rounds: Every round record the streams still hold, in closing order.
        evals: Every evaluation the event stream still holds, in order.
        faults: Every fault the event stream records, in order, with its observed effects.
        learners: Learner → its counts over all fragments (outcomes, ``tokens_merged``):
            exact, from the fragments' states.
        dead_letters: Reason tag → dead letters, all fragments.
        tokens_merged: Tokens merged, summed over fragments.
        token_fates: Learner → its token fate (token·fragments; ``core.tallies``).
    """

    run_id: str
    summary: dict[str, Any]
    versions: dict[int, int]
    rounds: list[RoundRecord]
    evals: list[EvalPoint]
    faults: list[FaultRecord]
    learners: dict[str, dict[str, int]]
    dead_letters: dict[str, int]
    tokens_merged: int
    token_fates: dict[str, TokenFate] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def merged_token_share(self) -> float | None:
        """``core.tallies.merged_token_share``, with the trained tokens of the summary."""
        trained = int(self.summary.get("tokens_trained") or 0)
        return merged_token_share(self.tokens_merged, len(self.versions), trained)


def _states(bus: Bus, limits: MessageLimits) -> dict[int, FragmentState]:
    states: dict[int, FragmentState] = {}
    for p in range(MAX_FRAGMENTS):
        raw = bus.get(bus.keys.state(p))
        if raw is None:
            break
        states[p] = FragmentState.from_bytes(raw, run_id=bus.keys.run_id, limits=limits)
    return states


def read_report(bus: Bus, limits: MessageLimits, summary: dict[str, Any]) -> RunReport:
    """Everything the report shows, from the run's bus.

    Raises:
        NotReady: The bus holds no fragment of this run.
        BusError: Redis failed.
    """
    states = _states(bus, limits)
    if not states:
        raise NotReady(f"run {bus.keys.run_id!r} has no fragment state in this Redis")
    log = RunLog(bus, len(states), limits, keep_rounds=1_000_000, keep_events=1_000_000)
    rounds: list[RoundRecord] = []
    book = FaultBook(keep=100_000)
    while True:
        new_rounds, new_events = log.poll()
        rounds += new_rounds
        for _, event in new_events:
            book.apply(event)
        if not new_rounds and not new_events:
            break
    evals = []
    for event in log.evals:
        loss = event.fields.get("loss")
        version = event.fields.get("min_version")
        if isinstance(loss, int | float):
            evals.append(
                EvalPoint(event.at_s, float(loss), version if isinstance(version, int) else None)
            )
    totals = summed(st.counters for st in states.values())
    notes = []
    if not summary:
        notes.append("no summary.json in the run directory: goodput and uptime unknown")
    return RunReport(
        run_id=bus.keys.run_id,
        summary=summary,
        versions={p: st.version for p, st in states.items()},
        rounds=sorted(rounds, key=lambda r: r.closed_at_s),
        evals=evals,
        faults=sorted(book.records.values(), key=lambda f: f.issued_at_s),
        learners=learner_counts(totals),
        dead_letters=dead_letters(totals),
        tokens_merged=sum(tokens_merged(st.counters) for st in states.values()),
        token_fates=run_token_fates(ops.token_counts(bus), totals),
        notes=notes,
    )
