"""``RedisBus``: the ``Bus`` protocol on Redis Streams through redis-py (Redis >= 7.0, Valkey).

Facts that shape it (measured in research/redis-pipeline.md):

* Payloads live in their own string keys (``SET … PX``), referenced from small stream entries;
  a contribution is written as one non-transactional pipeline (chunks first, then the XADD),
  the fastest measured write path. A reference can outlive its blob (TTL, writer crash between
  the two writes, a Redis restart); readers then get ``BlobMissing`` and count the contribution
  as lost.
* Separate clients for blocking reads, payloads, small commands and heartbeats (see
  ``_redis_conn``), each with a socket timeout above the longest ``BLOCK``.
* A restart without persistence drops streams and groups: group commands that hit NOGROUP
  recreate the group at id 0 and retry once (``_redis_groups``; read-only inspection does not).
  Lua scripts are re-sent on NOSCRIPT by redis-py.
* Fenced commits, leases, dead-lettering and heartbeats are Lua scripts (``_scripts``).
* Arguments are checked before anything is sent (``_values``, ``commit_ops``), with the same
  errors as ``MemoryBus``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import redis
from redis.typing import EncodableT, KeyT, StreamIdT

from dd_queue.bus import _replies
from dd_queue.bus._redis_conn import BusAddress, Connections, RedisOptions
from dd_queue.bus._redis_groups import RedisGroupOps
from dd_queue.bus._redis_kv import RedisKeyValueOps, encode_fields
from dd_queue.bus._values import (
    check_fields,
    check_key,
    check_maxlen,
    check_stream_id,
    format_stream_id,
    parse_stream_id,
)
from dd_queue.bus.commit_ops import check_dead_letter
from dd_queue.bus.types import (
    COMMIT_MARKER_TTL_S,
    Entry,
    InvalidArgument,
    dead_letter_fields,
    ttl_ms,
)
from dd_queue.clock import Clock, SystemClock
from dd_queue.keys import Keys, dead_letter_marker_key

T = TypeVar("T")
log = logging.getLogger("dd_queue.bus")


class RedisBus(RedisGroupOps, RedisKeyValueOps):
    """The bus on a Redis server.

    Args:
        url: ``redis://host:port/db`` of a Redis >= 7.0 or Valkey server.
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
        self._register_scripts()

    @property
    def keys(self) -> Keys:
        return self._keys

    @property
    def url(self) -> str | None:
        """The server's URL, to connect another process to it (None: injected clients)."""
        return self._url

    @property
    def remote(self) -> bool:
        return True

    @property
    def address(self) -> BusAddress | None:
        return None if self._url is None else BusAddress(self._url, self.options)

    @property
    def options(self) -> RedisOptions:
        """The client options this bus was made with."""
        return self._options

    @property
    def blob_chunk_bytes(self) -> int:
        return self._options.blob_chunk_bytes

    # ── helpers ───────────────────────────────────────────────────────────────────────────
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

    def trim(self, stream: str, *, maxlen: int, approximate: bool = True) -> int:
        if isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 0:
            raise InvalidArgument(f"trim maxlen must be an integer >= 0, got {maxlen!r}")
        raw = self._conn.call(
            "trim", lambda: self._conn.control.xtrim(stream, maxlen, approximate=approximate)
        )
        return _replies.as_int(raw, "XTRIM")

    def stream_length(self, stream: str) -> int:
        return _replies.as_int(self._conn.call("xlen", lambda: self._conn.control.xlen(stream)))

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

    def read_latest(self, stream: str) -> Entry | None:
        raw = self._conn.call("read_latest", lambda: self._conn.control.xrevrange(stream, count=1))
        found = _replies.entries(stream, raw, 0)
        return found[0] if found else None

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

    def dead_letter(
        self,
        entry: Entry,
        *,
        group: str,
        dlq: str,
        reason: str,
        maxlen: int | None = None,
    ) -> str:
        check_dead_letter(entry.stream, entry.id, group=group, dlq=dlq, maxlen=maxlen)
        fields = {**entry.fields, **dead_letter_fields(entry, group, reason)}
        marker = dead_letter_marker_key(dlq, entry.stream, entry.id)
        args: list[EncodableT] = [group, entry.id, "" if maxlen is None else maxlen]
        args.append(ttl_ms(COMMIT_MARKER_TTL_S))
        for name, value in fields.items():
            args += [name, value]
        raw = self._conn.call(
            "dead_letter", lambda: self._dlq_script(keys=[entry.stream, dlq, marker], args=args)
        )
        return _replies.as_str(raw, "dead_letter")

    def close(self) -> None:
        self._conn.close()


__all__ = ["RedisBus", "RedisOptions"]
