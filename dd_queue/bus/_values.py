"""The bus's argument checks, in one place: keys, stream fields, ``maxlen``, expiries, stream ids
(a blob's size and chunk layout are checked where blobs are chunked, in ``_chunks``).

The lowest layer of ``dd_queue.bus`` (it imports no other bus module): ``types``, ``_chunks``,
``commit_ops`` and both buses use it. Every check raises
:class:`~dd_queue.errors.InvalidArgument` *before* anything is sent, so a bad argument never
leaves half a commit applied, and both buses refuse the same arguments with the same error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from dd_queue.errors import InvalidArgument

_STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
_U64 = 1 << 64


def ttl_ms(ttl_s: float) -> int:
    """A positive expiry in seconds → whole milliseconds (at least 1), as ``PX`` takes it.

    Raises:
        InvalidArgument: ``ttl_s`` is not a finite number > 0 (a key without expiry is asked
            for with ``None``).
    """
    if (
        isinstance(ttl_s, bool)
        or not isinstance(ttl_s, int | float)
        or not (ttl_s > 0 and math.isfinite(ttl_s))
    ):
        raise InvalidArgument(
            f"ttl_s must be a finite number > 0, got {ttl_s!r} (use None for no expiry)"
        )
    return max(1, round(ttl_s * 1000))


def check_key(what: str, key: str) -> str:
    """Return ``key`` if it is a non-empty string, else raise :class:`InvalidArgument`."""
    if not isinstance(key, str) or not key:
        raise InvalidArgument(f"{what} must be a non-empty key string, got {key!r}")
    return key


def check_maxlen(what: str, maxlen: int | None) -> int | None:
    """Return ``maxlen`` if it is None or an integer >= 1, else raise :class:`InvalidArgument`."""
    if maxlen is not None and (
        isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 1
    ):
        raise InvalidArgument(f"{what} must be None or an integer >= 1, got {maxlen!r}")
    return maxlen


def check_fields(what: str, fields: Mapping[str, bytes]) -> dict[str, bytes]:
    """A copy of a stream entry's fields, checked: at least one field, names non-empty strings,
    values bytes-like (an entry without fields cannot exist on Redis).

    Raises:
        InvalidArgument: The fields break one of those rules.
    """
    if not isinstance(fields, Mapping) or not fields:
        raise InvalidArgument(f"{what} must be a non-empty mapping of field name → bytes")
    for name, value in fields.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{what}: field names must be non-empty strings, got {name!r}")
        if not isinstance(value, bytes | bytearray | memoryview):
            raise InvalidArgument(
                f"{what}: field {name!r} must be bytes, got {type(value).__name__}"
            )
    return dict(fields)


def check_stream_id(what: str, stream_id: str) -> str:
    """Return ``stream_id`` if it is ``"<ms>-<seq>"`` (both < 2^64), else raise.

    Raises:
        InvalidArgument: ``stream_id`` is not a complete stream id.
    """
    if not isinstance(stream_id, str) or not _STREAM_ID.fullmatch(stream_id):
        raise InvalidArgument(f"{what} must be a stream id '<ms>-<seq>', got {stream_id!r}")
    ms, _, seq = stream_id.partition("-")
    if int(ms) >= _U64 or int(seq) >= _U64:
        raise InvalidArgument(f"{what} {stream_id!r} is out of range (ids are two 64-bit parts)")
    return stream_id


def parse_stream_id(stream_id: str) -> tuple[int, int]:
    """``"<ms>-<seq>"`` → ``(ms, seq)`` for ordering; ``"<ms>"`` means ``(ms, 0)``.

    Raises:
        InvalidArgument: ``stream_id`` is neither form.
    """
    full = stream_id if isinstance(stream_id, str) and "-" in stream_id else f"{stream_id}-0"
    ms, _, seq = check_stream_id("stream id", full).partition("-")
    return int(ms), int(seq)


def stream_id_ms(stream_id: str) -> int:
    """The milliseconds part of a stream id: the bus's clock when the entry was appended.

    Raises:
        InvalidArgument: ``stream_id`` is not a stream id.
    """
    return parse_stream_id(stream_id)[0]


def format_stream_id(parsed: tuple[int, int]) -> str:
    """``(ms, seq)`` → ``"<ms>-<seq>"``."""
    return f"{parsed[0]}-{parsed[1]}"


__all__ = [
    "check_fields",
    "check_key",
    "check_maxlen",
    "check_stream_id",
    "format_stream_id",
    "parse_stream_id",
    "stream_id_ms",
    "ttl_ms",
]


def check_counts(what: str, increments: Mapping[str, int]) -> dict[str, int]:
    """A copy of counter increments without the zeros, checked: field names non-empty strings,
    values non-negative integers (counters only rise).

    Raises:
        InvalidArgument: An increment breaks one of those rules.
    """
    checked: dict[str, int] = {}
    for name, n in increments.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{what}: field names must be non-empty strings, got {name!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgument(f"{what}: {name!r} must rise by an integer >= 0, got {n!r}")
        if n:
            checked[name] = n
    return checked
