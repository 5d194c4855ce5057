"""Random inputs of a simulation: slice interruptions, return times and chip speeds.

**Failures per slice, not per chip.** Each chip is interrupted as a Poisson process of rate
1/MTBI; a slice of S chips fails when any of its chips does, so a slice is a Poisson process of
rate S/MTBI, and the n slices of the job together one of rate n·S/MTBI. We draw that aggregate
process once (a Poisson count, then uniform times), give each event a uniformly chosen slice,
and *thin* it: an event that hits a slice which is still out (its previous interruption has not
returned yet) is dropped, because a slice that is out cannot fail again. Thinning a Poisson
process this way is exact: each slice becomes an alternating renewal process, up ~ Exp(S/MTBI),
out ~ the return-time distribution. Cost: O(E log E) for E = N·T/MTBI events (≈ 197 000 for
2.4M chips over 30 days), independent of S; no per-chip work.

**Return times.** ``lognormal`` (median and 99th percentile), ``exp_weibull`` (the exponentiated
Weibull of Mudholkar & Srivastava, F(x) = (1 − exp(−(x/λ)^k))^α, sampled by inverting F),
``fixed`` and ``empirical`` (resampling observed durations, used by calibration).

**Chip speeds.** Chip c takes ``step_s · f_c`` per inner step with ln f_c ~ N(0, σ²), fixed for the
run. Drawing them is the one O(N) step (≈ 30 ms for 2.4M chips).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dd_queue.sim.config import RepairSpec

__all__ = ["SliceFailures", "sample_repairs", "slice_failures", "slice_speed_stats"]

_Floats = npt.NDArray[np.float64]
_Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class SliceFailures:
    """Accepted interruptions of a job's slices, sorted by time.

    Attributes:
        slice_id: Slice hit by each interruption, in ``[0, n_slices)``.
        at_s: When it failed, seconds from the start.
        repair_s: How long it stays out, seconds (it returns at ``at_s + repair_s``).
    """

    slice_id: _Ints
    at_s: _Floats
    repair_s: _Floats

    def of_slices(self, first: int, stop: int) -> SliceFailures:
        """The interruptions of slices ``first ≤ slice_id < stop`` (a learner's slices)."""
        keep = (self.slice_id >= first) & (self.slice_id < stop)
        return SliceFailures(self.slice_id[keep], self.at_s[keep], self.repair_s[keep])


def sample_repairs(rng: np.random.Generator, spec: RepairSpec, n: int) -> _Floats:
    """Draw ``n`` return times, seconds.

    Args:
        rng: The simulation's generator.
        spec: The distribution and its parameters.
        n: How many.

    Returns:
        Durations ≥ 0, seconds.
    """
    if spec.distribution == "fixed":
        return np.full(n, spec.fixed_s)
    if spec.distribution == "lognormal":
        return rng.lognormal(np.log(spec.median_s), spec.lognormal_sigma, n)
    if spec.distribution == "empirical":
        return rng.choice(np.asarray(spec.samples_s, dtype=np.float64), n)
    u = rng.random(n)
    inner = -np.log1p(-(u ** (1.0 / spec.shape_alpha)))
    return np.asarray(spec.scale_s * inner ** (1.0 / spec.shape_k), dtype=np.float64)


def slice_failures(
    rng: np.random.Generator,
    *,
    n_slices: int,
    rate_per_slice_s: float,
    duration_s: float,
    repair: RepairSpec,
) -> SliceFailures:
    """Interruptions of ``n_slices`` slices over ``[0, duration_s)``.

    Args:
        rng: The simulation's generator.
        n_slices: Slices in the job.
        rate_per_slice_s: Poisson rate of one slice while it is in, per second.
        duration_s: Simulated wall time, seconds.
        repair: Return-time distribution.

    Returns:
        The accepted interruptions, sorted by time (see the module docstring).
    """
    count = int(rng.poisson(n_slices * rate_per_slice_s * duration_s)) if rate_per_slice_s else 0
    at = np.sort(rng.uniform(0.0, duration_s, count))
    sid = rng.integers(0, n_slices, count).astype(np.int64)
    rep = sample_repairs(rng, repair, count)
    keep = _accepted(sid, at, rep, horizon_s=duration_s)
    return SliceFailures(sid[keep], at[keep], rep[keep])


def _accepted(sid: _Ints, at: _Floats, rep: _Floats, *, horizon_s: float) -> npt.NDArray[np.bool_]:
    """Which events hit a slice that is in (thinning), vectorised except for rare chains.

    An event that no earlier event of its slice covers is accepted whatever happened before;
    only events that some earlier event covers need the sequential rule (covered by an
    *accepted* earlier event → dropped), and those are a few percent.
    """
    keep = np.ones(at.size, dtype=bool)
    if at.size < 2:
        return keep
    order = np.lexsort((at, sid))
    s, t, end = sid[order], at[order], at[order] + rep[order]
    big = horizon_s + float(end.max()) + 1.0  # offsets make one running max serve all slices
    reach = np.maximum.accumulate(s * big + end)
    covered = np.zeros(t.size, dtype=bool)
    covered[1:] = s[1:] * big + t[1:] < reach[:-1]
    if not covered.any():
        return keep
    for first in np.unique(s[covered]):
        lo, hi = np.searchsorted(s, [first, first + 1])
        free_at = -np.inf
        for i in range(int(lo), int(hi)):
            if t[i] < free_at:
                keep[order[i]] = False
            else:
                free_at = end[i]
    return keep


def slice_speed_stats(
    rng: np.random.Generator, *, n_slices: int, chips_per_slice: int, sigma: float
) -> tuple[_Floats, _Floats]:
    """Per-slice slowest-chip factor and mean chip factor.

    Args:
        rng: The simulation's generator.
        n_slices: Slices.
        chips_per_slice: Chips per slice.
        sigma: σ of ln(step-time factor).

    Returns:
        ``(max_factor, mean_factor)`` per slice: a synchronous group steps at
        ``step_s · max`` over its slices' ``max_factor``; its chips are busy a share
        ``mean / max`` of each step.
    """
    if sigma == 0:
        ones = np.ones(n_slices)
        return ones, ones.copy()
    maxf = np.empty(n_slices)
    meanf = np.empty(n_slices)
    rows = max(1, 4_000_000 // chips_per_slice)  # bounded memory: ≤ 32 MB per block
    for lo in range(0, n_slices, rows):
        hi = min(n_slices, lo + rows)
        f = np.exp(sigma * rng.standard_normal((hi - lo, chips_per_slice)))
        maxf[lo:hi] = f.max(axis=1)
        meanf[lo:hi] = f.mean(axis=1)
    return maxf, meanf
