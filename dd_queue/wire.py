"""The wire format: schema-versioned msgpack envelopes, validated field by field, and blob framing.

Every message (``dd_queue.messages``) is a frozen dataclass whose envelope is a msgpack map of its
fields plus ``schema_version`` and ``type``; a stream entry carries it in field ``"m"``
(``ENTRY_FIELD``). ``decode_envelope`` checks, in order: size (PayloadTooLarge), msgpack
well-formedness with bounded lengths (CorruptPayload), ``schema_version`` and ``type``
(IncompatibleMessage), ``run_id`` (IncompatibleMessage), then the exact field set and every
field's type (CorruptPayload: missing, extra or mistyped; counts, times and weights must be finite
and ≥ 0). Per-message rules belong to the message classes.

A tensor payload is stored as a blob (``pack_blob``): ``b"DDQB"``, a little-endian uint32 header
length, a msgpack header (schema_version, run_id, blob_key, tensor header, the writer's signature
or empty bytes; ``dd_queue.auth``), zero padding to a
64-byte boundary (so the payload is aligned for numpy), then the codec payload. Where the blob
lives is said once, by the bus's ``BlobRef`` in the same stream entry (``dd_queue.bus.ops``); the
header records the key the blob was written for, and ``unpack_blob`` refuses a blob read through a
reference to another key, or holding another tensor than the entry describes.

Schema history: 3 added the blob header's ``sig``; 2 dropped ``blob_key``/``blob_nbytes``/
``n_chunks`` from contributions and global fragments (the bus's reference is the payload's only
location).
"""

from __future__ import annotations

