"""Domain helpers written once on top of the ``Bus`` protocol (so both buses share them).

Thin by design: they pick keys from ``bus.keys`` and put the bus's blob reference (``BLOB_FIELD``)
next to a message's envelope. That reference is the only record of where a payload lives; the
envelope (``dd_queue.messages``) carries identity, counters and the tensor header.

Two levels:

- raw: ``publish_contribution``, ``blob_ref``, ``fetch_blob`` move bytes and fields and
  interpret nothing;
- typed, one call per side: ``send_contribution``/``read_contribution`` for a learner's
  contribution, and ``global_notification_op`` (inside the fenced commit, after
  ``synchronizer.blobs.stage`` wrote the blob) / ``read_global`` for a global fragment. The
  readers verify, in order: envelope (``Message.from_fields``), entry stream vs. the message's
  fragment, the reference vs. the message's identity and ``MessageLimits.max_blob_bytes``, the
  blob's framing, key and tensor header (``dd_queue.wire.unpack_blob``), then decode (checksum,
  limits, NaN/Inf). Every refusal is a ``ProtocolError`` with a ``reason``, or ``BlobMissing``;
  ``rejection_reason`` names either for the dead-letter stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from dd_queue.auth import (
    CONTROL,
    OPEN,
    SYNCHRONIZER,
    Auth,
    FreshCommands,
    learner_principal,
    principal_of,
)
from dd_queue.bus.base import Bus
from dd_queue.bus.commit_ops import AppendOp
from dd_queue.bus.types import BlobData, BlobRef, Entry
from dd_queue.core.blockwise import Delta
from dd_queue.core.codec import EncodedTensor, Float32Array, TensorHeader, decode, decode_delta
from dd_queue.errors import (
    BlobMissing,
    ConfigError,
    CorruptPayload,
    PayloadTooLarge,
    ProtocolError,
    Unauthenticated,
)
from dd_queue.messages import Contribution, Event, FaultCommand, GlobalFragment, Heartbeat
from dd_queue.wire import BlobCheck, MessageLimits, blob_parts, unpack_blob

CONTROL_KIND = "fault"
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


def latest_global(bus: Bus, fragment_id: int) -> Entry | None:
    """The newest entry of a fragment's ``down`` stream (None before the first version)."""
    return bus.read_latest(bus.keys.down(fragment_id))


# ── typed: messages, blobs and decoding ────────────────────────────────────────────────────


def send_contribution(
    bus: Bus,
    msg: Contribution,
    encoded: EncodedTensor,
    *,
    ttl_s: float,
    maxlen: int | None = None,
    auth: Auth = OPEN,
    tokens: Mapping[str, int] | None = None,
) -> tuple[str, BlobRef]:
    """Publish a contribution: its blob at ``keys.up_blob(fragment, round, learner)`` and an
    entry (envelope + blob reference) on the fragment's ``up`` stream, in one round trip.

    Args:
        bus: The run's bus.
        msg: The contribution; ``msg.tensor`` must be ``encoded.header``.
        encoded: The codec output (its payload is written without being copied into a blob).
        ttl_s: Expiry of the blob, seconds (it outlives a round; the synchronizer unlinks it).
        maxlen: Approximate length the ``up`` stream is trimmed to.
        auth: The learner's key: the entry and the blob are signed with it.
        tokens: The learner's token counts to add (``report_tokens``), in the same round
            trip, just before the entry: a kill -9 in the middle of a send cannot leave the
            run with a published token that was not counted.

    Returns:
        ``(entry id, blob ref)``.

    Raises:
        ValueError: ``msg`` belongs to another run than ``bus`` or describes another tensor.
    """
    _check_sendable(bus, msg.run_id, msg.tensor, encoded)
    key = bus.keys.up_blob(msg.fragment_id, msg.round_id, msg.learner_id)
    stream = bus.keys.up(msg.fragment_id)
    fields = auth.sign_fields(
        "contribution", run_id=msg.run_id, where=stream, fields=msg.to_fields()
    )
    sign = auth.blob_signer(msg.run_id)
    return bus.append_with_blob(
        stream,
        fields,
        blob_key=key,
        data=blob_parts(run_id=msg.run_id, blob_key=key, encoded=encoded, sign=sign),
        ttl_s=ttl_s,
        ref_field=BLOB_FIELD,
        maxlen=maxlen,
        counts=None if tokens is None else _token_counts(bus, msg.learner_id, tokens),
    )


