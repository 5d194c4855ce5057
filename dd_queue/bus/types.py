"""Plain values that cross the ``Bus`` interface: entries, pending info, leases, blob refs, ops.

Everything here is a frozen dataclass (or a named tuple) of bytes, strings and numbers, identical
for every bus implementation. Stream field values are ``bytes``: the bus never interprets them.
``Entry`` and the argument checks live in ``_values``, the commit ops in ``commit_ops``; both are
re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from dd_queue.bus._values import (
    Entry,
    InvalidArgument,
    dead_letter_fields,
    format_stream_id,
    parse_stream_id,
    ttl_ms,
)
from dd_queue.bus.commit_ops import (
    COMMIT_MARKER_TTL_S,
    AckOp,
    AppendOp,
    CommitOp,
    CommitResult,
    DeadLetterOp,
    DeleteOp,
    SetOp,
    check_same_slot,
    commit_keys,
)
from dd_queue.errors import CorruptPayload
from dd_queue.keys import Keys, blob_chunk_key

Buffer = bytes | bytearray | memoryview
"""One contiguous piece of payload."""

BlobData = Buffer | Sequence[Buffer]
"""A payload: one buffer, or several that are written back to back without being joined."""

MiB = 1024 * 1024
DEFAULT_CHUNK_BYTES = 16 * MiB
"""Largest single Redis value a blob is split into (16 MiB; research/redis-pipeline.md §A.4)."""

MAX_BLOB_BYTES = 64 * 1024 * MiB
"""Largest blob a bus writes or reads (64 GiB): a reference claiming more is corrupt."""

MAX_BLOB_CHUNKS = 1 << 16
"""Most chunk keys one blob may occupy (bounds the work a forged reference can cause)."""


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
    """A lease on a name, fenced by a token and a nonce.

    Every fenced operation compares the stored value ``<token>:<nonce>:<owner>`` with this
    lease's, so an earlier incarnation of the same owner (same name, older acquisition) is
    refused even if a token were ever handed out twice.

    Attributes:
        name: The lease key.
        owner: Who holds it.
        token: Fencing token, strictly larger than every earlier holder's: at least the server
            clock in microseconds at acquisition, and above the last token handed out, so it
            keeps growing across a Redis restart that lost the counter.
        expires_at_s: When it expires, estimated on the *local* clock of this bus (the
            ``clock`` given to it: monotonic seconds by default), from the time the request
            was *sent*, so the real expiry is never earlier. Compare it with that clock's
            ``now()``, never with ``Bus.server_time_s()`` (Redis ``TIME``, another clock; on
            MemoryBus both are the injected clock). Stop acting under the lease before this.
        nonce: Random per acquisition; part of the stored lease value.
    """

    name: str
    owner: str
    token: int
    expires_at_s: float
    nonce: str

    @property
    def value(self) -> str:
        """The stored lease value, ``<token>:<nonce>:<owner>``."""
        return f"{self.token}:{self.nonce}:{self.owner}"


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


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """Chunks a blob of ``nbytes`` occupies: ``max(1, ceil(nbytes / chunk_bytes))``."""
    return max(1, -(-nbytes // chunk_bytes))


def check_blob_ref(ref: BlobRef, keys: Keys, chunk_bytes: int) -> BlobRef:
    """Refuse a reference (e.g. taken from a stream entry) before reading or deleting by it.

    Raises:
        CorruptPayload: The key is not a blob key of this run (``Keys.is_blob_key``), the size
            is over :data:`MAX_BLOB_BYTES`, or the chunk count does not follow from the size
            and ``chunk_bytes`` (every process of a run must use the same ``blob_chunk_bytes``).
    """
    if not isinstance(ref.key, str) or not keys.is_blob_key(ref.key):
        raise CorruptPayload(
            f"blob reference names {str(ref.key)[:120]!r}, not a blob key of run "
            f"{keys.run_id!r}; refusing to read or delete it"
        )
    if not 0 <= ref.nbytes <= MAX_BLOB_BYTES:
        raise CorruptPayload(f"blob {ref.key!r}: size {ref.nbytes} is over {MAX_BLOB_BYTES}")
    expected = chunk_count(ref.nbytes, chunk_bytes)
    if ref.n_chunks != expected or expected > MAX_BLOB_CHUNKS:
        raise CorruptPayload(
            f"blob {ref.key!r}: {ref.n_chunks} chunks for {ref.nbytes} bytes, expected "
            f"{expected} of {chunk_bytes} bytes (at most {MAX_BLOB_CHUNKS}); a forged reference, "
            "or a writer with another blob_chunk_bytes"
        )
    return ref


def check_blob_size(key: str, nbytes: int, n_chunks: int) -> None:
    """Refuse to write a blob that readers would refuse (:func:`check_blob_ref` limits).

    Raises:
        InvalidArgument: More than :data:`MAX_BLOB_BYTES` or :data:`MAX_BLOB_CHUNKS`.
    """
    if nbytes > MAX_BLOB_BYTES or n_chunks > MAX_BLOB_CHUNKS:
        raise InvalidArgument(
            f"blob {key!r} of {nbytes} bytes in {n_chunks} chunks is over the limit of "
            f"{MAX_BLOB_BYTES} bytes / {MAX_BLOB_CHUNKS} chunks; raise blob_chunk_bytes"
        )


__all__ = [
    "COMMIT_MARKER_TTL_S",
    "DEFAULT_CHUNK_BYTES",
    "MAX_BLOB_BYTES",
    "MAX_BLOB_CHUNKS",
    "AckOp",
    "AppendOp",
    "BlobData",
    "BlobRef",
    "Buffer",
    "CommitOp",
    "CommitResult",
    "DeadLetterOp",
    "DeleteOp",
    "Entry",
    "HeartbeatInfo",
    "InvalidArgument",
    "Lease",
    "PendingEntry",
    "PendingSummary",
    "Reclaimed",
    "SetOp",
    "check_blob_ref",
    "check_blob_size",
    "check_same_slot",
    "chunk_count",
    "commit_keys",
    "dead_letter_fields",
    "format_stream_id",
    "parse_stream_id",
    "ttl_ms",
]
