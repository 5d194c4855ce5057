"""The bus: every process talks to every other only through it (Redis, or its in-memory twin).

``Bus`` is the protocol; ``RedisBus`` and ``MemoryBus`` implement it with the same semantics,
each as one class in one module (``redis_streams``, ``memory``); ``ops`` holds the domain helpers
written once on top of it. ``InvalidArgument`` lives in ``dd_queue.errors`` and is re-exported.
"""

from dd_queue.bus._values import stream_id_ms
from dd_queue.bus.base import Bus
from dd_queue.bus.commit_ops import (
    AckOp,
    AppendOp,
    CommitOp,
    CommitResult,
    DeadLetterOp,
    DeleteOp,
    SetOp,
)
from dd_queue.bus.memory import MemoryBus
from dd_queue.bus.redis_streams import RedisBus, RedisOptions
from dd_queue.bus.types import (
    COMMIT_MARKER_TTL_S,
    DEFAULT_CHUNK_BYTES,
    MAX_BLOB_BYTES,
    MAX_BLOB_CHUNKS,
    BlobData,
    BlobRef,
    Entry,
    HeartbeatInfo,
    Lease,
    MemoryInfo,
    PendingEntry,
    PendingSummary,
    Reclaimed,
)
from dd_queue.errors import InvalidArgument

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
    "MemoryInfo",
    "PendingEntry",
    "PendingSummary",
    "Reclaimed",
    "RedisBus",
    "RedisOptions",
    "SetOp",
    "stream_id_ms",
]
