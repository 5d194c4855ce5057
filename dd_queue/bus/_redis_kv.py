"""RedisBus's string values, blobs, fenced leases and commits, and heartbeats.

A mixin of :class:`~dd_queue.bus.redis_streams.RedisBus` (which sets the attributes declared
here). Blob chunks go through the payload client, heartbeats through their own client, all
else through the control client.

Blobs whose key names a fencing token (``keys.names_fencing_token``: staged global fragments and
momentum) are written only where the key is free (``SET NX``, chunk 0 first), so a stale holder
can never overwrite what the current holder committed. A chunk that is already there with the
same bytes is our own retried write and counts as written.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence

from redis.commands.core import Script
from redis.typing import EncodableT, FieldT

from dd_queue.bus import _chunks, _replies, _scripts
from dd_queue.bus._redis_conn import Connections, RedisOptions
from dd_queue.bus._values import check_fields, check_key, check_maxlen
from dd_queue.bus.commit_ops import PrimitiveOp, primitive_ops
from dd_queue.bus.types import (
    COMMIT_MARKER_TTL_S,
    AckOp,
    AppendOp,
    BlobData,
    BlobRef,
    Buffer,
    CommitOp,
    CommitResult,
    HeartbeatInfo,
    Lease,
    SetOp,
    check_blob_ref,
    check_blob_size,
    check_same_slot,
    commit_keys,
    ttl_ms,
)
from dd_queue.clock import Clock
from dd_queue.errors import LeaseLost
from dd_queue.keys import (
    Keys,
    blob_chunk_key,
    check_name,
    commit_marker_key,
    fence_key,
    names_fencing_token,
)

log = logging.getLogger("dd_queue.bus")


def encode_fields(fields: Mapping[str, bytes]) -> dict[FieldT, EncodableT]:
    """Stream fields in the type redis-py's ``xadd`` declares."""
    out: dict[FieldT, EncodableT] = {}
    out.update(fields)
    return out


class RedisKeyValueOps:
    """Values, blobs, leases, fenced commits and heartbeats on Redis."""

    _keys: Keys
    _conn: Connections
    _options: RedisOptions
    _clock: Clock

    def _register_scripts(self) -> None:
        control, beat = self._conn.control, self._conn.heartbeat
        self._acquire_script: Script = control.register_script(_scripts.ACQUIRE_LEASE)
        self._renew_script: Script = control.register_script(_scripts.RENEW_LEASE)
        self._release_script: Script = control.register_script(_scripts.RELEASE_LEASE)
        self._commit_script: Script = control.register_script(_scripts.COMMIT)
        self._dlq_script: Script = control.register_script(_scripts.DEAD_LETTER)
        self._beat_script: Script = beat.register_script(_scripts.HEARTBEAT)
        self._beats_script: Script = beat.register_script(_scripts.HEARTBEATS)
        self._forget_script: Script = beat.register_script(_scripts.REMOVE_HEARTBEAT)

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
            check_blob_size(key, total, len(chunks))
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
    ) -> tuple[str, BlobRef]:
        check_key("stream", stream)
        check_key("blob key", blob_key)
        entry = encode_fields(check_fields("append fields", {**fields, ref_field: b""}))
        check_maxlen("append maxlen", maxlen)
        chunks, total = _chunks.split_chunks(data, self._options.blob_chunk_bytes)
        check_blob_size(blob_key, total, len(chunks))
        ref = BlobRef(blob_key, len(chunks), total)
        entry[ref_field] = ref.to_bytes()
        px_ms = ttl_ms(ttl_s)
        if names_fencing_token(blob_key):  # exclusive write first, then the reference
            self._put_chunks([(blob_key, chunks)], px_ms)
            raw = self._conn.call(
                "append_with_blob",
                lambda: self._conn.control.xadd(
                    stream, entry, maxlen=maxlen, approximate=approximate
                ),
            )
            return _replies.as_str(raw, "XADD"), ref

        def send() -> list[object]:
            # Chunks before the reference: the server runs a pipeline in order, so whoever
            # sees the entry finds the blob (unless it expired or Redis restarted).
            with self._conn.blobs.pipeline(transaction=False) as pipe:
                for index, chunk in enumerate(chunks):
                    pipe.set(blob_chunk_key(blob_key, index), chunk, px=px_ms)
                pipe.xadd(stream, entry, maxlen=maxlen, approximate=approximate)
                return pipe.execute()

        results = self._conn.call("append_with_blob", send)
        return _replies.as_str(results[-1], "XADD"), ref

    def get_blob(self, ref: BlobRef) -> bytes:
        check_blob_ref(ref, self._keys, self._options.blob_chunk_bytes)
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
            check_blob_ref(ref, self._keys, self._options.blob_chunk_bytes)
        return self.delete([key for ref in refs for key in ref.chunk_keys()])

    # ── leases and fenced commits ─────────────────────────────────────────────────────────
    def acquire_lease(self, name: str, owner: str, *, ttl_s: float) -> Lease | None:
        check_key("lease name", name)
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

    # ── heartbeats (own connection) ───────────────────────────────────────────────────────
    def _beat_keys(self) -> list[str]:
        return [
            self._keys.heartbeat_seen(),
            self._keys.heartbeat_expiry(),
            self._keys.heartbeat_data(),
        ]

    def server_time_s(self) -> float:
        raw = _replies.as_list(self._conn.call("time", lambda: self._conn.heartbeat.time()))
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
