"""Commit ops (``dd_queue.bus.commit_ops``): what each op refuses when it is built, and with which
message; how a ``DeadLetterOp`` expands; the commit marker's layout.

The error messages are what an operator reads when a commit is refused, so they are checked
word for word: each names the argument that was wrong (``SetOp.key``, ``DeadLetterOp.group``...).
Bus-level behaviour runs on MemoryBus and on RedisBus over fakeredis (no server needed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import fakeredis
import pytest

from dd_queue.bus import (
    AckOp,
    AppendOp,
    Bus,
    CommitOp,
    CommitResult,
    DeadLetterOp,
    DeleteOp,
    Entry,
    InvalidArgument,
    MemoryBus,
    RedisBus,
    SetOp,
)
from dd_queue.bus.commit_ops import (
    check_same_slot,
    decode_commit_marker,
    encode_commit_result,
    primitive_ops,
)
from dd_queue.clock import FakeClock
from dd_queue.keys import SYNC_GROUP, Keys

G = SYNC_GROUP
K = Keys("t")


def refusal(build: Callable[[], object]) -> str:
    """The message of the InvalidArgument that ``build`` raises."""
    with pytest.raises(InvalidArgument) as raised:
        build()
    return str(raised.value)


@pytest.fixture(params=["memory", "fakeredis"])
def bus(request: pytest.FixtureRequest) -> Iterator[Bus]:
    if request.param == "memory":
        made: Bus = MemoryBus("t", clock=FakeClock(1000.0))
    else:
        server = fakeredis.FakeServer()
        clients = [fakeredis.FakeRedis(server=server) for _ in range(4)]
        made = RedisBus.from_clients(
            "t", clients[0], reader=clients[1], blobs=clients[2], heartbeat=clients[3]
        )
    try:
        yield made
    finally:
        made.close()


# ── SetOp ───────────────────────────────────────────────────────────────────────────────────


def test_set_op_refusals_name_the_argument() -> None:
    assert refusal(lambda: SetOp("", b"v")) == "SetOp.key must be a non-empty key string, got ''"
    assert refusal(lambda: SetOp(K.state(0), "v")) == "SetOp.value must be bytes, got str"  # type: ignore[arg-type]
    assert refusal(lambda: SetOp(K.state(0), 7)) == "SetOp.value must be bytes, got int"  # type: ignore[arg-type]
    assert "ttl_s must be a finite number > 0, got 0" in refusal(lambda: SetOp("k", b"v", 0))


def test_set_op_accepts_bytes_like_values() -> None:
    for value in (b"v", bytearray(b"v"), memoryview(b"v")):
        assert SetOp(K.state(0), value, ttl_s=1.5).value == value  # type: ignore[arg-type]


# ── AppendOp ────────────────────────────────────────────────────────────────────────────────


def test_append_op_refusals_name_the_argument() -> None:
    assert (
        refusal(lambda: AppendOp("", {"v": b"1"}))
        == "AppendOp.stream must be a non-empty key string, got ''"
    )
    assert (
        refusal(lambda: AppendOp(K.down(0), {}))
        == "AppendOp.fields must be a non-empty mapping of field name → bytes"
    )
    assert (
        refusal(lambda: AppendOp(K.down(0), {"v": "1"}))  # type: ignore[dict-item]
        == "AppendOp.fields: field 'v' must be bytes, got str"
    )
    assert (
        refusal(lambda: AppendOp(K.down(0), {"v": b"1"}, maxlen=0))
        == "AppendOp.maxlen must be None or an integer >= 1, got 0"
    )


def test_append_op_keeps_a_copy_of_its_fields() -> None:
    fields = {"v": b"1"}
    op = AppendOp(K.down(0), fields, maxlen=5)
    fields["w"] = b"2"
    assert dict(op.fields) == {"v": b"1"} and op.maxlen == 5


# ── AckOp ───────────────────────────────────────────────────────────────────────────────────


def test_ack_op_refusals_name_the_argument() -> None:
    up = K.up(0)
    assert (
        refusal(lambda: AckOp("", G, ("1-0",)))
        == "AckOp.stream must be a non-empty key string, got ''"
    )
    assert (
        refusal(lambda: AckOp(up, "", ("1-0",)))
        == "AckOp.group must be a non-empty key string, got ''"
    )
    assert (
        refusal(lambda: AckOp(up, G, "1-0"))  # type: ignore[arg-type]
        == "AckOp.ids must be a sequence of ids, not one string"
    )
    assert (
        refusal(lambda: AckOp(up, G, ("1-0", "garbage")))
        == "AckOp id must be a stream id '<ms>-<seq>', got 'garbage'"
    )


def test_ack_op_takes_any_sequence_of_ids_as_a_tuple() -> None:
    assert AckOp(K.up(0), G, ["1-0", "2-5"]).ids == ("1-0", "2-5")  # type: ignore[arg-type]


# ── DeleteOp ────────────────────────────────────────────────────────────────────────────────


def test_delete_op_refusals_name_the_argument() -> None:
    assert (
        refusal(lambda: DeleteOp(K.state(0)))  # type: ignore[arg-type]
        == "DeleteOp.keys must be a sequence of keys, not one string"
    )
    assert (
        refusal(lambda: DeleteOp((K.state(0), "")))
        == "DeleteOp key must be a non-empty key string, got ''"
    )
    assert DeleteOp([K.state(0)]).keys == (K.state(0),)  # type: ignore[arg-type]


# ── DeadLetterOp ────────────────────────────────────────────────────────────────────────────


def test_dead_letter_op_refusals_name_the_argument() -> None:
    good = Entry(K.up(0), "1-0", {"m": b"x"})
    dlq = K.dlq(0)
    assert (
        refusal(lambda: DeadLetterOp("1-0", G, dlq, "r"))  # type: ignore[arg-type]
        == "DeadLetterOp.entry must be an Entry, got '1-0'"
    )
    assert (
        refusal(lambda: DeadLetterOp(Entry("", "1-0", {}), G, dlq, "r"))
        == "DeadLetterOp.entry.stream must be a non-empty key string, got ''"
    )
    assert (
        refusal(lambda: DeadLetterOp(Entry(K.up(0), "x", {}), G, dlq, "r"))
        == "DeadLetterOp.entry.id must be a stream id '<ms>-<seq>', got 'x'"
    )
    assert (
        refusal(lambda: DeadLetterOp(good, "", dlq, "r"))
        == "DeadLetterOp.group must be a non-empty key string, got ''"
    )
    assert (
        refusal(lambda: DeadLetterOp(good, G, "", "r"))
        == "DeadLetterOp.dlq must be a non-empty key string, got ''"
    )
    for reason in ("", None):
        assert (
            refusal(lambda: DeadLetterOp(good, G, dlq, reason))  # type: ignore[arg-type]  # noqa: B023
            == "DeadLetterOp.reason must be a non-empty string"
        )


@pytest.mark.parametrize("maxlen", [0, -1, True, 2.0])
def test_dead_letter_op_refuses_a_bad_maxlen_when_built(maxlen: object) -> None:
    good = Entry(K.up(0), "1-0", {"m": b"x"})
    assert (
        refusal(lambda: DeadLetterOp(good, G, K.dlq(0), "r", maxlen))  # type: ignore[arg-type]
        == f"DeadLetterOp.maxlen must be None or an integer >= 1, got {maxlen!r}"
    )


def test_dead_letter_op_expands_to_a_trimmed_append_and_the_ack() -> None:
    entry = Entry(K.up(0), "5-1", {"m": b"bad"})
    append, ack = DeadLetterOp(entry, G, K.dlq(0), "corrupt", 7).expand()
    assert append == AppendOp(
        K.dlq(0),
        {
            "m": b"bad",
            "ddq.dlq.reason": b"corrupt",
            "ddq.dlq.stream": K.up(0).encode(),
            "ddq.dlq.id": b"5-1",
            "ddq.dlq.group": G.encode(),
        },
        7,
    )
    assert append.maxlen == 7
    assert ack == AckOp(K.up(0), G, ("5-1",))
    assert DeadLetterOp(entry, G, K.dlq(0), "corrupt").expand()[0].maxlen is None


def test_a_committed_dead_letter_move_trims_the_dead_letter_stream() -> None:
    bus = MemoryBus("t", clock=FakeClock(1000.0))  # trims exactly (Redis: about maxlen)
    up, dlq = bus.keys.up(0), bus.keys.dlq(0)
    for i in range(3):
        bus.append(up, {"m": str(i).encode()})
    entries = bus.read_group(up, G, "sync-0", count=10)
    lease = bus.acquire_lease(bus.keys.lease(0), "sync-0", ttl_s=30)
    assert lease is not None
    result = bus.commit(
        lease, [DeadLetterOp(e, G, dlq, "r", maxlen=1) for e in entries], commit_id="0:dlq"
    )
    assert result.acked == 3 and len(result.entry_ids) == 3
    assert [e.id for e in bus.read(dlq)] == [result.entry_ids[-1]]


# ── primitive_ops and check_same_slot ───────────────────────────────────────────────────────


def test_primitive_ops_expand_dead_letter_moves_in_order_and_refuse_other_things() -> None:
    entry = Entry(K.up(0), "1-0", {"m": b"x"})
    first, move, last = SetOp(K.state(0), b"s"), DeadLetterOp(entry, G, K.dlq(0), "r"), DeleteOp(())
    assert primitive_ops([first, move, last]) == [first, *move.expand(), last]
    assert refusal(lambda: primitive_ops([first, "SET x 1"])) == "not a commit op: 'SET x 1'"  # type: ignore[list-item]


def test_keys_of_another_fragment_are_refused_with_the_reason() -> None:
    check_same_slot(K.lease(0), [K.state(0), K.up(0)])
    check_same_slot("plain-key", ["other", K.state(3)])  # no tag: not checked
    assert refusal(lambda: check_same_slot(K.lease(0), [K.state(0), K.dlq(3)])) == (
        f"{K.dlq(3)!r} is outside hash tag {{t.f0}} of {K.lease(0)!r}; a fenced commit may "
        "only touch keys of one fragment (use dd_queue.keys)"
    )


# ── the commit marker ───────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("result", "lease_value"),
    [
        (CommitResult(("1-0", "2-3"), 4), "17:ab12:sync-0"),
        (CommitResult((), 0), "17:ab12:sync-0"),
        (CommitResult(("9-9",), 1), "17:ab12:owner\nwith\nnewlines"),  # owners are free text
    ],
)
def test_a_marker_decodes_to_what_was_encoded_as_a_replay(
    result: CommitResult, lease_value: str
) -> None:
    raw = encode_commit_result(result, lease_value)
    assert decode_commit_marker(raw) == (
        CommitResult(result.entry_ids, result.acked, replayed=True),
        lease_value,
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"5",  # no separators
        b"5\n1-0",  # one separator only
        b"x\n1-0\n1:a:o",  # acked is not a number
        b"-1\n1-0\n1:a:o",
        b"\xff\xfe\n\x80\n\xc3",  # not UTF-8
        b"\xff",
    ],
)
def test_what_is_not_a_marker_decodes_to_none(raw: bytes) -> None:
    assert decode_commit_marker(raw) is None


def test_a_marker_with_undecodable_lease_bytes_still_decodes() -> None:
    decoded = decode_commit_marker(b"2\n1-0\n1:a:\xff")
    assert decoded == (CommitResult(("1-0",), 2, replayed=True), "1:a:\ufffd")


def test_a_retried_commit_replays_for_an_owner_with_newlines(bus: Bus) -> None:
    lease = bus.acquire_lease(bus.keys.lease(0), "sync\n0", ttl_s=30)
    assert lease is not None
    ops: list[CommitOp] = [
        AppendOp(bus.keys.rounds(0), {"r": b"1"}),
        SetOp(bus.keys.state(0), b"v1"),
    ]
    first = bus.commit(lease, ops, commit_id="0:1")
    again = bus.commit(lease, ops, commit_id="0:1")  # its reply was lost: the same call again
    assert not first.replayed and again.replayed
    assert again.entry_ids == first.entry_ids and again.acked == first.acked == 0
    assert bus.stream_length(bus.keys.rounds(0)) == 1  # applied once
