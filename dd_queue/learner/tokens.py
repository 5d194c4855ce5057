"""A learner's side of the token fate: what it computed, published and dropped, reported to
the run's ``tokens`` counters (``ops.report_tokens``; the synchronizer's side is
``core.tallies``).

Units are token·fragments: every token an inner step trains is trained for each of the P
fragments, and each fragment's contributions carry it separately (divide by P for tokens).

A snapshot's ``n_tokens`` counts every token since the learner last received the fragment (its
*span*); its ``new_tokens`` are those no earlier published or dropped snapshot of the same span
carried. The training thread adds computed tokens (``trained``); the sender thread asks for a
snapshot's new tokens (``new_tokens``) and records what became of it (``published``,
``dropped``). A send carries the counts due in its own round trip, just before its entry
(``ops.send_contribution(tokens=...)``), so the run's counts never show an entry whose tokens
the learner has not counted, and a kill -9 in the middle of a send (while its blob is being
written) leaves neither. What stays imperfect: a process killed after the counts' bytes reach
Redis and before the entry's (adjacent in one write) leaves those tokens *in flight* for good;
and a send whose reply is lost and is sent again counts its tokens twice. The fate shows both
(tokens in flight after the run; a learner that does not balance).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["TokenBook"]

KINDS = ("computed", "published", "dropped")


@dataclass(slots=True)
class _Span:
    base_version: int
    sent: int = 0  # n_tokens of the span's latest snapshot sent or dropped
    counted: int = 0  # n_tokens of the span's latest snapshot counted published or dropped


class TokenBook:
    """Token counts of one learner (thread-safe: the training thread and the sender share it).

    Args:
        n_fragments: P, the fragments of the plan.
    """

    def __init__(self, n_fragments: int) -> None:
        self.n_fragments = n_fragments
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(KINDS, 0)
        self._reported = dict.fromkeys(KINDS, 0)
        self._spans: dict[int, _Span] = {}

    def trained(self, n_tokens: int) -> None:
        """An inner step trained ``n_tokens`` (for every fragment)."""
        with self._lock:
            self._totals["computed"] += n_tokens * self.n_fragments

    def _span(self, p: int, base_version: int) -> _Span:
        span = self._spans.get(p)
        if span is None or span.base_version != base_version:  # a new span: p was received
            span = self._spans[p] = _Span(base_version)
        return span

    def new_tokens(self, fragment_id: int, base_version: int, n_tokens: int) -> int:
        """A snapshot's ``new_tokens`` on the wire: those of its ``n_tokens`` (since
        ``base_version`` was received) that no earlier sent or dropped snapshot carried."""
        with self._lock:
            return max(0, n_tokens - self._span(fragment_id, base_version).sent)

    def sending(self, fragment_id: int, base_version: int, n_tokens: int) -> None:
        """Count a snapshot as published, before it is sent (a retry counts nothing again)."""
        self._count(fragment_id, base_version, n_tokens, "published")

    def sent(self, fragment_id: int, base_version: int, n_tokens: int) -> None:
        """The snapshot reached the bus: later ones of its span carry only what it did not."""
        with self._lock:
            span = self._span(fragment_id, base_version)
            span.sent = max(span.sent, n_tokens)

    def dropped(self, fragment_id: int, base_version: int, n_tokens: int) -> None:
        """Count a snapshot as dropped (never sent: a fault, non-finite values)."""
        self._count(fragment_id, base_version, n_tokens, "dropped")
        self.sent(fragment_id, base_version, n_tokens)

    def _count(self, p: int, base_version: int, n_tokens: int, kind: str) -> None:
        with self._lock:
            span = self._span(p, base_version)
            self._totals[kind] += max(0, n_tokens - span.counted)
            span.counted = max(span.counted, n_tokens)

    def totals(self) -> dict[str, int]:
        """Counted so far, by kind (``KINDS``)."""
        with self._lock:
            return dict(self._totals)

    def claim(self) -> dict[str, int]:
        """What the counts rose by since the last claim, now claimed by the caller, who reports
        it to the run's counters, or gives it back with ``unclaim`` when that fails. A claim is
        taken under the lock, so two reporters (the heartbeat and the sender) never report the
        same increment twice."""
        with self._lock:
            due = {k: self._totals[k] - self._reported[k] for k in KINDS}
            self._reported.update(self._totals)
            return due

    def unclaim(self, increments: dict[str, int]) -> None:
        """``increments`` (from ``claim``) did not reach the run's counters: report them later."""
        with self._lock:
            for k, n in increments.items():
                self._reported[k] -= n
