"""Θ_p and momentum blobs: staged before the commit that references them, fetched on load.

Blobs of the committed state are kept without expiry: a fragment may go unmerged for hours (no
learner alive, every synchronizer down) and its Θ_p must still be there. They are deleted by the
commit that stops referencing them (a version leaving the ring, the previous momentum), inside
that same fenced commit, so nothing the state references can vanish and nothing it dropped stays.
A crash between staging and the commit leaves the staged blobs of that one version behind, under
the crashed incarnation's fencing token (noted in ``docs/protocol.md``).

Θ_p blobs use the wire's blob framing with the fp32 codec (learners read them with
``ops.read_global``, bit-exact); momentum blobs hold ``core.outer.state_to_bytes``. Both are a
short header followed by the array's bytes; for an array from the ``BufferPool`` the header is
written into the spare bytes in front of it (``buffers.framed``), so the blob goes to the socket
without being copied; any other array is sent as header + array, which the bus joins (one copy).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from dd_queue.auth import OPEN, SYNCHRONIZER, Auth
from dd_queue.bus import BlobRef, Bus, Lease
from dd_queue.core.anchor import VersionRing
from dd_queue.core.codec import TensorHeader, decode, encode_fp32_view
from dd_queue.core.merge import F32
from dd_queue.core.outer import NesterovState, state_from_bytes, state_parts
from dd_queue.errors import BlobMissing, CoreError, CorruptPayload, ProtocolError
from dd_queue.fragment_state import FragmentState, VersionRef
from dd_queue.messages import MessageLimits
from dd_queue.synchronizer.buffers import framed
from dd_queue.wire import blob_parts, unpack_blob

log = logging.getLogger("dd_queue.synchronizer")

__all__ = ["delete_keys_of", "load_momentum", "load_ring", "stage"]


def stage(
    bus: Bus,
    lease: Lease,
    *,
    fragment_id: int,
    version: int,
    theta: F32,
    state: NesterovState,
    auth: Auth = OPEN,
) -> tuple[VersionRef, TensorHeader, BlobRef]:
    """Write Θ_p(``version``) (exact fp32) and the outer momentum after it under the lease's
    fencing token, without expiry, in one round trip (``Bus.put_blobs``).

    Zero-copy for pooled arrays (module doc): each blob is the array's own memory with its
    header in front, handed to the socket as it is; neither may change during the call. With a
    key, the Θ_p blob's header carries the synchronizer's signature (learners and a
    synchronizer taking over check it).

    Returns:
        The ring entry to commit, the tensor header for the ``GlobalFragment`` notification,
        and the momentum blob's reference.

    Raises:
        LeaseLost: A key already holds another payload (another incarnation's staging).
    """
    theta_key = bus.keys.global_blob(fragment_id, version, lease.token)
    encoded = encode_fp32_view(theta)
    sign = auth.blob_signer(bus.keys.run_id)
    prefix, payload = blob_parts(
        run_id=bus.keys.run_id, blob_key=theta_key, encoded=encoded, sign=sign
    )
    header, body = state_parts(state)
    shared = np.may_share_memory(theta, state.momentum_buffer)  # one headroom: frame one only
    momentum_blob = None if shared else framed(state.momentum_buffer, header)
    theta_ref, momentum_ref = bus.put_blobs(
        [
            (theta_key, framed(theta, prefix) or [prefix, payload]),
            (
                bus.keys.momentum_blob(fragment_id, version, lease.token),
                momentum_blob or [header, body],
            ),
        ],
        ttl_s=None,
    )
    ring_entry = VersionRef(
        version=version, blob=theta_ref.to_bytes().decode(), tensor=encoded.header
    )
    return ring_entry, encoded.header, momentum_ref


def load_theta(
    bus: Bus, ref: VersionRef, *, limits: MessageLimits, size: int, auth: Auth = OPEN
) -> F32:
    """Fetch and decode Θ_p of one ring entry (checksum verified; with a keyring, the
    synchronizer's signature too: a replaced blob never becomes the global model).

    Raises:
        BlobMissing: The blob is gone (the run's state was damaged).
        ProtocolError: The blob does not match its reference, or is not signed
            (``Unauthenticated``).
    """
    blob_ref = ref.ref
    payload = unpack_blob(
        bus.get_blob(blob_ref),
        run_id=bus.keys.run_id,
        blob_key=blob_ref.key,
        expect=ref.tensor,
        limits=limits,
        check=auth.blob_check(bus.keys.run_id, SYNCHRONIZER),
    )
    theta = decode(ref.tensor, payload, limits=limits.tensor)
    if theta.size != size:
        raise CorruptPayload(f"{blob_ref.key}: {theta.size} elements, the fragment has {size}")
    return np.array(theta, dtype=np.float32, copy=True)


def load_ring(
    bus: Bus,
    state: FragmentState,
    *,
    capacity: int,
    limits: MessageLimits,
    size: int,
    auth: Auth = OPEN,
) -> tuple[VersionRing, F32]:
    """The version ring (last ``capacity`` versions of the state's ring) and Θ_p(v), a copy.

    A kept version whose blob cannot be read (gone, corrupt, or for Θ_p(v) not signed by the
    synchronizer: it was replaced in Redis) never stops the synchronizer:

    - an older one is left out of the ring, with a logged reason (a contribution based on it is
      then dropped as its base left the ring);
    - the current one is replaced by the newest older version that loads (logged as an error,
      ``fragment.restored``; the next merge publishes from it), so a damaged or forged blob
      neither becomes the global model nor stops the run.

    Raises:
        BlobMissing: No kept version loads and Θ_p(v)'s blob is gone.
        CorruptPayload: No kept version loads and Θ_p(v)'s blob does not verify. Either message
            names the fragment and each version's reason.
    """
    ring = VersionRing(capacity=capacity, size=size)
    reasons: dict[int, Exception] = {}
    for ref in state.ring[-capacity:]:
        try:
            theta = load_theta(bus, ref, limits=limits, size=size, auth=auth)
        except (BlobMissing, ProtocolError) as exc:
            reasons[ref.version] = exc
            older = ring.latest_version
            if ref.version == state.version and older is not None:
                log.error(
                    "fragment.restored fragment %d: Θ of version %d cannot be read (%s: %s); "
                    "continuing from version %d's Θ",
                    state.fragment_id,
                    ref.version,
                    type(exc).__name__,
                    exc,
                    older,
                )
                restored = ring.get(older)
                assert restored is not None  # latest_version is in the ring
                ring.push(ref.version, restored)  # copied in
            elif ref.version != state.version:
                log.warning(
                    "fragment.ring_dropped fragment %d version %d: its blob cannot be read "
                    "(%s); contributions based on it are dropped",
                    state.fragment_id,
                    ref.version,
                    exc,
                )
            continue
        ring.push(ref.version, theta)
    current = ring.get(state.version)
    if current is None:
        raise _unloadable(state, reasons)
    return ring, np.array(current, dtype=np.float32, copy=True)


def _unloadable(state: FragmentState, reasons: dict[int, Exception]) -> BlobMissing | ProtocolError:
    """The error for a fragment none of whose kept versions loads: ``BlobMissing`` when Θ_p(v)'s
    blob is gone, else ``CorruptPayload``; the message lists every version's reason."""
    why = "; ".join(f"v{v}: {type(e).__name__}: {e}" for v, e in reasons.items())
    text = (
        f"fragment {state.fragment_id}: no kept version of Θ loads "
        f"(current v{state.version}; {why or 'the ring holds no version'})"
    )
    if isinstance(reasons.get(state.version), BlobMissing):
        return BlobMissing(text)
    return CorruptPayload(text)


def load_momentum(bus: Bus, state: FragmentState, *, size: int) -> NesterovState:
    """The outer Nesterov state after the state's version.

    A momentum blob that is gone or does not decode is never a crash: the fragment continues
    with zero momentum (logged as an error, ``momentum.reset``); the next outer step
    initialises it from its gradient, as on the first step.
    """
    try:
        return state_from_bytes(bus.get_blob(state.momentum_ref), size=size)
    except (BlobMissing, ProtocolError, CoreError) as exc:
        log.error(
            "momentum.reset fragment %d: the momentum blob of version %d cannot be read "
            "(%s: %s); continuing with zero momentum",
            state.fragment_id,
            state.version,
            type(exc).__name__,
            exc,
        )
        return NesterovState.zeros(size)


def delete_keys_of(refs: Sequence[BlobRef]) -> tuple[str, ...]:
    """Every chunk key of the blobs (for a ``DeleteOp``)."""
    return tuple(key for ref in refs for key in ref.chunk_keys())
