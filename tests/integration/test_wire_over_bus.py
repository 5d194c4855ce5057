"""Messages over the bus, end to end: publish → group read → fetch → verify → decode.

Runs on MemoryBus, RedisBus on fakeredis and RedisBus on the private redis-server (fixture
``bus_case``), whose blob chunks are ``CHUNK_BYTES`` = 1 KiB, so every payload here is split into
several chunks. Every refused entry is dead-lettered with its reason and acked: never lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from dd_queue.bus import BlobRef, Bus, SetOp, ops
from dd_queue.core import codec
from dd_queue.core.codec import CodecSpec, DecodeLimits, EncodedTensor, encode
from dd_queue.errors import (
    BlobMissing,
    CorruptPayload,
    DDQError,
    IncompatibleMessage,
    NonFiniteValues,
    PayloadTooLarge,
)
from dd_queue.keys import SYNC_GROUP, blob_chunk_key
from dd_queue.messages import Contribution, GlobalFragment, MessageLimits, pack_blob
from tests.bus_support import dead_letter, stage_global_fragment
from tests.integration.conftest import CHUNK_BYTES, BusCase

G = SYNC_GROUP
LIMITS = MessageLimits()
N = 5000  # 20 KB in fp32, 2.8 KB in int4: several 1 KiB chunks for every codec
FRAGMENT, ROUND, LEARNER = 3, 7, "L1"
SPECS = [
    CodecSpec("fp32"),
    CodecSpec("fp32", zstd_level=1),
    CodecSpec("bf16"),
    CodecSpec("bf16", zstd_level=1, shuffle=True),
    CodecSpec("int8", block_size=256),
    CodecSpec("int8", block_size=256, zstd_level=3),
    CodecSpec("int4", block_size=64),
    CodecSpec("int4", block_size=64, zstd_level=1),
]


def spec_id(spec: CodecSpec) -> str:
    return f"{spec.name}-z{spec.zstd_level or 0}{'-shuffle' if spec.shuffle else ''}"


def outer_gradient(seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(N) * 1e-2).astype(np.float32)


def contribution(bus: Bus, encoded: EncodedTensor, **changes: object) -> Contribution:
    msg = Contribution(
        run_id=bus.keys.run_id,
        config_digest="cfg0",
        learner_id=LEARNER,
        fragment_id=FRAGMENT,
        round_id=ROUND,
        base_version=4,
        n_steps=24,
        n_tokens=24 * 4096,
        tensor=encoded.header,
        created_at_s=1.7e9,
    )
    return dataclasses.replace(msg, **changes)


def send(bus: Bus) -> BlobRef:
    """Publish one valid fp32 contribution of ``outer_gradient()``; returns its blob."""
    encoded = encode(outer_gradient(), CodecSpec("fp32"))
    return ops.send_contribution(bus, contribution(bus, encoded), encoded, ttl_s=60)[1]


def error_bound(x: np.ndarray, spec: CodecSpec) -> np.ndarray:
    """Per-element bound of ``dd_queue.core.codec``'s docstring (0 for fp32)."""
    magnitude = np.abs(x.astype(np.float64))
    if spec.name == "fp32":
        return np.zeros_like(magnitude)
    if spec.name == "bf16":
        return 2.0**-8 * magnitude + 2.0**-134
    n_blocks = -(-x.size // spec.block_size)
    padded = np.zeros(n_blocks * spec.block_size)
    padded[: x.size] = magnitude
    absmax = np.repeat(padded.reshape(n_blocks, -1).max(axis=1), spec.block_size)[: x.size]
    levels = 127 if spec.name == "int8" else 7
    return absmax / levels / 2 + absmax * 2.0**-21 + 2.0**-140


# ── contributions ───────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_contribution_round_trip_through_the_group(bus_case: BusCase, spec: CodecSpec) -> None:
    bus = bus_case.bus
    x = outer_gradient()
    encoded = encode(x, spec)
    msg = contribution(bus, encoded)
    entry_id, ref = ops.send_contribution(bus, msg, encoded, ttl_s=60, maxlen=1000)
    assert ref.key == bus.keys.up_blob(FRAGMENT, ROUND, LEARNER)
    assert ref.n_chunks == -(-ref.nbytes // CHUNK_BYTES) > 1  # chunking really happened

    up = bus.keys.up(FRAGMENT)
    [entry] = bus.read_group(up, G, "sync-0", count=10)
    assert entry.id == entry_id and ops.blob_ref(entry) == ref
    assert set(entry.fields) == {"m", ops.BLOB_FIELD}  # the reference is the only location
    out = np.full(N, np.nan, np.float32)
    received, values = ops.read_contribution(
        bus, entry, run_id=bus.keys.run_id, limits=LIMITS, out=out
    )
    assert values is out
    assert received == msg and received.identity == (LEARNER, FRAGMENT, ROUND)
    assert (received.base_version, received.n_steps, received.n_tokens) == (4, 24, 24 * 4096)
    if spec.name == "fp32":
        np.testing.assert_array_equal(out.view(np.uint32), x.view(np.uint32))
    else:
        err = np.abs(out.astype(np.float64) - x.astype(np.float64))
        assert np.all(err <= error_bound(x, spec))
    assert bus.ack(up, G, [entry.id], delete_keys=ref.chunk_keys()) == 1
    assert bus.pending_summary(up, G).count == 0
    with pytest.raises(BlobMissing):
        ops.read_contribution(bus, entry, run_id=bus.keys.run_id, limits=LIMITS)


def test_send_refuses_mismatched_messages(bus_case: BusCase) -> None:
    bus = bus_case.bus
    encoded = encode(outer_gradient(), CodecSpec("int8"))
    other = encode(outer_gradient(1), CodecSpec("int8"))
    with pytest.raises(ValueError, match="describes"):
        ops.send_contribution(bus, contribution(bus, other), encoded, ttl_s=60)
    with pytest.raises(ValueError, match="run"):
        ops.send_contribution(
            bus, contribution(bus, encoded, run_id="elsewhere"), encoded, ttl_s=60
        )
    assert bus.stream_length(bus.keys.up(FRAGMENT)) == 0


# ── refused entries: dead-lettered with their reason, acked, never lost ───────────────────


def _corrupt_blob(bus: Bus) -> tuple[int, MessageLimits]:
    ref = send(bus)
    chunk = blob_chunk_key(ref.key, ref.n_chunks - 2)  # a chunk inside the payload
    value = bytearray(bus.get(chunk) or b"")
    value[100] ^= 0x10
    bus.set(chunk, bytes(value))
    return FRAGMENT, LIMITS


def _deleted_blob(bus: Bus) -> tuple[int, MessageLimits]:
    bus.delete_blobs([send(bus)])
    return FRAGMENT, LIMITS


def _other_run(bus: Bus) -> tuple[int, MessageLimits]:
    encoded = encode(outer_gradient(), CodecSpec("bf16"))
    foreign = contribution(bus, encoded, run_id="another-run")
    ops.publish_contribution(
        bus,
        fragment_id=FRAGMENT,
        round_id=ROUND,
        learner_id=LEARNER,
        payload=pack_blob(
            run_id="another-run",
            blob_key=bus.keys.up_blob(FRAGMENT, ROUND, LEARNER),
            encoded=encoded,
        ),
        fields=foreign.to_fields(),
        ttl_s=60,
    )
    return FRAGMENT, LIMITS


def _nan_payload(bus: Bus) -> tuple[int, MessageLimits]:
    """A NaN smuggled past encode's own check, sealed with a valid checksum."""
    encoded = encode(outer_gradient(), CodecSpec("fp32"))
    raw = np.frombuffer(encoded.payload, np.float32).copy()
    raw[1234] = np.nan
    raw_u8 = raw.view(np.uint8)
    header = dataclasses.replace(
        encoded.header, checksum=codec._checksum(raw_u8, "fp32", N, 0, False)
    )
    forged = EncodedTensor(header, memoryview(raw_u8.tobytes()))
    ops.send_contribution(bus, contribution(bus, forged), forged, ttl_s=60)
    return FRAGMENT, LIMITS


def _oversized_blob(bus: Bus) -> tuple[int, MessageLimits]:
    tight = MessageLimits(max_envelope_bytes=1024, tensor=DecodeLimits(max_payload_bytes=1024))
    # refused from the reference alone: the blob is gone, and the error is still "too large"
    bus.delete_blobs([send(bus)])
    return FRAGMENT, tight


def _wrong_stream(bus: Bus) -> tuple[int, MessageLimits]:
    send(bus)
    entry = bus.read_latest(bus.keys.up(FRAGMENT))
    assert entry is not None
    bus.append(bus.keys.up(FRAGMENT + 1), entry.fields)  # fragment 3's message on fragment 4
    return FRAGMENT + 1, LIMITS


def _foreign_reference(bus: Bus) -> tuple[int, MessageLimits]:
    """L1's envelope with a reference to L2's (well-formed) blob of the same round."""
    encoded = encode(outer_gradient(), CodecSpec("fp32"))
    key = bus.keys.up_blob(FRAGMENT, ROUND, "L2")
    ref = bus.put_blob(
        key, pack_blob(run_id=bus.keys.run_id, blob_key=key, encoded=encoded), ttl_s=60
    )
    fields = {**contribution(bus, encoded).to_fields(), ops.BLOB_FIELD: ref.to_bytes()}
    bus.append(bus.keys.up(FRAGMENT), fields)
    return FRAGMENT, LIMITS


Prepare = Callable[[Bus], tuple[int, MessageLimits]]
BAD: dict[str, tuple[Prepare, type[DDQError], str, str]] = {
    "corrupt_blob": (_corrupt_blob, CorruptPayload, "corrupt", "checksum"),
    "deleted_blob": (_deleted_blob, BlobMissing, "blob_missing", "missing"),
    "other_run": (_other_run, IncompatibleMessage, "incompatible", "another-run"),
    "nan_payload": (_nan_payload, NonFiniteValues, "non_finite", "NaN"),
    "oversized_blob": (_oversized_blob, PayloadTooLarge, "too_large", "exceeds"),
    "wrong_stream": (_wrong_stream, CorruptPayload, "corrupt", "belongs on"),
    "foreign_reference": (_foreign_reference, CorruptPayload, "corrupt", "L2"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_refused_entries_are_dead_lettered_and_acked(bus_case: BusCase, case: str) -> None:
    bus = bus_case.bus
    prepare, error, reason, match = BAD[case]
    fragment, limits = prepare(bus)
    up = bus.keys.up(fragment)
    [entry] = bus.read_group(up, G, "sync-0", count=10)
    with pytest.raises(error, match=match) as refused:
        ops.read_contribution(bus, entry, run_id=bus.keys.run_id, limits=limits)
    assert ops.rejection_reason(refused.value) == reason  # type: ignore[arg-type]

    dlq = bus.keys.dlq(fragment)
    dead_id = dead_letter(bus, entry, group=G, dlq=dlq, reason=reason)
    assert bus.pending_summary(up, G).count == 0
    [dead] = bus.read(dlq)
    assert dead.id == dead_id
    assert dead.fields["ddq.dlq.reason"] == reason.encode()
    assert dead.fields["ddq.dlq.id"] == entry.id.encode()
    assert all(dead.fields[name] == value for name, value in entry.fields.items())


# ── global fragments ────────────────────────────────────────────────────────────────────────


def _global(bus: Bus, encoded: EncodedTensor, version: int = 6) -> GlobalFragment:
    return GlobalFragment(
        run_id=bus.keys.run_id,
        fragment_id=FRAGMENT,
        version=version,
        round_id=ROUND,
        tensor=encoded.header,
        created_at_s=1.7e9,
        reason="quorum 2/3 after grace window 0.4 s",
    )


@pytest.mark.parametrize("zstd_level", [0, 1])
def test_global_fragment_through_a_fenced_commit_is_bit_exact(
    bus_case: BusCase, zstd_level: int
) -> None:
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(FRAGMENT), "sync-0", ttl_s=30)
    assert lease is not None
    theta = (np.random.default_rng(2).standard_normal(N) * 0.02).astype(np.float32)
    theta[:4] = [-0.0, np.float32(1e-45), np.float32(3e38), np.float32(-1e-40)]
    encoded = encode(theta, CodecSpec("fp32", zstd_level=zstd_level))
    msg = _global(bus, encoded)
    ref = stage_global_fragment(bus, lease, msg, encoded, ttl_s=60)
    assert ref.key == bus.keys.global_blob(FRAGMENT, 6, lease.token) and ref.n_chunks > 1
    notify = ops.global_notification_op(bus, msg, ref, maxlen=100)
    result = bus.commit(lease, [notify, SetOp(bus.keys.state(FRAGMENT), b"v6")], commit_id="f3:v6")

    entry = ops.latest_global(bus, FRAGMENT)
    assert entry is not None and (entry.id,) == result.entry_ids
    received, values = ops.read_global(bus, entry, run_id=bus.keys.run_id, limits=LIMITS)
    assert received == msg
    np.testing.assert_array_equal(values.view(np.uint32), theta.view(np.uint32))


def test_global_fragment_refusals(bus_case: BusCase) -> None:
    bus = bus_case.bus
    lease = bus.acquire_lease(bus.keys.lease(FRAGMENT), "sync-0", ttl_s=30)
    assert lease is not None
    lossy = encode(outer_gradient(), CodecSpec("int8"))
    with pytest.raises(ValueError, match="fp32"):
        stage_global_fragment(bus, lease, _global(bus, lossy), lossy, ttl_s=60)
    encoded = encode(outer_gradient(), CodecSpec("fp32"))
    ref = stage_global_fragment(bus, lease, _global(bus, encoded, version=5), encoded, ttl_s=60)
    # an announcement of version 6 that points to version 5's blob
    bus.commit(
        lease, [ops.global_notification_op(bus, _global(bus, encoded), ref)], commit_id="f3:v6"
    )
    entry = ops.latest_global(bus, FRAGMENT)
    assert entry is not None
    with pytest.raises(CorruptPayload, match="version 6"):
        ops.read_global(bus, entry, run_id=bus.keys.run_id, limits=LIMITS)
    with pytest.raises(IncompatibleMessage):
        ops.read_global(bus, entry, run_id="another-run", limits=LIMITS)
    odd_token = BlobRef(bus.keys.global_blob(FRAGMENT, 6, 0)[:-1] + "²", 1, ref.nbytes)
    bus.commit(
        lease,
        [ops.global_notification_op(bus, _global(bus, encoded), odd_token)],
        commit_id="f3:v6b",
    )
    entry = ops.latest_global(bus, FRAGMENT)
    assert entry is not None
    with pytest.raises(CorruptPayload, match="version 6"):
        ops.read_global(bus, entry, run_id=bus.keys.run_id, limits=LIMITS)
