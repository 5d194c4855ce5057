"""Domain helpers written once on top of the ``Bus`` protocol (so both buses share them).

Thin by design: they only pick keys from ``bus.keys`` and the blob-reference field. Message
contents (the msgpack envelopes in the other fields) belong to ``dd_queue.messages``.
"""

from __future__ import annotations

from collections.abc import Mapping

from dd_queue.bus.base import Bus
from dd_queue.bus.types import BlobData, BlobRef, Entry, Lease
from dd_queue.errors import CorruptPayload

BLOB_FIELD = "blob"
"""Stream field that holds ``BlobRef.to_bytes()`` of an entry's payload."""


def publish_contribution(
    bus: Bus,
    *,
    fragment_id: int,
    round_id: int,
    learner_id: str,
    payload: BlobData,
    fields: Mapping[str, bytes],
    ttl_s: float,
    maxlen: int | None = None,
) -> tuple[str, BlobRef]:
    """Store a contribution's payload and append its reference to the fragment's ``up`` stream.

    The blob key is deterministic in (fragment, round, learner), so a retried publish rewrites
    the same key; a duplicated entry is caught by the synchronizer's dedupe on the same triple.

    Returns:
        ``(entry id, blob ref)``.
    """
    return bus.append_with_blob(
        bus.keys.up(fragment_id),
        fields,
        blob_key=bus.keys.up_blob(fragment_id, round_id, learner_id),
        data=payload,
        ttl_s=ttl_s,
        ref_field=BLOB_FIELD,
        maxlen=maxlen,
    )


def blob_ref(entry: Entry) -> BlobRef:
    """The payload reference an entry carries.

    Raises:
        CorruptPayload: The entry has no (valid) reference field.
    """
    raw = entry.fields.get(BLOB_FIELD)
    if raw is None:
        raise CorruptPayload(f"entry {entry.id} of {entry.stream!r} has no {BLOB_FIELD!r} field")
    return BlobRef.from_bytes(raw)


def fetch_blob(bus: Bus, entry: Entry) -> bytes:
    """The payload an entry refers to.

    Raises:
        CorruptPayload: The entry has no valid reference, or the chunks do not add up.
        BlobMissing: The payload expired or was never written (count the entry as lost).
    """
    return bus.get_blob(blob_ref(entry))


def stage_global(
    bus: Bus, lease: Lease, *, fragment_id: int, version: int, payload: BlobData, ttl_s: float
) -> BlobRef:
    """Write a global fragment's payload before the fenced commit that publishes it.

    The key names the lease's fencing token, so a stale holder staging the same version can
    never overwrite what the current holder commits; unreferenced stagings expire by TTL.
    """
    key = bus.keys.global_blob(fragment_id, version, lease.token)
    return bus.put_blob(key, payload, ttl_s=ttl_s)


def latest_global(bus: Bus, fragment_id: int) -> Entry | None:
    """The newest entry of a fragment's ``down`` stream (None before the first version)."""
    return bus.read_latest(bus.keys.down(fragment_id))


def send_command(
    bus: Bus, target: str, fields: Mapping[str, bytes], *, maxlen: int | None = 1000
) -> str:
    """Append a command to ``target``'s control stream; returns its id."""
    return bus.append(bus.keys.control(target), fields, maxlen=maxlen)


def read_commands(
    bus: Bus, target: str, *, after_id: str, count: int = 100, block_ms: int | None = None
) -> list[Entry]:
    """Commands for ``target`` after ``after_id`` (broadcast read; keep the last id seen)."""
    return bus.read(bus.keys.control(target), after_id=after_id, count=count, block_ms=block_ms)


def emit_event(bus: Bus, fields: Mapping[str, bytes], *, maxlen: int | None = 10_000) -> str:
    """Append an event to the run's dashboard stream; returns its id."""
    return bus.append(bus.keys.events(), fields, maxlen=maxlen)


__all__ = [
    "BLOB_FIELD",
    "blob_ref",
    "emit_event",
    "fetch_blob",
    "latest_global",
    "publish_contribution",
    "read_commands",
    "send_command",
    "stage_global",
]
