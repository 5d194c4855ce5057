"""From group timelines to the goodput ledger of ``dd_queue.core.goodput`` (the same arithmetic
the real services use), and to global downtime.

Each group becomes up to three ledger groups, so that a ledger group is in one state at a time:

- ``<g>`` — its chips in the job: ``training`` (the busy share of them), ``waiting``
  (checkpoint pauses) or ``restarting`` (stalls and rolled-back work);
- ``<g>.down`` — chips out of the job, ``down``;
- ``<g>.barrier`` — during training, the chips' idle share of each step while they wait at the
  step's barrier for the slowest chip (``1 − mean/max`` of the chip speeds), ``waiting``.

So goodput = busy training chip-seconds ÷ allocated chip-seconds, and uptime = the share of wall
time in which some group trains.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from dd_queue.core.goodput import GoodputSummary, summarize_arrays
from dd_queue.sim.timeline import KIND_TRAINING, GroupTimeline

__all__ = ["KIND_DOWN", "ledger_arrays", "summarize_timelines", "time_below_s"]

_Floats = npt.NDArray[np.float64]
_Ints = npt.NDArray[np.int64]
KIND_DOWN = 2


def ledger_arrays(timelines: Sequence[GroupTimeline]) -> dict[str, npt.NDArray[np.generic]]:
    """The ledger of ``timelines`` as the parallel arrays of ``summarize_arrays``.

    Args:
        timelines: One per group; group ``g`` yields ledger groups ``3g`` (in job),
            ``3g + 1`` (down) and ``3g + 2`` (barrier).

    Returns:
        ``group``, ``kind``, ``start_s``, ``end_s`` and ``chips`` arrays (chips ≥ 1).
    """
    parts: list[tuple[_Ints, _Ints, _Floats, _Floats, _Ints]] = []
    for g, tl in enumerate(timelines):
        training = tl.kind == KIND_TRAINING
        busy = np.where(
            training, np.rint(tl.active_chips * tl.busy_fraction), tl.active_chips
        ).astype(np.int64)
        idle = tl.active_chips - busy
        for group, kind, chips in (
            (3 * g, tl.kind, busy),
            (3 * g + 1, np.full(tl.kind.size, KIND_DOWN), tl.down_chips),
            (3 * g + 2, np.full(tl.kind.size, 1), idle),
        ):
            keep = chips > 0
            n = int(keep.sum())
            parts.append(
                (
                    np.full(n, group, dtype=np.int64),
                    kind[keep].astype(np.int64),
                    tl.start_s[keep],
                    tl.end_s[keep],
                    chips[keep].astype(np.int64),
                )
            )
    names = ("group", "kind", "start_s", "end_s", "chips")
    return {name: np.concatenate([p[i] for p in parts]) for i, name in enumerate(names)}


def summarize_timelines(timelines: Sequence[GroupTimeline], duration_s: float) -> GoodputSummary:
    """Goodput and uptime of ``timelines`` over ``[0, duration_s]`` via the core ledger.

    Args:
        timelines: The groups of one regime.
        duration_s: Simulated wall time, seconds.

    Returns:
        The core ``GoodputSummary``.
    """
    a = ledger_arrays(timelines)
    names = [f"{tl.name}{suffix}" for tl in timelines for suffix in ("", ".down", ".barrier")]
    return summarize_arrays(
        group=a["group"].astype(np.int64),
        kind=a["kind"].astype(np.int64),
        start_s=a["start_s"].astype(np.float64),
        end_s=a["end_s"].astype(np.float64),
        chips=a["chips"].astype(np.int64),
        window_s=(0.0, duration_s),
        group_names=names,
    )


def time_below_s(timelines: Sequence[GroupTimeline], k: int, duration_s: float) -> float:
    """Seconds during which fewer than ``k`` groups train (global downtime for quorum K).

    Args:
        timelines: The groups.
        k: The threshold, ≥ 1.
        duration_s: Simulated wall time, seconds.

    Returns:
        Total time with fewer than ``k`` groups in a ``training`` piece, seconds.
    """
    starts, ends = zip(*(tl.training_runs() for tl in timelines), strict=True)
    t = np.r_[np.concatenate(starts), np.concatenate(ends)]
    step = np.r_[np.ones(sum(s.size for s in starts)), -np.ones(sum(e.size for e in ends))]
    order = np.lexsort((step, t))  # at equal times, ends (−1) first
    t, step = t[order], step[order]
    count = np.cumsum(step)
    edges = np.r_[0.0, t, duration_s]
    counts = np.r_[0.0, count]
    length = np.diff(np.clip(edges, 0.0, duration_s))
    return float(length[counts < k].sum())
