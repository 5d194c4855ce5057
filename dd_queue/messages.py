"""The wire contract's messages: one frozen dataclass per kind, schema-versioned and validated.

Each message's envelope is a msgpack map of its fields plus ``schema_version`` and ``type``
(``dd_queue.wire`` encodes and checks it). ``to_bytes``/``from_bytes`` give the stored form
(heartbeats, round records); ``to_fields``/``from_fields`` put it in one stream-entry field,
``"m"`` (other entry fields, such as the bus's blob reference, belong to the bus and are ignored
here). Decoding applies the checks of ``dd_queue.wire`` and then each message's own rules.

Tensor messages (``Contribution``, ``GlobalFragment``) carry the tensor's identity, counters and
codec header; where the payload is stored is the bus's blob reference in the same entry, written
and checked by ``dd_queue.bus.ops`` (``send_contribution``/``read_contribution`` and the global
fragment pair).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Self

from dd_queue.core.codec import TensorHeader, check_header
from dd_queue.core.rounds import ContributionClaim
from dd_queue.errors import CorruptPayload, IncompatibleMessage
from dd_queue.wire import (
    ENTRY_FIELD,
    SCHEMA_VERSION,
    MessageLimits,
    decode_envelope,
    encode_envelope,
    entry_envelope,
    pack_blob,
    require_text,
    unpack_blob,
    unpack_envelope,
)

__all__ = [
    "ENTRY_FIELD",
    "SCHEMA_VERSION",
    "Contribution",
    "ContributorRecord",
    "EntryOutcome",
    "EntryOutcomeKind",
    "Event",
    "FaultCommand",
    "GlobalFragment",
    "Heartbeat",
    "Message",
    "MessageLimits",
    "RoundOpen",
    "RoundRecord",
    "message_from_bytes",
    "pack_blob",
    "unpack_blob",
]

_EVENT_KIND = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")
Scalar = Annotated[str | int | float | bool | None, "free-form"]
"""A free-form value (fault parameters, event fields): any sign, but finite."""


class Message:
    """Base of every envelope: encoding and validated decoding. Subclasses are dataclasses."""

    __slots__ = ()
    TYPE: ClassVar[str]
    run_id: str

    def to_bytes(self) -> bytes:
        """The msgpack envelope."""
        return encode_envelope(self.TYPE, self)

    def to_fields(self) -> dict[str, bytes]:
        """Stream-entry fields: the envelope under ``ENTRY_FIELD``."""
        return {ENTRY_FIELD: self.to_bytes()}

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray | memoryview, *, run_id: str, limits: MessageLimits
    ) -> Self:
        """Decode and validate an envelope of this type.

        Args:
            data: The envelope.
            run_id: The reader's run; a message of another run is refused.
            limits: Size limits.

        Raises:
            PayloadTooLarge: Envelope (or a referenced tensor) over ``limits``.
            CorruptPayload: Not msgpack, or missing, extra or mistyped fields, or broken rules.
            IncompatibleMessage: Other schema_version, type, run_id, codec or dtype.
        """
        message = decode_envelope(cls, data, type_name=cls.TYPE, run_id=run_id, limits=limits)
        message._validate(limits)
        return message

    @classmethod
    def from_fields(
        cls,
        fields: Mapping[Any, bytes],
        *,
        run_id: str,
        limits: MessageLimits,
    ) -> Self:
        """Decode the envelope in a stream entry's ``ENTRY_FIELD`` (keys may be str or bytes).

        Raises:
            CorruptPayload: No ``ENTRY_FIELD``; otherwise as ``from_bytes``.
        """
        return cls.from_bytes(entry_envelope(fields), run_id=run_id, limits=limits)

    def _validate(self, limits: MessageLimits) -> None:
        """Per-message rules beyond field types; subclasses extend it."""
        require_text(self, "run_id")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Contribution(ContributionClaim, Message):
    """A learner's outer gradient Δ_p for one fragment in one round (learner → synchronizer).

    The stream entry is a small reference: this envelope plus the bus's blob reference to the
    payload (``dd_queue.wire.pack_blob`` framing). Its claim (``core.rounds.ContributionClaim``:
    learner, fragment, round, base version, ``n_steps`` and ``n_tokens`` since the learner last
    received the fragment; Decoupled DiLoCo's merge weight is n_tokens · n_tokens / n_steps) is
    its dedupe identity and the synchronizer's bookkeeping.

    Attributes:
        config_digest: Digest of the sender's math-relevant config; the synchronizer compares it.
        tensor: Codec header of the payload (dd_queue.core.codec).
        created_at_s: Sender's wall-clock time, seconds since the epoch.
        new_tokens: The part of ``n_tokens`` that no earlier published or dropped contribution
            of this learner to this fragment carried since it last received it (token fate:
            ``core.tallies``); 0 ≤ new_tokens ≤ n_tokens.
    """

    TYPE: ClassVar[str] = "contribution"
    run_id: str
    config_digest: str
    tensor: TensorHeader
    created_at_s: float
    new_tokens: int = 0

    def _validate(self, limits: MessageLimits) -> None:
        require_text(self, "run_id", "config_digest", "learner_id")
        check_header(self.tensor, limits.tensor)
        if not 0 <= self.new_tokens <= self.n_tokens:
            raise CorruptPayload(
                f"new_tokens {self.new_tokens} outside [0, n_tokens = {self.n_tokens}]"
            )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GlobalFragment(Message):
    """A new global version Θ_p of a fragment (synchronizer → learners); always fp32 (exact).

    The ``down`` stream entry holds this envelope plus the bus's blob reference to the payload,
    staged under the lease's fencing token and appended inside the round's fenced commit.
    """

    TYPE: ClassVar[str] = "global"
    run_id: str
    fragment_id: int
    version: int
    round_id: int
    tensor: TensorHeader
    created_at_s: float
    reason: str

    def _validate(self, limits: MessageLimits) -> None:
        require_text(self, "run_id")
        if self.tensor.codec != "fp32":
            raise IncompatibleMessage(f"global fragments must be fp32, got {self.tensor.codec!r}")
        check_header(self.tensor, limits.tensor)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """A member's liveness and progress.

    Attributes:
        state: Free text such as ``training``, ``stalled``, ``draining``.
        step, n_tokens: Inner steps and tokens trained since the member started.
        step_time_ema_s: Moving average of one inner step, seconds (None before the first).
        versions: Fragment id → global version the member holds.
        queue_depths: Background queue name → items waiting (e.g. ``publish``, ``receive``).
        device, host, pid: Where the member runs.
        sent_at_s: Sender's wall-clock time, seconds since the epoch.
        train_loss: A learner's loss at its latest inner step (None: no step yet, the loss
            was not finite, or not a learner): the dashboard's per-learner curves.
    """

    TYPE: ClassVar[str] = "heartbeat"
    run_id: str
    config_digest: str
    role: Literal["learner", "synchronizer", "control"]
    member_id: str
    state: str
    step: int
    n_tokens: int
    step_time_ema_s: float | None
    versions: dict[int, int]
    queue_depths: dict[str, int]
    device: str
    host: str
    pid: int
    sent_at_s: float
    train_loss: float | None = None

    def _validate(self, limits: MessageLimits) -> None:
        require_text(self, "run_id", "member_id", "state")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ContributorRecord:
    """One learner's part in a round: its normalized merge weight, counters and staleness
    (global versions between its base version and the merged one)."""

    learner_id: str
    weight: float
    n_tokens: int
    n_steps: int
    staleness: int


EntryOutcomeKind = Literal[
    "merged", "superseded", "duplicate", "late", "stale", "invalid", "dropped", "carried"
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EntryOutcome:
    """What became of one contribution stream entry settled by a round's commit.

    ``merged`` entries went into the new version; ``carried`` ones stay pending for the
    fragment's next round (an abandoned round); every other outcome is acked unmerged, with its
    reason. Every entry id appears in exactly one record's outcomes (or in the DLQ).
    """

    entry_id: str
    learner_id: str
    round_id: int
    outcome: EntryOutcomeKind
    reason: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoundOpen(Message):
    """The synchronizer asks for contributions to ``fragment_id`` in ``round_id`` (run-wide
    ``open`` stream; learners follow it with non-blocking reads)."""

    TYPE: ClassVar[str] = "open"
    run_id: str
    fragment_id: int
    round_id: int
    opened_at_s: float
    reason: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoundRecord(Message):
    """What one round of one fragment did and why (for the API, dashboard and audits).

    ``version_after`` is ``version_before + 1`` for a merge and equal to it for an abandon.
    ``timings_s`` holds named durations (e.g. ``merge`` with the outer step, ``stage``), seconds.
    """

    TYPE: ClassVar[str] = "round"
    run_id: str
    fragment_id: int
    round_id: int
    version_before: int
    version_after: int
    decision: Literal["merge", "abandon"]
    reason: str
    contributors: tuple[ContributorRecord, ...]
    entries: tuple[EntryOutcome, ...]
    opened_at_s: float
    quorum_at_s: float | None
    closed_at_s: float
    timings_s: dict[str, float]

    def _validate(self, limits: MessageLimits) -> None:
        require_text(self, "run_id", "reason")
        step = 1 if self.decision == "merge" else 0
        if self.version_after != self.version_before + step:
            raise CorruptPayload(
                f"{self.decision} must take version {self.version_before} to "
                f"{self.version_before + step}, not {self.version_after}"
            )


FAULT_BOUNDS: dict[str, tuple[float, float]] = {
    "duration_s": (0.0, 3600.0),
    "seconds": (0.0, 3600.0),  # a synchronizer stall without a duration
    "factor": (1.0, 100.0),
    "delay_s": (0.0, 600.0),
    "count": (0.0, 100.0),
}
"""``name → (low, high)``: a fault command's duration and numeric parameters must lie in
``(low, high]``. Checked where a command is decoded, so a command written straight into Redis
is held to the same bounds as the HTTP API's (which uses these numbers)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FaultCommand(Message):
    """An injected fault for ``target`` (a learner id, ``"synchronizer"`` or ``"*"``); its
    duration and numeric parameters lie within :data:`FAULT_BOUNDS`."""

    TYPE: ClassVar[str] = "fault"
    run_id: str
    fault_id: str
    target: str
    kind: Literal["stall", "slow", "drop", "delay", "corrupt", "disconnect", "kill"]
    params: dict[str, Scalar]
    duration_s: float | None
    issued_at_s: float

    def _validate(self, limits: MessageLimits) -> None:
        require_text(self, "run_id", "fault_id", "target")
        bounded = {**self.params, "duration_s": self.duration_s}
        for name, (low, high) in FAULT_BOUNDS.items():
            value = bounded.get(name)
            if value is None:
                continue
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not (number and math.isfinite(float(value)) and low < float(value) <= high):
                raise CorruptPayload(
                    f"FaultCommand {self.fault_id!r}: {name} {value!r} is outside ({low:g}, "
                    f"{high:g}]; refused"
                )
        point = self.params.get("point")
        if point is not None and not (isinstance(point, str) and 0 < len(point) <= 64):
            raise CorruptPayload(f"FaultCommand {self.fault_id!r}: point {point!r} is not a name")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Event(Message):
    """Something that happened, named by a dotted ``kind`` such as ``round.merged``."""

    TYPE: ClassVar[str] = "event"
    run_id: str
    kind: str
    message: str
    fields: dict[str, Scalar]
    at_s: float

    def _validate(self, limits: MessageLimits) -> None:
        require_text(self, "run_id")
        if not _EVENT_KIND.fullmatch(self.kind):
            raise CorruptPayload(
                f"event kind {self.kind!r} is not a dotted name like 'round.merged'"
            )


_TYPES: dict[str, type[Message]] = {
    c.TYPE: c
    for c in (Contribution, GlobalFragment, Heartbeat, RoundOpen, RoundRecord, FaultCommand, Event)
}


def message_from_bytes(
    data: bytes | bytearray | memoryview, *, run_id: str, limits: MessageLimits
) -> Message:
    """Decode an envelope of any message type (e.g. a dead-lettered entry).

    Raises:
        As ``Message.from_bytes``; an unknown ``type`` is IncompatibleMessage.
    """
    kind = unpack_envelope(data, limits).get("type")
    if not isinstance(kind, str) or kind not in _TYPES:
        raise IncompatibleMessage(f"unknown message type {kind!r}; known: {sorted(_TYPES)}")
    return _TYPES[kind].from_bytes(data, run_id=run_id, limits=limits)
