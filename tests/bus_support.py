"""Bus helpers that only tests use (kept out of ``dd_queue.bus`` and its protocol).

- ``stage_global`` / ``stage_global_fragment``: write a global fragment's blob under a lease's
  fencing token, as ``synchronizer.blobs.stage`` does inside the synchronizer, so tests can
  publish a ``down`` notice without running one.
- ``dead_letter``: move one pending entry to a dead-letter stream and ack it, through the one
  way the bus offers (a fenced commit of a ``DeadLetterOp``, under a lease of its own).
- ``pending_ids``: the ids a Redis consumer group still holds pending (``XPENDING``, through a
  plain redis-py client: the bus itself only reports a summary).
"""

from __future__ import annotations

import redis

from dd_queue.auth import OPEN, Auth
from dd_queue.bus import Bus, DeadLetterOp, Entry, Lease
from dd_queue.bus.ops import _check_sendable
from dd_queue.bus.types import BlobData, BlobRef
from dd_queue.core.codec import EncodedTensor
from dd_queue.messages import GlobalFragment
from dd_queue.wire import blob_parts


def stage_global(
    bus: Bus, lease: Lease, *, fragment_id: int, version: int, payload: BlobData, ttl_s: float
) -> BlobRef:
    """Write a global fragment's payload before the fenced commit that publishes it.

    The key names the lease's fencing token, so a stale holder staging the same version can
    never overwrite what the current holder commits; unreferenced stagings expire by TTL.
    """
    key = bus.keys.global_blob(fragment_id, version, lease.token)
    return bus.put_blob(key, payload, ttl_s=ttl_s)


def stage_global_fragment(
    bus: Bus,
    lease: Lease,
    msg: GlobalFragment,
    encoded: EncodedTensor,
    *,
    ttl_s: float,
    auth: Auth = OPEN,
) -> BlobRef:
    """Write a global fragment's signed blob (``dd_queue.wire`` framing) under the lease's token;
    pass the reference to ``ops.global_notification_op`` / ``ops.global_notification_fields``.

    Raises:
        ValueError: ``msg`` belongs to another run, describes another tensor, or is not fp32.
    """
    _check_sendable(bus, msg.run_id, msg.tensor, encoded)
    if msg.tensor.codec != "fp32":
        raise ValueError(f"global fragments must be fp32 (exact), got {msg.tensor.codec!r}")
    key = bus.keys.global_blob(msg.fragment_id, msg.version, lease.token)
    sign = auth.blob_signer(msg.run_id)
    return bus.put_blob(
        key, blob_parts(run_id=msg.run_id, blob_key=key, encoded=encoded, sign=sign), ttl_s=ttl_s
    )


def dead_letter(bus: Bus, entry: Entry, *, group: str, dlq: str, reason: str) -> str:
    """Move ``entry`` to ``dlq`` with ``reason`` and ack it, in one fenced commit under a
    throwaway lease on the entry's hash tag; returns the dead-letter entry's id."""
    name = f"{entry.stream}:test-dlq-lease"
    lease = bus.acquire_lease(name, "tests", ttl_s=30)
    assert lease is not None, f"{name} is held by someone else"
    try:
        result = bus.commit(
            lease, [DeadLetterOp(entry, group, dlq, reason)], commit_id=f"dlq-{entry.id}"
        )
    finally:
        bus.release_lease(lease)
    [entry_id] = result.entry_ids
    return entry_id


def pending_ids(url: str, stream: str, group: str) -> list[str]:
    """Ids of every entry of ``stream`` delivered to ``group`` and not yet acked, in id order
    (empty when the stream or the group does not exist)."""
    client = redis.Redis.from_url(url)
    try:
        rows = client.xpending_range(stream, group, "-", "+", 1_000_000)
    except redis.ResponseError as exc:
        if "NOGROUP" in str(exc):
            return []
        raise
    finally:
        client.close()
    return [row["message_id"].decode() for row in rows]
