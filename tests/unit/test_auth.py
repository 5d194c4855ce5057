"""Signed messages (dd_queue.auth): keys, signatures over entries, blobs and heartbeats, the
member rule, replay guards and the ``ddq keys`` command. Real Ed25519 (cryptography), MemoryBus."""

from __future__ import annotations

import dataclasses
import json
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dd_queue.auth import (
    CONTROL,
    OPEN,
    SIG_FIELD,
    SYNCHRONIZER,
    Auth,
    FreshCommands,
    KeyRing,
    Refusals,
    learner_principal,
    principals,
    write_keys,
)
from dd_queue.bus import Bus, MemoryBus, ops
from dd_queue.config import AuthConfig
from dd_queue.core.codec import CodecSpec, encode
from dd_queue.errors import ConfigError, CorruptPayload, Unauthenticated
from dd_queue.messages import (
    Contribution,
    FaultCommand,
    GlobalFragment,
    Heartbeat,
    MessageLimits,
)
from dd_queue.wire import ENTRY_FIELD, pack_blob, unpack_blob
from tests.bus_support import stage_global_fragment

RUN = "authrun"
LIMITS = MessageLimits()


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("keys")
    write_keys(out, RUN, principals(["L0", "L1"]))
    return out


def auth_of(keys: Path, principal: str | None) -> Auth:
    return Auth.load(AuthConfig(keys_dir=keys), RUN, principal)


def contribution(learner: str = "L0", **changes: object) -> tuple[Contribution, object]:
    encoded = encode(np.linspace(-1, 1, 300, dtype=np.float32), CodecSpec("fp32"))
    msg = Contribution(
        run_id=RUN,
        config_digest="d",
        learner_id=learner,
        fragment_id=0,
        round_id=3,
        base_version=1,
        n_steps=10,
        n_tokens=1000,
        tensor=encoded.header,
        created_at_s=1.7e9,
    )
    return dataclasses.replace(msg, **changes), encoded


def heartbeat(member: str, role: str = "learner") -> Heartbeat:
    return Heartbeat(
        run_id=RUN,
        config_digest="d",
        role=role,  # type: ignore[arg-type]
        member_id=member,
        state="training",
        step=1,
        n_tokens=10,
        step_time_ema_s=0.1,
        versions={0: 1},
        queue_depths={},
        device="cpu",
        host="h",
        pid=1,
        sent_at_s=1.7e9,
    )


def only_entry(bus: Bus, stream: str):  # type: ignore[no-untyped-def]
    (entry,) = bus.read(stream, after_id="0-0")
    return entry


# ── keys and loading ──────────────────────────────────────────────────────────────────────


def test_write_keys_makes_one_private_key_per_principal_readable_only_by_its_owner(keys: Path):
    ring = KeyRing.from_json((keys / "keyring.json").read_text(), where="k")
    assert set(ring.keys) == {SYNCHRONIZER, CONTROL, "learner.L0", "learner.L1"}
    assert ring.learners == {"L0", "L1"}
    for principal in ring.keys:
        mode = (keys / f"{principal}.key").stat().st_mode
        assert stat.S_IMODE(mode) == 0o600
    assert "PRIVATE" not in (keys / "keyring.json").read_text()  # public keys only


def test_rerunning_keeps_every_key_and_adds_new_learners(tmp_path: Path):
    first = write_keys(tmp_path, RUN, principals(["L0"]))
    second = write_keys(tmp_path, RUN, principals(["L1"]))
    assert second.keys["learner.L0"] == first.keys["learner.L0"]  # an earlier member stays
    assert second.keys[SYNCHRONIZER] == first.keys[SYNCHRONIZER]
    assert "learner.L1" in second.keys


def test_no_keys_dir_is_open(keys: Path):
    assert Auth.load(AuthConfig(), RUN, SYNCHRONIZER) is OPEN
    assert not OPEN.checks and OPEN.sign(b"x") is None


