"""The bus: every process talks to every other only through it (Redis, or its in-memory twin).

``Bus`` is the protocol; ``RedisBus`` and ``MemoryBus`` implement it with the same semantics;
``ops`` holds the domain helpers written once on top of it.
"""

from dd_queue.bus.base import Bus
from dd_queue.bus.memory import MemoryBus
from dd_queue.bus.redis_streams import RedisBus, RedisOptions
from dd_queue.bus.types import (
    COMMIT_MARKER_TTL_S,
    DEFAULT_CHUNK_BYTES,
    MAX_BLOB_BYTES,
    MAX_BLOB_CHUNKS,
    AckOp,
    AppendOp,
    BlobData,
    BlobRef,
    CommitOp,
    CommitResult,
    DeadLetterOp,
    DeleteOp,
    Entry,
    HeartbeatInfo,
    InvalidArgument,
    Lease,
    PendingEntry,
    PendingSummary,
    Reclaimed,
    SetOp,
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
    "Bus",
    "CommitOp",
    "CommitResult",
    "DeadLetterOp",
    "DeleteOp",
    "Entry",
    "HeartbeatInfo",
    "InvalidArgument",
    "Lease",
    "MemoryBus",
    "PendingEntry",
    "PendingSummary",
    "Reclaimed",
    "RedisBus",
    "RedisOptions",
    "SetOp",
]
