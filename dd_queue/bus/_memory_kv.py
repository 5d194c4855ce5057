"""MemoryBus's string values, blobs, fenced leases and commits, and heartbeats.

Key layout and value formats match ``RedisBus`` exactly (chunk keys, ``<token>:<nonce>:<owner>``
lease values, the fence key, commit markers), so code that inspects keys sees the same thing on
both buses. Fencing tokens are ``max(last + 1, clock in microseconds)`` as on Redis; staged blobs
named after a token are written only where free, as with ``SET NX``.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence

from dd_queue.bus import _chunks
from dd_queue.bus._memory_store import MemoryCore
from dd_queue.bus._values import check_key
from dd_queue.bus.commit_ops import decode_commit_marker, encode_commit_result, primitive_ops
from dd_queue.bus.types import (
    COMMIT_MARKER_TTL_S,
    AckOp,
    AppendOp,
    BlobData,
    BlobRef,
    CommitOp,
    CommitResult,
    DeleteOp,
    HeartbeatInfo,
    Lease,
    SetOp,
    check_blob_ref,
    check_blob_size,
    check_same_slot,
    commit_keys,
    ttl_ms,
)
from dd_queue.errors import BusError, LeaseLost
from dd_queue.keys import (
    blob_chunk_key,
    check_name,
    commit_marker_key,
    fence_key,
    names_fencing_token,
)

_LEASE_VALUE = re.compile(rb"[0-9]+:[^:]*:(.*)", re.DOTALL)


class MemoryKeyValueOps(MemoryCore):
    """Values, blobs, leases, fenced commits and heartbeats of the in-memory bus."""

    # ── plain values ──────────────────────────────────────────────────────────────────────
    def get(self, key: str) -> bytes | None:
        with self._cond:
            found = self._value(key)
            return found.data if found else None

    def set(self, key: str, value: bytes, *, ttl_s: float | None = None) -> None:
        if ttl_s is not None:
            ttl_ms(ttl_s)  # same validation as RedisBus
        with self._cond:
            self._put(key, value, ttl_s)

    # ── blobs ─────────────────────────────────────────────────────────────────────────────
    def put_blob(self, key: str, data: BlobData, *, ttl_s: float | None) -> BlobRef:
        check_key("blob key", key)
        if ttl_s is not None:
            ttl_ms(ttl_s)
        chunks, total = _chunks.split_chunks(data, self._chunk_bytes)
        check_blob_size(key, total, len(chunks))
        values = [bytes(chunk) for chunk in chunks]
        with self._cond:
            if names_fencing_token(key):  # as SET NX: never overwrite another payload
                for index, value in enumerate(values):
                    found = self._value(blob_chunk_key(key, index))
                    if found is not None and found.data != value:
                        raise LeaseLost(
                            f"staged blob {key!r} (chunk {index}) already holds another "
                            "payload: another holder staged under the same fencing token; stop "
                            "acting for this lease and re-acquire (a new token names a new key)"
                        )
            for index, value in enumerate(values):
                self._put(blob_chunk_key(key, index), value, ttl_s)
        return BlobRef(key, len(chunks), total)

    def put_blobs(
        self, blobs: Sequence[tuple[str, BlobData]], *, ttl_s: float | None
    ) -> list[BlobRef]:
        for key, data in blobs:  # every blob checked before anything is written
            check_key("blob key", key)
            chunks, total = _chunks.split_chunks(data, self._chunk_bytes)
            check_blob_size(key, total, len(chunks))
        with self._cond:
            return [self.put_blob(key, data, ttl_s=ttl_s) for key, data in blobs]

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
        with self._cond:
            self._check_append(stream, {**fields, ref_field: b""}, maxlen)
            ref = self.put_blob(blob_key, data, ttl_s=ttl_s)
            entry_id = self._append(stream, {**fields, ref_field: ref.to_bytes()}, maxlen)
        return entry_id, ref

    def get_blob(self, ref: BlobRef) -> bytes:
        check_blob_ref(ref, self._keys, self._chunk_bytes)
        with self._cond:
            values = [self._value(key) for key in ref.chunk_keys()]
        return _chunks.join_chunks(ref, [v.data if v else None for v in values])

    def delete_blobs(self, refs: Sequence[BlobRef]) -> int:
        for ref in refs:  # every reference first: a forged one deletes nothing
            check_blob_ref(ref, self._keys, self._chunk_bytes)
        return self.delete([key for ref in refs for key in ref.chunk_keys()])

    # ── leases and fenced commits ─────────────────────────────────────────────────────────
    def acquire_lease(self, name: str, owner: str, *, ttl_s: float) -> Lease | None:
        check_key("lease name", name)
        ttl_ms(ttl_s)
        nonce = secrets.token_hex(8)
        with self._cond:
            current = self._value(name)
            if current is not None:
                parsed = _LEASE_VALUE.fullmatch(current.data)
                if parsed is None:
                    raise BusError(
                        f"acquire_lease: {name} holds {current.data[:80]!r}, not a lease value; "
                        "delete the key"
                    )
                if parsed.group(1) != owner.encode():
                    return None
            now = self._clock.now()
            counter = self._value(fence_key(name))
            last = int(counter.data) if counter and counter.data.isdigit() else 0
            token = max(last + 1, int(now * 1_000_000))
            self._put(fence_key(name), str(token).encode(), None)
            lease = Lease(name, owner, token, now + ttl_s, nonce)
            self._put(name, lease.value.encode(), ttl_s)
            return lease

    def renew_lease(self, lease: Lease, *, ttl_s: float) -> Lease:
        ttl_ms(ttl_s)
        with self._cond:
            self._check_lease(lease)
            self._put(lease.name, lease.value.encode(), ttl_s)
            return Lease(
                lease.name, lease.owner, lease.token, self._clock.now() + ttl_s, lease.nonce
            )

    def release_lease(self, lease: Lease) -> bool:
        with self._cond:
            current = self._value(lease.name)
            if current is None or current.data != lease.value.encode():
                return False
            del self._data[lease.name]
            return True

    def _check_lease(self, lease: Lease) -> None:
        current = self._value(lease.name)
        if current is None or current.data != lease.value.encode():
            holder = current.data.decode(errors="replace") if current else "nobody (expired)"
            raise LeaseLost(
                f"lease {lease.name} is held by {holder}, not {lease.value}; "
                "stop acting for this lease, re-acquire"
            )

    def commit(self, lease: Lease, ops: Sequence[CommitOp], *, commit_id: str) -> CommitResult:
        marker = commit_marker_key(lease.name, commit_id)
        steps = primitive_ops(ops)
        check_same_slot(lease.name, [key for op in steps for key in commit_keys(op)])
        with self._cond:
            found = self._value(marker)
            replay = decode_commit_marker(found.data) if found else None
            if replay is not None and replay[1] == lease.value:
                return replay[0]  # this commit already ran; its reply was lost
            # Everything that can fail is checked before the first write (as the Lua script).
            self._check_lease(lease)
            for op in steps:
                if isinstance(op, AppendOp | AckOp):
                    self._stream(op.stream)  # raises WRONGTYPE for a string key
            entry_ids: list[str] = []
            acked = 0
            for op in steps:
                if isinstance(op, SetOp):
                    self._put(op.key, op.value, op.ttl_s)
                elif isinstance(op, AppendOp):
                    entry_ids.append(self._append(op.stream, op.fields, op.maxlen))
                elif isinstance(op, AckOp):
                    acked += self._ack(op.stream, op.group, op.ids)
                elif isinstance(op, DeleteOp):
                    self.delete(op.keys)
            result = CommitResult(tuple(entry_ids), acked)
            self._put(marker, encode_commit_result(result, lease.value), COMMIT_MARKER_TTL_S)
            return result

    # ── heartbeats ────────────────────────────────────────────────────────────────────────
    def server_time_s(self) -> float:
        return self._clock.now()

    def heartbeat(self, member: str, payload: bytes, *, ttl_s: float) -> None:
        check_name("heartbeat member", member)
        ttl_ms(ttl_s)
        with self._cond:
            now = self._clock.now()
            self._beats[member] = (bytes(payload), now, now + ttl_s)

    def heartbeats(self) -> dict[str, HeartbeatInfo]:
        with self._cond:
            now = self._clock.now()
            for member in [m for m, (_, _, expires) in self._beats.items() if now >= expires]:
                del self._beats[member]
            return {
                member: HeartbeatInfo(payload, max(0.0, now - seen_s))
                for member, (payload, seen_s, _) in self._beats.items()
            }

    def remove_heartbeat(self, member: str) -> bool:
        with self._cond:
            return self._beats.pop(member, None) is not None