def test_loading_refuses_a_missing_foreign_or_mismatched_key_with_the_fix(
    keys: Path, tmp_path: Path
):
    with pytest.raises(ConfigError, match="ddq keys"):
        Auth.load(AuthConfig(keys_dir=tmp_path), RUN, SYNCHRONIZER)
    with pytest.raises(ConfigError, match="keyring of run 'authrun'"):
        Auth.load(AuthConfig(keys_dir=keys), "other", SYNCHRONIZER)
    with pytest.raises(ConfigError, match=r"learner\.L9 holds no key.*ddq keys"):
        Auth.load(AuthConfig(keys_dir=keys), RUN, learner_principal("L9"))
    with pytest.raises(ConfigError, match="not the key"):
        Auth.load(AuthConfig(keys_dir=keys, key_file=keys / "control.key"), RUN, SYNCHRONIZER)
    (tmp_path / "keyring.json").write_text('{"format": "nope"}')
    with pytest.raises(ConfigError, match="not a dd_queue keyring"):
        Auth.load(AuthConfig(keys_dir=tmp_path), RUN, None)


def test_the_key_is_never_in_the_repr(keys: Path):
    auth = auth_of(keys, SYNCHRONIZER)
    pem = (keys / "synchronizer.key").read_text()
    assert "_key" not in repr(auth) and pem.splitlines()[1] not in repr(auth)


# ── entries ─────────────────────────────────────────────────────────────────────────────


def test_a_signed_contribution_reads_back_and_every_forgery_is_unauthenticated(keys: Path):
    sync = auth_of(keys, SYNCHRONIZER)
    bus = MemoryBus(RUN)
    msg, encoded = contribution()
    ops.send_contribution(bus, msg, encoded, ttl_s=60, auth=auth_of(keys, "learner.L0"))
    entry = only_entry(bus, bus.keys.up(0))
    got, delta = ops.read_contribution(bus, entry, run_id=RUN, limits=LIMITS, auth=sync)
    assert got == msg and np.array_equal(delta, np.linspace(-1, 1, 300, dtype=np.float32))

    forgeries = {
        # no key at all (the attack of issue #22: anyone who can write to Redis)
        "unsigned": (contribution(), OPEN),
        # a member that signs for another member
        "as another learner": (contribution("L0"), auth_of(keys, "learner.L1")),
        # an id that holds no key: not a member, whatever n_tokens it claims
        "not a member": (contribution("L7", n_tokens=2**62), auth_of(keys, "learner.L1")),
        # the synchronizer's key is not a learner's
        "with the synchronizer's key": (contribution("L1"), sync),
    }
    for why, ((forged, enc), signer) in forgeries.items():
        bus = MemoryBus(RUN)
        ops.send_contribution(bus, forged, enc, ttl_s=60, auth=signer)
        entry = only_entry(bus, bus.keys.up(0))
        with pytest.raises(Unauthenticated) as info:
            ops.read_contribution(bus, entry, run_id=RUN, limits=LIMITS, auth=sync)
        assert info.value.reason == "unauthenticated", why
        # a reader without a keyring takes what is well formed: that is what signing fixes
        ops.read_contribution(bus, entry, run_id=RUN, limits=LIMITS)


def test_a_signed_envelope_with_a_changed_field_does_not_verify(keys: Path):
    sync, learner = auth_of(keys, SYNCHRONIZER), auth_of(keys, "learner.L0")
    bus = MemoryBus(RUN)
    msg, encoded = contribution()
    ops.send_contribution(bus, msg, encoded, ttl_s=60, auth=learner)
    entry = only_entry(bus, bus.keys.up(0))
    inflated = dataclasses.replace(msg, n_tokens=2**62).to_fields()[ENTRY_FIELD]
    forged = dataclasses.replace(entry, fields={**entry.fields, ENTRY_FIELD: inflated})
    with pytest.raises(Unauthenticated, match="does not verify"):
        ops.read_contribution(bus, forged, run_id=RUN, limits=LIMITS, auth=sync)
    elsewhere = dataclasses.replace(entry, stream=bus.keys.up(1))  # copied to another stream
    with pytest.raises((Unauthenticated, CorruptPayload)):
        ops.read_contribution(bus, elsewhere, run_id=RUN, limits=LIMITS, auth=sync)


