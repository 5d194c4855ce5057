"""The wire contract: round trips, and every way an envelope or blob can be refused."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dd_queue import wire
from dd_queue.core.codec import CodecSpec, DecodeLimits, decode, encode
from dd_queue.errors import (
    CoreError,
    CorruptPayload,
    IncompatibleMessage,
    PayloadTooLarge,
    ProtocolError,
)
from dd_queue.messages import (
    ENTRY_FIELD,
    SCHEMA_VERSION,
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
    message_from_bytes,
    pack_blob,
    unpack_blob,
)

RUN = "run-1"
LIMITS = MessageLimits()
X = np.linspace(-1, 1, 1000, dtype=np.float32)
INT8 = encode(X, CodecSpec("int8"))
FP32 = encode(X, CodecSpec("fp32", zstd_level=1))


def contribution(**changes: Any) -> Contribution:
    base = Contribution(
        run_id=RUN,
        config_digest="0123abcd",
        learner_id="L0",
        fragment_id=2,
        round_id=17,
        base_version=5,
        n_steps=24,
        n_tokens=24 * 4096,
        tensor=INT8.header,
        created_at_s=1.7e9,
    )
    return dataclasses.replace(base, **changes)


def examples() -> list[Message]:
    return [
        contribution(),
        GlobalFragment(
            run_id=RUN,
            fragment_id=2,
            version=6,
            round_id=17,
            tensor=FP32.header,
            created_at_s=1.7e9,
            reason="quorum 2/3 after grace window 0.4 s",
        ),
        Heartbeat(
            run_id=RUN,
            config_digest="0123abcd",
            role="learner",
            member_id="L0",
            state="training",
            step=1234,
            n_tokens=5_000_000,
            step_time_ema_s=0.125,
            versions={0: 3, 1: 2, 2: 6},
            queue_depths={"publish": 1, "receive": 0},
            device="cpu",
            host="box",
            pid=4242,
            sent_at_s=1.7e9,
        ),
        RoundRecord(
            run_id=RUN,
            fragment_id=2,
            round_id=17,
            version_before=5,
            version_after=6,
            decision="merge",
            reason="quorum 2/3 after grace window 0.4 s",
            contributors=(
                ContributorRecord(learner_id="L0", weight=0.6, n_tokens=9, n_steps=3, staleness=0),
                ContributorRecord(learner_id="L1", weight=0.4, n_tokens=6, n_steps=3, staleness=1),
            ),
            entries=(
                EntryOutcome(
                    entry_id="1-0", learner_id="L0", round_id=17, outcome="merged", reason="ok"
                ),
                EntryOutcome(
                    entry_id="2-0",
                    learner_id="L2",
                    round_id=12,
                    outcome="stale",
                    reason="L2 base v1 is 5 versions behind v6 > max_staleness 4",
                ),
            ),
            opened_at_s=10.0,
            quorum_at_s=10.5,
            closed_at_s=10.9,
            timings_s={"merge": 0.01, "outer_step": 0.002, "publish": 0.03},
        ),
        FaultCommand(
            run_id=RUN,
            fault_id="f-1",
            target="L1",
            kind="slow",
            params={"factor": 3.0, "offset": -2, "mode": "sleep", "strict": True, "note": None},
            duration_s=30.0,
            issued_at_s=1.7e9,
        ),
        Event(
            run_id=RUN,
            kind="round.merged",
            message="fragment 2 v6",
            fields={"fragment_id": 2, "lag_s": -0.5},
            at_s=1.7e9,
        ),
        RoundOpen(run_id=RUN, fragment_id=2, round_id=17, opened_at_s=10.0, reason="due"),
    ]


def envelope(message: Message) -> dict[str, Any]:
    return msgpack.unpackb(message.to_bytes(), strict_map_key=False)  # type: ignore[no-any-return]


def pack(body: dict[str, Any]) -> bytes:
    return msgpack.packb(body)  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("message", examples(), ids=lambda m: type(m).__name__)
def test_round_trip_through_bytes_and_fields(message: Message) -> None:
    cls = type(message)
    assert cls.from_bytes(message.to_bytes(), run_id=RUN, limits=LIMITS) == message
    fields = message.to_fields()
    assert list(fields) == [ENTRY_FIELD]
    assert cls.from_fields(fields, run_id=RUN, limits=LIMITS) == message
    # redis-py without decode_responses gives bytes keys; the bus adds its own fields
    as_read = {ENTRY_FIELD.encode(): fields[ENTRY_FIELD], b"blob": b"ddqblob1 1 10 k"}
    assert cls.from_fields(as_read, run_id=RUN, limits=LIMITS) == message
    assert message_from_bytes(message.to_bytes(), run_id=RUN, limits=LIMITS) == message


@pytest.mark.parametrize("message", examples(), ids=lambda m: type(m).__name__)
def test_envelopes_are_small_and_versioned(message: Message) -> None:
    body = envelope(message)
    assert body["schema_version"] == SCHEMA_VERSION and body["type"] == message.TYPE
    assert len(message.to_bytes()) < 1024


def test_contribution_identity_is_the_dedupe_key() -> None:
    assert contribution().identity == ("L0", 2, 17)
    assert contribution(n_tokens=1).identity == contribution().identity


@settings(max_examples=50, deadline=None)
@given(
    learner_id=st.text(min_size=1, max_size=20),
    ints=st.lists(st.integers(0, 2**63), min_size=5, max_size=5),
    created_at_s=st.floats(0, 1e12),
)
def test_contribution_round_trip_property(
    learner_id: str, ints: list[int], created_at_s: float
) -> None:
    fragment_id, round_id, base_version, n_steps, n_tokens = ints
    message = contribution(
        learner_id=learner_id,
        fragment_id=fragment_id,
        round_id=round_id,
        base_version=base_version,
        n_steps=n_steps,
        n_tokens=n_tokens,
        created_at_s=created_at_s,
    )
    assert Contribution.from_bytes(message.to_bytes(), run_id=RUN, limits=LIMITS) == message


def test_integer_times_are_accepted_as_floats() -> None:
    body = envelope(contribution())
    body["created_at_s"] = 17
    decoded = Contribution.from_bytes(pack(body), run_id=RUN, limits=LIMITS)
    assert decoded.created_at_s == 17.0 and isinstance(decoded.created_at_s, float)


# ----------------------------------------------------------------------------- incompatible


@pytest.mark.parametrize(
    ("key", "value"),
    [("schema_version", SCHEMA_VERSION + 1), ("schema_version", 0), ("type", "heartbeat")],
)
def test_other_versions_and_types_are_incompatible(key: str, value: object) -> None:
    body = envelope(contribution())
    body[key] = value
    with pytest.raises(IncompatibleMessage):
        Contribution.from_bytes(pack(body), run_id=RUN, limits=LIMITS)


@pytest.mark.parametrize("message", examples(), ids=lambda m: type(m).__name__)
def test_messages_of_another_run_are_incompatible(message: Message) -> None:
    with pytest.raises(IncompatibleMessage, match="run"):
        type(message).from_bytes(message.to_bytes(), run_id="run-2", limits=LIMITS)


def test_a_newer_schema_is_incompatible_even_with_other_fields() -> None:
    body = {"schema_version": SCHEMA_VERSION + 1, "type": "contribution", "whatever": [1, 2]}
    with pytest.raises(IncompatibleMessage, match="schema_version"):
        Contribution.from_bytes(pack(body), run_id=RUN, limits=LIMITS)


def test_a_schema_1_envelope_with_its_own_blob_location_is_incompatible() -> None:
    """Schema 2 dropped blob_key/blob_nbytes/n_chunks: an older sender is told to upgrade."""
    body = envelope(contribution()) | {"blob_key": "k", "blob_nbytes": 10, "n_chunks": 1}
    body["schema_version"] = 1
    with pytest.raises(IncompatibleMessage, match="upgrade"):
        Contribution.from_bytes(pack(body), run_id=RUN, limits=LIMITS)
    body["schema_version"] = SCHEMA_VERSION  # and the location fields are no longer part of it
    with pytest.raises(CorruptPayload, match="unexpected \\['blob_key', 'blob_nbytes'"):
        Contribution.from_bytes(pack(body), run_id=RUN, limits=LIMITS)


@pytest.mark.parametrize(("field", "value"), [("codec", "fp8"), ("dtype", "float64")])
def test_unknown_codec_or_dtype_is_incompatible(field: str, value: str) -> None:
    body = envelope(contribution())
    body["tensor"][field] = value
    with pytest.raises(IncompatibleMessage):
        Contribution.from_bytes(pack(body), run_id=RUN, limits=LIMITS)


def test_global_fragments_must_be_exact() -> None:
    lossy = dataclasses.replace(examples()[1], tensor=INT8.header)  # type: ignore[type-var]
    with pytest.raises(IncompatibleMessage, match="fp32"):
        GlobalFragment.from_bytes(lossy.to_bytes(), run_id=RUN, limits=LIMITS)


def test_unknown_message_type() -> None:
    body = envelope(contribution()) | {"type": "gossip"}
    with pytest.raises(IncompatibleMessage, match="gossip"):
        message_from_bytes(pack(body), run_id=RUN, limits=LIMITS)


# ----------------------------------------------------------------------------- corrupt


def test_missing_and_extra_fields_are_corrupt() -> None:
    body = envelope(contribution())
    del body["n_steps"]
    with pytest.raises(CorruptPayload, match="missing fields \\['n_steps'\\]"):
        Contribution.from_bytes(pack(body), run_id=RUN, limits=LIMITS)
    body = envelope(contribution()) | {"surprise": 1}
    with pytest.raises(CorruptPayload, match="unexpected \\['surprise'\\]"):
        Contribution.from_bytes(pack(body), run_id=RUN, limits=LIMITS)
    body = envelope(contribution())
    del body["tensor"]["checksum"]
    with pytest.raises(CorruptPayload, match=r"contribution\.tensor"):
        Contribution.from_bytes(pack(body), run_id=RUN, limits=LIMITS)


@pytest.mark.parametrize("value", [None, 7, b"run-1"])
def test_missing_or_mistyped_run_id_is_corrupt(value: object) -> None:
    body = envelope(contribution())
    if value is None:
        del body["run_id"]
    else:
        body["run_id"] = value
    with pytest.raises(CorruptPayload, match="run_id"):
        Contribution.from_bytes(pack(body), run_id=RUN, limits=LIMITS)


@pytest.mark.parametrize("kwargs", [{"max_envelope_bytes": 0}, {"max_items": 1.5}])
def test_message_limits_are_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(CoreError, match="MessageLimits"):
        MessageLimits(**kwargs)


def test_missing_schema_version_is_corrupt() -> None:
    body = envelope(contribution())
    del body["schema_version"]
    with pytest.raises(CorruptPayload, match="schema_version"):
        Contribution.from_bytes(pack(body), run_id=RUN, limits=LIMITS)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_steps", "24"),
        ("n_steps", -1),
        ("n_steps", 24.0),
        ("n_steps", True),
        ("n_steps", None),
        ("learner_id", 7),
        ("learner_id", b"L0"),
        ("learner_id", ""),
        ("config_digest", ""),
        ("created_at_s", float("nan")),
        ("created_at_s", float("inf")),
        ("created_at_s", -1.0),
        ("created_at_s", "now"),
        ("tensor", [1, 2]),
        ("tensor", {"codec": "int8"}),
    ],
)
def test_mistyped_contribution_fields_are_corrupt(field: str, value: object) -> None:
    body = envelope(contribution())
    body[field] = value
    with pytest.raises(CorruptPayload, match=field if field != "tensor" else "tensor"):
        Contribution.from_bytes(pack(body), run_id=RUN, limits=LIMITS)


@pytest.mark.parametrize(
    ("index", "field", "value"),
    [
        (2, "role", "boss"),
        (2, "versions", {"0": 3}),
        (2, "versions", {0: -3}),
        (2, "versions", [1, 2]),
        (2, "step_time_ema_s", "fast"),
        (2, "queue_depths", {1: 2}),
        (3, "contributors", [{"learner_id": "L0"}]),
        (3, "contributors", "L0"),
        (3, "decision", "merged"),
        (3, "version_after", 5),  # a merge must advance the version by one
        (3, "timings_s", {"merge": -0.1}),
        (4, "kind", "explode"),
        (4, "params", {"x": [1, 2]}),
        (4, "params", {"x": float("nan")}),
        (4, "target", ""),
        (5, "kind", "merged"),
        (5, "kind", "Round.Merged"),
        (5, "kind", "round.merged\n"),
        (5, "fields", {1: "x"}),
    ],
)
def test_mistyped_fields_of_other_messages_are_corrupt(
    index: int, field: str, value: object
) -> None:
    message = examples()[index]
    body = envelope(message)
    body[field] = value
    with pytest.raises(CorruptPayload):
        type(message).from_bytes(pack(body), run_id=RUN, limits=LIMITS)


def test_abandoned_round_keeps_its_version() -> None:
    merged = next(m for m in examples() if isinstance(m, RoundRecord))
    abandoned = dataclasses.replace(merged, decision="abandon", version_after=5)  # type: ignore[type-var]
    assert RoundRecord.from_bytes(abandoned.to_bytes(), run_id=RUN, limits=LIMITS) == abandoned
    bad = dataclasses.replace(merged, decision="abandon")  # type: ignore[type-var]
    with pytest.raises(CorruptPayload, match="abandon"):
        RoundRecord.from_bytes(bad.to_bytes(), run_id=RUN, limits=LIMITS)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"\x92\x01\x02",  # a list, not a map
        msgpack.packb({"schema_version": 1})[:-1],  # truncated
        msgpack.packb({"a": 1}) + b"\x00",  # trailing data
        b"\x81\xa1a" + b"\x91" * 5000 + b"\x90",  # deep nesting
        msgpack.packb({"a": msgpack.ExtType(1, b"x")}),  # ext types are not allowed
        b"\x81\xa3\xff\xfe\xfd\x01",  # a key that is not UTF-8
    ],
    ids=repr,
)
def test_malformed_envelopes_are_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptPayload):
        Contribution.from_bytes(data, run_id=RUN, limits=LIMITS)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400), cut=st.integers(0, 400), flip=st.integers(0, 8 * 400))
def test_random_and_damaged_envelopes_never_escape_the_error_tree(
    data: bytes, cut: int, flip: int
) -> None:
    valid = bytearray(contribution().to_bytes()[:cut])
    if flip < 8 * len(valid):
        valid[flip // 8] ^= 1 << (flip % 8)
    for candidate in (data, bytes(valid)):
        with contextlib.suppress(ProtocolError):
            message_from_bytes(candidate, run_id=RUN, limits=LIMITS)


def test_entry_without_the_envelope_field() -> None:
    with pytest.raises(CorruptPayload, match="'m'"):
        Contribution.from_fields({"blob": b"x"}, run_id=RUN, limits=LIMITS)
    with pytest.raises(CorruptPayload):
        Contribution.from_bytes("not bytes", run_id=RUN, limits=LIMITS)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- size limits


def test_oversized_envelope_is_refused_before_parsing() -> None:
    event = Event(run_id=RUN, kind="log.line", message="x" * 5000, fields={}, at_s=0.0)
    small = MessageLimits(max_envelope_bytes=4096)
    with pytest.raises(PayloadTooLarge, match="max_envelope_bytes"):
        Event.from_bytes(event.to_bytes(), run_id=RUN, limits=small)


def test_too_many_items_is_corrupt() -> None:
    event = Event(run_id=RUN, kind="a.b", message="", fields={str(i): i for i in range(50)}, at_s=0)
    with pytest.raises(CorruptPayload):
        Event.from_bytes(event.to_bytes(), run_id=RUN, limits=MessageLimits(max_items=10))


def test_referenced_tensor_over_the_limits_is_too_large() -> None:
    tight = MessageLimits(tensor=DecodeLimits(max_elements=999, max_payload_bytes=1 << 20))
    with pytest.raises(PayloadTooLarge, match="max_elements"):
        Contribution.from_bytes(contribution().to_bytes(), run_id=RUN, limits=tight)


# ----------------------------------------------------------------------------- blobs


def test_contribution_end_to_end_through_a_blob() -> None:
    key = "ddq:run-1:{run-1.f2}:blob:up:17:L0"  # the key comes from the bus's reference
    blob = pack_blob(run_id=RUN, blob_key=key, encoded=INT8)
    received = Contribution.from_fields(contribution().to_fields(), run_id=RUN, limits=LIMITS)
    payload = unpack_blob(blob, run_id=RUN, blob_key=key, expect=received.tensor, limits=LIMITS)
    out = np.empty(1000, np.float32)
    assert decode(received.tensor, payload, out=out, limits=LIMITS.tensor) is out
    np.testing.assert_array_equal(out, decode(INT8.header, INT8.payload, limits=LIMITS.tensor))


def test_blob_parts_do_not_copy_the_payload() -> None:
    prefix, payload = wire.blob_parts(run_id=RUN, blob_key="k", encoded=INT8)
    assert payload is INT8.payload and len(prefix) % 64 == 0
    assert prefix + bytes(payload) == pack_blob(run_id=RUN, blob_key="k", encoded=INT8)


def test_blob_payload_is_aligned_and_zero_copy() -> None:
    blob = pack_blob(run_id=RUN, blob_key="k", encoded=FP32)
    payload = unpack_blob(blob, run_id=RUN, blob_key="k", expect=FP32.header, limits=LIMITS)
    offset = len(blob) - payload.nbytes
    assert offset % 64 == 0 and bytes(payload) == bytes(FP32.payload)
    assert payload.obj is blob  # a view, not a copy


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"blob_key": "other"}, CorruptPayload),
        ({"expect": FP32.header}, CorruptPayload),
        ({"run_id": "run-2"}, IncompatibleMessage),
    ],
    ids=str,
)
def test_blob_must_match_its_entry(kwargs: dict[str, Any], error: type[Exception]) -> None:
    blob = pack_blob(run_id=RUN, blob_key="k", encoded=INT8)
    args: dict[str, Any] = {"run_id": RUN, "blob_key": "k", "expect": INT8.header, "limits": LIMITS}
    args |= kwargs
    with pytest.raises(error):
        unpack_blob(blob, **args)


def test_damaged_blobs() -> None:
    blob = pack_blob(run_id=RUN, blob_key="k", encoded=INT8)
    args: dict[str, Any] = {"run_id": RUN, "blob_key": "k", "expect": INT8.header}
    payload_offset = len(blob) - INT8.payload.nbytes
    for cut in [*range(0, payload_offset, 7), payload_offset - 1]:  # prefix, header, padding
        with pytest.raises(CorruptPayload):
            unpack_blob(blob[:cut], limits=LIMITS, **args)
    with pytest.raises(CorruptPayload, match="DDQB"):
        unpack_blob(b"XXXX" + blob[4:], limits=LIMITS, **args)
    with pytest.raises(CorruptPayload, match="header length"):
        unpack_blob(blob[:4] + b"\xff\xff\xff\x00" + blob[8:], limits=LIMITS, **args)
    # a cut in the payload passes the blob check and is caught by the codec
    payload = unpack_blob(blob[:-10], limits=LIMITS, **args)
    with pytest.raises(CorruptPayload):
        decode(INT8.header, payload, limits=LIMITS.tensor)
    too_small = MessageLimits(tensor=DecodeLimits(max_payload_bytes=100))
    with pytest.raises(PayloadTooLarge):
        unpack_blob(blob, limits=too_small, **args)


def _forged_command(**changes: Any) -> bytes:
    """A fault command's envelope with fields changed after encoding (as a writer to Redis
    that skips the HTTP API would send it)."""
    good = FaultCommand(
        run_id=RUN, fault_id="f-9", target="L0", kind="stall", params={}, duration_s=5.0,
        issued_at_s=1.7e9,
    )  # fmt: skip
    body = envelope(good)
    for name, value in changes.items():
        if name in ("duration_s",):
            body[name] = value
        else:
            body["params"] = {**body["params"], name: value}
    return msgpack.packb(body)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"duration_s": 1e9}, "duration_s 1000000000.0 is outside (0, 3600]"),
        ({"duration_s": 0.0}, "duration_s 0.0 is outside (0, 3600]"),
        ({"duration_s": -5.0}, "fault.duration_s must be float"),  # (the wire: finite, >= 0)
        ({"duration_s": float("nan")}, "fault.duration_s must be float"),
        ({"factor": 1e6}, "factor 1000000.0 is outside (1, 100]"),
        ({"factor": 1.0}, "factor 1.0 is outside (1, 100]"),
        ({"delay_s": 601}, "delay_s 601 is outside (0, 600]"),
        ({"seconds": 3601.0}, "seconds 3601.0 is outside (0, 3600]"),
        ({"count": 0}, "count 0 is outside (0, 100]"),
        ({"factor": "3"}, "factor '3' is outside"),
        ({"factor": True}, "factor True is outside"),
        ({"point": ""}, "point '' is not a name"),
        ({"point": 7}, "point 7 is not a name"),
    ],
)
def test_fault_commands_out_of_bounds_are_refused_where_they_are_decoded(changes, words):
    with pytest.raises(CorruptPayload, match=re.escape(words)):
        FaultCommand.from_bytes(_forged_command(**changes), run_id=RUN, limits=LIMITS)


def test_fault_commands_at_the_bounds_decode():
    for changes in ({"duration_s": 3600.0}, {"factor": 100}, {"delay_s": 600.0},
                    {"count": 100}, {"seconds": 0.5}, {"point": "after_merge"}):  # fmt: skip
        FaultCommand.from_bytes(_forged_command(**changes), run_id=RUN, limits=LIMITS)