def read_contribution(
    bus: Bus,
    entry: Entry,
    *,
    run_id: str,
    limits: MessageLimits,
    out: Float32Array | None = None,
    parsed: Contribution | None = None,
    codes: bool = False,
    auth: Auth = OPEN,
) -> tuple[Contribution, Delta]:
    """Validate an ``up`` entry, fetch its blob and decode it (into ``out`` when given).

    An ``entry.deleted`` (trimmed while pending) has no fields: ack it rather than read it.

    Args:
        bus: The run's bus.
        entry: The entry as read through the group.
        run_id: The reader's run.
        limits: Envelope, blob and tensor limits (``WireConfig.message_limits()``).
        out: Writable, C-contiguous float32 buffer of the fragment's size to decode into.
        parsed: ``Contribution.from_fields(entry.fields, run_id=run_id, limits=limits)``, if
            the caller made it already (to choose ``out``); it is not parsed again.
        codes: Keep an int8/int4 payload as its codes (``core.codec.decode_delta``: a
            ``Blockwise`` stored in ``out``'s bytes), not decoded to float32.
        auth: The run's keyring: the entry and the blob must be signed by the learner the
            message names (a learner id without a key is not a member).

    Returns:
        The message and the decoded outer gradient (``out`` itself when given, or with
        ``codes`` a ``Blockwise`` whose buffer is ``out``).

    Raises:
        ProtocolError: The subclass says why (CorruptPayload, IncompatibleMessage,
            PayloadTooLarge, NonFiniteValues); dead-letter the entry.
        BlobMissing: The payload expired or was never written; the contribution is lost.
        CoreError: ``out`` is not a writable, C-contiguous float32 array (a caller bug).
    """
    msg = parsed or Contribution.from_fields(entry.fields, run_id=run_id, limits=limits)
    _check_stream(entry, bus.keys.up(msg.fragment_id))
    signer = learner_principal(msg.learner_id)
    auth.check_fields(
        "contribution", signer, run_id=run_id, where=entry.stream, fields=entry.fields
    )
    try:
        expected_key = bus.keys.up_blob(msg.fragment_id, msg.round_id, msg.learner_id)
    except ConfigError as exc:
        raise CorruptPayload(f"entry {entry.id}: learner_id {msg.learner_id!r}: {exc}") from exc
    ref = blob_ref(entry)
    if ref.key != expected_key:
        raise CorruptPayload(f"entry {entry.id} refers to {ref.key!r}, not {expected_key!r}")
    check = auth.blob_check(run_id, signer)
    payload = _fetch_payload(bus, ref, msg.tensor, run_id=run_id, limits=limits, check=check)
    if codes:
        return msg, decode_delta(msg.tensor, payload, out=out, limits=limits.tensor)
    return msg, decode(msg.tensor, payload, out=out, limits=limits.tensor)


def global_notification_fields(
    bus: Bus, msg: GlobalFragment, ref: BlobRef, *, auth: Auth = OPEN
) -> dict[str, bytes]:
    """Fields of a ``down`` entry: the envelope, the staged blob's reference and (with a key)
    the synchronizer's signature of both."""
    fields = auth.sign_fields(
        "global",
        run_id=msg.run_id,
        where=bus.keys.down(msg.fragment_id),
        fields=msg.to_fields(),
        extra=ref.key.encode(),
    )
    return {**fields, BLOB_FIELD: ref.to_bytes()}