def test_a_replaced_blob_is_unauthenticated_even_with_a_valid_checksum(keys: Path):
    """The attack of issue #22: a blob swapped for another whose CRC-32 was made to match."""
    learner, sync = auth_of(keys, "learner.L0"), auth_of(keys, SYNCHRONIZER)
    msg, encoded = contribution()
    key = "k"
    blob = pack_blob(run_id=RUN, blob_key=key, encoded=encoded, sign=learner.blob_signer(RUN))
    check = sync.blob_check(RUN, "learner.L0")
    unpack_blob(blob, run_id=RUN, blob_key=key, expect=msg.tensor, limits=LIMITS, check=check)
    other = encode(np.zeros(300, np.float32), CodecSpec("fp32"))
    forged = bytearray(blob)
    forged[-len(bytes(other.payload)) :] = bytes(other.payload)  # any payload, same length
    with pytest.raises(Unauthenticated):
        unpack_blob(
            bytes(forged), run_id=RUN, blob_key=key, expect=msg.tensor, limits=LIMITS, check=check
        )
    unsigned = pack_blob(run_id=RUN, blob_key=key, encoded=encoded)
    with pytest.raises(Unauthenticated, match="no valid signature"):
        unpack_blob(
            unsigned, run_id=RUN, blob_key=key, expect=msg.tensor, limits=LIMITS, check=check
        )
    check_other = sync.blob_check(RUN, "learner.L1")  # signed, but by somebody else
    with pytest.raises(Unauthenticated):
        unpack_blob(
            blob, run_id=RUN, blob_key=key, expect=msg.tensor, limits=LIMITS, check=check_other
        )


def test_global_fragments_must_come_from_the_synchronizer(keys: Path):
    bus = MemoryBus(RUN)
    lease = bus.acquire_lease(bus.keys.lease(0), "s", ttl_s=30)
    assert lease is not None
    encoded = encode(np.ones(300, np.float32), CodecSpec("fp32"))
    learner_view = auth_of(keys, "learner.L0")
    signers = ((auth_of(keys, SYNCHRONIZER), True), (learner_view, False), (OPEN, False))
    for i, (signer, ok) in enumerate(signers):
        msg = GlobalFragment(
            run_id=RUN,
            fragment_id=0,
            version=1 if ok else 1015 + i,  # the attack of issue #22: a far-ahead version
            round_id=1,
            tensor=encoded.header,
            created_at_s=1.7e9,
            reason="r",
        )
        ref = stage_global_fragment(bus, lease, msg, encoded, ttl_s=60, auth=signer)
        bus.append(bus.keys.down(0), ops.global_notification_fields(bus, msg, ref, auth=signer))
        entry = bus.read_latest(bus.keys.down(0))
        assert entry is not None
        if ok:
            got, theta = ops.read_global(bus, entry, run_id=RUN, limits=LIMITS, auth=learner_view)
            assert got.version == 1 and np.array_equal(theta, np.ones(300, np.float32))
        else:
            with pytest.raises(Unauthenticated):
                ops.read_global(bus, entry, run_id=RUN, limits=LIMITS, auth=learner_view)


def test_fault_commands_must_be_signed_by_the_control_plane_for_their_stream(keys: Path):
    bus, reader = MemoryBus(RUN), auth_of(keys, "learner.L0")
    cmd = FaultCommand(
        run_id=RUN,
        fault_id="f1",
        target="*",
        kind="kill",
        params={},
        duration_s=None,
        issued_at_s=1.7e9,
    )
    ops.send_command(bus, "all", cmd.to_fields(), auth=auth_of(keys, CONTROL))
    entry = only_entry(bus, bus.keys.control("all"))
    assert ops.read_command(entry, run_id=RUN, limits=LIMITS, auth=reader) == cmd
    with pytest.raises(Unauthenticated):  # the same signed command copied to L0's stream
        ops.read_command(
            dataclasses.replace(entry, stream=bus.keys.control("L0")),
            run_id=RUN,
            limits=LIMITS,
            auth=reader,
        )
    for forger in (OPEN, auth_of(keys, SYNCHRONIZER), reader):
        bus = MemoryBus(RUN)
        ops.send_command(bus, "all", cmd.to_fields(), auth=forger)
        with pytest.raises(Unauthenticated):
            ops.read_command(
                only_entry(bus, bus.keys.control("all")), run_id=RUN, limits=LIMITS, auth=reader
            )


