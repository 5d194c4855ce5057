"""The wire contract: schema-versioned msgpack envelopes, validated field by field on decode.

Every message is a frozen dataclass whose envelope is a msgpack map of its fields plus
``schema_version`` and ``type``. ``to_bytes``/``from_bytes`` give the stored form (heartbeats,
round records); ``to_fields``/``from_fields`` put it in one stream-entry field, ``"m"`` (other
entry fields, such as the bus's blob reference, belong to the bus and are ignored here).

Decoding checks, in order: size (PayloadTooLarge), msgpack well-formedness with bounded lengths
(CorruptPayload), ``schema_version`` and ``type`` (IncompatibleMessage), ``run_id``
(IncompatibleMessage), then the exact field set and every field's type (CorruptPayload: missing,
extra or mistyped; counts, times and weights must be finite and ≥ 0), then per-message rules.

A tensor payload is stored as a blob (``pack_blob``): ``b"DDQB"``, a little-endian uint32 header
length, a msgpack header (schema_version, run_id, blob_key, tensor header), zero padding to a
64-byte boundary (so the payload is aligned for numpy), then the codec payload. The bus may split
the blob into chunks; ``n_chunks`` and ``blob_nbytes`` describe the stored blob. ``unpack_blob``
checks it against the stream entry's own header before anything is decoded.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct
import types
from collections.abc import Mapping
from typing import (
    Annotated,
    Any,
    ClassVar,
    Literal,
    Self,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

import msgpack

from dd_queue.core.codec import DecodeLimits, EncodedTensor, TensorHeader, check_header
from dd_queue.errors import CoreError, CorruptPayload, IncompatibleMessage, PayloadTooLarge

__all__ = [
    "ENTRY_FIELD",
    "SCHEMA_VERSION",
    "Contribution",
    "ContributorRecord",
    "Event",
    "FaultCommand",
    "GlobalFragment",
    "Heartbeat",
    "Message",
    "MessageLimits",
    "RoundRecord",
    "message_from_bytes",
    "pack_blob",
    "unpack_blob",
]

SCHEMA_VERSION: int = 1
ENTRY_FIELD = "m"
BLOB_MAGIC = b"DDQB"
_BLOB_ALIGN_BYTES = 64
_PREFIX = struct.Struct("<4sI")
_FIELD_TYPES: dict[type[Any], dict[str, Any]] = {}
_EVENT_KIND = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")
Scalar = Annotated[str | int | float | bool | None, "free-form"]
"""A free-form value (fault parameters, event fields): any sign, but finite."""


@dataclasses.dataclass(frozen=True, slots=True)
class MessageLimits:
    """Bounds on what a decode accepts.

    Attributes:
        max_envelope_bytes: Largest envelope (or blob header), bytes.
        max_items: Largest number of entries in any list or map of an envelope.
        tensor: Limits on tensor headers and payloads (see ``dd_queue.core.codec``).
    """

    max_envelope_bytes: int = 1 << 20
    max_items: int = 4096
    tensor: DecodeLimits = dataclasses.field(default_factory=DecodeLimits)

    def __post_init__(self) -> None:
        for name in ("max_envelope_bytes", "max_items"):
            if type(value := getattr(self, name)) is not int or value < 1:
                raise CoreError(f"MessageLimits.{name} must be a positive integer, got {value!r}")

    @property
    def max_blob_bytes(self) -> int:
        """Largest stored blob: header, padding and the largest payload, bytes."""
        return (
            _PREFIX.size
            + self.max_envelope_bytes
            + _BLOB_ALIGN_BYTES
            + self.tensor.max_payload_bytes
        )


class Message:
    """Base of every envelope: encoding and validated decoding. Subclasses are dataclasses."""

    __slots__ = ()
    TYPE: ClassVar[str]
    run_id: str

    def to_bytes(self) -> bytes:
        """The msgpack envelope."""
        body = dataclasses.asdict(self)  # type: ignore[call-overload]
        return msgpack.packb({"schema_version": SCHEMA_VERSION, "type": self.TYPE, **body})  # type: ignore[no-any-return]

    def to_fields(self) -> dict[str, bytes]:
        """Stream-entry fields: the envelope under ``ENTRY_FIELD``."""
        return {ENTRY_FIELD: self.to_bytes()}

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray | memoryview, *, run_id: str, limits: MessageLimits
    ) -> Self:
        """Decode and validate an envelope of this type.

        Args:
            data: The envelope.
            run_id: The reader's run; a message of another run is refused.
            limits: Size limits.

        Raises:
            PayloadTooLarge: Envelope (or a referenced tensor) over ``limits``.
            CorruptPayload: Not msgpack, or missing, extra or mistyped fields, or broken rules.
            IncompatibleMessage: Other schema_version, type, run_id, codec or dtype.
        """
        body = _unpack(data, limits)
        if type(version := body.pop("schema_version", None)) is not int:
            raise CorruptPayload(f"envelope has no integer schema_version: {version!r}")
        if version != SCHEMA_VERSION:
            raise IncompatibleMessage(
                f"schema_version {version} != {SCHEMA_VERSION}; upgrade the older process"
            )
        if (kind := body.pop("type", None)) != cls.TYPE:
            raise IncompatibleMessage(f"expected a {cls.TYPE!r} message, got type {kind!r}")
        if isinstance(sender := body.get("run_id"), str) and sender != run_id:
            raise IncompatibleMessage(f"message of run {sender!r} read by run {run_id!r}")
        message: Self = _from_map(cls, body, cls.TYPE)
        message._validate(limits)
        return message

    @classmethod
    def from_fields(
        cls,
        fields: Mapping[Any, bytes],
        *,
        run_id: str,
        limits: MessageLimits,
    ) -> Self:
        """Decode the envelope in a stream entry's ``ENTRY_FIELD`` (keys may be str or bytes).

        Raises:
            CorruptPayload: No ``ENTRY_FIELD``; otherwise as ``from_bytes``.
        """
        value = fields.get(ENTRY_FIELD, fields.get(ENTRY_FIELD.encode()))
        if not isinstance(value, bytes | bytearray | memoryview):
            raise CorruptPayload(
                f"stream entry has no bytes {ENTRY_FIELD!r} field: {sorted(map(str, fields))}"
            )
        return cls.from_bytes(value, run_id=run_id, limits=limits)

    def _validate(self, limits: MessageLimits) -> None:
        """Per-message rules beyond field types; subclasses extend it."""
        _require_text(self, "run_id")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Contribution(Message):
    """A learner's outer gradient Δ_p for one fragment in one round (learner → synchronizer).

    The stream entry is a small reference; the payload is a blob (``pack_blob``) at ``blob_key``.
    Dedupe identity: ``(learner_id, fragment_id, round_id)``.

    Attributes:
        config_digest: Digest of the sender's math-relevant config; the synchronizer compares it.
        base_version: Global version of the fragment the learner's Δ is taken against.
        n_steps, n_tokens: Inner steps and tokens since the learner last received the fragment
            (Decoupled DiLoCo's merge weight is n_tokens · n_tokens / n_steps).
        tensor: Codec header of the payload (dd_queue.core.codec).
        blob_key, blob_nbytes, n_chunks: Where the stored blob lives, its size in bytes and the
            number of chunk keys the bus split it into.
        created_at_s: Sender's wall-clock time, seconds since the epoch.
    """

    TYPE: ClassVar[str] = "contribution"
    run_id: str
    config_digest: str
    learner_id: str
    fragment_id: int
    round_id: int
    base_version: int
    n_steps: int
    n_tokens: int
    tensor: TensorHeader
    blob_key: str
    blob_nbytes: int
    n_chunks: int
    created_at_s: float

    @property
    def identity(self) -> tuple[str, int, int]:
        """The deduplication key ``(learner_id, fragment_id, round_id)``."""
        return (self.learner_id, self.fragment_id, self.round_id)

    def _validate(self, limits: MessageLimits) -> None:
        _require_text(self, "run_id", "config_digest", "learner_id", "blob_key")
        _check_blob(self.tensor, self.blob_nbytes, self.n_chunks, limits)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GlobalFragment(Message):
    """A new global version of a fragment (synchronizer → learners); always fp32 (exact)."""

    TYPE: ClassVar[str] = "global"
    run_id: str
    fragment_id: int
    version: int
    round_id: int
    tensor: TensorHeader
    blob_key: str
    blob_nbytes: int
    n_chunks: int
    created_at_s: float
    reason: str

    def _validate(self, limits: MessageLimits) -> None:
        _require_text(self, "run_id", "blob_key")
        if self.tensor.codec != "fp32":
            raise IncompatibleMessage(f"global fragments must be fp32, got {self.tensor.codec!r}")
        _check_blob(self.tensor, self.blob_nbytes, self.n_chunks, limits)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """A member's liveness and progress.

    Attributes:
        state: Free text such as ``training``, ``stalled``, ``draining``.
        step, n_tokens: Inner steps and tokens trained since the member started.
        step_time_ema_s: Moving average of one inner step, seconds (None before the first).
        versions: Fragment id → global version the member holds.
        queue_depths: Background queue name → items waiting (e.g. ``publish``, ``receive``).
        device, host, pid: Where the member runs.
        sent_at_s: Sender's wall-clock time, seconds since the epoch.
    """

    TYPE: ClassVar[str] = "heartbeat"
    run_id: str
    config_digest: str
    role: Literal["learner", "synchronizer", "control"]
    member_id: str
    state: str
    step: int
    n_tokens: int
    step_time_ema_s: float | None
    versions: dict[int, int]
    queue_depths: dict[str, int]
    device: str
    host: str
    pid: int
    sent_at_s: float

    def _validate(self, limits: MessageLimits) -> None:
        _require_text(self, "run_id", "member_id", "state")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ContributorRecord:
    """One learner's part in a round: its normalized merge weight, counters and staleness
    (global versions between its base version and the merged one)."""

    learner_id: str
    weight: float
    n_tokens: int
    n_steps: int
    staleness: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoundRecord(Message):
    """What one round of one fragment did and why (for the API, dashboard and audits).

    ``version_after`` is ``version_before + 1`` for a merge and equal to it for an abandon.
    ``timings_s`` holds named durations (e.g. ``merge``, ``outer_step``, ``publish``), seconds.
    """

    TYPE: ClassVar[str] = "round"
    run_id: str
    fragment_id: int
    round_id: int
    version_before: int
    version_after: int
    decision: Literal["merge", "abandon"]
    reason: str
    contributors: tuple[ContributorRecord, ...]
    opened_at_s: float
    quorum_at_s: float | None
    closed_at_s: float
    timings_s: dict[str, float]

    def _validate(self, limits: MessageLimits) -> None:
        _require_text(self, "run_id", "reason")
        step = 1 if self.decision == "merge" else 0
        if self.version_after != self.version_before + step:
            raise CorruptPayload(
                f"{self.decision} must take version {self.version_before} to "
                f"{self.version_before + step}, not {self.version_after}"
            )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FaultCommand(Message):
    """An injected fault for ``target`` (a learner id, ``"synchronizer"`` or ``"*"``)."""

    TYPE: ClassVar[str] = "fault"
    run_id: str
    fault_id: str
    target: str
    kind: Literal["stall", "slow", "drop", "delay", "corrupt", "disconnect", "kill"]
    params: dict[str, Scalar]
    duration_s: float | None
    issued_at_s: float

    def _validate(self, limits: MessageLimits) -> None:
        _require_text(self, "run_id", "fault_id", "target")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Event(Message):
    """Something that happened, named by a dotted ``kind`` such as ``round.merged``."""

    TYPE: ClassVar[str] = "event"
    run_id: str
    kind: str
    message: str
    fields: dict[str, Scalar]
    at_s: float

    def _validate(self, limits: MessageLimits) -> None:
        _require_text(self, "run_id")
        if not _EVENT_KIND.fullmatch(self.kind):
            raise CorruptPayload(
                f"event kind {self.kind!r} is not a dotted name like 'round.merged'"
            )


_TYPES: dict[str, type[Message]] = {
    c.TYPE: c for c in (Contribution, GlobalFragment, Heartbeat, RoundRecord, FaultCommand, Event)
}


def message_from_bytes(
    data: bytes | bytearray | memoryview, *, run_id: str, limits: MessageLimits
) -> Message:
    """Decode an envelope of any message type (e.g. a dead-lettered entry).

    Raises:
        As ``Message.from_bytes``; an unknown ``type`` is IncompatibleMessage.
    """
    kind = _unpack(data, limits).get("type")
    if not isinstance(kind, str) or kind not in _TYPES:
        raise IncompatibleMessage(f"unknown message type {kind!r}; known: {sorted(_TYPES)}")
    return _TYPES[kind].from_bytes(data, run_id=run_id, limits=limits)


# ----------------------------------------------------------------------------- blobs


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _BlobHeader(Message):
    TYPE: ClassVar[str] = "blob"
    run_id: str
    blob_key: str
    tensor: TensorHeader


def pack_blob(*, run_id: str, blob_key: str, encoded: EncodedTensor) -> bytes:
    """The stored form of a tensor payload: prefix, header, padding, payload (one copy).

    Args:
        run_id: The writer's run.
        blob_key: The key the blob is stored under (checked by ``unpack_blob``).
        encoded: The codec output.

    Returns:
        The blob bytes.
    """
    header = _BlobHeader(run_id=run_id, blob_key=blob_key, tensor=encoded.header).to_bytes()
    padding = -(_PREFIX.size + len(header)) % _BLOB_ALIGN_BYTES
    prefix = _PREFIX.pack(BLOB_MAGIC, len(header)) + header + bytes(padding)
    return b"".join((prefix, encoded.payload))


def unpack_blob(
    data: bytes | bytearray | memoryview,
    *,
    run_id: str,
    blob_key: str,
    expect: TensorHeader,
    limits: MessageLimits,
) -> memoryview:
    """Check a stored blob against the stream entry that references it; return its payload.

    Args:
        data: The blob bytes (chunks joined).
        run_id: The reader's run.
        blob_key: The key the blob was read from.
        expect: The tensor header of the referencing message.
        limits: Size limits.

    Returns:
        A zero-copy view of the codec payload, for ``dd_queue.core.codec.decode``.

    Raises:
        CorruptPayload: Truncated, not a blob, or written for another key or tensor.
        IncompatibleMessage: Another schema_version or run.
        PayloadTooLarge: Header or payload over ``limits``.
    """
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    if view.nbytes < _PREFIX.size:
        raise CorruptPayload(f"blob {blob_key!r} is {view.nbytes} bytes: truncated")
    magic, header_nbytes = _PREFIX.unpack_from(view)
    if magic != BLOB_MAGIC:
        raise CorruptPayload(f"blob {blob_key!r} does not start with {BLOB_MAGIC!r}")
    if header_nbytes > min(limits.max_envelope_bytes, view.nbytes - _PREFIX.size):
        raise CorruptPayload(f"blob {blob_key!r} header length {header_nbytes} is impossible")
    end = _PREFIX.size + header_nbytes
    header = _BlobHeader.from_bytes(view[_PREFIX.size : end], run_id=run_id, limits=limits)
    if header.blob_key != blob_key:
        raise CorruptPayload(f"blob read from {blob_key!r} was written for {header.blob_key!r}")
    if header.tensor != expect:
        raise CorruptPayload(f"blob {blob_key!r} holds {header.tensor}, its entry says {expect}")
    if (start := end + (-end % _BLOB_ALIGN_BYTES)) > view.nbytes:
        raise CorruptPayload(f"blob {blob_key!r} is truncated before its payload")
    payload = view[start:]
    if payload.nbytes > limits.tensor.max_payload_bytes:
        raise PayloadTooLarge(
            f"blob {blob_key!r} payload of {payload.nbytes} bytes is over the limit"
        )
    return payload


# ----------------------------------------------------------------------------- validation


def _unpack(data: object, limits: MessageLimits) -> dict[Any, Any]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CorruptPayload(f"envelope must be bytes, got {type(data).__name__}")
    if (size := memoryview(data).nbytes) > limits.max_envelope_bytes:
        raise PayloadTooLarge(
            f"envelope of {size} bytes exceeds max_envelope_bytes={limits.max_envelope_bytes}"
        )
    try:
        body = msgpack.unpackb(
            data,
            raw=False,
            use_list=False,
            strict_map_key=False,
            max_str_len=limits.max_envelope_bytes,
            max_bin_len=limits.max_envelope_bytes,
            max_array_len=limits.max_items,
            max_map_len=limits.max_items,
            max_ext_len=0,
        )
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError) as exc:
        raise CorruptPayload(f"envelope is not valid msgpack: {exc}") from exc
    if not isinstance(body, dict):
        raise CorruptPayload(f"envelope must be a map, got {type(body).__name__}")
    return body


def _field_types(cls: type[Any]) -> dict[str, Any]:
    if cls not in _FIELD_TYPES:
        hints = get_type_hints(cls, include_extras=True)
        _FIELD_TYPES[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _FIELD_TYPES[cls]


def _from_map(cls: type[Any], value: object, path: str) -> Any:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise CorruptPayload(f"{path} must be a map with string keys")
    types_ = _field_types(cls)
    missing, extra = types_.keys() - value.keys(), value.keys() - types_.keys()
    if missing or extra:
        raise CorruptPayload(
            f"{path}: missing fields {sorted(missing)}, unexpected {sorted(extra)}"
        )
    return cls(**{name: _convert(value[name], tp, f"{path}.{name}") for name, tp in types_.items()})


def _convert(value: object, tp: Any, path: str) -> object:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:  # free-form Scalar: any sign, finite
        if type(value) in (str, int, bool, type(None)) or (
            type(value) is float and math.isfinite(value)
        ):
            return value
        return _bad(path, "a string, finite number, boolean or nil", value)
    if tp in (int, float) or origin is Literal or tp in (str, bool, type(None)):
        return _scalar(value, tp, path)
    if origin in (Union, types.UnionType):
        for arm in args:
            try:
                return _convert(value, arm, path)
            except CorruptPayload:
                continue
        return _bad(path, " | ".join(getattr(a, "__name__", str(a)) for a in args), value)
    if origin is dict:
        if not isinstance(value, dict):
            return _bad(path, "a map", value)
        return {
            _convert(k, args[0], f"{path} key"): _convert(v, args[1], f"{path}[{k!r}]")
            for k, v in value.items()
        }
    if origin is tuple:
        if not isinstance(value, tuple | list):
            return _bad(path, "a list", value)
        return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _from_map(tp, value, path)  # type: ignore[arg-type]
    raise TypeError(f"unsupported field type {tp!r} at {path}")  # a bug in a message class


def _scalar(value: object, tp: Any, path: str) -> object:
    if get_origin(tp) is Literal:
        return (
            value
            if isinstance(value, str) and value in get_args(tp)
            else _bad(path, f"one of {get_args(tp)}", value)
        )
    if tp is float and type(value) in (int, float):
        number = float(value)  # type: ignore[arg-type]
        return (
            number if math.isfinite(number) and number >= 0 else _bad(path, "finite and ≥ 0", value)
        )
    if type(value) is not tp:
        return _bad(path, getattr(tp, "__name__", str(tp)), value)
    if tp is int and value < 0:  # type: ignore[operator]
        return _bad(path, "≥ 0", value)
    return value


def _bad(path: str, expected: str, value: object) -> Any:
    raise CorruptPayload(f"{path} must be {expected}, got {value!r:.80}")


def _require_text(message: object, *names: str) -> None:
    for name in names:
        if not getattr(message, name):
            raise CorruptPayload(f"{type(message).__name__}.{name} must not be empty")


def _check_blob(
    tensor: TensorHeader, blob_nbytes: int, n_chunks: int, limits: MessageLimits
) -> None:
    check_header(tensor, limits.tensor)
    if blob_nbytes > limits.max_blob_bytes:
        raise PayloadTooLarge(f"blob of {blob_nbytes} bytes exceeds {limits.max_blob_bytes}")
    if not 1 <= n_chunks <= max(1, blob_nbytes):
        raise CorruptPayload(f"n_chunks {n_chunks} is impossible for a {blob_nbytes}-byte blob")
