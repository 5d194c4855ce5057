"""The malformed-input corpus: over a thousand hostile inputs across every message type, each
refused with the right error by the reader that would meet it, and nothing crashes.

Every case goes through the real reader of its message (``ops.read_contribution``,
``ops.read_global``, ``ops.read_command``, ``ops.read_heartbeat``, ``Message.from_fields``,
``wire.unpack_blob``) of a signed run (dd_queue.auth, real Ed25519 keys) on a MemoryBus:
truncations, bit flips, wrong lengths, mistyped, missing and extra fields, zstd bombs, NaN/Inf,
wrong shapes, missing, foreign and misplaced signatures, and entries replayed from another run,
stream or round. A case passes when the reader raises the expected ``ProtocolError`` subclass
(``BlobMissing`` where a payload is gone); any other exception, or none, fails it.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zstandard

from dd_queue.auth import CONTROL, OPEN, SIG_FIELD, SYNCHRONIZER, Auth, principals, write_keys
from dd_queue.bus import Entry, MemoryBus, ops
from dd_queue.config import AuthConfig
from dd_queue.core import codec
from dd_queue.core.codec import CodecSpec, DecodeLimits, EncodedTensor, TensorHeader, encode
from dd_queue.errors import (
    BlobMissing,
    CorruptPayload,
    DDQError,
    IncompatibleMessage,
    NonFiniteValues,
    PayloadTooLarge,
    ProtocolError,
    Unauthenticated,
)
from dd_queue.messages import (
    ENTRY_FIELD,
    Contribution,
    ContributorRecord,
    EntryOutcome,
    Event,
    FaultCommand,
    GlobalFragment,
    Heartbeat,
    Message,
    MessageLimits,
    RoundOpen,
    RoundRecord,
)
from dd_queue.wire import pack_blob, unpack_blob
from tests.bus_support import stage_global_fragment

RUN = "corpus"
N = 256
LIMITS = MessageLimits(
    max_envelope_bytes=64 * 1024,
    tensor=DecodeLimits(max_payload_bytes=1 << 20, max_decompressed_bytes=1 << 20),
)
Expect = type[BaseException] | tuple[type[BaseException], ...]
Case = tuple[str, Callable[[], object], Expect]
ANY_REFUSAL: Expect = (ProtocolError, BlobMissing)


@dataclasses.dataclass
class World:
    """A signed run's keys and one valid, signed entry of each kind on a MemoryBus."""

    bus: MemoryBus
    sync: Auth
    control: Auth
    learners: dict[str, Auth]
    contribution: Entry
    global_entry: Entry
    command: Entry
    heartbeat: bytes


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    keys: Path = tmp_path_factory.mktemp("keys")
    write_keys(keys, RUN, principals(["L0", "L1"]))

    def load(principal: str | None) -> Auth:
        return Auth.load(AuthConfig(keys_dir=keys), RUN, principal)

    bus = MemoryBus(RUN)
    learners = {i: load(f"learner.{i}") for i in ("L0", "L1")}
    sync, control = load(SYNCHRONIZER), load(CONTROL)
    msg, encoded = contribution()
    ops.send_contribution(bus, msg, encoded, ttl_s=600, auth=learners["L0"])
    lease = bus.acquire_lease(bus.keys.lease(0), "s", ttl_s=600)
    assert lease is not None
    notice, theta = global_fragment(version=3)
    ref = stage_global_fragment(bus, lease, notice, theta, ttl_s=600, auth=sync)
    bus.append(bus.keys.down(0), ops.global_notification_fields(bus, notice, ref, auth=sync))
    ops.send_command(bus, "L0", command().to_fields(), auth=control)
    hb = heartbeat()
    sealed = learners["L0"].seal("heartbeat", run_id=RUN, where="heartbeat:L0", data=hb.to_bytes())
    return World(
        bus=bus,
        sync=sync,
        control=control,
        learners=learners,
        contribution=latest(bus, bus.keys.up(0)),
        global_entry=latest(bus, bus.keys.down(0)),
        command=latest(bus, bus.keys.control("L0")),
        heartbeat=sealed,
    )