def global_notification_op(
    bus: Bus, msg: GlobalFragment, ref: BlobRef, *, maxlen: int | None = None, auth: Auth = OPEN
) -> AppendOp:
    """The commit op that announces a staged global fragment on its ``down`` stream."""
    fields = global_notification_fields(bus, msg, ref, auth=auth)
    return AppendOp(bus.keys.down(msg.fragment_id), fields, maxlen)


def read_global(
    bus: Bus,
    entry: Entry,
    *,
    run_id: str,
    limits: MessageLimits,
    out: Float32Array | None = None,
    auth: Auth = OPEN,
) -> tuple[GlobalFragment, Float32Array]:
    """Validate a ``down`` entry, fetch its blob and decode it bit-exactly (fp32).

    Args and raises as ``read_contribution``; the reference must name this fragment's blob of
    ``msg.version`` (under any fencing token: the commit that appended it was fenced), and with
    a keyring the entry and the blob must be signed by the synchronizer.
    """
    msg = GlobalFragment.from_fields(entry.fields, run_id=run_id, limits=limits)
    _check_stream(entry, bus.keys.down(msg.fragment_id))
    ref = blob_ref(entry)
    auth.check_fields(
        "global",
        SYNCHRONIZER,
        run_id=run_id,
        where=entry.stream,
        fields=entry.fields,
        extra=ref.key.encode(),
    )
    token = ref.key.rpartition(":t")[2]
    if not token.isdecimal() or ref.key != bus.keys.global_blob(
        msg.fragment_id, msg.version, int(token)
    ):
        raise CorruptPayload(
            f"entry {entry.id} refers to {ref.key!r}, not a blob of fragment "
            f"{msg.fragment_id} version {msg.version}"
        )
    check = auth.blob_check(run_id, SYNCHRONIZER)
    payload = _fetch_payload(bus, ref, msg.tensor, run_id=run_id, limits=limits, check=check)
    return msg, decode(msg.tensor, payload, out=out, limits=limits.tensor)


def rejection_reason(error: ProtocolError | BlobMissing) -> str:
    """The dead-letter reason of a refused entry: the ``ProtocolError``'s ``reason``
    (``corrupt``, ``incompatible``, ``too_large``, ``non_finite``) or ``blob_missing``."""
    return error.reason if isinstance(error, ProtocolError) else "blob_missing"


def _check_sendable(bus: Bus, run_id: str, header: TensorHeader, encoded: EncodedTensor) -> None:
    if run_id != bus.keys.run_id:
        raise ValueError(f"message of run {run_id!r} sent on the bus of run {bus.keys.run_id!r}")
    if header != encoded.header:
        raise ValueError(f"message describes {header}, the payload is {encoded.header}")


def _check_stream(entry: Entry, expected: str) -> None:
    if entry.stream != expected:
        raise CorruptPayload(
            f"entry {entry.id} of {entry.stream!r} belongs on {expected!r} by its fragment"
        )


def _fetch_payload(
    bus: Bus,
    ref: BlobRef,
    header: TensorHeader,
    *,
    run_id: str,
    limits: MessageLimits,
    check: BlobCheck | None,
) -> memoryview:
    """Fetch (size bounded first) and check the framing against ``ref`` and ``header``."""
    if ref.nbytes > limits.max_blob_bytes:
        raise PayloadTooLarge(
            f"blob {ref.key!r} of {ref.nbytes} bytes exceeds {limits.max_blob_bytes}"
        )
    blob = bus.get_blob(ref)
    return unpack_blob(
        blob, run_id=run_id, blob_key=ref.key, expect=header, limits=limits, check=check
    )


def send_command(
    bus: Bus,
    target: str,
    fields: Mapping[str, bytes],
    *,
    maxlen: int | None = 1000,
    auth: Auth = OPEN,
) -> str:
    """Append a command to ``target``'s control stream (signed with the control plane's key,
    if it has one); returns its id."""
    stream = bus.keys.control(target)
    signed = auth.sign_fields(CONTROL_KIND, run_id=bus.keys.run_id, where=stream, fields=fields)
    return bus.append(stream, signed, maxlen=maxlen)


