"""A kept blob that cannot be read is never a crash (``dd_queue.synchronizer.blobs``), on MemoryBus.

A fragment's state names its ring of Θ_p blobs and its momentum blob; each is damaged here by
hand (overwritten with garbage, deleted, replaced by an unsigned one) and loaded again, as a
restarted synchronizer does: an unreadable older version leaves the ring, an unreadable current
one is replaced by the newest older version that loads, and lost momentum restarts from zero.
Only a fragment none of whose versions loads raises, naming each version's reason.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from dd_queue.auth import OPEN, SYNCHRONIZER, Auth, principals, write_keys
from dd_queue.bus import MemoryBus
from dd_queue.config import AuthConfig
from dd_queue.core.codec import encode_fp32_view
from dd_queue.core.outer import NesterovState
from dd_queue.errors import BlobMissing, CorruptPayload
from dd_queue.fragment_state import FragmentState, VersionRef
from dd_queue.messages import MessageLimits
from dd_queue.synchronizer import blobs
from dd_queue.wire import pack_blob

RUN = "t"
SIZE = 64
LIMITS = MessageLimits()
LOGGER = "dd_queue.synchronizer"


def theta_of(version: int) -> np.ndarray:
    return np.full(SIZE, version + 0.5, np.float32)


def kept(bus: MemoryBus, versions: int, *, auth: Auth = OPEN) -> FragmentState:
    """A fragment state whose ring holds versions 0..``versions``-1, each Θ_p(v) filled with
    v + 0.5 and the momentum after the last one filled with 7 (step 3)."""
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=600)
    assert lease is not None
    ring: list[VersionRef] = []
    momentum = None
    for v in range(versions):
        state = NesterovState(np.full(SIZE, 7.0, np.float32), step=3)
        ref, _, momentum = blobs.stage(
            bus, lease, fragment_id=0, version=v, theta=theta_of(v), state=state, auth=auth
        )
        ring.append(ref)
    assert momentum is not None
    return FragmentState(
        run_id=RUN,
        fragment_id=0,
        n_fragments=1,
        plan_digest="plan",
        config_digest="cfg",
        segments=(),
        version=versions - 1,
        last_merged_round_id=None,
        ring=tuple(ring),
        momentum=momentum.to_bytes().decode(),
        quorum_ema_s=None,
        sync_ema_s=None,
        ema_samples=(0, 0),
        counters={},
        last_reason="test",
        committed_by="sync-0",
    )


def ref_of(state: FragmentState, version: int) -> VersionRef:
    (ref,) = [r for r in state.ring if r.version == version]
    return ref


def corrupt(bus: MemoryBus, state: FragmentState, version: int) -> None:
    """Same size, wrong bytes: the checksum fails."""
    for key in ref_of(state, version).ref.chunk_keys():
        bus.set(key, b"\x00" * len(bus.get(key) or b"x"))


def delete(bus: MemoryBus, state: FragmentState, version: int) -> None:
    assert bus.delete_blobs([ref_of(state, version).ref]) >= 1


def load(bus: MemoryBus, state: FragmentState, *, capacity: int = 4, auth: Auth = OPEN):
    return blobs.load_ring(bus, state, capacity=capacity, limits=LIMITS, size=SIZE, auth=auth)


def messages(caplog, prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


def test_an_intact_ring_loads_every_version_and_logs_nothing(caplog):
    bus = MemoryBus(RUN)
    state = kept(bus, 3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ring, theta = load(bus, state)
    assert ring.versions == (0, 1, 2)
    np.testing.assert_array_equal(theta, theta_of(2))
    assert theta.flags.writeable
    assert not caplog.records


@pytest.mark.parametrize("damage", [corrupt, delete], ids=["corrupt", "missing"])
def test_an_unreadable_current_theta_is_restored_from_the_newest_older_version(damage, caplog):
    bus = MemoryBus(RUN)
    state = kept(bus, 3)
    damage(bus, state, 2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ring, theta = load(bus, state)
    assert ring.versions == (0, 1, 2)  # v2 holds v1's Θ: contributions based on v2 re-anchor
    np.testing.assert_array_equal(theta, theta_of(1))
    np.testing.assert_array_equal(ring.get(2), theta_of(1))
    np.testing.assert_array_equal(ring.get(1), theta_of(1))
    (msg,) = messages(caplog, "fragment.restored")
    reason = "BlobMissing" if damage is delete else "CorruptPayload"
    assert msg.startswith("fragment.restored fragment 0: Θ of version 2 cannot be read")
    assert reason in msg and "continuing from version 1's Θ" in msg
    assert [r.levelno for r in caplog.records] == [logging.ERROR]


def test_the_current_theta_skips_an_unreadable_older_version_too(caplog):
    bus = MemoryBus(RUN)
    state = kept(bus, 4)
    corrupt(bus, state, 3)
    delete(bus, state, 2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ring, theta = load(bus, state)
    assert ring.versions == (0, 1, 3)
    np.testing.assert_array_equal(theta, theta_of(1))
    (dropped,) = messages(caplog, "fragment.ring_dropped")
    assert dropped.startswith("fragment.ring_dropped fragment 0 version 2")
    (restored,) = messages(caplog, "fragment.restored")
    assert "version 3" in restored and "from version 1's Θ" in restored


def replace_current(bus: MemoryBus, state: FragmentState, theta: np.ndarray) -> FragmentState:
    """Θ_p(v) rewritten by another writer as a well-formed, unsigned blob of ``theta``, and the
    state's ring entry pointed at it (its size and header match the new blob)."""
    current = ref_of(state, state.version)
    encoded = encode_fp32_view(theta)
    blob = pack_blob(run_id=RUN, blob_key=current.ref.key, encoded=encoded)
    bus.delete_blobs([current.ref])  # put_blob never overwrites
    ref = bus.put_blob(current.ref.key, blob, ttl_s=None)
    entry = VersionRef(version=state.version, blob=ref.to_bytes().decode(), tensor=encoded.header)
    return dataclasses.replace(state, ring=(*state.ring[:-1], entry))


