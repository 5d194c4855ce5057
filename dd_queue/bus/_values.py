"""The lowest layer of ``dd_queue.bus``: argument checks, stream ids, expiries and ``Entry``.

``types`` and ``commit_ops`` build on it. Every check raises :class:`InvalidArgument` *before*
anything is sent, so a bad argument never leaves half a commit applied, and both buses refuse the
same arguments with the same error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from dd_queue.errors import BusError

_STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
_U64 = 1 << 64


class InvalidArgument(BusError, ValueError):
    """A bus call or commit op got an argument Redis would refuse: empty fields, a malformed
    stream id, an expiry or ``maxlen`` that is not positive, an empty key.

    Raised before anything is sent, so nothing was applied: fix the caller. It is a ``BusError``
    (the bus refused) and a ``ValueError`` (a bad argument).
    """


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


def format_stream_id(parsed: tuple[int, int]) -> str:
    """``(ms, seq)`` → ``"<ms>-<seq>"``."""
    return f"{parsed[0]}-{parsed[1]}"


@dataclass(frozen=True, slots=True)
class Entry:
    """One stream entry as a reader sees it.

    Attributes:
        stream: Key of the stream it came from.
        id: Stream id, ``"<ms>-<seq>"``.
        fields: Field name → raw bytes. Empty when the entry was trimmed away while it was still
            pending (a re-read of the pending list shows such entries; ack them).
        delivery_count: How often the group delivered it (1 on first delivery); 0 for reads
            outside a group.
    """

    stream: str
    id: str
    fields: Mapping[str, bytes]
    delivery_count: int = 0

    @property
    def deleted(self) -> bool:
        """True for a pending entry whose data was trimmed (a real entry has ≥ 1 field)."""
        return not self.fields


def dead_letter_fields(entry: Entry, group: str, reason: str) -> dict[str, bytes]:
    """Fields a dead-letter entry carries besides the original ones (``ddq.dlq.*``)."""
    return {
        "ddq.dlq.reason": reason.encode(),
        "ddq.dlq.stream": entry.stream.encode(),
        "ddq.dlq.id": entry.id.encode(),
        "ddq.dlq.group": group.encode(),
    }


__all__ = [
    "Entry",
    "InvalidArgument",
    "check_fields",
    "check_key",
    "check_maxlen",
    "check_stream_id",
    "dead_letter_fields",
    "format_stream_id",
    "parse_stream_id",
    "ttl_ms",
]