def read_command(
    entry: Entry,
    *,
    run_id: str,
    limits: MessageLimits,
    auth: Auth = OPEN,
    fresh: FreshCommands | None = None,
    now_s: float = 0.0,
) -> FaultCommand:
    """Decode a control-stream entry; with a keyring it must be signed by the control plane
    for this very stream (a command copied to another target does not verify) and, given
    ``fresh``, be new and younger than its ``max_age_s`` at wall time ``now_s`` (a replay).

    Raises:
        ProtocolError: Malformed, out of bounds, of another run, or ``Unauthenticated``.
    """
    cmd = FaultCommand.from_fields(entry.fields, run_id=run_id, limits=limits)
    auth.check_fields(CONTROL_KIND, CONTROL, run_id=run_id, where=entry.stream, fields=entry.fields)
    if (
        auth.checks
        and fresh is not None
        and (replay := fresh.refusal(cmd.fault_id, cmd.issued_at_s, now_s))
    ):
        raise Unauthenticated(replay)
    return cmd


def accepted_commands(
    entries: Iterable[Entry],
    *,
    run_id: str,
    limits: MessageLimits,
    auth: Auth,
    fresh: FreshCommands,
    now_s: float,
    refused: Callable[[Entry, ProtocolError], None],
) -> list[FaultCommand]:
    """The commands among control-stream ``entries`` that ``read_command`` accepts, in order;
    each refused entry goes to ``refused`` with the reason (the reader counts and reports it)."""
    found: list[FaultCommand] = []
    for entry in entries:
        try:
            cmd = read_command(
                entry, run_id=run_id, limits=limits, auth=auth, fresh=fresh, now_s=now_s
            )
        except ProtocolError as exc:
            refused(entry, exc)
            continue
        found.append(cmd)
    return found


def heartbeat(bus: Bus, hb: Heartbeat, *, ttl_s: float, auth: Auth = OPEN) -> None:
    """Write ``hb`` as its member's heartbeat, sealed with the writer's key if it has one."""
    data = auth.seal(
        "heartbeat", run_id=hb.run_id, where=f"heartbeat:{hb.member_id}", data=hb.to_bytes()
    )
    bus.heartbeat(hb.member_id, data, ttl_s=ttl_s)


def read_heartbeat(
    member: str, data: bytes, *, run_id: str, limits: MessageLimits, auth: Auth = OPEN
) -> Heartbeat:
    """Decode ``member``'s heartbeat; with a keyring it must be sealed by that member
    (``learner.<id>``, or the synchronizer's or control plane's key for theirs).

    Raises:
        ProtocolError: Malformed, of another run, of another member than its slot, or
            ``Unauthenticated`` (a member without a key, or a forged seal).
    """
    body, sig = Auth.unsealed(data)
    hb = Heartbeat.from_bytes(body, run_id=run_id, limits=limits)
    if hb.member_id != member:
        raise CorruptPayload(f"heartbeat of {hb.member_id!r} stored as {member!r}'s")
    auth.check_sealed(
        "heartbeat",
        principal_of(hb.role, hb.member_id),
        run_id=run_id,
        where=f"heartbeat:{member}",
        data=body,
        signature=sig,
    )
    return hb


def read_commands(
    bus: Bus, target: str, *, after_id: str, count: int = 100, block_ms: int | None = None
) -> list[Entry]:
    """Commands for ``target`` after ``after_id`` (broadcast read; keep the last id seen)."""
    return bus.read(bus.keys.control(target), after_id=after_id, count=count, block_ms=block_ms)


def emit_event(bus: Bus, fields: Mapping[str, bytes], *, maxlen: int | None = 10_000) -> str:
    """Append an event to the run's dashboard stream; returns its id."""
    return bus.append(bus.keys.events(), fields, maxlen=maxlen)


