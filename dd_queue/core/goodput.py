"""Goodput ledger arithmetic: where allocated chip time went, and how much of it trained.

Definitions from Decoupled DiLoCo (Douillard et al., arXiv 2604.21428):

- **Goodput** = useful training time ÷ allocated chip time, both in chip-seconds:
  ``Σ chips·duration over training intervals ÷ Σ chips·duration over all intervals``.
- **Uptime** = share of wall time during which training advances at all: the length of the
  union of every training interval, over all learners, ÷ the wall time.

The ledger holds intervals per learner (or per chip group, e.g. an elastic data-parallel slice),
each of one kind: ``training`` (useful work only; work later thrown away, such as steps an SPMD
job rolls back after a failure, belongs in ``restarting``), ``waiting``, ``down`` or
``restarting``. The ledger must cover every allocated chip-second: a gap in a group's timeline
is *not* counted as allocated. A group is in one state at a time, so its intervals must not
overlap (touching is fine). If every group's intervals cover the whole window, goodput is a
chip-weighted mean of per-group training shares and therefore ≤ uptime.

Everything is vectorised with numpy (sort + cumulative max), O(n log n), so a simulator can
summarise millions of intervals; ``summarize`` is the convenient object form.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from dd_queue.errors import CoreError

__all__ = [
    "INTERVAL_KINDS",
    "ChipInterval",
    "GoodputSummary",
    "IntervalKind",
    "summarize",
    "summarize_arrays",
    "union_length_s",
]

IntervalKind = Literal["training", "waiting", "down", "restarting"]
INTERVAL_KINDS: tuple[IntervalKind, ...] = ("training", "waiting", "down", "restarting")
"""Kind codes for ``summarize_arrays``: the index in this tuple (training = 0)."""

_Floats = npt.NDArray[np.float64]
_Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, kw_only=True)
class ChipInterval:
    """One group of chips in one state for a span of time.

    Attributes:
        group_id: The learner (or chip group) the chips belong to.
        kind: training / waiting / down / restarting.
        start_s: Start, seconds.
        end_s: End, seconds, ≥ ``start_s``.
        chips: Chips in the group during the interval, ≥ 1.
    """

    group_id: str
    kind: IntervalKind
    start_s: float
    end_s: float
    chips: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GoodputSummary:
    """Totals of a ledger over its window.

    Attributes:
        wall_s: Length of the window, seconds.
        allocated_chip_s: Chip-seconds of all intervals in the window.
        training_chip_s: Chip-seconds of training.
        waiting_chip_s: Chip-seconds of waiting.
        down_chip_s: Chip-seconds down.
        restarting_chip_s: Chip-seconds restarting.
        training_union_s: Seconds during which at least one group trained.
        goodput: ``training_chip_s / allocated_chip_s`` in [0, 1] (0 when nothing allocated).
        uptime: ``training_union_s / wall_s`` in [0, 1] (0 for an empty window).
    """

    wall_s: float
    allocated_chip_s: float
    training_chip_s: float
    waiting_chip_s: float
    down_chip_s: float
    restarting_chip_s: float
    training_union_s: float
    goodput: float
    uptime: float


def union_length_s(start_s: _Floats, end_s: _Floats) -> float:
    """Length of the union of intervals ``[start_s[i], end_s[i]]``, seconds.

    Sort by start, then each interval adds what extends past the furthest end seen before it.

    Args:
        start_s: Starts, seconds.
        end_s: Ends, seconds, each ≥ its start.

    Returns:
        The total covered length (0 for no intervals).
    """
    start = np.asarray(start_s, dtype=np.float64)
    end = np.asarray(end_s, dtype=np.float64)
    if start.size == 0:
        return 0.0
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    covered_before = np.concatenate(([-np.inf], reach[:-1]))
    added = end - np.maximum(start, covered_before)
    return float(np.clip(added, 0.0, None).sum())


def summarize_arrays(
    *,
    group: _Ints,
    kind: _Ints,
    start_s: _Floats,
    end_s: _Floats,
    chips: _Ints,
    window_s: tuple[float, float] | None = None,
    group_names: Sequence[str] | None = None,
) -> GoodputSummary:
    """Summarise a ledger given as parallel arrays (the simulator's fast path).

    Args:
        group: Group (learner) number of each interval.
        kind: Index into ``INTERVAL_KINDS`` of each interval.
        start_s: Starts, seconds.
        end_s: Ends, seconds.
        chips: Chips of each interval, ≥ 1.
        window_s: ``(begin, end)`` to clip to, seconds; default: from the earliest start to
            the latest end.
        group_names: Names of the group numbers, used only in error messages.

    Returns:
        The ``GoodputSummary``.

    Raises:
        CoreError: On mismatched lengths, non-finite times, ``end < start``, unknown kinds,
            codes or chips that are not integers, chips < 1, chip-seconds beyond float64,
            overlapping intervals of one group, an empty ledger without a window, or a window
            that ends before it begins.
    """
    g, k, s, e, c = _validated(group, kind, start_s, end_s, chips)
    _check_no_overlap(g, s, e, group_names)
    begin, finish = _window(s, e, window_s)
    s, e = np.clip(s, begin, finish), np.clip(e, begin, finish)
    with np.errstate(over="ignore", invalid="ignore"):  # refused just below, in words
        chip_s = c * (e - s)
        wall = finish - begin
        by_kind = [float(chip_s[k == code].sum()) for code in range(len(INTERVAL_KINDS))]
    allocated = sum(by_kind)  # finite only if every (non-negative) term and their sums are
    if not (np.isfinite(chip_s).all() and np.isfinite(wall) and np.isfinite(allocated)):
        raise CoreError("chip-seconds overflow float64: the times or chip counts are too large")
    training = k == 0
    union = union_length_s(s[training], e[training])
    return GoodputSummary(
        wall_s=wall,
        allocated_chip_s=allocated,
        training_chip_s=by_kind[0],
        waiting_chip_s=by_kind[1],
        down_chip_s=by_kind[2],
        restarting_chip_s=by_kind[3],
        training_union_s=union,
        goodput=min(1.0, by_kind[0] / allocated) if allocated > 0 else 0.0,
        uptime=min(1.0, union / wall) if wall > 0 else 0.0,
    )


def summarize(
    intervals: Iterable[ChipInterval], *, window_s: tuple[float, float] | None = None
) -> GoodputSummary:
    """Summarise a ledger of ``ChipInterval``s (see ``summarize_arrays`` for the rules).

    Args:
        intervals: The ledger.
        window_s: ``(begin, end)`` to clip to, seconds; default: the ledger's span.

    Returns:
        The ``GoodputSummary``.

    Raises:
        CoreError: As ``summarize_arrays``.
    """
    items = list(intervals)
    names = sorted({iv.group_id for iv in items})
    number = {name: i for i, name in enumerate(names)}
    codes = {name: i for i, name in enumerate(INTERVAL_KINDS)}
    bad = sorted({str(iv.kind) for iv in items if iv.kind not in codes})
    if bad:
        raise CoreError(f"unknown interval kinds {bad}; use one of {INTERVAL_KINDS}")
    return summarize_arrays(
        group=np.array([number[iv.group_id] for iv in items], dtype=np.int64),
        kind=np.array([codes[iv.kind] for iv in items], dtype=np.int64),
        start_s=np.array([iv.start_s for iv in items], dtype=np.float64),
        end_s=np.array([iv.end_s for iv in items], dtype=np.float64),
        chips=np.array([iv.chips for iv in items]),  # refused unless integers
        window_s=window_s,
        group_names=names,
    )


def _validated(
    group: _Ints, kind: _Ints, start_s: _Floats, end_s: _Floats, chips: _Ints
) -> tuple[_Ints, _Ints, _Floats, _Floats, _Floats]:
    g = _integers("group", group)
    k = _integers("kind", kind)
    s = np.asarray(start_s, dtype=np.float64)
    e = np.asarray(end_s, dtype=np.float64)
    c = np.asarray(chips)
    if not all(a.ndim == 1 and a.shape == g.shape for a in (k, s, e, c)):
        raise CoreError("group, kind, start_s, end_s and chips must be 1-D and of equal length")
    if not (np.isfinite(s).all() and np.isfinite(e).all()):
        raise CoreError("interval times must be finite")
    backwards = np.flatnonzero(e < s)
    if backwards.size:
        i = int(backwards[0])
        raise CoreError(f"interval {i} ends before it starts ({s[i]:g} s → {e[i]:g} s)")
    if ((k < 0) | (k >= len(INTERVAL_KINDS))).any():
        raise CoreError(f"kind codes must index INTERVAL_KINDS {INTERVAL_KINDS}")
    if c.size and (not np.issubdtype(c.dtype, np.integer) or (c < 1).any()):
        raise CoreError("chips must be integers ≥ 1")
    return g, k, s, e, c.astype(np.float64)


def _integers(name: str, values: _Ints) -> _Ints:
    """``values`` as int64; fractional or boolean codes are refused, never truncated."""
    a = np.asarray(values)
    if a.size and not (np.issubdtype(a.dtype, np.integer) and a.dtype != np.bool_):
        raise CoreError(f"{name} codes must be integers, not {a.dtype}")
    return a.astype(np.int64)


def _check_no_overlap(
    group: _Ints, start: _Floats, end: _Floats, names: Sequence[str] | None
) -> None:
    """Raise if two positive-length intervals of one group overlap (touching is fine).

    Sorted by (group, start), the first overlapping pair is always adjacent once zero-length
    intervals (which overlap nothing) are left out.
    """
    keep = end > start
    g, s, e = group[keep], start[keep], end[keep]
    order = np.lexsort((s, g))
    g, s, e = g[order], s[order], e[order]
    clash = np.flatnonzero((g[1:] == g[:-1]) & (s[1:] < e[:-1]))
    if clash.size:
        i = int(clash[0])
        who = names[int(g[i])] if names is not None else f"group {int(g[i])}"
        raise CoreError(
            f"{who}: intervals [{s[i]:g}, {e[i]:g}] and [{s[i + 1]:g}, {e[i + 1]:g}] overlap; "
            "a group is in one state at a time"
        )


def _window(
    start: _Floats, end: _Floats, window_s: tuple[float, float] | None
) -> tuple[float, float]:
    if window_s is None:
        if start.size == 0:
            raise CoreError("empty ledger: pass window_s to summarise no intervals")
        return float(start.min()), float(end.max())
    begin, finish = float(window_s[0]), float(window_s[1])
    if not (math.isfinite(begin) and math.isfinite(finish) and finish >= begin):
        raise CoreError(f"window_s must be finite with end ≥ begin, got {window_s}")
    return begin, finish
