"""What an in-process run reports: evaluations, goodput, rounds, learners (JSON-able).

``RunResult.to_dict`` is the variant's entry in an experiment's JSON result. Round records are
read back from the bus (every fragment's ``rounds`` stream) and kept compact: one short row per
round plus a summary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dd_queue.bus import Bus
from dd_queue.core.goodput import GoodputSummary
from dd_queue.messages import MessageLimits, RoundRecord
from dd_queue.runner.evaluate import EvalPoint
from dd_queue.runner.slot import LearnerSlot

__all__ = ["ROUND_COLUMNS", "RoundSummary", "RunResult", "read_rounds", "summarize_rounds"]

ROUND_COLUMNS = (
    "fragment",
    "round",
    "decision",
    "version",
    "contributors",
    "opened_s",
    "quorum_s",
    "closed_s",
    "grace_s",
)
"""Columns of the compact round rows (times in virtual seconds; grace window in seconds)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundSummary:
    """Totals over every round of a run.

    Attributes:
        merged: Rounds that made a new version.
        abandoned: Rounds closed without quorum.
        mean_contributors: Mean learners merged per merged round.
        mean_staleness: Mean versions a merged contribution was behind.
        late_or_dropped: Contributions refused as late, stale or dropped.
    """

    merged: int
    abandoned: int
    mean_contributors: float
    mean_staleness: float
    late_or_dropped: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """Everything one variant's run reports.

    Attributes:
        name: The variant's name.
        mode: decoupled | synchronous | data-parallel.
        n_learners: M.
        tokens: Tokens trained by all learners (at the stop).
        stop_s: Virtual time the training stopped (budget or time limit), seconds.
        end_s: Virtual time after the drain, seconds.
        final: The evaluation after the drain.
        evals: Every evaluation, in time order (the final one last).
        goodput: The goodput ledger over ``[0, stop_s]``.
        rounds: Round totals.
        round_rows: One row per round (``ROUND_COLUMNS``).
        learners: Per learner: steps, tokens, failures, seconds by state.
        settings: The runner and synchronizer settings that define the variant.
        elapsed_s: Real (host) seconds the run took.
    """

    name: str
    mode: str
    n_learners: int
    tokens: int
    stop_s: float
    end_s: float
    final: EvalPoint
    evals: tuple[EvalPoint, ...]
    goodput: GoodputSummary
    rounds: RoundSummary
    round_rows: tuple[tuple[Any, ...], ...]
    learners: tuple[dict[str, Any], ...]
    settings: dict[str, Any]
    elapsed_s: float

    def to_dict(self, *, with_rounds: bool = True) -> dict[str, Any]:
        """Plain JSON-able data (``with_rounds=False`` leaves out the per-round rows)."""
        data: dict[str, Any] = {
            "name": self.name,
            "mode": self.mode,
            "n_learners": self.n_learners,
            "tokens": self.tokens,
            "stop_s": self.stop_s,
            "end_s": self.end_s,
            "final": dataclasses.asdict(self.final),
            "evals": [dataclasses.asdict(e) for e in self.evals],
            "goodput": dataclasses.asdict(self.goodput),
            "rounds": dataclasses.asdict(self.rounds),
            "learners": list(self.learners),
            "settings": self.settings,
            "elapsed_s": self.elapsed_s,
        }
        if with_rounds:
            data["round_columns"] = list(ROUND_COLUMNS)
            data["round_rows"] = [list(row) for row in self.round_rows]
        return data


def read_rounds(bus: Bus, n_fragments: int, *, limits: MessageLimits) -> list[RoundRecord]:
    """Every round record on the bus, ordered by (closing time, fragment, round)."""
    records: list[RoundRecord] = []
    for p in range(n_fragments):
        after = "0-0"
        while entries := bus.read(bus.keys.rounds(p), after_id=after, count=500):
            after = entries[-1].id
            records += [
                RoundRecord.from_fields(e.fields, run_id=bus.keys.run_id, limits=limits)
                for e in entries
            ]
    return sorted(records, key=lambda r: (r.closed_at_s, r.fragment_id, r.round_id))


def summarize_rounds(
    records: list[RoundRecord],
) -> tuple[RoundSummary, tuple[tuple[Any, ...], ...]]:
    """Totals and compact rows of ``records``."""
    merged = [r for r in records if r.decision == "merge"]
    contributors = [len(r.contributors) for r in merged]
    staleness = [c.staleness for r in merged for c in r.contributors]
    refused = sum(
        1 for r in records for e in r.entries if e.outcome in ("late", "stale", "dropped")
    )
    summary = RoundSummary(
        merged=len(merged),
        abandoned=len(records) - len(merged),
        mean_contributors=sum(contributors) / len(contributors) if contributors else 0.0,
        mean_staleness=sum(staleness) / len(staleness) if staleness else 0.0,
        late_or_dropped=refused,
    )
    rows = tuple(
        (
            r.fragment_id,
            r.round_id,
            r.decision,
            r.version_after,
            len(r.contributors),
            round(r.opened_at_s, 4),
            None if r.quorum_at_s is None else round(r.quorum_at_s, 4),
            round(r.closed_at_s, 4),
            round(r.timings_s.get("grace_window", 0.0), 4),
        )
        for r in records
    )
    return summary, rows


def learner_rows(slots: list[LearnerSlot]) -> tuple[dict[str, Any], ...]:
    """Per learner slot: id, speed factor, steps, tokens, failures and seconds by state."""
    return tuple(
        {
            "learner": s.learner_id,
            "factor": s.timer.factor,
            "steps": s.steps,
            "tokens": s.tokens,
            "failures": s.n_failures,
            **{f"{kind}_s": s.log.seconds(kind) for kind in ("training", "waiting", "down")},
            "restarting_s": s.log.seconds("restarting"),
        }
        for s in slots
    )
