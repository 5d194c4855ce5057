"""The ``Bus`` protocol: the low-level operations every process uses to talk through Redis.

Two implementations keep identical semantics and are held to them by one contract suite
(``tests/integration/test_bus_contract.py``): :class:`~dd_queue.bus.memory.MemoryBus` (in
process, injected clock) and :class:`~dd_queue.bus.redis_streams.RedisBus` (redis-py).

The bus is payload-agnostic: stream fields are bytes, blobs are bytes. Key names come from
:mod:`dd_queue.keys` (``bus.keys``); the bus builds none itself except the chunk and fence keys
that :mod:`dd_queue.keys` derives from a blob or lease key.

Delivery is at-least-once. An entry read through a group stays pending until acked; a consumer
that dies leaves it there for :meth:`Bus.reclaim`. Ack only after the work the entry fed is
committed (the synchronizer acks inside its fenced commit), so a crash means a redelivery,
never a loss. On Redis, a retried append can be duplicated and a retried group read can leave
an entry pending unseen (the reply was lost): dedupe on content, and reclaim idle entries.
A retried :meth:`Bus.commit` is not applied twice: it leaves a marker and replays its first
result. Bad entries are dead-lettered inside a commit (``DeadLetterOp``), fenced like any write.

Arguments are checked before anything is sent; a bad one raises
:class:`~dd_queue.errors.InvalidArgument` (a ``BusError`` and a ``ValueError``) on every bus.

The methods come in sections (streams, consumer groups, plain values, blobs, leases and fenced
commits, heartbeats), in the same order in both implementations. ``remote`` and ``address``
say what a caller may otherwise have asked with ``isinstance(bus, RedisBus)``.

Time units: ``*_ms`` integer milliseconds, ``*_s`` float seconds. ``block_ms`` is wall time:
``None`` or ``0`` means "do not block"; a bus call never blocks forever.
Multi-stream group reads need all streams in one Cluster slot on a Redis Cluster (one fragment's
keys share a hash tag); on a single node any streams work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from dd_queue.bus._redis_conn import BusAddress
from dd_queue.bus.commit_ops import CommitOp, CommitResult
from dd_queue.bus.types import (
    BlobData,
    BlobRef,
    Entry,
    HeartbeatInfo,
    Lease,
    MemoryInfo,
    PendingSummary,
    Reclaimed,
)
from dd_queue.keys import Keys


@runtime_checkable
class Bus(Protocol):
    """Streams, consumer groups, blobs, fenced leases and heartbeats of one run."""

    @property
    def keys(self) -> Keys:
        """Key builder of this bus's run."""
        ...

    @property
    def blob_chunk_bytes(self) -> int:
        """Largest single value a blob is split into, in bytes."""
        ...

    @property
    def remote(self) -> bool:
        """Whether reads cross a network (a server), so that reading ahead on a worker pays."""
        ...

    @property
    def address(self) -> BusAddress | None:
        """How another process reaches the same bus (fetch processes, children), or None:
        it cannot (an in-memory bus, or a bus over injected clients)."""
        ...

    # ── streams ───────────────────────────────────────────────────────────────────────────
    def append(
        self,
        stream: str,
        fields: Mapping[str, bytes],
        *,
        maxlen: int | None = None,
        approximate: bool = True,
    ) -> str:
        """Append an entry (``XADD``), trimming to ``maxlen`` entries (``~``: at least that many
        stay; Redis trims whole nodes only). Returns the new entry's id.

        Raises:
            InvalidArgument: ``fields`` is empty or not ``str → bytes``, ``maxlen`` < 1.
        """
        ...

    def stream_length(self, stream: str) -> int:
        """Number of entries in a stream (0 if it does not exist)."""
        ...

    def read(
        self,
        stream: str,
        *,
        after_id: str = "0-0",
        count: int = 100,
        block_ms: int | None = None,
    ) -> list[Entry]:
        """Broadcast read (``XREAD``): entries with id > ``after_id`` (``"$"``: only entries
        appended after the call). Nothing becomes pending."""
        ...

    def read_latest(self, stream: str) -> Entry | None:
        """The newest entry of a stream, or None when it is empty."""
        ...

    # ── consumer groups ───────────────────────────────────────────────────────────────────
    def ensure_group(self, stream: str, group: str) -> None:
        """Create ``group`` at id 0, creating the stream too; a no-op if it exists.

        Id 0, not ``$``: after a Redis restart without persistence, entries appended before
        the group is recreated must still be delivered.
        """
        ...

    def read_group(
        self,
        streams: str | Sequence[str],
        group: str,
        consumer: str,
        *,
        count: int = 1,
        block_ms: int | None = None,
    ) -> list[Entry]:
        """Read new entries for ``consumer`` (``XREADGROUP … >``); they become pending.

        A missing group (or stream) is created at id 0 first, so a restarted Redis is
        transparent. ``count`` applies per stream. Returns ``[]`` after ``block_ms`` with no
        entry.
        """
        ...

    def read_own_pending(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        count: int = 100,
        after_id: str = "0-0",
    ) -> list[Entry]:
        """Re-read ``consumer``'s own pending entries with id > ``after_id``
        (``XREADGROUP … <after_id>``), e.g. after a restart under a stable consumer name; page
        by passing the last id seen. Increments delivery counts. Trimmed entries come back with
        empty ``fields`` (``Entry.deleted``); ack them."""
        ...

    def ack(
        self, stream: str, group: str, ids: Sequence[str], *, delete_keys: Sequence[str] = ()
    ) -> int:
        """Acknowledge entries; returns how many were pending (already-acked ids count 0).

        ``delete_keys`` (e.g. the acked entries' blob chunk keys) are deleted in the same
        round trip, right after the ack; not atomically with it on Redis.
        """
        ...

    def reclaim(
        self, stream: str, group: str, consumer: str, *, min_idle_ms: int, count: int = 100
    ) -> Reclaimed:
        """Move up to ``count`` entries idle ``>= min_idle_ms`` to ``consumer``
        (``XAUTOCLAIM`` semantics, scanning the whole pending list). Delivery counts
        increment. Pending entries whose data was trimmed are dropped and reported."""
        ...

    def pending_summary(self, stream: str, group: str) -> PendingSummary:
        """Count of pending entries per consumer (``XPENDING`` summary). Read-only: a missing
        group or stream reads as empty and is not created."""
        ...

    # ── plain values ──────────────────────────────────────────────────────────────────────
    def get(self, key: str) -> bytes | None:
        """Value of a string key, or None if absent or expired."""
        ...

    def set(self, key: str, value: bytes, *, ttl_s: float | None = None) -> None:
        """Set a string key, with an expiry when ``ttl_s`` is given."""
        ...

    def delete(self, keys: Sequence[str]) -> int:
        """Delete keys of any type (``UNLINK``); returns how many existed."""
        ...

    # ── counts ────────────────────────────────────────────────────────────────────────────
    def add_counts(self, key: str, increments: Mapping[str, int]) -> None:
        """Add ``increments`` to the integer fields of the hash at ``key`` (one ``HINCRBY`` a
        field, pipelined): counters kept in the bus, so that whoever reads them after a restart
        reads the same totals. A connection lost mid-call is retried like any command, so a
        count may be added twice then (never lost once the call returned).

        Raises:
            InvalidArgument: A field name is empty or an increment is not an integer >= 0.
            BusError: ``key`` holds another type.
        """
        ...

    def read_counts(self, key: str) -> dict[str, int]:
        """The counters of the hash at ``key`` (``HGETALL``); ``{}`` when it does not exist."""
        ...

    def memory_info(self) -> MemoryInfo | None:
        """The server's memory use and limit (``INFO memory``); None where there is no server
        (MemoryBus) or it has no ``INFO`` (fakeredis)."""
        ...

    def shard_of(self, key: str) -> str | None:
        """The Redis Cluster master that serves ``key`` now (``host:port``); None on a single
        server or in memory (one shard)."""
        ...

    # ── blobs ─────────────────────────────────────────────────────────────────────────────
    def put_blob(self, key: str, data: BlobData, *, ttl_s: float | None) -> BlobRef:
        """Store a payload under ``key`` in chunks of ≤ ``blob_chunk_bytes``, each with expiry
        ``ttl_s`` (None: no expiry, e.g. blobs a committed state references; they must then be
        deleted explicitly, by the commit that stops referencing them). ``data`` is one buffer
        (bytes, memoryview, numpy array) or a list/tuple of buffers; buffers are not joined into
        one copy.

        A key that names a fencing token (``keys.global_blob`` / ``keys.momentum_blob``) is
        written only where free (``SET NX``): the same bytes again are fine (a retry), other
        bytes raise ``LeaseLost`` and nothing is overwritten.

        Raises:
            LeaseLost: A token-named key already holds another payload.
            InvalidArgument: Bad ``ttl_s``, or over ``MAX_BLOB_BYTES`` / ``MAX_BLOB_CHUNKS``.
        """
        ...

    def put_blobs(
        self, blobs: Sequence[tuple[str, BlobData]], *, ttl_s: float | None
    ) -> list[BlobRef]:
        """``put_blob`` for each ``(key, data)``, in one round trip where the backend allows
        (Redis: one pipeline, two when a token-named blob has several chunks). Every key and
        size is checked before anything is written; a ``LeaseLost`` may leave the other blobs
        written (staged blobs of a dead incarnation, as after a crash before its commit).

        Raises:
            As ``put_blob``.
        """
        ...

    def append_with_blob(
        self,
        stream: str,
        fields: Mapping[str, bytes],
        *,
        blob_key: str,
        data: BlobData,
        ttl_s: float,
        ref_field: str = "blob",
        maxlen: int | None = None,
        approximate: bool = True,
        counts: tuple[str, Mapping[str, int]] | None = None,
    ) -> tuple[str, BlobRef]:
        """Store a blob and append an entry referencing it (field ``ref_field`` holds
        ``BlobRef.to_bytes()``), in one round trip where the backend allows.

        ``counts`` (``(key, increments)``, as :meth:`add_counts` takes them) rise in the same
        round trip, just before the entry: a crash between the two can leave counts without
        their entry, never an entry without its counts.

        On Redis this is one non-transactional pipeline (the measured fastest write path), so
        an entry can outlive its blob (TTL, or a crash between the two): readers get
        :class:`~dd_queue.errors.BlobMissing` and treat the contribution as lost.
        Returns ``(entry id, blob ref)``.
        """
        ...

    def get_blob(self, ref: BlobRef) -> bytes:
        """Reassemble a blob.

        The reference is checked first (``_chunks.check_blob_ref``): its key must be a blob key
        of this run and its chunk count must follow from its size and ``blob_chunk_bytes``.

        Raises:
            BlobMissing: A chunk is gone.
            CorruptPayload: The reference fails those checks, or the chunk sizes do not match.
        """
        ...

    def delete_blobs(self, refs: Sequence[BlobRef]) -> int:
        """Delete every chunk of the blobs; returns how many chunk keys existed.

        Raises:
            CorruptPayload: A reference fails ``_chunks.check_blob_ref`` (nothing is deleted).
        """
        ...

    # ── leases and fenced commits ─────────────────────────────────────────────────────────
    def acquire_lease(self, name: str, owner: str, *, ttl_s: float) -> Lease | None:
        """Take lease ``name`` for ``ttl_s`` if it is free or expired, or already ``owner``'s
        (a re-acquire fences the owner's earlier incarnation). Each success draws a new,
        strictly larger fencing token (at least the server clock in microseconds, so also
        after a Redis restart) and a new random nonce. Returns None while someone else holds
        it.

        Raises:
            BusError: The lease key holds something that is not a lease value.
        """
        ...

    def renew_lease(self, lease: Lease, *, ttl_s: float) -> Lease:
        """Extend a held lease by ``ttl_s`` from now.

        Raises:
            LeaseLost: The lease expired or another owner took it.
        """
        ...

    def release_lease(self, lease: Lease) -> bool:
        """Give a lease up if it is still held under this token; returns whether it was."""
        ...

    def commit(self, lease: Lease, ops: Sequence[CommitOp], *, commit_id: str) -> CommitResult:
        """Apply ``ops`` atomically, only if ``lease`` is still current.

        Everything is validated before the first write (op arguments when the ops were built,
        then lease value and key types), so a refused commit applies nothing. All keys must
        share the lease key's hash tag (one fragment) so the commit stays one script on a
        Redis Cluster.

        Args:
            lease: The lease the commit is fenced by.
            ops: The writes; ``DeadLetterOp`` settles a bad entry under the fence.
            commit_id: Names this commit, unique per lease for distinct commits (the
                synchronizer uses ``f"{fragment}:{version}"``); see
                :func:`dd_queue.keys.check_commit_id`. The commit leaves a marker
                ``<lease key>:commit:<commit_id>`` for ``COMMIT_MARKER_TTL_S``; running the
                same id again under the same lease (a retry after a lost reply) applies nothing
                and returns the first result with ``replayed=True``, even if the lease has
                expired since. Under another lease (a new acquisition) the id runs afresh.

        Raises:
            LeaseLost: Another owner holds the lease or it expired; nothing was applied.
            BusError: An op targets a key of the wrong type; nothing was applied.
            InvalidArgument: A key is outside the lease's hash tag.
            ConfigError: ``commit_id`` is not a valid id.
        """
        ...

    # ── heartbeats ────────────────────────────────────────────────────────────────────────
    def server_time_s(self) -> float:
        """The bus's clock in seconds (Redis ``TIME``; the injected clock for MemoryBus).

        Heartbeat ages use it. ``Lease.expires_at_s`` does not: on Redis it is on the local
        clock given to the bus (see :class:`~dd_queue.bus.types.Lease`).
        """
        ...

    def heartbeat(self, member: str, payload: bytes, *, ttl_s: float) -> None:
        """Record that ``member`` is alive, stamped with the bus's clock; it disappears from
        :meth:`heartbeats` ``ttl_s`` after its last beat. On Redis this uses its own
        connection, so big transfers never delay it."""
        ...

    def heartbeats(self) -> dict[str, HeartbeatInfo]:
        """Every live member → ``(payload, age_s)``, ages measured on the bus's one clock.
        Expired members are removed."""
        ...

    def remove_heartbeat(self, member: str) -> bool:
        """Remove a member (clean shutdown); returns whether it was present."""
        ...

    # ── closing ───────────────────────────────────────────────────────────────────────────
    def close(self) -> None:
        """Release connections; the bus must not be used afterwards.

        A read blocked in another thread stops promptly with ``BusError("bus closed")`` (on
        Redis its connection is closed under it and not reopened), and so does any later call.
        """
        ...


__all__ = ["Bus"]
