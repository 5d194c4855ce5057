"""The three training regimes on one shared failure history, and their figures.

Within a repetition every regime sees the *same* slice interruptions, return times and chip
speeds (common random numbers), so differences between regimes are not sampling noise.

- ``plain_dp`` — one SPMD group of all slices with checkpoint/restart (``spmd_timeline``).
- ``elastic_dp`` — one elastic group of all slices (``elastic_timeline``).
- ``decoupled`` — M elastic groups (learners) of contiguous slices, plus the synchronizer's
  rounds (``simulate_rounds``). Global downtime is the time with fewer than K learners training.

A synchronous group steps at the pace of its slowest chip, so its chips are busy only a share
mean/max of each step (see ``dd_queue.sim.ledger``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from dd_queue.sim.config import Regime, SimConfig
from dd_queue.sim.failures import SliceFailures, slice_failures, slice_speed_stats
from dd_queue.sim.ledger import summarize_timelines, time_below_s
from dd_queue.sim.rounds import simulate_rounds
from dd_queue.sim.timeline import GroupTimeline, elastic_timeline, spmd_timeline

__all__ = ["RegimeResult", "checkpoint_interval_s", "run_repetition", "simulate"]

_Floats = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True, kw_only=True)
class RegimeResult:
    """Figures of one regime (mean over repetitions when aggregated).

    Attributes:
        regime: plain_dp / elastic_dp / decoupled.
        learners: M (1 for the data-parallel regimes).
        chips: Chips simulated (whole slices).
        goodput: Busy training chip-seconds ÷ allocated chip-seconds.
        goodput_std: Standard deviation of goodput over repetitions (0 for one).
        uptime: Share of wall time in which training advances.
        global_downtime_s: Seconds with no training (DP) or fewer than K learners training.
        wall_s: Simulated wall time, seconds.
        shares: Allocated chip-seconds by kind: training, waiting, down, restarting.
        interruptions: Slice interruptions in the run.
        merges_per_hour: Merged rounds per hour (decoupled only).
        mean_quorum: Learners per merge (decoupled only).
        token_share: Per learner share of merged tokens (DP: ``(1.0,)``).
        grace_window_s: ξ_grace used (decoupled only), seconds.
        repetitions: Repetitions aggregated.
        timelines: The groups' timelines (first repetition; for plots), else empty.
    """

    regime: Regime
    learners: int
    chips: int
    goodput: float
    goodput_std: float = 0.0
    uptime: float
    global_downtime_s: float
    wall_s: float
    shares: dict[str, float]
    interruptions: float
    merges_per_hour: float | None = None
    mean_quorum: float | None = None
    token_share: tuple[float, ...] = (1.0,)
    grace_window_s: float | None = None
    repetitions: int = 1
    timelines: tuple[GroupTimeline, ...] = field(default=(), repr=False)

    @property
    def label(self) -> str:
        """``plain_dp``, ``elastic_dp`` or ``decoupled_M8``."""
        return f"decoupled_M{self.learners}" if self.regime == "decoupled" else self.regime

    def public_dict(self) -> dict[str, object]:
        """The figures as JSON-ready data (no timelines)."""
        return {
            "regime": self.regime,
            "label": self.label,
            "learners": self.learners,
            "chips": self.chips,
            "goodput": self.goodput,
            "goodput_std": self.goodput_std,
            "uptime": self.uptime,
            "global_downtime_s": self.global_downtime_s,
            "global_downtime_share": self.global_downtime_s / self.wall_s,
            "wall_s": self.wall_s,
            "chip_time_shares": self.shares,
            "interruptions": self.interruptions,
            "merges_per_hour": self.merges_per_hour,
            "mean_quorum": self.mean_quorum,
            "token_share": list(self.token_share),
            "grace_window_s": self.grace_window_s,
            "repetitions": self.repetitions,
        }


def checkpoint_interval_s(cfg: SimConfig) -> float:
    """Plain DP's checkpoint interval: configured, or the ``spmd.checkpoint_rule`` optimum.

    With δ the checkpoint cost and M = MTBF_job = MTBI_chip / chips: Young (1974) √(2δM);
    Daly (2006) √(2δM)·(1 + √(δ/2M)/3 + δ/(18M)) − δ for δ < 2M, else M. Never shorter than
    one step; inf without failures.
    """
    if cfg.spmd.checkpoint_interval_s is not None:
        return cfg.spmd.checkpoint_interval_s
    rate = cfg.cluster.n_slices * cfg.cluster.slice_failure_rate_per_s
    if rate == 0:
        return math.inf
    delta, mtbf = cfg.spmd.checkpoint_cost_s, 1.0 / rate
    young = math.sqrt(2.0 * delta * mtbf)
    if cfg.spmd.checkpoint_rule == "young":
        interval = young
    elif delta < 2.0 * mtbf:
        interval = young * (1 + math.sqrt(delta / (2 * mtbf)) / 3 + delta / (18 * mtbf)) - delta
    else:
        interval = mtbf
    return max(cfg.cluster.step_s, interval)


def run_repetition(
    cfg: SimConfig,
    rng: np.random.Generator,
    *,
    regimes: Sequence[Regime],
    learner_counts: Sequence[int],
    keep_timelines: bool = False,
) -> list[RegimeResult]:
    """Simulate every regime (and every M for ``decoupled``) on one failure history.

    Args:
        cfg: The configuration.
        rng: This repetition's generator.
        regimes: Regimes to run.
        learner_counts: M values for ``decoupled``.
        keep_timelines: Keep the groups' timelines in the results (for plots).

    Returns:
        One ``RegimeResult`` per regime and M.
    """
    cl, duration = cfg.cluster, cfg.run.duration_s
    fails = slice_failures(
        rng,
        n_slices=cl.n_slices,
        rate_per_slice_s=cl.slice_failure_rate_per_s,
        duration_s=duration,
        repair=cfg.repair,
    )
    maxf, meanf = slice_speed_stats(
        rng, n_slices=cl.n_slices, chips_per_slice=cl.chips_per_slice, sigma=cl.speed_sigma
    )
    out: list[RegimeResult] = []
    for regime in regimes:
        counts = learner_counts if regime == "decoupled" else (1,)
        for m in counts:
            groups = _groups(cfg, regime, m, fails, maxf, meanf)
            out.append(_result(cfg, regime, groups, fails, keep_timelines))
    return out


def _busy(cfg: SimConfig, meanf: _Floats, maxf: _Floats) -> float:
    """Share of a synchronous group's chip time spent computing: mean/max chip speed, or 1
    when ``accounting.barrier_wait`` counts the wait for the slowest chip as training."""
    if cfg.accounting.barrier_wait == "goodput":
        return 1.0
    return float(meanf.mean() / maxf.max())


def _groups(
    cfg: SimConfig, regime: Regime, m: int, fails: SliceFailures, maxf: _Floats, meanf: _Floats
) -> list[GroupTimeline]:
    cl, duration = cfg.cluster, cfg.run.duration_s
    absorb = cfg.accounting.failure_during_stall == "absorbed"
    if regime == "plain_dp":
        return [
            spmd_timeline(
                "dp",
                chips=cl.n_slices * cl.chips_per_slice,
                failures=fails,
                spec=cfg.spmd,
                detection_s=cfg.elastic.detection_s,
                checkpoint_interval_s=checkpoint_interval_s(cfg),
                step_s=cl.step_s * float(maxf.max()),
                busy_fraction=_busy(cfg, meanf, maxf),
                duration_s=duration,
                absorb=absorb,
            )
        ]
    bounds = [i * cl.n_slices // m for i in range(m + 1)]
    return [
        elastic_timeline(
            "dp" if regime == "elastic_dp" else f"L{i}",
            n_slices=hi - lo,
            chips_per_slice=cl.chips_per_slice,
            failures=fails.of_slices(lo, hi),
            spec=cfg.elastic,
            step_s=cl.step_s * float(maxf[lo:hi].max()),
            busy_fraction=_busy(cfg, meanf[lo:hi], maxf[lo:hi]),
            duration_s=duration,
            absorb=absorb,
        )
        for i, (lo, hi) in enumerate(itertools.pairwise(bounds))
    ]


def _result(
    cfg: SimConfig,
    regime: Regime,
    groups: list[GroupTimeline],
    fails: SliceFailures,
    keep_timelines: bool,
) -> RegimeResult:
    duration = cfg.run.duration_s
    s = summarize_timelines(groups, duration)
    alloc = s.allocated_chip_s or 1.0
    shares = {
        "training": s.training_chip_s / alloc,
        "waiting": s.waiting_chip_s / alloc,
        "down": s.down_chip_s / alloc,
        "restarting": s.restarting_chip_s / alloc,
    }
    result = RegimeResult(
        regime=regime,
        learners=len(groups),
        chips=cfg.cluster.n_slices * cfg.cluster.chips_per_slice,
        goodput=s.goodput,
        uptime=s.uptime,
        global_downtime_s=duration - s.training_union_s,
        wall_s=duration,
        shares=shares,
        interruptions=float(fails.at_s.size),
        timelines=tuple(groups) if keep_timelines else (),
    )
    if regime != "decoupled":
        return result
    rounds = simulate_rounds(groups, cfg.decoupled, duration)
    return replace(
        result,
        global_downtime_s=time_below_s(groups, cfg.decoupled.quorum, duration),
        merges_per_hour=rounds.merges_per_hour,
        mean_quorum=rounds.mean_quorum,
        token_share=rounds.token_share,
        grace_window_s=rounds.grace_window_s,
    )


def simulate(
    cfg: SimConfig,
    *,
    learner_counts: Sequence[int] | None = None,
    keep_timelines: bool = False,
) -> list[RegimeResult]:
    """Run ``cfg.run.repetitions`` repetitions of ``cfg.run.regimes`` and average them.

    Args:
        cfg: The configuration (seed, duration, regimes, repetitions included).
        learner_counts: M values for ``decoupled``; default ``(cfg.decoupled.learners,)``.
        keep_timelines: Keep the first repetition's timelines (for plots).

    Returns:
        One aggregated ``RegimeResult`` per regime and M, in run order.
    """
    counts = tuple(learner_counts or (cfg.decoupled.learners,))
    seeds = np.random.SeedSequence(cfg.run.seed).spawn(cfg.run.repetitions)
    reps = [
        run_repetition(
            cfg,
            np.random.default_rng(seed),
            regimes=cfg.run.regimes,
            learner_counts=counts,
            keep_timelines=keep_timelines and i == 0,
        )
        for i, seed in enumerate(seeds)
    ]
    return [_aggregate([rep[j] for rep in reps]) for j in range(len(reps[0]))]


def _aggregate(results: list[RegimeResult]) -> RegimeResult:
    first = results[0]
    if len(results) == 1:
        return first

    def mean(values: Sequence[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return float(np.mean(known)) if known else None

    goodputs = [r.goodput for r in results]
    return replace(
        first,
        goodput=float(np.mean(goodputs)),
        goodput_std=float(np.std(goodputs, ddof=1)),
        uptime=float(np.mean([r.uptime for r in results])),
        global_downtime_s=float(np.mean([r.global_downtime_s for r in results])),
        shares={k: float(np.mean([r.shares[k] for r in results])) for k in first.shares},
        interruptions=float(np.mean([r.interruptions for r in results])),
        merges_per_hour=mean([r.merges_per_hour for r in results]),
        mean_quorum=mean([r.mean_quorum for r in results]),
        token_share=tuple(np.mean([r.token_share for r in results], axis=0).tolist()),
        grace_window_s=mean([r.grace_window_s for r in results]),
        repetitions=len(results),
    )