def test_a_current_theta_of_the_wrong_size_is_restored(caplog):
    """A valid blob of another size (another fragment's, copied over) is not this Θ_p."""
    bus = MemoryBus(RUN)
    state = replace_current(bus, kept(bus, 2), np.ones(SIZE // 2, np.float32))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _, theta = load(bus, state)
    np.testing.assert_array_equal(theta, theta_of(0))
    (msg,) = messages(caplog, "fragment.restored")
    assert f"32 elements, the fragment has {SIZE}" in msg, msg


def test_only_versions_in_the_capacity_are_tried():
    """The ring keeps the last ``capacity`` versions: an older state entry is no fallback."""
    bus = MemoryBus(RUN)
    state = kept(bus, 3)
    corrupt(bus, state, 2)
    corrupt(bus, state, 1)
    with pytest.raises(CorruptPayload, match="fragment 0: no kept version of Θ loads"):
        load(bus, state, capacity=2)
    ring, theta = load(bus, state, capacity=3)
    assert ring.versions == (0, 2)
    np.testing.assert_array_equal(theta, theta_of(0))


def test_no_loadable_version_raises_naming_each_versions_reason():
    bus = MemoryBus(RUN)
    state = kept(bus, 3)
    corrupt(bus, state, 0)
    delete(bus, state, 1)
    corrupt(bus, state, 2)
    with pytest.raises(CorruptPayload) as info:
        load(bus, state)
    text = str(info.value)
    assert text.startswith("fragment 0: no kept version of Θ loads (current v2; ")
    assert "v0: CorruptPayload" in text and "v1: BlobMissing" in text
    assert "v2: CorruptPayload" in text
    delete(bus, state, 2)
    with pytest.raises(BlobMissing, match=r"current v2; v0: CorruptPayload.*v2: BlobMissing"):
        load(bus, state)


def test_a_single_version_ring_that_cannot_load_raises():
    bus = MemoryBus(RUN)
    state = kept(bus, 1)
    delete(bus, state, 0)
    with pytest.raises(BlobMissing, match="fragment 0: no kept version"):
        load(bus, state)


def test_an_unsigned_current_theta_is_restored_from_a_signed_older_one(tmp_path: Path, caplog):
    """With a keyring, a Θ_p(v) replaced by a well-formed but unsigned blob never loads."""
    write_keys(tmp_path, RUN, principals(["L0"]))
    auth = Auth.load(AuthConfig(keys_dir=tmp_path), RUN, SYNCHRONIZER)
    bus = MemoryBus(RUN)
    state = replace_current(bus, kept(bus, 2, auth=auth), np.ones(SIZE, np.float32))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _, theta = load(bus, state, auth=auth)
    np.testing.assert_array_equal(theta, theta_of(0))
    (msg,) = messages(caplog, "fragment.restored")
    assert "Unauthenticated" in msg


def test_momentum_loads_when_intact():
    bus = MemoryBus(RUN)
    state = kept(bus, 2)
    momentum = blobs.load_momentum(bus, state, size=SIZE)
    np.testing.assert_array_equal(momentum.momentum_buffer, np.full(SIZE, 7.0))
    assert momentum.step == 3


def _momentum_of_size(bus: MemoryBus, size: int) -> str:
    """A momentum blob of another fragment (``size`` elements), as a state's reference."""
    lease = bus.acquire_lease(bus.keys.lease(1), "sync-0", ttl_s=600)
    assert lease is not None
    theta = np.zeros(size, np.float32)
    _, _, ref = blobs.stage(
        bus, lease, fragment_id=1, version=0, theta=theta, state=NesterovState.zeros(size)
    )
    return ref.to_bytes().decode()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [("missing", "BlobMissing"), ("garbage", "CoreError"), ("wrong size", "CoreError")],
)
def test_unreadable_momentum_is_reset_to_zero_with_a_logged_reason(damage, reason, caplog):
    bus = MemoryBus(RUN)
    state = kept(bus, 2)
    if damage == "missing":
        bus.delete_blobs([state.momentum_ref])
    elif damage == "garbage":
        for key in state.momentum_ref.chunk_keys():
            bus.set(key, b"\x00" * len(bus.get(key) or b"x"))
    else:
        state = dataclasses.replace(state, momentum=_momentum_of_size(bus, SIZE // 2))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        momentum = blobs.load_momentum(bus, state, size=SIZE)
    np.testing.assert_array_equal(momentum.momentum_buffer, np.zeros(SIZE, np.float32))
    assert momentum.step == 0 and momentum.momentum_buffer.flags.writeable
    (msg,) = messages(caplog, "momentum.reset")
    assert msg.startswith("momentum.reset fragment 0: ") and reason in msg, msg
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