import dataclasses
import math
import struct
import types
from collections.abc import Callable, Mapping
from typing import (
    Annotated,
    Any,
    ClassVar,
    Literal,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

import msgpack

from dd_queue.core.codec import DecodeLimits, EncodedTensor, TensorHeader
from dd_queue.errors import CoreError, CorruptPayload, IncompatibleMessage, PayloadTooLarge

__all__ = [
    "BLOB_MAGIC",
    "ENTRY_FIELD",
    "SCHEMA_VERSION",
    "BlobCheck",
    "BlobSigner",
    "MessageLimits",
    "blob_parts",
    "decode_envelope",
    "encode_envelope",
    "entry_envelope",
    "pack_blob",
    "require_text",
    "unpack_blob",
    "unpack_envelope",
]

SCHEMA_VERSION: int = 3
ENTRY_FIELD = "m"
BLOB_MAGIC = b"DDQB"
_BLOB_ALIGN_BYTES = 64
_PREFIX = struct.Struct("<4sI")
_FIELD_TYPES: dict[type[Any], dict[str, Any]] = {}
_T = TypeVar("_T")


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


# ----------------------------------------------------------------------------- envelopes


def encode_envelope(type_name: str, message: Any) -> bytes:
    """The msgpack envelope of a dataclass instance: its fields plus schema_version and type."""
    body = dataclasses.asdict(message)
    return msgpack.packb({"schema_version": SCHEMA_VERSION, "type": type_name, **body})  # type: ignore[no-any-return]


def entry_envelope(fields: Mapping[Any, bytes]) -> bytes | bytearray | memoryview:
    """The envelope in a stream entry's ``ENTRY_FIELD`` (keys may be str or bytes).

    Raises:
        CorruptPayload: The entry has no bytes ``ENTRY_FIELD``.
    """
    value = fields.get(ENTRY_FIELD, fields.get(ENTRY_FIELD.encode()))
    if not isinstance(value, bytes | bytearray | memoryview):
        raise CorruptPayload(
            f"stream entry has no bytes {ENTRY_FIELD!r} field: {sorted(map(str, fields))}"
        )
    return value


def unpack_envelope(data: object, limits: MessageLimits) -> dict[Any, Any]:
    """The envelope as a map, size and msgpack lengths bounded; nothing else checked.

    Raises:
        PayloadTooLarge: ``data`` is over ``limits.max_envelope_bytes``.
        CorruptPayload: Not bytes, not msgpack, not a map, or a list or map over ``max_items``.
    """
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


def decode_envelope(
    cls: type[_T], data: object, *, type_name: str, run_id: str, limits: MessageLimits
) -> _T:
    """Decode an envelope into dataclass ``cls`` (the checks of the module docstring, in order).

    Args:
        cls: The dataclass; its field annotations are the schema.
        data: The envelope bytes.
        type_name: The ``type`` the envelope must carry.
        run_id: The reader's run; an envelope of another run is refused.
        limits: Size limits.

    Raises:
        PayloadTooLarge: The envelope is over ``limits``.
        CorruptPayload: Not msgpack, or missing, extra or mistyped fields.
        IncompatibleMessage: Another schema_version, type or run_id.
    """
    body = unpack_envelope(data, limits)
    if type(version := body.pop("schema_version", None)) is not int:
        raise CorruptPayload(f"envelope has no integer schema_version: {version!r}")
    if version != SCHEMA_VERSION:
        raise IncompatibleMessage(
            f"schema_version {version} != {SCHEMA_VERSION}; upgrade the older process"
        )
    if (kind := body.pop("type", None)) != type_name:
        raise IncompatibleMessage(f"expected a {type_name!r} message, got type {kind!r}")
    if isinstance(sender := body.get("run_id"), str) and sender != run_id:
        raise IncompatibleMessage(f"message of run {sender!r} read by run {run_id!r}")
    decoded: _T = _from_map(cls, body, type_name)
    return decoded


def require_text(message: object, *names: str) -> None:
    """Refuse empty text fields.

    Raises:
        CorruptPayload: One of the named attributes is empty.
    """
    for name in names:
        if not getattr(message, name):
            raise CorruptPayload(f"{type(message).__name__}.{name} must not be empty")


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
    if tp in (int, float) or origin is Literal or tp in (str, bytes, bool, type(None)):
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


# ----------------------------------------------------------------------------- blobs


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _BlobHeader:
    TYPE: ClassVar[str] = "blob"
    run_id: str
    blob_key: str
    tensor: TensorHeader
    sig: bytes


BlobSigner = Callable[[str, TensorHeader, memoryview], bytes | None]
"""``(blob_key, tensor header, payload) → signature`` (``dd_queue.auth``), or None: unsigned."""
BlobCheck = Callable[[str, TensorHeader, memoryview, bytes], None]
"""``(blob_key, tensor header, payload, signature)``: raises ``Unauthenticated`` if it is not
the expected writer's."""


def blob_parts(
    *, run_id: str, blob_key: str, encoded: EncodedTensor, sign: BlobSigner | None = None
) -> tuple[bytes, memoryview]:
    """The stored form of a tensor payload as two buffers, written back to back: prefix (magic,
    header length, header, padding) and the codec payload itself (not copied).

    Args:
        run_id: The writer's run.
        blob_key: The key the blob is stored under (checked by ``unpack_blob``).
        encoded: The codec output.
        sign: The writer's signature of key, tensor header and payload, kept in the header.
    """
    payload = memoryview(encoded.payload).cast("B")
    sig = (sign(blob_key, encoded.header, payload) if sign is not None else None) or b""
    header = encode_envelope(
        _BlobHeader.TYPE,
        _BlobHeader(run_id=run_id, blob_key=blob_key, tensor=encoded.header, sig=sig),
    )
    padding = -(_PREFIX.size + len(header)) % _BLOB_ALIGN_BYTES
    return _PREFIX.pack(BLOB_MAGIC, len(header)) + header + bytes(padding), encoded.payload


def pack_blob(
    *, run_id: str, blob_key: str, encoded: EncodedTensor, sign: BlobSigner | None = None
) -> bytes:
    """``blob_parts`` joined into one bytes object (one copy of the payload)."""
    return b"".join(blob_parts(run_id=run_id, blob_key=blob_key, encoded=encoded, sign=sign))


def unpack_blob(
    data: bytes | bytearray | memoryview,
    *,
    run_id: str,
    blob_key: str,
    expect: TensorHeader,
    limits: MessageLimits,
    check: BlobCheck | None = None,
) -> memoryview:
    """Check a stored blob against the stream entry that references it; return its payload.

    Args:
        data: The blob bytes (chunks joined).
        run_id: The reader's run.
        blob_key: The key the entry's reference points to (``BlobRef.key``).
        expect: The tensor header of the referencing message.
        limits: Size limits.
        check: Checks the header's signature of the payload (``dd_queue.auth``), last.

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
    header = decode_envelope(
        _BlobHeader, view[_PREFIX.size : end], type_name="blob", run_id=run_id, limits=limits
    )
    if header.blob_key != blob_key:
        raise CorruptPayload(f"blob read from {blob_key!r} was written for {header.blob_key!r}")
    if header.tensor != expect:
        raise CorruptPayload(f"blob {blob_key!r} holds {header.tensor}, its entry says {expect}")
    if (start := end + (-end % _BLOB_ALIGN_BYTES)) > view.nbytes:
        raise CorruptPayload(f"blob {blob_key!r} is truncated before its payload")
    if any(view[end:start]):  # the padding is zeros: no byte of a blob goes unchecked
        raise CorruptPayload(f"blob {blob_key!r} has non-zero padding before its payload")
    payload = view[start:]
    if payload.nbytes > limits.tensor.max_payload_bytes:
        raise PayloadTooLarge(
            f"blob {blob_key!r} payload of {payload.nbytes} bytes is over the limit"
        )
    if check is not None:
        check(blob_key, header.tensor, payload, header.sig)
    return payload
