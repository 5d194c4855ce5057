"""Plain values that cross the ``Bus`` interface: entries, pending info, leases, blob refs, ops.

Everything here is a frozen dataclass (or a named tuple) of bytes, strings and numbers, identical
for every bus implementation, plus the bus's limits. Stream field values are ``bytes``: the bus
never interprets them. The argument checks live in ``_values`` (``parse_stream_id`` is re-exported
here for readers of stream ids), the blob limits' checks in ``_chunks``, the commit ops in
``commit_ops``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from dd_queue.bus._values import parse_stream_id
from dd_queue.errors import CorruptPayload
from dd_queue.keys import blob_chunk_key

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

COMMIT_MARKER_TTL_S = 600.0
"""How long a commit remembers that it ran, so that a retry of it, after its reply was lost,
replays the first result instead of running again (seconds; far longer than any retry window of
``RedisOptions.unavailable_after_s``)."""


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
class MemoryInfo:
    """The server's memory (``INFO memory``).

    Attributes:
        used_bytes: ``used_memory``.
        max_bytes: ``maxmemory``; 0 when the server has no limit.
    """

    used_bytes: int
    max_bytes: int


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


__all__ = [
    "COMMIT_MARKER_TTL_S",
    "DEFAULT_CHUNK_BYTES",
    "MAX_BLOB_BYTES",
    "MAX_BLOB_CHUNKS",
    "BlobData",
    "BlobRef",
    "Buffer",
    "Entry",
    "HeartbeatInfo",
    "Lease",
    "MemoryInfo",
    "PendingEntry",
    "PendingSummary",
    "Reclaimed",
    "parse_stream_id",
]
