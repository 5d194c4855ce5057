"""Decoupled DiLoCo rounds at learner/round granularity, decided by the core quorum policy.

The synchronizer opens one round per estimated inner-step time ξ_step (fragment
``round mod P``, P = H). A learner answers at its next step boundary and its contribution
arrives ``transfer_s`` later; a learner with no chip in the job is not live. Learner step
boundaries follow each learner's timeline: it steps every ``step_s`` from the moment it last
resumed, and a stalled learner answers one step after it resumes.

**Where the core policy is used exactly.** ``grace_window`` (dd_queue.core.policy) computes
ξ_grace from the estimates ξ_step (the fleet's mean step time), ξ_quorum (the mean time to
quorum over the evaluated rounds: the value the EMA converges to in steady state) and ξ_sync. In
``policy_mode: exact`` every evaluated round is replayed through ``RoundState.admit`` and
``decide``, event by event (``exact_round``). **Closed form** (the default) is the vectorised
equivalent of ``decide`` for one round whose live set does not change while it is open:

    q        = the K-th earliest live arrival (K shrunk to the live count under "shrink")
    merge_at = max(q, min(last live arrival, q + ξ_grace, round_timeout))   if q ≤ timeout
    merged   = the live learners that arrived by merge_at; else the round is abandoned

A test replays random rounds through both and checks they agree. Rounds are evaluated at up to
``policy_rounds`` evenly spread times (O(R·M log M)); counts are scaled to the whole run.
Approximations: liveness is read when the round opens; a learner whose run is cut before its
next boundary answers one step after it resumes; contributions held by an abandoned round are
not carried into the fragment's next round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dd_queue.core.policy import Ema, Estimates, PolicyParams, decide, grace_window
from dd_queue.core.rounds import ContributionMeta, RoundState
from dd_queue.sim.config import DecoupledSpec
from dd_queue.sim.timeline import GroupTimeline

__all__ = ["RoundStats", "closed_form_rounds", "exact_round", "learner_arrivals", "simulate_rounds"]

_Floats = npt.NDArray[np.float64]
_Bools = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundStats:
    """What the synchronizer did over the run.

    Attributes:
        rounds_opened: Rounds opened in the whole run.
        rounds_evaluated: Rounds actually evaluated (evenly spread).
        merges_per_hour: Merged rounds per hour of wall time.
        abandoned_share: Share of rounds abandoned without quorum.
        mean_quorum: Mean number of learners merged per merged round.
        token_share: Per learner, its share of the tokens in merged contributions.
        grace_window_s: ξ_grace from ``grace_window``, seconds.
        grace_note: How ξ_grace was derived (the core's note).
        quorum_wait_s: ξ_quorum, mean time from opening to quorum, seconds.
    """

    rounds_opened: int
    rounds_evaluated: int
    merges_per_hour: float
    abandoned_share: float
    mean_quorum: float
    token_share: tuple[float, ...]
    grace_window_s: float
    grace_note: str
    quorum_wait_s: float


def learner_arrivals(
    timelines: Sequence[GroupTimeline], open_s: _Floats, transfer_s: float
) -> tuple[_Floats, _Bools, _Floats]:
    """Arrival offsets of every learner's answer to rounds opened at ``open_s``.

    Args:
        timelines: One per learner.
        open_s: Round opening times, seconds.
        transfer_s: Upload time of a contribution, seconds.

    Returns:
        ``(offset_s, live, chips)``, each R × M: seconds from opening to arrival (inf if it
        never answers), whether the learner is live, and its chips in the job.
    """
    shape = (open_s.size, len(timelines))
    offset, live, chips = np.full(shape, np.inf), np.zeros(shape, bool), np.zeros(shape)
    for m, tl in enumerate(timelines):
        piece = np.clip(np.searchsorted(tl.start_s, open_s, side="right") - 1, 0, None)
        chips[:, m] = tl.active_chips[piece]
        live[:, m] = chips[:, m] > 0
        rs, re = tl.runs()
        if rs.size == 0:
            continue
        j = np.searchsorted(rs, open_s, side="right") - 1
        inside = (j >= 0) & (open_s < re[np.maximum(j, 0)])
        since = open_s - rs[np.maximum(j, 0)]
        boundary = rs[np.maximum(j, 0)] + np.ceil(since / tl.step_s) * tl.step_s
        nxt = np.where(j + 1 < rs.size, rs[np.minimum(j + 1, rs.size - 1)] + tl.step_s, np.inf)
        ok = inside & (boundary <= re[np.maximum(j, 0)])
        arrive = np.where(ok, boundary, nxt) + transfer_s - open_s
        offset[:, m] = np.where(live[:, m], arrive, np.inf)
    return offset, live, chips


def _quorum_times(offset: _Floats, live: _Bools, params: PolicyParams) -> tuple[_Floats, _Floats]:
    n_live = live.sum(axis=1)
    k = np.full(n_live.size, params.quorum)
    if params.quorum_policy == "shrink":
        k = np.where(k > n_live, np.maximum(n_live, 1), k)
    arr = np.sort(np.where(live, offset, np.inf), axis=1)
    rows = np.arange(n_live.size)
    q = np.where(n_live >= k, arr[rows, np.minimum(k, arr.shape[1]) - 1], np.inf)
    last = np.where(n_live > 0, arr[rows, np.maximum(n_live - 1, 0)], np.inf)
    return q, last


def closed_form_rounds(
    offset: _Floats, live: _Bools, params: PolicyParams, grace_s: float
) -> tuple[_Bools, _Floats, _Bools]:
    """Vectorised ``decide`` for rounds with fixed live sets (see the module docstring).

    Args:
        offset: R × M arrival offsets, seconds (inf: never).
        live: R × M live learners.
        params: Quorum, policy and timeout.
        grace_s: ξ_grace, seconds.

    Returns:
        ``(merged, merge_at_s, contributors)``: per round whether it merged and when (offset,
        seconds; inf if abandoned), and R × M who was merged.
    """
    q, last = _quorum_times(offset, live, params)
    merged = q <= params.round_timeout_s
    at = np.maximum(q, np.minimum(np.minimum(last, q + grace_s), params.round_timeout_s))
    at = np.where(merged, at, np.inf)
    contributors = live & (offset <= at[:, None])
    return merged, at, contributors


def exact_round(
    arrivals: dict[str, float],
    live: frozenset[str],
    *,
    params: PolicyParams,
    estimates: Estimates,
) -> tuple[float | None, frozenset[str]]:
    """Run one round through ``RoundState`` and ``decide`` event by event (opened at 0 s).

    Args:
        arrivals: Learner → arrival offset, seconds (inf: never).
        live: The live learners (fixed while the round is open).
        params: The policy.
        estimates: ξ estimates for the grace window.

    Returns:
        ``(merge_at_s, contributors)``, or ``(None, frozenset())`` if the round is abandoned
        or would wait forever.
    """
    state = RoundState.open(fragment_id=0, round_id=0, opened_at_s=0.0, current_version=0)
    pending = sorted((t, name) for name, t in arrivals.items() if math.isfinite(t))
    i = 0
    wake: float | None = 0.0
    while True:
        nxt = pending[i][0] if i < len(pending) else math.inf
        now = min(nxt, math.inf if wake is None else wake)
        if math.isinf(now):
            return None, frozenset()
        while i < len(pending) and pending[i][0] <= now:
            meta = ContributionMeta(
                learner_id=pending[i][1],
                fragment_id=0,
                round_id=0,
                base_version=0,
                n_steps=1,
                n_tokens=1,
            )
            state, _ = state.admit(meta, now=now, max_staleness=params.max_staleness)
            i += 1
        d = decide(now, state.view(), live, params=params, estimates=estimates)
        if d.kind == "merge":
            return now, frozenset(d.contributors)
        if d.kind == "abandon":
            return None, frozenset()
        wake = d.wake_at


def simulate_rounds(
    timelines: Sequence[GroupTimeline], spec: DecoupledSpec, duration_s: float
) -> RoundStats:
    """Evaluate the synchronizer's rounds over the learners' timelines.

    Args:
        timelines: One per learner.
        spec: Policy knobs, transfer and sync times, evaluation mode and budget.
        duration_s: Simulated wall time, seconds.

    Returns:
        The ``RoundStats``.
    """
    params = spec.policy_params()
    pace_s = float(np.mean([tl.step_s for tl in timelines]))
    opened = max(1, int(duration_s // pace_s))
    idx = np.unique(np.linspace(0, opened - 1, min(opened, spec.policy_rounds)).astype(np.int64))
    open_s = idx.astype(np.float64) * pace_s
    offset, live, chips = learner_arrivals(timelines, open_s, spec.transfer_s)
    q, _ = _quorum_times(offset, live, params)
    reached = q[q <= params.round_timeout_s]
    quorum_s = float(reached.mean()) if reached.size else math.nan
    estimates = Estimates(
        step_s=Ema(pace_s, 1),
        quorum_s=Ema(quorum_s, 1) if reached.size else Ema(),
        sync_s=Ema(spec.sync_s, 1),
    )
    grace = grace_window(params, estimates)
    if spec.policy_mode == "exact":
        merged, contributors = _exact_rounds(offset, live, params, estimates)
    else:
        merged, _, contributors = closed_form_rounds(offset, live, params, grace.seconds)
    steps = np.array([tl.step_s for tl in timelines])
    tokens = (contributors * chips / steps).sum(axis=0)
    share = tokens / tokens.sum() if tokens.sum() > 0 else np.zeros(len(timelines))
    n_merged = int(merged.sum())
    return RoundStats(
        rounds_opened=opened,
        rounds_evaluated=int(idx.size),
        merges_per_hour=n_merged / idx.size * 3600.0 / pace_s,
        abandoned_share=1.0 - n_merged / idx.size,
        mean_quorum=float(contributors[merged].sum(axis=1).mean()) if n_merged else 0.0,
        token_share=tuple(float(x) for x in share),
        grace_window_s=grace.seconds,
        grace_note=grace.note,
        quorum_wait_s=quorum_s,
    )


def _exact_rounds(
    offset: _Floats, live: _Bools, params: PolicyParams, estimates: Estimates
) -> tuple[_Bools, _Bools]:
    names = [f"L{m}" for m in range(offset.shape[1])]
    merged = np.zeros(offset.shape[0], dtype=bool)
    contributors = np.zeros(offset.shape, dtype=bool)
    for r in range(offset.shape[0]):
        alive = frozenset(n for n, ok in zip(names, live[r], strict=True) if ok)
        arrivals = {n: float(offset[r, m]) for m, n in enumerate(names) if live[r, m]}
        at, who = exact_round(arrivals, alive, params=params, estimates=estimates)
        merged[r] = at is not None
        contributors[r] = [n in who for n in names]
    return merged, contributors