def test_a_signature_of_the_wrong_length_or_type_is_unauthenticated(keys: Path):
    ring = auth_of(keys, None).keyring
    assert ring is not None
    for sig in (None, b"", b"x" * 63, b"x" * 65, "x" * 64, 7):
        with pytest.raises(Unauthenticated, match="no valid signature"):
            ring.verify(SYNCHRONIZER, b"data", sig)
    with pytest.raises(Unauthenticated, match="does not verify"):
        ring.verify(SYNCHRONIZER, b"data", b"\0" * 64)


# ── heartbeats: only members count ─────────────────────────────────────────────────────────


def test_heartbeats_count_only_when_sealed_by_their_member(keys: Path):
    reader = auth_of(keys, CONTROL)
    bus = MemoryBus(RUN)
    ops.heartbeat(bus, heartbeat("L0"), ttl_s=30, auth=auth_of(keys, "learner.L0"))
    ops.heartbeat(
        bus, heartbeat("sync-0", "synchronizer"), ttl_s=30, auth=auth_of(keys, SYNCHRONIZER)
    )
    ops.heartbeat(bus, heartbeat("L1"), ttl_s=30, auth=auth_of(keys, "learner.L0"))  # for L1
    ops.heartbeat(bus, heartbeat("ghost"), ttl_s=30)  # unsigned, not a member
    ops.heartbeat(
        bus, heartbeat("sync-9", "synchronizer"), ttl_s=30, auth=auth_of(keys, "learner.L0")
    )
    accepted, refused = [], []
    for member, info in sorted(bus.heartbeats().items()):
        try:
            ops.read_heartbeat(member, info.payload, run_id=RUN, limits=LIMITS, auth=reader)
            accepted.append(member)
        except Unauthenticated:
            refused.append(member)
    assert accepted == ["L0", "sync-0"] and refused == ["L1", "ghost", "sync-9"]
    # readers without a keyring still read sealed heartbeats (a mixed upgrade keeps working)
    for member, info in bus.heartbeats().items():
        assert (
            ops.read_heartbeat(member, info.payload, run_id=RUN, limits=LIMITS).member_id == member
        )


def test_a_heartbeat_stored_in_another_members_slot_is_refused():
    data = heartbeat("L0").to_bytes()
    with pytest.raises(CorruptPayload, match="stored as 'L1'"):
        ops.read_heartbeat("L1", data, run_id=RUN, limits=LIMITS)


# ── replay guard and refusal counts (pure) ────────────────────────────────────────────────


def test_fresh_commands_refuse_a_repeat_and_an_old_command():
    fresh = FreshCommands(max_age_s=300)
    assert fresh.refusal("a", issued_at_s=1000.0, now_s=1010.0) is None
    assert "before" in (fresh.refusal("a", issued_at_s=1000.0, now_s=1011.0) or "")
    assert "ago" in (fresh.refusal("b", issued_at_s=1000.0, now_s=1300.5) or "")
    assert fresh.refusal("b", issued_at_s=1000.0, now_s=1299.0) is None  # not remembered when old


def test_refusals_count_every_one_and_report_in_batches():
    refusals = Refusals(interval_s=5.0)
    reports = [refusals.add("heartbeat", "unauthenticated", t) for t in np.arange(0, 12, 0.1)]
    assert refusals.total == {("heartbeat", "unauthenticated"): 120}
    sent = [r for r in reports if r]
    assert len(sent) == 3  # at 0 s, 5 s and 10 s: a flood costs one report an interval
    assert sum(n for r in sent for n in r.values()) <= 120
    assert sum(n for r in sent for n in r.values()) + 19 >= 120  # only the tail is pending


# ── ddq keys ────────────────────────────────────────────────────────────────────────────


def test_ddq_keys_writes_a_keyring_and_ends_with_json(tmp_path: Path):
    out = tmp_path / "k"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dd_queue.cli",
            "keys",
            "--config",
            "demo",
            "--out",
            str(out),
            "--learner-ids",
            "L0,L3",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["run_id"] == "demo"
    assert {k["principal"] for k in summary["keys"]} == {
        "synchronizer",
        "control",
        "learner.L0",
        "learner.L3",
    }
    assert Auth.load(AuthConfig(keys_dir=out), "demo", "learner.L3").checks
    bad = subprocess.run(
        [sys.executable, "-m", "dd_queue.cli", "keys", "--out", str(out), "--learner-ids", "a b"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "learner_id" in bad.stderr
    assert SIG_FIELD == "sig"
