"""``RedisBus``: the ``Bus`` protocol on Redis Streams through redis-py (Redis >= 7.0, Valkey).

The whole class is here, its methods in the order of the ``Bus`` protocol (streams, consumer
groups, plain values, blobs, leases and fenced commits, heartbeats), as in its twin ``MemoryBus``
(``memory.py``). Pure helpers stand apart: connections, options and the bounded retry
(``_redis_conn``), reply parsing (``_replies``), the Lua scripts (``_scripts``), argument checks
(``_values``, ``commit_ops``) and chunking (``_chunks``).

Facts that shape it (measured in research/redis-pipeline.md):

* Payloads live in their own string keys (``SET … PX``), referenced from small stream entries;
  a contribution is written as one non-transactional pipeline (chunks first, then the XADD),
  the fastest measured write path. A reference can outlive its blob (TTL, writer crash between
  the two writes, a Redis restart); readers then get ``BlobMissing`` and count the contribution
  as lost.
* Separate clients for blocking reads, payloads, small commands and heartbeats (see
  ``_redis_conn``), each with a socket timeout above the longest ``BLOCK``. Blob chunks go
  through the payload client, heartbeats through their own, all else through the control client.
* A restart without persistence drops streams and groups: commands that act for a consumer
  (reading, re-reading its pending entries, reclaiming) recreate a group that hit NOGROUP at
  id 0 and retry once; read-only inspection (``pending_summary``) never creates
  anything: a missing group or stream reads as empty. Lua scripts are re-sent on NOSCRIPT by
  redis-py.
* Fenced commits, leases and heartbeats are Lua scripts (``_scripts``).
* Blobs whose key names a fencing token (``keys.names_fencing_token``: staged global fragments
  and momentum) are written only where the key is free (``SET NX``, chunk 0 first), so a stale
  holder can never overwrite what the current holder committed. A chunk that is already there
  with the same bytes is our own retried write and counts as written.
* Arguments are checked before anything is sent, with the same errors as ``MemoryBus``.
* On a Redis Cluster (``redis+cluster://``) every command names keys of one slot: each fragment's
  keys share a hash tag, pipelines are split by node, multi-key deletes are one ``UNLINK`` a key.
  A group read over streams of several slots reads every slot at once (``_fanout``); a lease
  name must carry a hash tag, so the lease, its fence and its commits stay on one slot.
"""

from __future__ import annotations

import builtins
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import redis
import redis.exceptions as rexc
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.crc import key_slot
from redis.typing import EncodableT, FieldT, KeyT, StreamIdT

from dd_queue.bus import _chunks, _replies, _scripts
from dd_queue.bus._fanout import FanOut
from dd_queue.bus._redis_conn import BusAddress, Connections, RedisOptions
from dd_queue.bus._values import (
    check_counts,
    check_fields,
    check_key,
    check_maxlen,
    check_stream_id,
    format_stream_id,
    parse_stream_id,
    ttl_ms,
)
from dd_queue.bus.commit_ops import (
    AckOp,
    AppendOp,
    CommitOp,
    CommitResult,
    PrimitiveOp,
    SetOp,
    check_same_slot,
    commit_keys,
    primitive_ops,
)
from dd_queue.bus.types import (
    COMMIT_MARKER_TTL_S,
    BlobData,
    BlobRef,
    Buffer,
    Entry,
    HeartbeatInfo,
    Lease,
    MemoryInfo,
    PendingEntry,
    PendingSummary,
    Reclaimed,
)
from dd_queue.clock import Clock, SystemClock
from dd_queue.errors import BusError, InvalidArgument, LeaseLost, NoGroup, NotReplicated
from dd_queue.keys import (
    Keys,
    blob_chunk_key,
    check_name,
    commit_marker_key,
    fence_key,
    hash_tag,
    names_fencing_token,
)

T = TypeVar("T")
log = logging.getLogger("dd_queue.bus")

_PENDING_PAGE = 100
_NODE_FAILED = (
    redis.ConnectionError,
    redis.TimeoutError,
    builtins.TimeoutError,
    rexc.MovedError,  # (and AskError, its base) the slot moved: a failover happened
    rexc.AskError,
    rexc.ClusterDownError,
    rexc.TryAgainError,
)