FAULT_COUNTS = "faults"
"""The ``Keys.counts`` hash of faults sent, by kind."""
REFUSED_COUNTS = "refused"
"""The ``Keys.counts`` hash of refused messages, fields ``<reader>|<kind>|<reason>``."""


def report_refused(
    bus: Bus,
    reader: str,
    due: Mapping[tuple[str, str], int],
    *,
    at_s: float,
    maxlen: int | None = 10_000,
) -> None:
    """Count a reader's refused messages ``(kind, reason) → n`` in the run's ``refused``
    counters (kept in the bus: totals survive every restart) and report each pair as a
    ``message.refused`` event."""
    if not due:
        return
    bus.add_counts(
        bus.keys.counts(REFUSED_COUNTS), {f"{reader}|{k}|{r}": n for (k, r), n in due.items()}
    )
    for (k, r), n in due.items():
        event = Event(
            run_id=bus.keys.run_id,
            kind="message.refused",
            message=f"{n} {k} message(s) refused by {reader}: {r}",
            fields={"reader": reader, "message_kind": k, "reason": r, "count": n},
            at_s=at_s,
        )
        emit_event(bus, event.to_fields(), maxlen=maxlen)


TOKEN_COUNTS = "tokens"
"""The ``Keys.counts`` hash of the learners' own token counts, fields ``<learner>|<kind>``
(``computed``, ``published``, ``dropped``; token·fragments, ``dd_queue.learner.tokens``)."""


def _token_counts(
    bus: Bus, learner_id: str, increments: Mapping[str, int]
) -> tuple[str, dict[str, int]]:
    return bus.keys.counts(TOKEN_COUNTS), {f"{learner_id}|{k}": n for k, n in increments.items()}


def report_tokens(bus: Bus, learner_id: str, increments: Mapping[str, int]) -> None:
    """Add a learner's token counts (kept in the bus: they add up across its restarts)."""
    bus.add_counts(*_token_counts(bus, learner_id, increments))


def token_counts(bus: Bus) -> dict[str, dict[str, int]]:
    """Learner → its reported token counts by kind (``report_tokens``)."""
    found: dict[str, dict[str, int]] = {}
    for field, n in bus.read_counts(bus.keys.counts(TOKEN_COUNTS)).items():
        learner, _, kind = field.rpartition("|")
        found.setdefault(learner, {})[kind] = n
    return found


def count_fault(bus: Bus, kind: str) -> None:
    """Count one fault sent (the run's ``faults`` counters, kept in the bus)."""
    bus.add_counts(bus.keys.counts(FAULT_COUNTS), {kind: 1})


def fault_counts(bus: Bus) -> dict[str, int]:
    """Faults sent, by kind (``count_fault``)."""
    return bus.read_counts(bus.keys.counts(FAULT_COUNTS))


def refused_counts(bus: Bus) -> dict[tuple[str, str, str], int]:
    """The run's refused messages by ``(reader, kind, reason)`` (``report_refused``)."""
    found: dict[tuple[str, str, str], int] = {}
    for field, n in bus.read_counts(bus.keys.counts(REFUSED_COUNTS)).items():
        reader, _, rest = field.partition("|")
        kind, _, reason = rest.partition("|")
        found[reader, kind, reason] = n
    return found


__all__ = [
    "BLOB_FIELD",
    "accepted_commands",
    "blob_ref",
    "count_fault",
    "emit_event",
    "fault_counts",
    "fetch_blob",
    "global_notification_fields",
    "global_notification_op",
    "heartbeat",
    "latest_global",
    "publish_contribution",
    "read_command",
    "read_commands",
    "read_contribution",
    "read_global",
    "read_heartbeat",
    "refused_counts",
    "rejection_reason",
    "report_refused",
    "report_tokens",
    "send_command",
    "send_contribution",
    "token_counts",
]
