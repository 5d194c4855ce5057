"""Timelines of synchronous groups: when a group trains, stalls, loses work, or has chips out.

A *group* is a set of slices that steps in lock-step: the whole job for the data-parallel
regimes, one learner for Decoupled DiLoCo. Its timeline is piecewise constant; every piece has a
ledger kind for the chips that are in the job (``training``, ``waiting`` or ``restarting``, as
in ``dd_queue.core.goodput``) and a count of chips that are out (``down``).

**Elastic group** (elastic DP; each Decoupled DiLoCo learner). A slice failure at ``f`` stalls
the group from ``f`` (the collective hangs) to ``f + detection + downscale``; the step in flight
is lost (the time since the group's last step boundary). When the slice returns at ``u`` the
group stalls again for ``upscale``. A membership change that arrives while the group is already
stalled restarts the reconfiguration, so stalls are the *union* of the intervals
``[event, event + cost]``: one sort and one running maximum (with
``accounting.failure_during_stall: absorbed`` the reconfiguration under way covers such a change
instead: ``absorb_intervals``). While stalled the group's chips are ``restarting``; the slices
that are out are ``down`` until they return.

**Plain SPMD group.** A failure at ``f`` stops everything until ``f + detection + restart``
(or, with ``waits_for_repair``, until ``max(f + detection, return) + restart``); failures
during a stall extend it the same way (or, ``absorbed``, are covered by the restart under
way). A hot spare takes the failed slice's place, so no chip is ``down`` (spares are not
counted as allocated). Between stalls the job trains ``C`` seconds and
then blocks ``δ`` for a checkpoint (``waiting``); a failure throws away the progress since the
last checkpoint (``restarting``, as the ledger asks for rolled-back work).

Everything is vectorised: O(E log E) for E interruptions of the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dd_queue.sim.config import ElasticSpec, SpmdSpec
from dd_queue.sim.failures import SliceFailures

__all__ = [
    "KIND_RESTARTING",
    "KIND_TRAINING",
    "KIND_WAITING",
    "GroupTimeline",
    "absorb_intervals",
    "elastic_timeline",
    "merge_intervals",
    "spmd_timeline",
    "stall_blocks",
]

_Floats = npt.NDArray[np.float64]
_Ints = npt.NDArray[np.int64]
_Bools = npt.NDArray[np.bool_]
KIND_TRAINING, KIND_WAITING, KIND_RESTARTING = 0, 1, 3  # codes of INTERVAL_KINDS


@dataclass(frozen=True, slots=True)
class GroupTimeline:
    """Piecewise-constant state of one synchronous group over ``[0, duration]``.

    Attributes:
        name: The group, e.g. ``"dp"`` or ``"L3"``.
        start_s: Piece starts, seconds, increasing.
        end_s: Piece ends, seconds (``end_s[i] == start_s[i + 1]``).
        kind: Ledger kind code of the chips in the job (``KIND_*``).
        active_chips: Chips in the job during the piece.
        down_chips: Chips out (failed and not yet returned).
        stalled: True during detection, reconfiguration or restart.
        busy_fraction: Share of a training step the average chip computes (mean/max speed).
        step_s: The group's inner-step time (its slowest chip), seconds.
        failures_s: Interruptions of the group's slices, seconds (for plots).
    """

    name: str
    start_s: _Floats
    end_s: _Floats
    kind: _Ints
    active_chips: _Ints
    down_chips: _Ints
    stalled: _Bools
    busy_fraction: float
    step_s: float
    failures_s: _Floats

    def runs(self) -> tuple[_Floats, _Floats]:
        """Maximal stretches in which the group steps (not stalled, some chips in), seconds."""
        going = (~self.stalled) & (self.active_chips > 0)
        return _runs(self.start_s, self.end_s, going)

    def training_runs(self) -> tuple[_Floats, _Floats]:
        """Maximal stretches of ``training`` pieces with chips in, seconds."""
        going = (self.kind == KIND_TRAINING) & (self.active_chips > 0)
        return _runs(self.start_s, self.end_s, going)


def merge_intervals(start_s: _Floats, end_s: _Floats) -> tuple[_Floats, _Floats]:
    """Union of intervals ``[start_s[i], end_s[i]]`` as disjoint sorted blocks, seconds."""
    if start_s.size == 0:
        return np.empty(0), np.empty(0)
    order = np.argsort(start_s, kind="stable")
    s, reach = start_s[order], np.maximum.accumulate(end_s[order])
    new = np.ones(s.size, dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.r_[first[1:] - 1, s.size - 1]
    return s[first], reach[last]


def absorb_intervals(start_s: _Floats, end_s: _Floats) -> tuple[_Floats, _Floats]:
    """Stall blocks when an event inside a block is absorbed by it, seconds: a block opens at
    the first event after the previous block's end and lasts that event's own cost; the events
    it covers neither open a block nor extend it (``accounting.failure_during_stall:
    absorbed``). O(B log E) for B blocks."""
    if start_s.size == 0:
        return np.empty(0), np.empty(0)
    order = np.argsort(start_s, kind="stable")
    s, e = start_s[order], end_s[order]
    opened: list[int] = []
    i = 0
    while i < s.size:
        opened.append(i)
        i = max(i + 1, int(np.searchsorted(s, e[i], side="left")))
    idx = np.asarray(opened, dtype=np.int64)
    return s[idx], e[idx]


def stall_blocks(start_s: _Floats, end_s: _Floats, *, absorb: bool) -> tuple[_Floats, _Floats]:
    """The stall blocks of events with cost windows ``[start, end]``: their union (a failure
    during a stall starts it again) or, with ``absorb``, ``absorb_intervals``."""
    return absorb_intervals(start_s, end_s) if absorb else merge_intervals(start_s, end_s)


def _runs(start: _Floats, end: _Floats, on: _Bools) -> tuple[_Floats, _Floats]:
    edges = np.diff(np.r_[0, on.astype(np.int8), 0])
    return start[edges[:-1] == 1], end[np.flatnonzero(edges[1:] == -1)]


def _in_blocks(t: _Floats, b_start: _Floats, b_end: _Floats) -> _Bools:
    if b_start.size == 0:
        return np.zeros(t.size, dtype=bool)
    idx = np.searchsorted(b_start, t, side="right") - 1
    return (idx >= 0) & (t < b_end[np.maximum(idx, 0)])


def elastic_timeline(
    name: str,
    *,
    n_slices: int,
    chips_per_slice: int,
    failures: SliceFailures,
    spec: ElasticSpec,
    step_s: float,
    busy_fraction: float,
    duration_s: float,
    absorb: bool = False,
) -> GroupTimeline:
    """Timeline of an elastic group of ``n_slices`` slices (see the module docstring).

    Args:
        name: Group name.
        n_slices: Slices in the group.
        chips_per_slice: Chips per slice.
        failures: Interruptions of the group's slices, sorted by time.
        spec: Detection and reconfiguration times.
        step_s: The group's inner-step time, seconds.
        busy_fraction: Mean/max chip speed of the group.
        duration_s: Simulated wall time, seconds.
        absorb: A membership change during a stall is absorbed by the reconfiguration under
            way (``stall_blocks``) instead of starting it again.

    Returns:
        The group's ``GroupTimeline``.
    """
    f, end_t = failures.at_s, duration_s
    u = f + failures.repair_s
    back = u[u < end_t]
    b_start, b_end = stall_blocks(
        np.r_[f, back],
        np.r_[f + spec.detection_s + spec.downscale_s, back + spec.upscale_s],
        absorb=absorb,
    )
    lost_start = _lost_starts(f, b_start, b_end, step_s)
    cuts = np.unique(np.clip(np.r_[0.0, end_t, b_start, b_end, f, back, lost_start], 0, end_t))
    start, stop = cuts[:-1], cuts[1:]
    mid = 0.5 * (start + stop)
    out = np.searchsorted(f, mid) - np.searchsorted(np.sort(u), mid)
    stalled = _in_blocks(mid, b_start, b_end)
    lost_end = f[np.isfinite(lost_start)]
    lost = _in_blocks(mid, lost_start[np.isfinite(lost_start)], lost_end)
    kind = np.where(stalled | lost, KIND_RESTARTING, KIND_TRAINING)
    return _compact(
        GroupTimeline(
            name=name,
            start_s=start,
            end_s=stop,
            kind=kind.astype(np.int64),
            active_chips=((n_slices - out) * chips_per_slice).astype(np.int64),
            down_chips=(out * chips_per_slice).astype(np.int64),
            stalled=stalled,
            busy_fraction=busy_fraction,
            step_s=step_s,
            failures_s=f,
        )
    )


def _lost_starts(f: _Floats, b_start: _Floats, b_end: _Floats, step_s: float) -> _Floats:
    """Start of the lost partial step before each failure that hit a stepping group (else inf).

    A failure hits a stepping group when it opened its stall block; the group had stepped from
    the previous block's end, so the step in flight began ``(f − resumed) mod step_s`` before.
    """
    if f.size == 0:
        return np.empty(0)
    idx = np.searchsorted(b_start, f, side="right") - 1
    opened = b_start[idx] == f
    resumed = np.where(idx >= 1, b_end[np.maximum(idx - 1, 0)], 0.0)
    lost = np.mod(f - resumed, step_s)
    return np.where(opened, f - lost, np.inf)


def spmd_timeline(
    name: str,
    *,
    chips: int,
    failures: SliceFailures,
    spec: SpmdSpec,
    detection_s: float,
    checkpoint_interval_s: float,
    step_s: float,
    busy_fraction: float,
    duration_s: float,
    absorb: bool = False,
) -> GroupTimeline:
    """Timeline of a plain SPMD job with checkpoint/restart (see the module docstring).

    Args:
        name: Group name.
        chips: Chips in the job.
        failures: Interruptions of the job's slices, sorted by time.
        spec: Restart and checkpoint parameters.
        detection_s: Failure → the job knows, seconds.
        checkpoint_interval_s: Training time between checkpoints, seconds (inf: never).
        step_s: The job's inner-step time, seconds.
        busy_fraction: Mean/max chip speed.
        duration_s: Simulated wall time, seconds.
        absorb: A failure during a stall is covered by the restart under way
            (``stall_blocks``) instead of starting detection + restart again.

    Returns:
        The job's ``GroupTimeline``.
    """
    f = failures.at_s
    ready = f + detection_s
    if spec.waits_for_repair:
        ready = np.maximum(ready, f + failures.repair_s)
    b_start, b_end = stall_blocks(f, ready + spec.restart_s, absorb=absorb)
    run_a = np.r_[0.0, np.minimum(b_end, duration_s)]
    run_b = np.r_[np.minimum(b_start, duration_s), duration_s]
    keep = run_b > run_a
    by_failure = np.r_[np.ones(b_start.size, dtype=bool), False][keep]
    a, b = run_a[keep], run_b[keep]
    cut1, cut2 = _checkpoint_cuts(
        a, b, by_failure, interval_s=checkpoint_interval_s, cost_s=spec.checkpoint_cost_s
    )
    s_b, e_b = b_start[b_start < duration_s], np.minimum(b_end[b_start < duration_s], duration_s)
    start = np.r_[a, cut1, cut2, s_b]
    stop = np.r_[cut1, cut2, b, e_b]
    kind = np.r_[
        np.full(a.size, KIND_TRAINING),
        np.full(a.size, KIND_WAITING),
        np.full(a.size, KIND_RESTARTING),
        np.full(s_b.size, KIND_RESTARTING),
    ]
    stalled = np.r_[np.zeros(3 * a.size, dtype=bool), np.ones(s_b.size, dtype=bool)]
    order = np.argsort(start, kind="stable")
    return _compact(
        GroupTimeline(
            name=name,
            start_s=start[order],
            end_s=stop[order],
            kind=kind[order].astype(np.int64),
            active_chips=np.full(start.size, chips, dtype=np.int64),
            down_chips=np.zeros(start.size, dtype=np.int64),
            stalled=stalled[order],
            busy_fraction=busy_fraction,
            step_s=step_s,
            failures_s=f,
        )
    )


def _checkpoint_cuts(
    a: _Floats, b: _Floats, by_failure: _Bools, *, interval_s: float, cost_s: float
) -> tuple[_Floats, _Floats]:
    """Split each run ``[a, b)`` into kept training, checkpoint pauses and lost progress.

    The run trains ``interval_s`` then blocks ``cost_s``, repeatedly. A run ended by a failure
    keeps only the completed checkpoints' progress; the last run (ended by the window) keeps all.

    Returns:
        ``(cut1, cut2)``: training is ``[a, cut1)``, pauses ``[cut1, cut2)``, lost ``[cut2, b)``.
    """
    cycle = interval_s + cost_s
    if np.isfinite(cycle):
        done = np.floor((b - a) / cycle)
        ckpt, kept = done * cost_s, done * interval_s
    else:  # no checkpoint ever: a failure loses everything since the last restart
        ckpt, kept = np.zeros(a.size), np.zeros(a.size)
    useful = np.where(by_failure, kept, (b - a) - ckpt)
    return a + useful, a + useful + ckpt


def _compact(tl: GroupTimeline) -> GroupTimeline:
    """Drop empty pieces and merge neighbours in the same state (fewer ledger intervals)."""
    keep = tl.end_s > tl.start_s
    s, e, k = tl.start_s[keep], tl.end_s[keep], tl.kind[keep]
    a, d, st = tl.active_chips[keep], tl.down_chips[keep], tl.stalled[keep]
    if s.size == 0:
        return tl
    same = (k[1:] == k[:-1]) & (a[1:] == a[:-1]) & (d[1:] == d[:-1]) & (st[1:] == st[:-1])
    first = np.r_[True, ~same]
    last = np.r_[~same, True]
    return GroupTimeline(
        name=tl.name,
        start_s=s[first],
        end_s=e[last],
        kind=k[first],
        active_chips=a[first],
        down_chips=d[first],
        stalled=st[first],
        busy_fraction=tl.busy_fraction,
        step_s=tl.step_s,
        failures_s=tl.failures_s,
    )
