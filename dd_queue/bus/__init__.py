"""The bus: every process talks to every other only through it (Redis, or its in-memory twin).

``Bus`` is the protocol; ``RedisBus`` and ``MemoryBus`` implement it with the same semantics;
``ops`` holds the domain helpers written once on top of it.
"""

from dd_queue.bus.base import Bus
from dd_queue.bus.memory import MemoryBus
from dd_queue.bus.redis_streams import RedisBus, RedisOptions
from dd_queue.bus.types import (
    DEFAULT_CHUNK_BYTES,
    AckOp,
    AppendOp,
    BlobData,
    BlobRef,
    CommitOp,
    CommitResult,
    DeleteOp,
    Entry,
    HeartbeatInfo,
    Lease,
    PendingEntry,
    PendingSummary,
    Reclaimed,
    SetOp,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "AckOp",
    "AppendOp",
    "BlobData",
    "BlobRef",
    "Bus",
    "CommitOp",
    "CommitResult",
    "DeleteOp",
    "Entry",
    "HeartbeatInfo",
    "Lease",
    "MemoryBus",
    "PendingEntry",
    "PendingSummary",
    "Reclaimed",
    "RedisBus",
    "RedisOptions",
    "SetOp",
]
