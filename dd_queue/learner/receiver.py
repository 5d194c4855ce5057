"""Follow the run's streams for one learner: round openings, global versions, fault commands.

Every read is a broadcast ``XREAD`` from the last id seen (docs/protocol.md); nothing becomes
pending and nothing is acked. Global fragments are fetched and verified with ``ops.read_global``
(envelope, stream, blob reference, framing, checksum, NaN/Inf, bit-exact fp32) and checked
against the learner's fragment plan (element count) before they are queued; a refused entry is
logged with its reason, counted and skipped, and never touches the model.

Catch-up by latest: when several versions of a fragment arrived since the last read, only the
newest is fetched (an older one is tried only if the newer one is refused). Versions only move
forward: an entry not newer than what the learner holds or has queued is skipped unfetched.

Realignment: a Redis restart without persistence recreates streams with smaller ids, and an
``XREAD`` after a larger id would then wait forever. ``realign`` compares each stream's newest
id with the position and rewinds positions that are ahead of their stream.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from dd_queue.auth import OPEN, Auth, FreshCommands, Refusals
from dd_queue.bus import Bus, Entry, ops
from dd_queue.bus.types import parse_stream_id
from dd_queue.core.fragments import FragmentPlan
from dd_queue.errors import (
    BlobMissing,
    BusError,
    IncompatibleMessage,
    ProtocolError,
)
from dd_queue.learner.exchange import Received
from dd_queue.messages import FaultCommand, GlobalFragment, MessageLimits, RoundOpen

log = logging.getLogger("dd_queue.learner")

START = "0-0"
BROADCAST_TARGET = "all"
"""Control stream every member reads besides its own (``keys.control("all")``)."""
_PAGE = 500
M = TypeVar("M", RoundOpen, FaultCommand)


@dataclass(frozen=True, slots=True)
class Rejection:
    """A global-fragment entry that was refused, with its reason tag and message."""

    fragment_id: int
    entry_id: str
    reason: str
    message: str


class Follower:
    """Read positions of one learner on the ``open``, ``down`` and control streams.

    Args:
        bus: The run's bus.
        plan: The learner's fragment plan (element counts of every fragment).
        learner_id: Whose control stream to follow (plus ``all``).
        limits: Envelope and payload limits.
        now: Clock of ``Received.received_at_s``.
        auth: The run's keyring: globals must be signed by the synchronizer and commands by
            the control plane (``dd_queue.auth``); refusals are counted in ``refusals``.
        wall: Wall-clock seconds (the age of a signed command).
        max_command_age_s: A signed command older than this is a replay.
    """

    def __init__(
        self,
        bus: Bus,
        *,
        plan: FragmentPlan,
        learner_id: str,
        limits: MessageLimits,
        now: Callable[[], float],
        auth: Auth = OPEN,
        wall: Callable[[], float] = time.time,
        max_command_age_s: float = 300.0,
    ) -> None:
        self.bus, self.plan, self.limits, self._now = bus, plan, limits, now
        self.auth, self._wall, self.learner_id = auth, wall, learner_id
        self.refusals = Refusals()
        self._fresh = FreshCommands(max_command_age_s)
        self.run_id = bus.keys.run_id
        self.down = [bus.keys.down(p) for p in range(plan.n_fragments)]
        self.control = [bus.keys.control(learner_id), bus.keys.control(BROADCAST_TARGET)]
        self.positions: dict[str, str] = dict.fromkeys([*self.down, *self.control], START)
        self.positions[bus.keys.opened_rounds()] = START
        self.rejections: list[Rejection] = []

    # ── positions ────────────────────────────────────────────────────────────────────────
    def start_at_latest(self, streams: Sequence[str]) -> None:
        """Skip what ``streams`` already hold (a learner joining now acts on news only)."""
        for stream in streams:
            latest = self.bus.read_latest(stream)
            self.positions[stream] = latest.id if latest else START

    def realign(self) -> list[str]:
        """Rewind positions that are ahead of their stream (it was recreated); returns them."""
        rewound = []
        for stream, position in self.positions.items():
            latest = self.bus.read_latest(stream)
            newest = parse_stream_id(latest.id) if latest else (0, 0)
            if newest < parse_stream_id(position):
                self.positions[stream] = START
                rewound.append(stream)
        if rewound:
            log.warning(
                "learner.streams_reset %d streams recreated; reading them again",
                len(rewound),
                extra={"ddq": {"streams": rewound}},
            )
        return rewound

    def _read_new(self, stream: str, *, block_ms: int = 0) -> list[Entry]:
        position = self.positions[stream]
        page = self.bus.read(stream, after_id=position, count=_PAGE, block_ms=block_ms or None)
        entries = list(page)
        while len(page) == _PAGE:  # a full page: there may be more
            page = self.bus.read(stream, after_id=page[-1].id, count=_PAGE)
            entries += page
        if entries:
            self.positions[stream] = entries[-1].id
        return entries

    # ── round openings and commands ──────────────────────────────────────────────────────
    def read_opens(self, *, block_ms: int = 0) -> list[RoundOpen]:
        """Round openings since the last call (waits up to ``block_ms`` for the first)."""
        stream = self.bus.keys.opened_rounds()
        return list(self._decode(self._read_new(stream, block_ms=block_ms), RoundOpen))

    def scan_opens(self) -> list[RoundOpen]:
        """Every round opening still in the stream (learner-paced mode learns p's round)."""
        stream = self.bus.keys.opened_rounds()
        self.positions[stream] = START
        return self.read_opens()

    def read_commands(self) -> list[FaultCommand]:
        """Fault commands sent to this learner or to all since the last call (with a
        keyring: signed by the control plane for that stream, fresh and not seen before)."""
        self._report(self.refusals.flush(self._now()))  # what an earlier call left pending
        found: list[FaultCommand] = []
        for stream in self.control:
            found += ops.accepted_commands(
                self._read_new(stream),
                run_id=self.run_id,
                limits=self.limits,
                auth=self.auth,
                fresh=self._fresh,
                now_s=self._wall(),
                refused=lambda entry, exc: self._refused("fault", entry, exc),
            )
        return found

    def _decode(self, entries: list[Entry], kind: type[M]) -> Iterator[M]:
        for entry in entries:
            try:
                yield kind.from_fields(entry.fields, run_id=self.run_id, limits=self.limits)
            except ProtocolError as exc:
                self._refused(kind.TYPE, entry, exc)

    def _refused(self, kind: str, entry: Entry, exc: ProtocolError | BlobMissing) -> None:
        """Count a refused entry; log it and report the counts as ``message.refused`` events
        (a flood: once an interval, with its count)."""
        reason = ops.rejection_reason(exc)
        due = self.refusals.add(kind, reason, self._now())
        log.log(
            logging.WARNING if due else logging.DEBUG,
            "learner.refused %s %s %s: %s",
            kind,
            entry.stream,
            entry.id,
            exc,
            extra={"ddq": {"reason": reason, "kind": kind}},
        )
        self._report(due)

    def _report(self, due: dict[tuple[str, str], int]) -> None:
        with contextlib.suppress(BusError):  # best effort: the count stays in ``refusals``
            ops.report_refused(self.bus, self.learner_id, due, at_s=self._wall())

    # ── global fragments ─────────────────────────────────────────────────────────────────
    def read_globals(
        self, known_version: Callable[[int], int], fragment_ids: Iterable[int] | None = None
    ) -> list[Received]:
        """The newest valid, newer global of every fragment that has news.

        Args:
            known_version: Fragment → newest version held or queued (−1: none).
            fragment_ids: Read only these fragments' streams (default: all).
        """
        found: list[Received] = []
        for p in range(len(self.down)) if fragment_ids is None else sorted(fragment_ids):
            entries = self._read_new(self.down[p])
            if entries:
                received = self.newest_valid(p, entries, known_version(p))
                if received is not None:
                    found.append(received)
        return found

    def newest_valid(self, fragment_id: int, entries: list[Entry], known: int) -> Received | None:
        """Try ``entries`` newest first; the first valid one newer than ``known``, or None."""
        for entry in reversed(entries):
            try:
                msg = GlobalFragment.from_fields(
                    entry.fields, run_id=self.run_id, limits=self.limits
                )
                if msg.version <= known:
                    return None  # older entries are older versions still
                return self._fetch(fragment_id, entry, msg)
            except (ProtocolError, BlobMissing) as exc:
                self._reject(fragment_id, entry, exc)
        return None

    def _fetch(self, fragment_id: int, entry: Entry, msg: GlobalFragment) -> Received:
        size = self.plan.fragments[fragment_id].size
        if msg.tensor.n_elements != size:
            raise IncompatibleMessage(
                f"global fragment {fragment_id} v{msg.version} has {msg.tensor.n_elements} "
                f"elements, this learner's plan {size}: model or n_fragments differ"
            )
        msg, values = ops.read_global(
            self.bus,
            entry,
            run_id=self.run_id,
            limits=self.limits,
            out=np.empty(size, np.float32),
            auth=self.auth,
        )
        return Received(
            fragment_id=fragment_id,
            version=msg.version,
            round_id=msg.round_id,
            values=values,
            received_at_s=self._now(),
        )

    def _reject(self, fragment_id: int, entry: Entry, exc: ProtocolError | BlobMissing) -> None:
        reason = ops.rejection_reason(exc)
        self.rejections.append(Rejection(fragment_id, entry.id, reason, str(exc)))
        del self.rejections[:-100]  # keep the last 100 for inspection
        self._refused("global", entry, exc)


__all__ = ["BROADCAST_TARGET", "START", "Follower", "Rejection"]
