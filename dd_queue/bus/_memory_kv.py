"""MemoryBus's string values, blobs, fenced leases and commits, and heartbeats.

Key layout and value formats match ``RedisBus`` exactly (chunk keys, ``<token>:<owner>`` lease
values, the fence counter), so code that inspects keys sees the same thing on both buses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dd_queue.bus import _chunks
from dd_queue.bus._memory_store import MemoryCore
from dd_queue.bus.types import (
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
    check_same_slot,
    commit_keys,
    ttl_ms,
)
from dd_queue.errors import LeaseLost
from dd_queue.keys import blob_chunk_key, check_name, fence_key


def _lease_value(token: int, owner: str) -> bytes:
    return f"{token}:{owner}".encode()


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
    def put_blob(self, key: str, data: BlobData, *, ttl_s: float) -> BlobRef:
        ttl_ms(ttl_s)
        chunks, total = _chunks.split_chunks(data, self._chunk_bytes)
        with self._cond:
            for index, chunk in enumerate(chunks):
                self._put(blob_chunk_key(key, index), bytes(chunk), ttl_s)
        return BlobRef(key, len(chunks), total)

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
            ref = self.put_blob(blob_key, data, ttl_s=ttl_s)
            entry_id = self._append(stream, {**fields, ref_field: ref.to_bytes()}, maxlen)
        return entry_id, ref

    def get_blob(self, ref: BlobRef) -> bytes:
        with self._cond:
            values = [self._value(key) for key in ref.chunk_keys()]
        return _chunks.join_chunks(ref, [v.data if v else None for v in values])

    def delete_blobs(self, refs: Sequence[BlobRef]) -> int:
        return self.delete([key for ref in refs for key in ref.chunk_keys()])

    # ── leases and fenced commits ─────────────────────────────────────────────────────────
    def acquire_lease(self, name: str, owner: str, *, ttl_s: float) -> Lease | None:
        ttl_ms(ttl_s)
        with self._cond:
            current = self._value(name)
            if current is not None and current.data.partition(b":")[2].decode() != owner:
                return None
            counter = self._value(fence_key(name))
            token = int(counter.data) + 1 if counter else 1
            self._put(fence_key(name), str(token).encode(), None)
            self._put(name, _lease_value(token, owner), ttl_s)
            return Lease(name, owner, token, self._clock.now() + ttl_s)

    def renew_lease(self, lease: Lease, *, ttl_s: float) -> Lease:
        ttl_ms(ttl_s)
        with self._cond:
            self._check_lease(lease)
            self._put(lease.name, _lease_value(lease.token, lease.owner), ttl_s)
            return Lease(lease.name, lease.owner, lease.token, self._clock.now() + ttl_s)

    def release_lease(self, lease: Lease) -> bool:
        with self._cond:
            current = self._value(lease.name)
            if current is None or current.data != _lease_value(lease.token, lease.owner):
                return False
            del self._data[lease.name]
            return True

    def _check_lease(self, lease: Lease) -> None:
        current = self._value(lease.name)
        if current is None or current.data != _lease_value(lease.token, lease.owner):
            holder = current.data.decode() if current else "nobody (expired)"
            raise LeaseLost(
                f"lease {lease.name} is held by {holder}, not {lease.token}:{lease.owner}; "
                "stop acting for this lease, re-acquire"
            )

    def commit(self, lease: Lease, ops: Sequence[CommitOp]) -> CommitResult:
        check_same_slot(lease.name, [key for op in ops for key in commit_keys(op)])
        with self._cond:
            # Everything that can fail is checked before the first write (as the Lua script).
            self._check_lease(lease)
            for op in ops:
                if isinstance(op, AppendOp | AckOp):
                    self._stream(op.stream)  # raises WRONGTYPE for a string key
            entry_ids: list[str] = []
            acked = 0
            for op in ops:
                if isinstance(op, SetOp):
                    self._put(op.key, op.value, op.ttl_s)
                elif isinstance(op, AppendOp):
                    entry_ids.append(self._append(op.stream, op.fields, op.maxlen))
                elif isinstance(op, AckOp):
                    acked += self._ack(op.stream, op.group, op.ids)
                elif isinstance(op, DeleteOp):
                    self.delete(op.keys)
            return CommitResult(tuple(entry_ids), acked)

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