def latest(bus: MemoryBus, stream: str) -> Entry:
    entry = bus.read_latest(stream)
    assert entry is not None
    return entry


# ── valid messages ────────────────────────────────────────────────────────────────────────


def contribution(**changes: Any) -> tuple[Contribution, EncodedTensor]:
    encoded = encode(
        np.linspace(-0.01, 0.01, N, dtype=np.float32), CodecSpec("int8", block_size=64)
    )
    msg = Contribution(
        run_id=RUN,
        config_digest="digest",
        learner_id="L0",
        fragment_id=0,
        round_id=5,
        base_version=3,
        n_steps=20,
        n_tokens=20 * 512,
        tensor=encoded.header,
        created_at_s=1.7e9,
    )
    return dataclasses.replace(msg, **changes), encoded


def global_fragment(version: int) -> tuple[GlobalFragment, EncodedTensor]:
    encoded = encode(np.ones(N, np.float32), CodecSpec("fp32"))
    msg = GlobalFragment(
        run_id=RUN,
        fragment_id=0,
        version=version,
        round_id=4,
        tensor=encoded.header,
        created_at_s=1.7e9,
        reason="merged",
    )
    return msg, encoded


def command(**changes: Any) -> FaultCommand:
    cmd = FaultCommand(
        run_id=RUN,
        fault_id="f1",
        target="L0",
        kind="slow",
        params={"factor": 2.0},
        duration_s=5.0,
        issued_at_s=1.7e9,
    )
    return dataclasses.replace(cmd, **changes)


def heartbeat(**changes: Any) -> Heartbeat:
    hb = Heartbeat(
        run_id=RUN,
        config_digest="digest",
        role="learner",
        member_id="L0",
        state="training",
        step=10,
        n_tokens=100,
        step_time_ema_s=0.1,
        versions={0: 3},
        queue_depths={"publish": 0},
        device="cpu",
        host="h",
        pid=7,
        sent_at_s=1.7e9,
        train_loss=2.5,
    )
    return dataclasses.replace(hb, **changes)


UNSIGNED: dict[str, Message] = {
    "open": RoundOpen(run_id=RUN, fragment_id=0, round_id=5, opened_at_s=1.7e9, reason="r"),
    "round": RoundRecord(
        run_id=RUN,
        fragment_id=0,
        round_id=5,
        version_before=3,
        version_after=4,
        decision="merge",
        reason="quorum",
        contributors=(
            ContributorRecord(learner_id="L0", weight=1.0, n_tokens=10, n_steps=1, staleness=0),
        ),
        entries=(
            EntryOutcome(
                entry_id="1-0", learner_id="L0", round_id=5, outcome="merged", reason="ok"
            ),
        ),
        opened_at_s=1.0,
        quorum_at_s=2.0,
        closed_at_s=3.0,
        timings_s={"merge": 0.1},
    ),
    "event": Event(run_id=RUN, kind="round.merged", message="m", fields={"a": 1}, at_s=1.0),
}


# ── readers ───────────────────────────────────────────────────────────────────────────────


def read_contribution(w: World, entry: Entry) -> Callable[[], object]:
    return lambda: ops.read_contribution(w.bus, entry, run_id=RUN, limits=LIMITS, auth=w.sync)


def read_global(w: World, entry: Entry) -> Callable[[], object]:
    reader = w.learners["L1"]
    return lambda: ops.read_global(w.bus, entry, run_id=RUN, limits=LIMITS, auth=reader)


def read_command(w: World, entry: Entry) -> Callable[[], object]:
    reader = w.learners["L0"]
    return lambda: ops.read_command(entry, run_id=RUN, limits=LIMITS, auth=reader)