class RedisBus:
    """The bus on a Redis server.

    Args:
        url: ``redis://host:port/db`` of a Redis >= 7.0 or Valkey server, or
            ``redis+cluster://host:port[,host:port…]`` of a Redis (Valkey) Cluster.
        run_id: Namespace for ``keys``.
        options: Timeouts, retry bound and chunk size (defaults: :class:`RedisOptions`).
        clock: Local clock for lease expiry estimates (default: monotonic system clock).
    """

    def __init__(
        self,
        url: str,
        run_id: str,
        *,
        options: RedisOptions | None = None,
        clock: Clock | None = None,
    ) -> None:
        opts = options or RedisOptions()
        self._setup(run_id, Connections.from_url(url, opts), opts, clock)
        self._url: str | None = url

    @classmethod
    def from_clients(
        cls,
        run_id: str,
        client: redis.Redis,
        *,
        reader: redis.Redis | None = None,
        blobs: redis.Redis | None = None,
        heartbeat: redis.Redis | None = None,
        options: RedisOptions | None = None,
        clock: Clock | None = None,
    ) -> RedisBus:
        """A bus over given clients (e.g. ``fakeredis.FakeRedis``); it closes them on close.

        Args:
            run_id: Namespace for ``keys``.
            client: Client for small commands; also the default for the other roles.
            reader: Client for blocking reads.
            blobs: Client for payloads.
            heartbeat: Client for heartbeats.
            options: As for the constructor (socket options do not apply to given clients).
            clock: As for the constructor.
        """
        opts = options or RedisOptions()
        conns = Connections(
            control=client,
            reader=reader or client,
            blobs=blobs or client,
            heartbeat=heartbeat or client,
            options=opts,
            where="(injected client)",
        )
        bus = cls.__new__(cls)
        bus._setup(run_id, conns, opts, clock)
        bus._url = None
        return bus

    def _setup(
        self, run_id: str, conns: Connections, options: RedisOptions, clock: Clock | None
    ) -> None:
        self._keys = Keys(run_id)
        self._conn = conns
        self._options = options
        self._clock: Clock = clock or SystemClock()
        self._fanout: FanOut[Entry] = FanOut()
        control, beat = conns.control, conns.heartbeat
        self._acquire_script: Script = control.register_script(_scripts.ACQUIRE_LEASE)
        self._renew_script: Script = control.register_script(_scripts.RENEW_LEASE)
        self._release_script: Script = control.register_script(_scripts.RELEASE_LEASE)
        self._commit_script: Script = control.register_script(_scripts.COMMIT)
        self._beat_script: Script = beat.register_script(_scripts.HEARTBEAT)
        self._beats_script: Script = beat.register_script(_scripts.HEARTBEATS)
        self._forget_script: Script = beat.register_script(_scripts.REMOVE_HEARTBEAT)

    @property
    def keys(self) -> Keys:
        return self._keys

    @property
    def blob_chunk_bytes(self) -> int:
        return self._options.blob_chunk_bytes

    @property
    def remote(self) -> bool:
        return True  # every read crosses a network: reading ahead on a worker pays

    @property
    def address(self) -> BusAddress | None:
        return None if self._url is None else BusAddress(self._url, self.options)

    @property
    def cluster(self) -> bool:
        """The server is a Redis Cluster (keys route by slot)."""
        return self._conn.cluster

    @property
    def url(self) -> str | None:
        """The server's URL, to connect another process to it (None: injected clients)."""
        return self._url

    @property
    def options(self) -> RedisOptions:
        """The client options this bus was made with."""
        return self._options

    # ── streams ───────────────────────────────────────────────────────────────────────────
    def append(
        self,
        stream: str,
        fields: Mapping[str, bytes],
        *,
        maxlen: int | None = None,
        approximate: bool = True,
    ) -> str:
        check_key("stream", stream)
        entry = encode_fields(check_fields("append fields", fields))
        check_maxlen("append maxlen", maxlen)
        raw = self._conn.call(
            "append",
            lambda: self._conn.control.xadd(stream, entry, maxlen=maxlen, approximate=approximate),
        )
        return _replies.as_str(raw, "XADD")

    def stream_length(self, stream: str) -> int:
        return _replies.as_int(self._conn.call("xlen", lambda: self._conn.control.xlen(stream)))

    def read(
        self,
        stream: str,
        *,
        after_id: str = "0-0",
        count: int = 100,
        block_ms: int | None = None,
    ) -> list[Entry]:
        if after_id == "$":  # pin "now" once, so split BLOCKs miss nothing in between
            latest = self.read_latest(stream)
            after_id = latest.id if latest else "0-0"
        start: dict[KeyT, StreamIdT] = {stream: format_stream_id(parse_stream_id(after_id))}

        def once(block: int | None) -> list[Entry]:
            raw = self._conn.call(
                "read", lambda: self._conn.reader.xread(start, count=count, block=block)
            )
            return _replies.xread(raw, delivery_count=0)

        return self._blocking(block_ms, once)

    def _blocking(self, block_ms: int | None, once: Callable[[int | None], list[T]]) -> list[T]:
        if not block_ms:
            return once(None)
        # One BLOCK never exceeds max_block_ms, which stays below the socket timeout: a dead
        # server is then a socket error (retried, bounded), never a silent empty read.
        deadline = time.monotonic() + block_ms / 1000
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            found = once(max(1, min(remaining_ms, self._options.max_block_ms)))
            if found or remaining_ms <= self._options.max_block_ms:
                return found

    def read_latest(self, stream: str) -> Entry | None:
        raw = self._conn.call("read_latest", lambda: self._conn.control.xrevrange(stream, count=1))
        found = _replies.entries(stream, raw, 0)
        return found[0] if found else None

    # ── consumer groups ───────────────────────────────────────────────────────────────────
    def ensure_group(self, stream: str, group: str) -> None:
        def create() -> None:
            try:
                self._conn.control.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):
                    raise

        self._conn.call("ensure_group", create)

    def _with_group(self, streams: Sequence[str], group: str, what: str, fn: Callable[[], T]) -> T:
        try:
            return self._conn.call(what, fn)
        except NoGroup:
            # Redis restarted without persistence (or the stream was deleted): recreate the
            # group at id 0 so entries appended since the restart are still delivered.
            log.warning("bus.group_recreated %s on %s", group, list(streams))
            for stream in streams:
                self.ensure_group(stream, group)
            return self._conn.call(what, fn)

    def read_group(
        self,
        streams: str | Sequence[str],
        group: str,
        consumer: str,
        *,
        count: int = 1,
        block_ms: int | None = None,
    ) -> list[Entry]:
        names = [streams] if isinstance(streams, str) else list(streams)
        by_slot = self._by_slot(names)
        if len(by_slot) == 1:
            return self._read_group_once(names, group, consumer, count, block_ms)
        parts = [
            (
                (group, consumer, *slot_names),
                lambda block, n=slot_names: self._read_group_once(n, group, consumer, count, block),
            )
            for slot_names in by_slot
        ]
        return self._fanout.read(parts, block_ms)

    def _by_slot(self, names: list[str]) -> list[list[str]]:
        """``names`` grouped by Cluster slot (one group when the server is not a cluster)."""
        if not self._conn.cluster:
            return [names]
        groups: dict[int, list[str]] = {}
        for name in names:
            groups.setdefault(key_slot(name.encode()), []).append(name)
        return list(groups.values())

    def _read_group_once(
        self, names: list[str], group: str, consumer: str, count: int, block_ms: int | None
    ) -> list[Entry]:
        """One ``XREADGROUP`` over streams of one slot (split into BLOCKs of max_block_ms)."""
        wanted: dict[KeyT, StreamIdT] = dict.fromkeys(names, ">")

        def once(block: int | None) -> list[Entry]:
            raw = self._with_group(
                names,
                group,
                "read_group",
                lambda: self._conn.reader.xreadgroup(
                    group, consumer, wanted, count=count, block=block
                ),
            )
            return _replies.xread(raw, delivery_count=1)

        return self._blocking(block_ms, once)

    def read_own_pending(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        count: int = 100,
        after_id: str = "0-0",
    ) -> list[Entry]:
        start: dict[KeyT, StreamIdT] = {stream: format_stream_id(parse_stream_id(after_id))}
        raw = self._with_group(
            [stream],
            group,
            "read_own_pending",
            lambda: self._conn.control.xreadgroup(group, consumer, start, count=count),
        )
        found = _replies.xread(raw, delivery_count=0)
        counts = self._delivery_counts(stream, group, consumer, [e.id for e in found])
        return [Entry(e.stream, e.id, e.fields, counts.get(e.id, 1)) for e in found]

    def _delivery_counts(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> dict[str, int]:
        """Delivery counts of ``consumer``'s pending ``ids`` (ascending), from ranged
        ``XPENDING … <first> <last> <n> <consumer>`` calls (usually one). An id missing from
        the answer (the group vanished meanwhile) is left out; callers default to 1."""
        if not ids:
            return {}
        wanted, counts = set(ids), dict[str, int]()
        last, page = ids[-1], max(_PENDING_PAGE, len(ids))

        def fetch(first: str) -> list[PendingEntry]:
            raw = self._conn.call(
                "pending",
                lambda: self._conn.control.xpending_range(
                    stream, group, first, last, page, consumername=consumer
                ),
            )
            return _replies.pending_range(raw)

        start = ids[0]
        while True:
            try:
                rows = fetch(start)
            except NoGroup:  # the group vanished (restart) since the read: counts unknown
                return counts
            counts.update({r.id: r.delivery_count for r in rows if r.id in wanted})
            if len(rows) < page or len(counts) == len(wanted):
                return counts
            ms, seq = parse_stream_id(rows[-1].id)
            start = format_stream_id((ms, seq + 1))

    def ack(
        self, stream: str, group: str, ids: Sequence[str], *, delete_keys: Sequence[str] = ()
    ) -> int:
        for entry_id in ids:
            check_stream_id("ack id", entry_id)
        if not ids and not delete_keys:
            return 0

        def send() -> list[object]:
            with self._conn.control.pipeline(transaction=False) as pipe:
                if ids:
                    pipe.xack(stream, group, *ids)
                for key in delete_keys:  # one key per UNLINK: stays valid on a Cluster
                    pipe.unlink(key)
                return pipe.execute()

        results = self._conn.call("ack", send)
        return _replies.as_int(results[0]) if ids else 0

    def reclaim(
        self, stream: str, group: str, consumer: str, *, min_idle_ms: int, count: int = 100
    ) -> Reclaimed:
        claimed: list[Entry] = []
        deleted: list[str] = []
        cursor = "0-0"
        while len(claimed) < count:
            raw = self._autoclaim(
                stream, group, consumer, min_idle_ms, cursor, count - len(claimed)
            )
            cursor, got, gone = _replies.xautoclaim(stream, raw)
            claimed += got
            deleted += gone
            if cursor == "0-0":
                break
        if deleted:  # 7.x already dropped them; Redis 6.2 keeps them pending until acked
            self._conn.call("ack", lambda: self._conn.control.xack(stream, group, *deleted))
        ordered = sorted(claimed, key=lambda e: parse_stream_id(e.id))
        counts = self._delivery_counts(stream, group, consumer, [e.id for e in ordered])
        entries = [Entry(e.stream, e.id, e.fields, counts.get(e.id, 1)) for e in claimed]
        return Reclaimed(entries=entries, deleted_ids=deleted)

    def _autoclaim(
        self, stream: str, group: str, consumer: str, min_idle_ms: int, start: str, count: int
    ) -> object:
        return self._with_group(
            [stream],
            group,
            "reclaim",
            lambda: self._conn.control.xautoclaim(
                stream, group, consumer, min_idle_ms, start_id=start, count=count
            ),
        )

    def pending_summary(self, stream: str, group: str) -> PendingSummary:
        try:
            raw = self._conn.call(
                "pending_summary", lambda: self._conn.control.xpending(stream, group)
            )
        except NoGroup:
            return PendingSummary(0, None, None, {})
        return _replies.pending_summary(raw)

    # ── plain values ──────────────────────────────────────────────────────────────────────
    def get(self, key: str) -> bytes | None:
        return _replies.as_bytes_or_none(
            self._conn.call("get", lambda: self._conn.control.get(key))
        )

    def set(self, key: str, value: bytes, *, ttl_s: float | None = None) -> None:
        px = None if ttl_s is None else ttl_ms(ttl_s)
        self._conn.call("set", lambda: self._conn.control.set(key, value, px=px))

    def delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0

        def send() -> list[object]:
            with self._conn.control.pipeline(transaction=False) as pipe:
                for key in keys:  # one key per UNLINK: stays valid on a Cluster
                    pipe.unlink(key)
                return pipe.execute()

        return sum(_replies.as_int(n) for n in self._conn.call("delete", send))

    # ── blobs ─────────────────────────────────────────────────────────────────────────────
    def put_blob(self, key: str, data: BlobData, *, ttl_s: float | None) -> BlobRef:
        return self.put_blobs([(key, data)], ttl_s=ttl_s)[0]

    def put_blobs(
        self, blobs: Sequence[tuple[str, BlobData]], *, ttl_s: float | None
    ) -> list[BlobRef]:
        split: list[tuple[str, list[Buffer], int]] = []
        for key, data in blobs:  # every blob checked before anything is written
            check_key("blob key", key)
            chunks, total = _chunks.split_chunks(data, self._options.blob_chunk_bytes)
            _chunks.check_blob_size(key, total, len(chunks))
            split.append((key, chunks, total))
        px_ms = None if ttl_s is None else ttl_ms(ttl_s)
        self._put_chunks([(key, chunks) for key, chunks, _ in split], px_ms)
        return [BlobRef(key, len(chunks), total) for key, chunks, total in split]

    def _put_chunks(self, blobs: list[tuple[str, list[Buffer]]], px_ms: int | None) -> None:
        """Write blobs' chunks in at most two pipelines: token-named blobs with ``SET NX``,
        chunk 0 first (it claims the name), then their other chunks; the rest in the first."""
        first: list[tuple[str, int, Buffer, bool]] = []
        rest: list[tuple[str, int, Buffer, bool]] = []
        for key, chunks in blobs:
            exclusive = names_fencing_token(key)
            for index, chunk in enumerate(chunks):
                (rest if exclusive and index > 0 else first).append((key, index, chunk, exclusive))
        for wave in (first, rest):
            if wave:
                self._put_wave(wave, px_ms)

    def _put_wave(self, wave: list[tuple[str, int, Buffer, bool]], px_ms: int | None) -> None:
        """One pipeline of chunk writes ``(key, index, chunk, exclusive)``; an exclusive one
        (``SET NX``) that found its chunk taken must find the same bytes there (a retry)."""

        def send() -> list[object]:
            with self._conn.blobs.pipeline(transaction=False) as pipe:
                for key, index, chunk, exclusive in wave:
                    pipe.set(blob_chunk_key(key, index), chunk, px=px_ms, nx=exclusive)
                return pipe.execute()

        written = self._conn.call("put_blob", send)
        for (key, index, chunk, exclusive), ok in zip(wave, written, strict=True):
            if exclusive and not ok and self._get_chunk(blob_chunk_key(key, index)) != bytes(chunk):
                raise LeaseLost(
                    f"staged blob {key!r} (chunk {index}) already holds another payload: "
                    "another holder staged under the same fencing token; stop acting for "
                    "this lease and re-acquire (a new token names a new key)"
                )

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
        check_key("stream", stream)
        check_key("blob key", blob_key)
        entry = encode_fields(check_fields("append fields", {**fields, ref_field: b""}))
        check_maxlen("append maxlen", maxlen)
        counts_key, increments = counts or ("", {})
        if counts is not None:
            check_key("counts key", counts_key)
        rises = sorted(check_counts("append counts", increments).items())
        chunks, total = _chunks.split_chunks(data, self._options.blob_chunk_bytes)
        _chunks.check_blob_size(blob_key, total, len(chunks))
        ref = BlobRef(blob_key, len(chunks), total)
        entry[ref_field] = ref.to_bytes()
        px_ms = ttl_ms(ttl_s)
        if names_fencing_token(blob_key):  # exclusive write first, then the reference
            self._put_chunks([(blob_key, chunks)], px_ms)

            def append() -> list[object]:
                with self._conn.control.pipeline(transaction=False) as pipe:
                    for name, n in rises:
                        pipe.hincrby(counts_key, name, n)
                    pipe.xadd(stream, entry, maxlen=maxlen, approximate=approximate)
                    return pipe.execute()

            raw = self._conn.call("append_with_blob", append)[-1]
            return _replies.as_str(raw, "XADD"), ref

        def send() -> list[object]:
            # Chunks, counts, reference: the server runs a pipeline in order, so whoever sees
            # the entry finds the blob (unless it expired or Redis restarted) and the counts.
            with self._conn.blobs.pipeline(transaction=False) as pipe:
                for index, chunk in enumerate(chunks):
                    pipe.set(blob_chunk_key(blob_key, index), chunk, px=px_ms)
                for name, n in rises:
                    pipe.hincrby(counts_key, name, n)
                pipe.xadd(stream, entry, maxlen=maxlen, approximate=approximate)
                return pipe.execute()

        results = self._conn.call("append_with_blob", send)
        return _replies.as_str(results[-1], "XADD"), ref

    def get_blob(self, ref: BlobRef) -> bytes:
        _chunks.check_blob_ref(ref, self._keys, self._options.blob_chunk_bytes)
        values: list[bytes | None] = []
        for key in ref.chunk_keys():  # one GET per chunk: no giant pipelined reply buffer
            value = self._get_chunk(key)
            values.append(value)
            if value is None:
                break
        values += [None] * (ref.n_chunks - len(values))
        return _chunks.join_chunks(ref, values)

    def _get_chunk(self, key: str) -> bytes | None:
        return _replies.as_bytes_or_none(
            self._conn.call("get_blob", lambda: self._conn.blobs.get(key))
        )

    def delete_blobs(self, refs: Sequence[BlobRef]) -> int:
        for ref in refs:  # every reference first: a forged one deletes nothing
            _chunks.check_blob_ref(ref, self._keys, self._options.blob_chunk_bytes)
        return self.delete([key for ref in refs for key in ref.chunk_keys()])

    # ── leases and fenced commits ─────────────────────────────────────────────────────────
    def acquire_lease(self, name: str, owner: str, *, ttl_s: float) -> Lease | None:
        check_key("lease name", name)
        if self._conn.cluster and hash_tag(name) is None:
            raise InvalidArgument(
                f"lease name {name!r} has no hash tag: on a Redis Cluster the lease, its fence "
                "and its commits must share one slot; name it like 'ddq:run:{tag}:lease' "
                "(dd_queue.keys.Keys.lease does)"
            )
        px_ms, sent_s, nonce = ttl_ms(ttl_s), self._clock.now(), secrets.token_hex(8)
        raw = self._conn.call(
            "acquire_lease",
            lambda: self._acquire_script(keys=[name, fence_key(name)], args=[owner, px_ms, nonce]),
        )
        if raw is None:
            return None
        lease = Lease(name, owner, _replies.as_int(raw), sent_s + ttl_s, nonce)
        log.info("bus.lease.acquired %s token %d by %s", name, lease.token, owner)
        return lease

    def renew_lease(self, lease: Lease, *, ttl_s: float) -> Lease:
        px_ms, sent_s = ttl_ms(ttl_s), self._clock.now()
        raw = self._conn.call(
            "renew_lease",
            lambda: self._renew_script(keys=[lease.name], args=[lease.value, px_ms]),
        )
        if _replies.as_int(raw) != 1:
            raise LeaseLost(
                f"lease {lease.name!r} token {lease.token} of {lease.owner!r} expired or was "
                "taken over; stop acting for it and re-acquire"
            )
        return Lease(lease.name, lease.owner, lease.token, sent_s + ttl_s, lease.nonce)

    def release_lease(self, lease: Lease) -> bool:
        raw = self._conn.call(
            "release_lease",
            lambda: self._release_script(keys=[lease.name], args=[lease.value]),
        )
        return _replies.as_int(raw) == 1

    def commit(self, lease: Lease, ops: Sequence[CommitOp], *, commit_id: str) -> CommitResult:
        marker = commit_marker_key(lease.name, commit_id)
        steps = primitive_ops(ops)
        check_same_slot(lease.name, [key for op in steps for key in commit_keys(op)])
        keys, args = _commit_args(lease, marker, steps)
        if self._options.commit_replicas:
            raw = self._conn.call("commit", lambda: self._commit_replicated(lease, keys, args))
        else:
            raw = self._conn.call("commit", lambda: self._commit_script(keys=keys, args=args))
        ids, acked, replayed = _replies.as_list(raw, "commit")
        result = CommitResult(
            tuple(_replies.as_str(i) for i in _replies.as_list(ids)),
            _replies.as_int(acked),
            replayed=_replies.as_int(replayed) == 1,
        )
        if result.replayed:
            log.info("bus.commit.replayed %s %s", lease.name, commit_id)
        return result

    def _commit_replicated(self, lease: Lease, keys: list[str], args: list[EncodableT]) -> object:
        """The commit script, then ``WAIT commit_replicas commit_wait_ms``, in one pipeline on
        one connection of the lease's node (``WAIT`` counts that connection's writes).

        Never retried here: a commit whose connection broke, or that fewer replicas confirmed,
        may be lost in a failover, or (retried on a promoted replica) applied to an older state.
        ``NotReplicated`` tells the caller to rebuild from what Redis holds (the synchronizer
        does, as after any bus error).

        Raises:
            NotReplicated: Fewer replicas confirmed in time, or the node failed on the way.
        """
        want, wait_ms = self._options.commit_replicas, self._options.commit_wait_ms
        control = self._conn.control
        node = control
        try:
            if isinstance(control, RedisCluster):
                owner = control.get_node_from_key(lease.name)  # type: ignore[no-untyped-call]
                node = control.get_redis_connection(owner)
            with node.pipeline(transaction=False) as pipe:
                self._commit_script(keys=keys, args=args, client=pipe)
                pipe.execute_command("WAIT", want, wait_ms)
                raw, confirmed = pipe.execute()
        except _NODE_FAILED as exc:
            self._refresh_slots()
            raise NotReplicated(
                f"commit under {lease.name!r} not confirmed: the node failed on the way ({exc}); "
                "it may be lost in a failover: rebuild from what Redis holds"
            ) from exc
        if _replies.as_int(confirmed) < want:
            raise NotReplicated(
                f"commit under {lease.name!r} confirmed by {_replies.as_int(confirmed)} of "
                f"{want} replicas within {wait_ms} ms (redis.commit_replicas); it may be lost "
                "in a failover: rebuild from what Redis holds"
            )
        return raw

    def _refresh_slots(self) -> None:
        """Re-read a cluster's slot map (a failover may have moved the lease's slot)."""
        control = self._conn.control
        if isinstance(control, RedisCluster):
            try:
                control.nodes_manager.initialize()
            except (redis.RedisError, rexc.RedisClusterException) as exc:
                log.warning("bus.cluster.refresh_failed %s", exc)

    # ── heartbeats (own connection) ───────────────────────────────────────────────────────
    def add_counts(self, key: str, increments: Mapping[str, int]) -> None:
        check_key("counts key", key)
        checked = check_counts("add_counts", increments)
        if not checked:
            return

        def send() -> list[object]:  # one HINCRBY a field (no MULTI: the ACLs need no more)
            with self._conn.control.pipeline(transaction=False) as pipe:
                for name, n in sorted(checked.items()):
                    pipe.hincrby(key, name, n)
                return pipe.execute()

        self._conn.call("add_counts", send)

    def read_counts(self, key: str) -> dict[str, int]:
        check_key("counts key", key)
        return _replies.counts(
            self._conn.call("read_counts", lambda: self._conn.control.hgetall(key))
        )

    def memory_info(self) -> MemoryInfo | None:
        control = self._conn.control
        try:
            if isinstance(control, RedisCluster):  # every master: the fullest one is the limit
                raw = self._conn.call(
                    "info memory",
                    lambda: control.info("memory", target_nodes=RedisCluster.PRIMARIES),
                )
                return _replies.fullest_memory_info(raw)
            raw = self._conn.call("info memory", lambda: control.info("memory"))
        except BusError as exc:
            if "unknown command" in str(exc):  # a server without INFO (fakeredis)
                return None
            raise
        return _replies.memory_info(raw)

    def shard_of(self, key: str) -> str | None:
        control = self._conn.control
        if not isinstance(control, RedisCluster):
            return None
        node = control.get_node_from_key(key)  # type: ignore[no-untyped-call]
        return str(node.name)

    def slot_ranges(self) -> list[tuple[tuple[int, int], str]]:
        """A cluster's slot ranges and the master serving each (``host:port``), as the cluster
        reports them now (``CLUSTER SLOTS``); ``[]`` on a single server."""
        control = self._conn.control
        if not isinstance(control, RedisCluster):
            return []
        raw: object = self._conn.call("cluster slots", control.cluster_slots)
        if not isinstance(raw, Mapping):  # redis-py parses the reply into {(lo, hi): info}
            raise BusError(f"CLUSTER SLOTS: unexpected reply {type(raw).__name__}")
        return sorted(
            ((int(lo), int(hi)), f"{info['primary'][0]}:{info['primary'][1]}")
            for (lo, hi), info in raw.items()
        )

    def server_time_s(self) -> float:
        beat = self._conn.heartbeat

        def ask() -> object:
            if isinstance(beat, RedisCluster):  # the clock heartbeats are stamped with
                node = beat.get_node_from_key(self._keys.heartbeat_seen())  # type: ignore[no-untyped-call]
                return beat.time(target_nodes=node)
            return beat.time()

        raw = _replies.as_list(self._conn.call("time", ask))
        return _replies.as_int(raw[0]) + _replies.as_int(raw[1]) / 1e6

    def heartbeat(self, member: str, payload: bytes, *, ttl_s: float) -> None:
        check_name("heartbeat member", member)
        args: list[EncodableT] = [member, payload, ttl_ms(ttl_s)]
        self._conn.call("heartbeat", lambda: self._beat_script(keys=self._beat_keys(), args=args))

    def heartbeats(self) -> dict[str, HeartbeatInfo]:
        raw = _replies.as_list(
            self._conn.call("heartbeats", lambda: self._beats_script(keys=self._beat_keys()))
        )
        now_ms = float(_replies.as_str(raw[0]))
        seen = {m.decode(): float(s) for m, s in _replies.flat_pairs(raw[1])}
        payloads = dict(_replies.flat_pairs(raw[2]))
        return {
            member: HeartbeatInfo(
                payloads.get(member.encode(), b""), max(0.0, (now_ms - ms) / 1000)
            )
            for member, ms in seen.items()
        }

    def remove_heartbeat(self, member: str) -> bool:
        raw = self._conn.call(
            "remove_heartbeat",
            lambda: self._forget_script(keys=self._beat_keys(), args=[member]),
        )
        return _replies.as_int(raw) == 1

    def _beat_keys(self) -> list[str]:
        return [
            self._keys.heartbeat_seen(),
            self._keys.heartbeat_expiry(),
            self._keys.heartbeat_data(),
        ]

    # ── closing ───────────────────────────────────────────────────────────────────────────
    def close(self) -> None:
        self._fanout.close()
        self._conn.close()


def encode_fields(fields: Mapping[str, bytes]) -> dict[FieldT, EncodableT]:
    """Stream fields in the type redis-py's ``xadd`` declares."""
    out: dict[FieldT, EncodableT] = {}
    out.update(fields)
    return out


def _commit_args(
    lease: Lease, marker: str, ops: Sequence[PrimitiveOp]
) -> tuple[list[str], list[EncodableT]]:
    """Flatten ops into the KEYS/ARGV layout that ``_scripts.COMMIT`` parses."""
    keys: list[str] = [lease.name, marker]
    args: list[EncodableT] = [lease.value, ttl_ms(COMMIT_MARKER_TTL_S)]
    for op in ops:
        if isinstance(op, SetOp):
            keys.append(op.key)
            args += ["S", op.value, "" if op.ttl_s is None else ttl_ms(op.ttl_s)]
        elif isinstance(op, AppendOp):
            keys.append(op.stream)
            args += ["X", "" if op.maxlen is None else op.maxlen, len(op.fields)]
            for name, value in op.fields.items():
                args += [name, value]
        elif isinstance(op, AckOp):
            keys.append(op.stream)
            args += ["A", op.group, len(op.ids), *op.ids]
        else:
            for key in op.keys:
                keys.append(key)
                args.append("D")
    return keys, args


__all__ = ["RedisBus", "RedisOptions"]
