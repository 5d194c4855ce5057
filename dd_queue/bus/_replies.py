"""Typed parsing of redis-py replies (RESP2 shapes, as redis-py's callbacks leave them).

redis-py annotates its sync/async commands with ``X | Awaitable[X]``; these helpers take
``object`` and check shapes at runtime, so the bus needs no casts and a surprising reply becomes
a clear ``BusError`` instead of an ``AttributeError`` deep inside a loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dd_queue.bus.types import Entry, MemoryInfo, PendingEntry, PendingSummary
from dd_queue.errors import BusError


def _unexpected(what: str, raw: object) -> BusError:
    return BusError(f"unexpected Redis reply to {what}: {str(raw)[:200]}")


def as_str(raw: object, what: str = "command") -> str:
    """bytes/str reply → str."""
    if isinstance(raw, bytes):
        return raw.decode()
    if isinstance(raw, str):
        return raw
    raise _unexpected(what, raw)


def as_bytes_or_none(raw: object, what: str = "GET") -> bytes | None:
    """Bulk-string-or-nil reply → bytes or None."""
    if raw is None or isinstance(raw, bytes):
        return raw
    if isinstance(raw, str):
        return raw.encode()
    raise _unexpected(what, raw)


def as_int(raw: object, what: str = "command") -> int:
    """Integer reply (or its bytes/str form) → int."""
    if isinstance(raw, bool):
        return int(raw)
    if isinstance(raw, int):
        return raw
    if isinstance(raw, bytes | str):
        try:
            return int(raw)
        except ValueError:
            pass
    raise _unexpected(what, raw)


def as_list(raw: object, what: str = "command") -> list[Any]:
    """Array reply → list."""
    if isinstance(raw, list | tuple):
        return list(raw)
    raise _unexpected(what, raw)


def _fields(raw: object) -> dict[str, bytes]:
    if raw is None:
        return {}  # a pending entry whose data was trimmed
    if isinstance(raw, Mapping):
        return {as_str(k): bytes(v) for k, v in raw.items()}
    if isinstance(raw, list | tuple):  # flat [field, value, ...] (Lua / raw replies)
        items = list(raw)
        return {as_str(items[i]): bytes(items[i + 1]) for i in range(0, len(items), 2)}
    raise _unexpected("stream entry", raw)


def entries(stream: str, raw: object, delivery_count: int) -> list[Entry]:
    """``[(id, fields), ...]`` → entries of ``stream``."""
    out: list[Entry] = []
    for item in as_list(raw, "stream range"):
        pair = as_list(item, "stream entry")
        out.append(Entry(stream, as_str(pair[0]), _fields(pair[1]), delivery_count))
    return out


def xread(raw: object, delivery_count: int) -> list[Entry]:
    """XREAD / XREADGROUP reply (``[[stream, entries], ...]`` or a RESP3 map) → entries."""
    if raw is None:
        return []
    pairs = list(raw.items()) if isinstance(raw, Mapping) else as_list(raw, "XREAD")
    out: list[Entry] = []
    for pair in pairs:
        stream, items = (pair[0], pair[1])
        if isinstance(items, list | tuple) and len(items) == 1 and isinstance(items[0], list):
            items = items[0]  # RESP3 map values arrive wrapped once
        out += entries(as_str(stream), items, delivery_count)
    return out


def xautoclaim(stream: str, raw: object) -> tuple[str, list[Entry], list[str]]:
    """XAUTOCLAIM reply → ``(next cursor, claimed entries, deleted ids)``.

    Redis 6.2 answers with two elements and hands trimmed entries back with empty fields;
    those are reported as deleted too.
    """
    parts = as_list(raw, "XAUTOCLAIM")
    cursor = as_str(parts[0], "XAUTOCLAIM")
    claimed = entries(stream, parts[1], 0)
    deleted = [as_str(i) for i in as_list(parts[2])] if len(parts) > 2 else []
    deleted += [e.id for e in claimed if e.deleted]
    return cursor, [e for e in claimed if not e.deleted], deleted


def pending_summary(raw: object) -> PendingSummary:
    """XPENDING summary (redis-py dict) → PendingSummary."""
    if not isinstance(raw, Mapping):
        raise _unexpected("XPENDING", raw)
    consumers: dict[str, int] = {}
    for item in raw.get("consumers") or []:
        consumers[as_str(item["name"])] = as_int(item["pending"])
    count = as_int(raw.get("pending", 0))
    if count == 0:
        return PendingSummary(0, None, None, {})
    return PendingSummary(count, as_str(raw["min"]), as_str(raw["max"]), consumers)


def pending_range(raw: object) -> list[PendingEntry]:
    """XPENDING range (redis-py list of dicts) → pending entries."""
    out: list[PendingEntry] = []
    for item in as_list(raw, "XPENDING"):
        if not isinstance(item, Mapping):
            raise _unexpected("XPENDING", item)
        out.append(
            PendingEntry(
                id=as_str(item["message_id"]),
                consumer=as_str(item["consumer"]),
                idle_ms=as_int(item["time_since_delivered"]),
                delivery_count=as_int(item["times_delivered"]),
            )
        )
    return out


def flat_pairs(raw: object) -> list[tuple[bytes, bytes]]:
    """Flat ``[k1, v1, k2, v2, ...]`` (Lua HGETALL / ZRANGE WITHSCORES) → pairs."""
    items = as_list(raw, "script")
    return [(bytes(items[i]), bytes(items[i + 1])) for i in range(0, len(items), 2)]


def counts(raw: object) -> dict[str, int]:
    """HGETALL of a counters hash → name → integer."""
    if not isinstance(raw, Mapping):
        raise _unexpected("HGETALL", raw)
    return {as_str(k, "HGETALL"): as_int(v, "HGETALL") for k, v in raw.items()}


def memory_info(raw: object) -> MemoryInfo:
    """INFO memory → used and max bytes."""
    if not isinstance(raw, Mapping) or "used_memory" not in raw:
        raise _unexpected("INFO memory", raw)
    return MemoryInfo(
        used_bytes=as_int(raw["used_memory"], "INFO memory"),
        max_bytes=as_int(raw.get("maxmemory", 0), "INFO memory"),
    )


def fullest_memory_info(raw: object) -> MemoryInfo:
    """INFO memory of every master of a cluster (node → reply) → the fullest master's: the
    one nearest its ``maxmemory`` (or using most, where no master has a limit)."""
    if not isinstance(raw, Mapping) or not raw:
        raise _unexpected("INFO memory (cluster)", raw)
    infos = [memory_info(reply) for reply in raw.values()]
    return max(infos, key=lambda m: (m.used_bytes / m.max_bytes if m.max_bytes else 0.0,
                                     m.used_bytes))  # fmt: skip