def read_heartbeat(w: World, data: bytes, member: str = "L0") -> Callable[[], object]:
    return lambda: ops.read_heartbeat(member, data, run_id=RUN, limits=LIMITS, auth=w.control)


def with_envelope(entry: Entry, envelope: bytes) -> Entry:
    return dataclasses.replace(entry, fields={**entry.fields, ENTRY_FIELD: envelope})


def with_fields(entry: Entry, **fields: bytes | None) -> Entry:
    out = {k: v for k, v in entry.fields.items() if fields.get(k, b"") is not None}
    out.update({k: v for k, v in fields.items() if v is not None})
    return dataclasses.replace(entry, fields=out)


def flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def cuts(n: int, k: int = 40) -> list[int]:
    return sorted({0, 1, 2, n - 1, *range(0, n, max(1, n // k))} - {n})


def bits(n_bytes: int, k: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return sorted(rng.sample(range(n_bytes * 8), min(k, n_bytes * 8)))


def body_of(message: Message) -> dict[str, Any]:
    return dict(msgpack.unpackb(message.to_bytes(), raw=False, strict_map_key=False))


def pack(body: dict[str, Any]) -> bytes:
    return bytes(msgpack.packb(body))


def wrong_values(value: object) -> list[object]:
    """Values of another type than ``value`` (or out of range), as msgpack can carry them."""
    if isinstance(value, bool):
        return ["yes", 1, None]
    if isinstance(value, int):
        return ["1", -1, 1.5, None, [1]]
    if isinstance(value, float):
        return ["1.0", float("nan"), float("inf"), -1.0, [1.0]]
    if isinstance(value, str):
        return [5, None, ["x"], {"x": 1}]
    if isinstance(value, dict):
        return [[1, 2], "map", 5]
    if isinstance(value, list | tuple):
        return [{"a": 1}, "list", 5]
    return [5, "x"]


# ── the corpus ────────────────────────────────────────────────────────────────────────────


def envelope_cases(
    name: str, message: Message, decode: Callable[[bytes], object]
) -> Iterator[Case]:
    """Cases every envelope shares: truncations, mistyped, missing and extra fields, another
    schema version, type or run, not a map, oversize."""
    data = message.to_bytes()
    for cut in cuts(len(data)):
        yield f"{name} truncated to {cut} B", lambda d=data[:cut]: decode(d), CorruptPayload
    body = body_of(message)
    for field in [k for k in body if k not in ("schema_version", "type", "run_id")]:
        yield (
            f"{name} without {field}",
            lambda f=field: decode(pack({k: v for k, v in body.items() if k != f})),
            CorruptPayload,
        )
        for bad in wrong_values(body[field]):
            if bad is None and field in _NULLABLE:
                continue
            if isinstance(body[field], dict) and field in ("params", "fields"):
                continue  # free-form maps: checked below by value
            yield (
                f"{name}.{field} = {bad!r:.20}",
                lambda f=field, b=bad: decode(pack({**body, f: b})),
                CorruptPayload,
            )
    yield f"{name} with an extra field", lambda: decode(pack({**body, "extra": 1})), CorruptPayload
    for key, value, error in (
        ("schema_version", body["schema_version"] + 1, IncompatibleMessage),
        ("schema_version", "3", CorruptPayload),
        ("type", "other", IncompatibleMessage),
        ("run_id", "another-run", IncompatibleMessage),  # replayed from another run
    ):
        yield f"{name} {key}={value!r}", lambda k=key, v=value: decode(pack({**body, k: v})), error
    for not_a_map in ([1, 2], "text", 5, None):
        yield (
            f"{name} as {type(not_a_map).__name__}",
            lambda x=not_a_map: decode(pack(x)),
            CorruptPayload,
        )  # type: ignore[arg-type]
    yield (
        f"{name} oversize",
        lambda: decode(pack({**body, "reason": "x" * 70_000})),
        PayloadTooLarge,
    )
    yield (
        f"{name} with an ext type",
        lambda: decode(msgpack.packb(msgpack.ExtType(1, b"x"))),
        CorruptPayload,
    )


_NULLABLE = {"duration_s", "step_time_ema_s", "quorum_at_s", "train_loss"}


def corpus(w: World) -> list[Case]:
    """Every case, by message type."""
    return [
        *unsigned_cases(),
        *contribution_cases(w),
        *blob_cases(w),
        *global_cases(w),
        *fault_cases(w),
        *heartbeat_cases(w),
    ]


def unsigned_cases() -> list[Case]:
    """Round openings, round records, events: envelope cases through ``from_bytes``."""
    cases: list[Case] = []
    for name, message in UNSIGNED.items():
        cls = type(message)
        cases += envelope_cases(
            name, message, lambda d, c=cls: c.from_bytes(d, run_id=RUN, limits=LIMITS)
        )

    return cases


def contribution_cases(w: World) -> list[Case]:
    """Contributions as the synchronizer reads them: the envelope and the signature."""
    cases: list[Case] = []
    msg, _ = contribution()
    e = w.contribution
    cases += envelope_cases(
        "contribution", msg, lambda d: read_contribution(w, with_envelope(e, d))()
    )
    envelope = e.fields[ENTRY_FIELD]
    for bit in bits(len(envelope), 120, 1):
        cases.append(
            (
                f"contribution envelope bit {bit}",
                read_contribution(w, with_envelope(e, flip(envelope, bit))),
                ANY_REFUSAL,
            )
        )
    sig = e.fields[SIG_FIELD]
    for bit in bits(len(sig), 40, 2):
        cases.append(
            (
                f"contribution signature bit {bit}",
                read_contribution(w, with_fields(e, sig=flip(sig, bit))),
                Unauthenticated,
            )
        )
    for label, value in (
        ("missing", None),
        ("empty", b""),
        ("63 B", sig[:63]),
        ("65 B", sig + b"x"),
        ("random", bytes(64)),
    ):
        cases.append(
            (
                f"contribution signature {label}",
                read_contribution(w, with_fields(e, sig=value)),
                Unauthenticated,
            )
        )
    for learner, signer in (("L0", "L1"), ("L1", "L0"), ("L0", None)):
        forged, enc = contribution(learner_id=learner, n_tokens=2**62)
        bus = MemoryBus(RUN)
        auth = w.learners[signer] if signer else OPEN
        ops.send_contribution(bus, forged, enc, ttl_s=60, auth=auth)
        entry = latest(bus, bus.keys.up(0))
        cases.append(
            (
                f"contribution of {learner} signed by {signer}",
                lambda b=bus, x=entry: ops.read_contribution(
                    b, x, run_id=RUN, limits=LIMITS, auth=w.sync
                ),
                Unauthenticated,
            )
        )
    for round_id in (4, 6, 99):  # the signed envelope copied into another round's identity
        replayed = with_envelope(e, dataclasses.replace(msg, round_id=round_id).to_bytes())
        cases.append(
            (
                f"contribution replayed as round {round_id}",
                read_contribution(w, replayed),
                Unauthenticated,
            )
        )
    cases.append(
        (
            "contribution on another stream",
            read_contribution(w, dataclasses.replace(e, stream=w.bus.keys.up(1))),
            CorruptPayload,
        )
    )
    return cases


def blob_cases(w: World) -> list[Case]:
    """A contribution's blob: truncations, bit flips, wrong keys, lengths and shapes, and
    signed NaN/Inf payloads and zstd bombs (``unpack_blob``, signature checked)."""
    cases: list[Case] = []
    msg, _ = contribution()
    e = w.contribution
    blob = w.bus.get_blob(ops.blob_ref(e))
    check = w.sync.blob_check(RUN, "learner.L0")
    key = ops.blob_ref(e).key

    def unpack(data: bytes, header: TensorHeader = msg.tensor) -> object:
        payload = unpack_blob(
            data, run_id=RUN, blob_key=key, expect=header, limits=LIMITS, check=check
        )
        return codec.decode(header, payload, limits=LIMITS.tensor)

    for cut in cuts(len(blob), 60):
        cases.append(
            (f"contribution blob truncated to {cut} B", lambda c=cut: unpack(blob[:c]), ANY_REFUSAL)
        )
    for bit in bits(len(blob), 150, 3):
        cases.append(
            (f"contribution blob bit {bit}", lambda b=bit: unpack(flip(blob, b)), ANY_REFUSAL)
        )
    cases.append(
        (
            "contribution blob under another key",
            lambda: unpack_blob(
                blob, run_id=RUN, blob_key="other", expect=msg.tensor, limits=LIMITS, check=check
            ),
            CorruptPayload,
        )
    )
    cases.append(
        (
            "contribution blob of another shape",
            lambda: unpack(blob, dataclasses.replace(msg.tensor, n_elements=N * 2)),
            CorruptPayload,
        )
    )
    header_len = int.from_bytes(blob[4:8], "little")
    for impossible in (len(blob), 1 << 31, header_len - 1, 0):
        cases.append(
            (
                f"contribution blob header length {impossible}",
                lambda n=impossible: unpack(blob[:4] + n.to_bytes(4, "little") + blob[8:]),
                ANY_REFUSAL,
            )
        )
    # signed by the real learner, but NaN/Inf or a zstd bomb inside (checksum resealed)
    learner = w.learners["L0"]
    for label, values in (
        ("NaN", np.full(N, np.nan, np.float32)),
        ("Inf", np.full(N, np.inf, np.float32)),
    ):
        raw = values.tobytes()
        header = TensorHeader(
            "fp32",
            N,
            0,
            zstd=False,
            shuffle=False,
            raw_nbytes=len(raw),
            checksum=codec._checksum(np.frombuffer(raw, np.uint8), "fp32", N, 0, False),
        )
        signed = pack_blob(
            run_id=RUN,
            blob_key=key,
            encoded=EncodedTensor(header, memoryview(raw)),
            sign=learner.blob_signer(RUN),
        )
        cases.append(
            (
                f"contribution of {label} (signed)",
                lambda s=signed, h=header: unpack(s, h),
                NonFiniteValues,
            )
        )
    for declared, size in ((4 * N, 64 << 20), (1 << 19, 16 << 20)):
        frame = zstandard.ZstdCompressor(level=1).compress(bytes(size))
        header = TensorHeader(
            "fp32", declared // 4, 0, zstd=True, shuffle=False, raw_nbytes=declared, checksum=0
        )
        signed = pack_blob(
            run_id=RUN,
            blob_key=key,
            encoded=EncodedTensor(header, memoryview(frame)),
            sign=learner.blob_signer(RUN),
        )
        cases.append(
            (
                f"zstd bomb of {size >> 20} MiB declaring {declared} B",
                lambda s=signed, h=header: unpack(s, h),
                (CorruptPayload, PayloadTooLarge),
            )
        )
    cases.append(
        ("blob reference missing", read_contribution(w, with_fields(e, blob=None)), CorruptPayload)
    )
    cases.append(
        (
            "blob reference garbage",
            read_contribution(w, with_fields(e, blob=b"\xc1junk")),
            CorruptPayload,
        )
    )

    return cases


def global_cases(w: World) -> list[Case]:
    """Global fragments as learners read them (the −Θ at v1015 attack among them)."""
    cases: list[Case] = []
    notice, _ = global_fragment(version=3)
    g = w.global_entry
    cases += envelope_cases("global", notice, lambda d: read_global(w, with_envelope(g, d))())
    genv = g.fields[ENTRY_FIELD]
    for bit in bits(len(genv), 100, 4):
        cases.append(
            (
                f"global envelope bit {bit}",
                read_global(w, with_envelope(g, flip(genv, bit))),
                ANY_REFUSAL,
            )
        )
    gsig = g.fields[SIG_FIELD]
    for bit in bits(len(gsig), 30, 5):
        cases.append(
            (
                f"global signature bit {bit}",
                read_global(w, with_fields(g, sig=flip(gsig, bit))),
                Unauthenticated,
            )
        )
    cases.append(("global unsigned", read_global(w, with_fields(g, sig=None)), Unauthenticated))
    for version in (1015, 4, 2):  # the signed entry relabelled (the -Θ attack's v1015)
        cases.append(
            (
                f"global relabelled v{version}",
                read_global(
                    w, with_envelope(g, dataclasses.replace(notice, version=version).to_bytes())
                ),
                ANY_REFUSAL,
            )
        )
    gblob = w.bus.get_blob(ops.blob_ref(g))
    gref = ops.blob_ref(g)
    gcheck = w.learners["L1"].blob_check(RUN, SYNCHRONIZER)
    for bit in bits(len(gblob), 100, 6):
        cases.append(
            (
                f"global blob bit {bit}",
                lambda b=bit: codec.decode(
                    notice.tensor,
                    unpack_blob(
                        flip(gblob, b),
                        run_id=RUN,
                        blob_key=gref.key,
                        expect=notice.tensor,
                        limits=LIMITS,
                        check=gcheck,
                    ),
                    limits=LIMITS.tensor,
                ),
                ANY_REFUSAL,
            )
        )
    bus2 = MemoryBus(RUN)
    lease2 = bus2.acquire_lease(bus2.keys.lease(0), "x", ttl_s=60)
    assert lease2 is not None
    for i, signer in enumerate((w.learners["L0"], w.control, OPEN)):  # only the synchronizer may
        forged_notice, theta = global_fragment(version=10 + i)
        ref = stage_global_fragment(bus2, lease2, forged_notice, theta, ttl_s=60, auth=signer)
        bus2.append(
            bus2.keys.down(0), ops.global_notification_fields(bus2, forged_notice, ref, auth=signer)
        )
        entry = latest(bus2, bus2.keys.down(0))
        cases.append(
            (
                f"global signed by {signer.principal}",
                lambda x=entry: ops.read_global(
                    bus2, x, run_id=RUN, limits=LIMITS, auth=w.learners["L1"]
                ),
                Unauthenticated,
            )
        )

    return cases


def fault_cases(w: World) -> list[Case]:
    """Fault commands as learners and synchronizers read them: signatures, bounds, replays."""
    cases: list[Case] = []
    c = w.command
    cases += envelope_cases("fault", command(), lambda d: read_command(w, with_envelope(c, d))())
    cenv = c.fields[ENTRY_FIELD]
    for bit in bits(len(cenv), 100, 7):
        cases.append(
            (
                f"fault envelope bit {bit}",
                read_command(w, with_envelope(c, flip(cenv, bit))),
                ANY_REFUSAL,
            )
        )
    csig = c.fields[SIG_FIELD]
    for bit in bits(len(csig), 30, 8):
        cases.append(
            (
                f"fault signature bit {bit}",
                read_command(w, with_fields(c, sig=flip(csig, bit))),
                Unauthenticated,
            )
        )
    cases.append(("fault unsigned", read_command(w, with_fields(c, sig=None)), Unauthenticated))
    for target in ("all", "L1", "synchronizer"):  # the signed command copied to other targets
        cases.append(
            (
                f"fault replayed on control:{target}",
                read_command(w, dataclasses.replace(c, stream=w.bus.keys.control(target))),
                Unauthenticated,
            )
        )
    for name, value in (("duration_s", 1e9), ("duration_s", 0.0), ("duration_s", -5.0)):
        cases.append(
            (
                f"fault {name}={value}",
                read_command(w, with_envelope(c, command(**{name: value}).to_bytes())),
                CorruptPayload,
            )
        )
    for param, value in (
        ("factor", 1e9),
        ("factor", 0.5),
        ("delay_s", 1e6),
        ("count", 1e4),
        ("point", "x" * 100),
        ("factor", True),
    ):
        cases.append(
            (
                f"fault {param}={value!r:.12}",
                read_command(w, with_envelope(c, command(params={param: value}).to_bytes())),
                CorruptPayload,
            )
        )
    for kind in ("reboot", "KILL", ""):
        cases.append(
            (
                f"fault kind {kind!r}",
                read_command(w, with_envelope(c, pack({**body_of(command()), "kind": kind}))),
                CorruptPayload,
            )
        )

    return cases


def heartbeat_cases(w: World) -> list[Case]:
    """Heartbeats as the control plane reads them: only members, sealed by themselves."""
    cases: list[Case] = []
    hb = heartbeat()
    cases += envelope_cases("heartbeat", hb, lambda d: read_heartbeat(w, d)())
    data = w.heartbeat
    for bit in bits(len(data), 100, 9):
        cases.append((f"heartbeat bit {bit}", read_heartbeat(w, flip(data, bit)), ANY_REFUSAL))
    cases.append(("heartbeat unsealed", read_heartbeat(w, hb.to_bytes()), Unauthenticated))
    for member, sealer in (("ghost", "L0"), ("L1", "L0"), ("L0", "L1")):
        body = heartbeat(member_id=member).to_bytes()
        sealed = w.learners[sealer].seal(
            "heartbeat", run_id=RUN, where=f"heartbeat:{member}", data=body
        )
        cases.append(
            (
                f"heartbeat of {member} sealed by {sealer}",
                read_heartbeat(w, sealed, member),
                Unauthenticated,
            )
        )
    cases.append(
        ("heartbeat in another member's slot", read_heartbeat(w, data, "L1"), CorruptPayload)
    )
    synced = heartbeat(role="synchronizer", member_id="sync-9").to_bytes()
    sealed = w.learners["L0"].seal("heartbeat", run_id=RUN, where="heartbeat:sync-9", data=synced)
    cases.append(
        (
            "a learner's seal on a synchronizer heartbeat",
            read_heartbeat(w, sealed, "sync-9"),
            Unauthenticated,
        )
    )
    return cases


# ── the tests ─────────────────────────────────────────────────────────────────────────────


def test_the_corpus_has_over_a_thousand_cases_across_every_message_type(world: World) -> None:
    cases = corpus(world)
    assert len(cases) >= 1000, len(cases)
    kinds = {name.split()[0].split(".")[0] for name, _, _ in cases}
    assert {"contribution", "global", "fault", "heartbeat", "open", "round", "event"} <= kinds
    assert len({name for name, _, _ in cases}) == len(cases)  # every case is its own
    by_kind = collections.Counter(name.split()[0].split(".")[0] for name, _, _ in cases)
    print(f"corpus: {len(cases)} cases, {dict(sorted(by_kind.items()))}")


def test_every_case_is_refused_with_the_right_error_and_nothing_crashes(world: World) -> None:
    wrong: list[str] = []
    for name, call, expected in corpus(world):
        try:
            call()
        except expected:
            continue
        except DDQError as exc:
            wrong.append(f"{name}: {type(exc).__name__}: {exc}")
        except Exception as exc:  # a crash: the reader let something unchecked through
            wrong.append(f"{name}: CRASH {type(exc).__name__}: {exc}")
        else:
            wrong.append(f"{name}: accepted")
    assert not wrong, f"{len(wrong)} cases:\n" + "\n".join(wrong[:60])


def test_the_valid_entries_of_the_world_are_accepted(world: World) -> None:
    """The corpus's base entries themselves verify: each refusal is the mutation's doing."""
    read_contribution(world, world.contribution)()
    read_global(world, world.global_entry)()
    read_command(world, world.command)()
    read_heartbeat(world, world.heartbeat)()
    for message in UNSIGNED.values():
        type(message).from_bytes(message.to_bytes(), run_id=RUN, limits=LIMITS)
