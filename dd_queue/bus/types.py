"""Plain values that cross the ``Bus`` interface: entries, pending info, leases, blob refs, ops.

Everything here is a frozen dataclass (or a named tuple) of bytes, strings and numbers, identical
for every bus implementation. Stream field values are ``bytes``: the bus never interprets them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from dd_queue.errors import CorruptPayload
from dd_queue.keys import blob_chunk_key, hash_tag

Buffer = bytes | bytearray | memoryview
"""One contiguous piece of payload."""

BlobData = Buffer | Sequence[Buffer]
"""A payload: one buffer, or several that are written back to back without being joined."""

MiB = 1024 * 1024
DEFAULT_CHUNK_BYTES = 16 * MiB
"""Largest single Redis value a blob is split into (16 MiB; research/redis-pipeline.md §A.4)."""


def ttl_ms(ttl_s: float) -> int:
    """A positive expiry in seconds → whole milliseconds (at least 1), as ``PX`` takes it.

    Raises:
        ValueError: ``ttl_s`` is not > 0 (a key without expiry is asked for with ``None``).
    """
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    return max(1, round(ttl_s * 1000))


def parse_stream_id(stream_id: str) -> tuple[int, int]:
    """``"<ms>-<seq>"`` → ``(ms, seq)`` for ordering; ``"<ms>"`` means ``(ms, 0)``."""
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def format_stream_id(parsed: tuple[int, int]) -> str:
    """``(ms, seq)`` → ``"<ms>-<seq>"``."""
    return f"{parsed[0]}-{parsed[1]}"


@dataclass(frozen=True, slots=True)
class Entry:
    """One stream entry as a reader sees it.

    Attributes:
        stream: Key of the stream it came from.
        id: Stream id, ``"<ms>-<seq>"``.
        fields: Field name → raw bytes. Empty when the entry was trimmed away while it was still
            pending (a re-read of the pending list shows such entries; ack them).
        delivery_count: How often the group delivered it (1 on first delivery); 0 for reads
            outside a group.
    """

    stream: str
    id: str
    fields: Mapping[str, bytes]
    delivery_count: int = 0

    @property
    def deleted(self) -> bool:
        """True for a pending entry whose data was trimmed (a real entry has ≥ 1 field)."""
        return not self.fields


def dead_letter_fields(entry: Entry, group: str, reason: str) -> dict[str, bytes]:
    """Fields a dead-letter entry carries besides the original ones (``ddq.dlq.*``)."""
    return {
        "ddq.dlq.reason": reason.encode(),
        "ddq.dlq.stream": entry.stream.encode(),
        "ddq.dlq.id": entry.id.encode(),
        "ddq.dlq.group": group.encode(),
    }


@dataclass(frozen=True, slots=True)
class PendingEntry:
    """One entry of a group's pending list (delivered, not yet acked).

    Attributes:
        id: Stream id.
        consumer: Consumer that holds it.
        idle_ms: Milliseconds since it was last delivered to that consumer.
        delivery_count: Deliveries so far (reset to 1 by an AOF restart of Redis).
    """

    id: str
    consumer: str
    idle_ms: int
    delivery_count: int


@dataclass(frozen=True, slots=True)
class PendingSummary:
    """Size of a group's pending list.

    Attributes:
        count: Entries delivered and not acked (including trimmed ones not yet reclaimed).
        min_id: Smallest pending id, or None when nothing is pending.
        max_id: Largest pending id, or None.
        consumers: Consumer → number of entries it holds (only consumers holding some).
    """

    count: int
    min_id: str | None
    max_id: str | None
    consumers: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """Result of reclaiming idle pending entries (``XAUTOCLAIM`` semantics).

    Attributes:
        entries: Entries now owned by the claiming consumer, delivery counts incremented.
        deleted_ids: Pending ids whose data was trimmed; they were dropped from the pending list.
    """

    entries: list[Entry]
    deleted_ids: list[str]


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease on a name, fenced by a token that only grows while the key space lives.

    Attributes:
        name: The lease key.
        owner: Who holds it.
        token: Fencing token, strictly larger than every earlier holder's (a Redis restart
            without persistence starts the counter again; stale tokens still fail, because the
            check is equality with the current holder's token).
        expires_at_s: When it expires, on the bus's clock (monotonic seconds), estimated from
            the time the request was *sent*, so the real expiry is never earlier. Stop acting
            under the lease before this.
    """

    name: str
    owner: str
    token: int
    expires_at_s: float


