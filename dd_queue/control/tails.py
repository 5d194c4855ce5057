"""Follow the run's streams incrementally: round records, dead letters and events.

The bus has forward reads only, so the control plane keeps a position per stream and reads
what is new (``XREAD`` after the last id, in pages) on every refresh; the first refresh reads
what the streams still hold (they are trimmed to ``redis.stream_maxlen``, the round records
to ``redis.rounds_maxlen``). A stream whose newest
id is below our position was reset (Redis restarted without persistence): it is read again
from the start. Entries that do not decode are skipped and logged, never fatal.

What is kept: the newest round records, per-learner tallies over every record and dead letter
read, the newest events and the eval-loss history. Totals that must survive a restart are not
counted here but read from the fragments' states and the run's counters (``core.tallies``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from dd_queue.bus import Bus, Entry
from dd_queue.bus.types import parse_stream_id
from dd_queue.errors import DDQError
from dd_queue.messages import Contribution, Event, MessageLimits, RoundRecord

__all__ = ["RunLog", "StreamTail", "Tally"]

log = logging.getLogger("dd_queue.control")
_PAGE = 500


class StreamTail:
    """A read position on one stream."""

    def __init__(self, bus: Bus, stream: str) -> None:
        self.bus, self.stream, self.after = bus, stream, "0-0"

    def poll(self, max_entries: int = 20_000) -> list[Entry]:
        """Entries appended since the last poll (at most ``max_entries``)."""
        found: list[Entry] = []
        while len(found) < max_entries:
            page = self.bus.read(self.stream, after_id=self.after, count=_PAGE)
            if not page:
                break
            found += page
            self.after = page[-1].id
            if len(page) < _PAGE:
                break
        if not found and self.after != "0-0":
            latest = self.bus.read_latest(self.stream)
            newest = parse_stream_id(latest.id) if latest else (0, 0)
            if newest < parse_stream_id(self.after):
                log.warning("control.stream_reset %s: reading it again", self.stream)
                self.after = "0-0"
                return self.poll(max_entries)
        return found


@dataclass(slots=True)
class Tally:
    """One learner's contributions, as settled by round records and dead letters."""

    merged: int = 0
    unmerged: int = 0  # superseded, duplicate, late, stale, invalid, dropped
    dead_lettered: int = 0
    last_weights: dict[int, float] = field(default_factory=dict)

    @property
    def sent(self) -> int:
        """Contributions the synchronizer settled (every outcome but ``carried``)."""
        return self.merged + self.unmerged + self.dead_lettered


class RunLog:
    """Tails of every fragment's ``rounds`` and ``dlq`` and of the run's ``events``.

    Args:
        bus: The run's bus.
        n_fragments: P.
        limits: Decode limits.
        keep_rounds: Newest round records kept (across fragments).
        keep_events: Newest events kept.
    """

    def __init__(
        self,
        bus: Bus,
        n_fragments: int,
        limits: MessageLimits,
        *,
        keep_rounds: int = 1000,
        keep_events: int = 500,
    ) -> None:
        keys, self._run_id, self._limits = bus.keys, bus.keys.run_id, limits
        self._rounds = [StreamTail(bus, keys.rounds(p)) for p in range(n_fragments)]
        self._dlq = [StreamTail(bus, keys.dlq(p)) for p in range(n_fragments)]
        self._events = StreamTail(bus, keys.events())
        self.rounds: deque[RoundRecord] = deque(maxlen=keep_rounds)
        self.events: deque[tuple[str, Event]] = deque(maxlen=keep_events)
        self.evals: deque[Event] = deque(maxlen=keep_events)
        self.tallies: dict[str, Tally] = {}
        self.last_round: dict[int, RoundRecord] = {}

    def poll(self) -> tuple[list[RoundRecord], list[tuple[str, Event]]]:
        """Read what is new everywhere; returns the new round records (in closing order) and
        the new events (id, event)."""
        new_rounds = sorted(self._decode_rounds(), key=lambda r: r.closed_at_s)
        for record in new_rounds:
            self._count(record)
        for tail in self._dlq:
            for entry in tail.poll():
                self._tally(self._learner_of(entry)).dead_lettered += 1
        new_events = list(self._decode_events())
        for event_id, event in new_events:
            self.events.append((event_id, event))
            if event.kind == "eval.done":
                self.evals.append(event)
        return new_rounds, new_events

    def _decode_rounds(self) -> Iterator[RoundRecord]:
        for tail in self._rounds:
            for entry in tail.poll():
                try:
                    yield RoundRecord.from_fields(
                        entry.fields, run_id=self._run_id, limits=self._limits
                    )
                except DDQError as exc:
                    log.warning("control.bad_round %s %s: %s", entry.stream, entry.id, exc)

    def _decode_events(self) -> Iterator[tuple[str, Event]]:
        for entry in self._events.poll():
            try:
                yield (
                    entry.id,
                    Event.from_fields(entry.fields, run_id=self._run_id, limits=self._limits),
                )
            except DDQError as exc:
                log.warning("control.bad_event %s: %s", entry.id, exc)

    def _count(self, record: RoundRecord) -> None:
        self.rounds.append(record)
        self.last_round[record.fragment_id] = record
        for outcome in record.entries:
            if outcome.outcome == "merged":
                self._tally(outcome.learner_id).merged += 1
            elif outcome.outcome != "carried":
                self._tally(outcome.learner_id).unmerged += 1
        for c in record.contributors:
            self._tally(c.learner_id).last_weights[record.fragment_id] = c.weight

    def _tally(self, learner_id: str) -> Tally:
        return self.tallies.setdefault(learner_id, Tally())

    def _learner_of(self, entry: Entry) -> str:
        try:
            msg = Contribution.from_fields(entry.fields, run_id=self._run_id, limits=self._limits)
        except DDQError:
            return "?"
        return msg.learner_id

    def newest_rounds(self, limit: int) -> list[RoundRecord]:
        """The ``limit`` most recently closed rounds, newest first."""
        return sorted(self.rounds, key=lambda r: r.closed_at_s, reverse=True)[:limit]
