"""Operations of a fenced commit (``Bus.commit``) and its result.

Each op checks its arguments when it is built (``__post_init__``), so a commit that would fail on
an argument is refused before anything is sent, identically on every bus: Redis scripts do not
roll back, and a command failing in the middle of one would leave the earlier writes applied.
Import them from :mod:`dd_queue.bus`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from dd_queue.bus._values import check_fields, check_key, check_maxlen, check_stream_id, ttl_ms
from dd_queue.bus.types import Entry
from dd_queue.errors import InvalidArgument
from dd_queue.keys import hash_tag


def _names(
    field: str, noun: str, values: Sequence[str], check: Callable[[str, str], object]
) -> tuple[str, ...]:
    """``values`` as a tuple, each passing ``check`` (e.g. ``check_key``), named in errors as
    ``<op> <noun>`` (``field`` is ``<op>.<field>``).

    Raises:
        InvalidArgument: One string instead of a sequence, or a value ``check`` refuses.
    """
    if isinstance(values, str):
        raise InvalidArgument(f"{field} must be a sequence of {noun}s, not one string")
    out = tuple(values)
    what = f"{field.partition('.')[0]} {noun}"
    for value in out:
        check(what, value)
    return out


@dataclass(frozen=True, slots=True)
class SetOp:
    """Set a string key (``SET key value [PX ttl]``); ``ttl_s`` None keeps it forever.

    Raises:
        InvalidArgument: ``key`` is empty, ``value`` is not bytes, ``ttl_s`` is not > 0.
    """

    key: str
    value: bytes
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        check_key("SetOp.key", self.key)
        if not isinstance(self.value, bytes | bytearray | memoryview):
            raise InvalidArgument(f"SetOp.value must be bytes, got {type(self.value).__name__}")
        if self.ttl_s is not None:
            ttl_ms(self.ttl_s)


@dataclass(frozen=True, slots=True)
class AppendOp:
    """Append one entry to a stream, trimming it to about ``maxlen`` entries (``MAXLEN ~``:
    Redis trims whole nodes only, so at least ``maxlen`` stay).

    Raises:
        InvalidArgument: ``stream`` is empty, ``fields`` is empty or not ``str → bytes``,
            ``maxlen`` is not None or >= 1.
    """

    stream: str
    fields: Mapping[str, bytes]
    maxlen: int | None = None

    def __post_init__(self) -> None:
        check_key("AppendOp.stream", self.stream)
        object.__setattr__(self, "fields", check_fields("AppendOp.fields", self.fields))
        check_maxlen("AppendOp.maxlen", self.maxlen)


@dataclass(frozen=True, slots=True)
class AckOp:
    """Acknowledge entries of a group (removes them from its pending list).

    Raises:
        InvalidArgument: ``stream`` or ``group`` is empty, an id is not ``"<ms>-<seq>"``.
    """

    stream: str
    group: str
    ids: tuple[str, ...]

    def __post_init__(self) -> None:
        check_key("AckOp.stream", self.stream)
        check_key("AckOp.group", self.group)
        object.__setattr__(self, "ids", _names("AckOp.ids", "id", self.ids, check_stream_id))


@dataclass(frozen=True, slots=True)
class DeleteOp:
    """Delete keys (``UNLINK``); pass ``BlobRef.chunk_keys()`` to drop a blob.

    Raises:
        InvalidArgument: A key is empty.
    """

    keys: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", _names("DeleteOp.keys", "key", self.keys, check_key))


@dataclass(frozen=True, slots=True)
class DeadLetterOp:
    """Move a pending entry to a dead-letter stream and ack it, inside a fenced commit.

    The one way to settle a bad entry: a stale lease holder's commit is refused, so it can
    neither ack nor dead-letter entries after a takeover. The dead-letter entry carries the
    original fields plus ``ddq.dlq.reason``, ``ddq.dlq.stream``, ``ddq.dlq.id`` and
    ``ddq.dlq.group``; its id is reported in ``CommitResult.entry_ids`` and the ack in
    ``CommitResult.acked``.

    Attributes:
        entry: The entry, as read through ``group``.
        group: The group that holds it pending.
        dlq: Dead-letter stream; shares the entry stream's hash tag (``keys.dlq(fragment)``).
        reason: Why (e.g. ``ops.rejection_reason(error)``).
        maxlen: Trim the dead-letter stream to about this many entries.

    Raises:
        InvalidArgument: Empty ``group``, ``dlq`` or ``reason``, a malformed entry id or
            ``maxlen``.
    """

    entry: Entry
    group: str
    dlq: str
    reason: str
    maxlen: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.entry, Entry):
            raise InvalidArgument(f"DeadLetterOp.entry must be an Entry, got {self.entry!r}")
        check_key("DeadLetterOp.entry.stream", self.entry.stream)
        check_stream_id("DeadLetterOp.entry.id", self.entry.id)
        check_key("DeadLetterOp.group", self.group)
        check_key("DeadLetterOp.dlq", self.dlq)
        if not isinstance(self.reason, str) or not self.reason:
            raise InvalidArgument("DeadLetterOp.reason must be a non-empty string")
        check_maxlen("DeadLetterOp.maxlen", self.maxlen)

    def expand(self) -> tuple[AppendOp, AckOp]:
        """The same move as an append to the dead-letter stream followed by the ack."""
        fields = {
            **self.entry.fields,
            "ddq.dlq.reason": self.reason.encode(),
            "ddq.dlq.stream": self.entry.stream.encode(),
            "ddq.dlq.id": self.entry.id.encode(),
            "ddq.dlq.group": self.group.encode(),
        }
        return (
            AppendOp(self.dlq, fields, self.maxlen),
            AckOp(self.entry.stream, self.group, (self.entry.id,)),
        )


CommitOp = SetOp | AppendOp | AckOp | DeleteOp | DeadLetterOp
"""One write of a fenced commit; a commit applies all of them or none."""

PrimitiveOp = SetOp | AppendOp | AckOp | DeleteOp
"""What the buses execute: a ``DeadLetterOp`` becomes an ``AppendOp`` and an ``AckOp``."""


def primitive_ops(ops: Sequence[CommitOp]) -> list[PrimitiveOp]:
    """``ops`` with every ``DeadLetterOp`` expanded, in order.

    Raises:
        InvalidArgument: An element is not a commit op.
    """
    out: list[PrimitiveOp] = []
    for op in ops:
        if isinstance(op, DeadLetterOp):
            out += op.expand()
        elif isinstance(op, SetOp | AppendOp | AckOp | DeleteOp):
            out.append(op)
        else:
            raise InvalidArgument(f"not a commit op: {op!r}")
    return out


def commit_keys(op: CommitOp) -> tuple[str, ...]:
    """Every key an op writes."""
    if isinstance(op, SetOp):
        return (op.key,)
    if isinstance(op, AppendOp | AckOp):
        return (op.stream,)
    if isinstance(op, DeadLetterOp):
        return (op.dlq, op.entry.stream)
    return op.keys


def check_same_slot(anchor: str, keys: Sequence[str]) -> None:
    """Refuse keys outside ``anchor``'s hash tag (one script must stay on one Cluster slot).

    An anchor without a tag (ad-hoc keys on a single node) is not checked.

    Raises:
        InvalidArgument: A key carries another hash tag than ``anchor``.
    """
    tag = hash_tag(anchor)
    if tag is None:
        return
    for key in keys:
        if hash_tag(key) != tag:
            raise InvalidArgument(
                f"{key!r} is outside hash tag {{{tag}}} of {anchor!r}; a fenced commit may "
                "only touch keys of one fragment (use dd_queue.keys)"
            )


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a fenced commit did.

    Attributes:
        entry_ids: Ids of the appended entries, in the order of the ``AppendOp`` and
            ``DeadLetterOp`` ops.
        acked: Entries removed from pending lists (already-acked ids do not count).
        replayed: True when this commit id had already run under the same lease (its reply was
            lost and the call was retried): nothing was applied again, and ``entry_ids`` and
            ``acked`` are those of the first run.
    """

    entry_ids: tuple[str, ...]
    acked: int
    replayed: bool = False


def encode_commit_result(result: CommitResult, lease_value: str) -> bytes:
    """Marker value remembering a commit: ``<acked>\\n<id> <id> ...\\n<lease value>`` (the same
    layout the Redis script writes)."""
    return f"{result.acked}\n{' '.join(result.entry_ids)}\n{lease_value}".encode()


def decode_commit_marker(raw: bytes) -> tuple[CommitResult, str] | None:
    """``(result, lease value)`` of a marker, or None if it is not one."""
    acked, sep1, rest = raw.decode(errors="replace").partition("\n")
    ids, sep2, lease_value = rest.partition("\n")
    if not (sep1 and sep2 and acked.isdecimal()):
        return None
    return CommitResult(tuple(ids.split()), int(acked), replayed=True), lease_value


__all__ = [
    "AckOp",
    "AppendOp",
    "CommitOp",
    "CommitResult",
    "DeadLetterOp",
    "DeleteOp",
    "PrimitiveOp",
    "SetOp",
    "check_same_slot",
    "commit_keys",
    "decode_commit_marker",
    "encode_commit_result",
    "primitive_ops",
]