class HeartbeatInfo(NamedTuple):
    """Last heartbeat of one member: ``(payload, age_s)``; age is measured on the bus's clock."""

    payload: bytes
    age_s: float


_REF_MAGIC = "ddqblob1"


@dataclass(frozen=True, slots=True)
class BlobRef:
    """Where a (possibly chunked) payload lives: its key, chunk count and total size.

    Chunk 0 is stored at ``key``, chunk ``i`` at :func:`dd_queue.keys.blob_chunk_key`.

    Attributes:
        key: The blob key.
        n_chunks: Number of chunk keys (``>= 1``).
        nbytes: Total payload size in bytes.
    """

    key: str
    n_chunks: int
    nbytes: int

    def chunk_keys(self) -> tuple[str, ...]:
        """Every key this blob occupies, chunk 0 first."""
        return tuple(blob_chunk_key(self.key, i) for i in range(self.n_chunks))

    def to_bytes(self) -> bytes:
        """Wire form for a stream field: ``b"ddqblob1 <n_chunks> <nbytes> <key>"``."""
        return f"{_REF_MAGIC} {self.n_chunks} {self.nbytes} {self.key}".encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> BlobRef:
        """Parse :meth:`to_bytes` output.

        Raises:
            CorruptPayload: ``raw`` is not a blob reference.
        """
        try:
            magic, n_chunks, nbytes, key = raw.decode().split(" ", 3)
            ref = cls(key=key, n_chunks=int(n_chunks), nbytes=int(nbytes))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CorruptPayload(f"not a blob reference: {raw[:80]!r}") from exc
        if magic != _REF_MAGIC or ref.n_chunks < 1 or ref.nbytes < 0 or not key:
            raise CorruptPayload(f"not a blob reference: {raw[:80]!r}")
        return ref


# ── operations of a fenced commit ──────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class SetOp:
    """Set a string key (``SET key value [PX ttl]``)."""

    key: str
    value: bytes
    ttl_s: float | None = None


@dataclass(frozen=True, slots=True)
class AppendOp:
    """Append one entry to a stream, trimming it to about ``maxlen`` entries."""

    stream: str
    fields: Mapping[str, bytes]
    maxlen: int | None = None


@dataclass(frozen=True, slots=True)
class AckOp:
    """Acknowledge entries of a group (removes them from its pending list)."""

    stream: str
    group: str
    ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DeleteOp:
    """Delete keys (``UNLINK``); pass ``BlobRef.chunk_keys()`` to drop a blob."""

    keys: tuple[str, ...]


CommitOp = SetOp | AppendOp | AckOp | DeleteOp
"""One write of a fenced commit; a commit applies all of them or none."""


def commit_keys(op: CommitOp) -> tuple[str, ...]:
    """Every key an op writes."""
    if isinstance(op, SetOp):
        return (op.key,)
    if isinstance(op, AppendOp | AckOp):
        return (op.stream,)
    return op.keys


def check_same_slot(anchor: str, keys: Sequence[str]) -> None:
    """Refuse keys outside ``anchor``'s hash tag (one script must stay on one Cluster slot).

    An anchor without a tag (ad-hoc keys on a single node) is not checked.

    Raises:
        ValueError: A key carries another hash tag than ``anchor``.
    """
    tag = hash_tag(anchor)
    if tag is None:
        return
    for key in keys:
        if hash_tag(key) != tag:
            raise ValueError(
                f"{key!r} is outside hash tag {{{tag}}} of {anchor!r}; a fenced commit or "
                "dead-letter move may only touch keys of one fragment (use dd_queue.keys)"
            )


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a fenced commit did.

    Attributes:
        entry_ids: Ids of the appended entries, in the order of the ``AppendOp`` s.
        acked: Entries removed from pending lists (already-acked ids do not count).
    """

    entry_ids: tuple[str, ...]
    acked: int


__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "AckOp",
    "AppendOp",
    "BlobData",
    "BlobRef",
    "Buffer",
    "CommitOp",
    "CommitResult",
    "DeleteOp",
    "Entry",
    "HeartbeatInfo",
    "Lease",
    "PendingEntry",
    "PendingSummary",
    "Reclaimed",
    "SetOp",
    "check_same_slot",
    "commit_keys",
    "dead_letter_fields",
    "format_stream_id",
    "parse_stream_id",
    "ttl_ms",
]
