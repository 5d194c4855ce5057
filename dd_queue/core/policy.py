"""The quorum and grace-window policy: when a fragment round merges, waits or is abandoned.

Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) merges a fragment once at least K distinct
learners contributed (the minimum quorum), after an adaptive grace window that lets slower
learners join without costing the overlap's slack:

    ξ_slack = τ·ξ_step − (ξ_quorum + ξ_sync)
    ξ_grace = clamp(γ·ξ_slack, 0, cap),   cap = grace_cap_s if set, else ξ_step

with ξ_step (learner inner-step time), ξ_quorum (round open → quorum) and ξ_sync (pull + merge +
outer step + publish) kept as exponential moving averages (``Ema``), all in seconds. Until all
three estimates exist the grace window is the cap (0 s if the cap itself is unknown).

``decide`` checks, in order:

1. **Below quorum.** With no live learner it waits for one to join, without a deadline, unless
   entries already settled without a merge (late, superseded, stale, ...) wait for the
   fragment's next commit to be acknowledged: then it abandons at the round timeout, so they
   do not stay pending while nobody trains (held contributions are carried, as below). Else,
   at ``opened_at + round_timeout_s`` it abandons the round; held contributions are *not*
   dropped: they stay held for the fragment's next round (``RoundState.reopened``), so learners
   that already sent lose nothing and the next round needs only the missing ones. Before the
   timeout it waits, naming the missing learners. A learner whose answer to the round was
   refused (stale, unreadable, ...) is not missing: it answers a round once. When every live
   learner answered and quorum is still not met, the round is abandoned at once (nothing more
   can come before the timeout; the next round is the refused learners' next chance).
2. **Fast path.** Quorum met and every live learner contributed (also when none is left
   alive): merge at once.
3. **Grace window.** Quorum met: merge once ``ξ_grace`` has elapsed since the quorum was
   reached, or at the round timeout if that comes first; wait until then.

K larger than the learners that can still contribute (live, or already holding a
contribution) follows ``quorum_policy``: ``"wait"`` keeps K and explains that learners must
join; ``"shrink"`` lowers K to that count (at least 1) and says so. Learners that join mid-round
count as live at once and may contribute. Every ``Decision`` carries its reason as data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from dd_queue.core._text import fmt_s
from dd_queue.core.rounds import RoundView
from dd_queue.errors import CoreError

__all__ = [
    "Decision",
    "DecisionKind",
    "Ema",
    "Estimates",
    "GraceWindow",
    "PolicyParams",
    "QuorumPolicy",
    "decide",
    "grace_window",
]

DecisionKind = Literal["wait", "merge", "abandon"]
QuorumPolicy = Literal["wait", "shrink"]
_MAX_NAMES = 6
_KEPT = "held contributions stay for the fragment's next round"


def _finite(name: str, value: float, *, low: float, high: float = math.inf) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise CoreError(f"{name} must be finite and within [{low}, {high}], got {value!r}")


def _count(name: str, value: int, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CoreError(f"{name} must be an integer ≥ {low}, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyParams:
    """Knobs of the quorum policy; ``SyncConfig`` mirrors these names.

    Attributes:
        quorum: Minimum quorum K, distinct learners per merge, ≥ 1.
        quorum_policy: What to do when K exceeds the learners that can contribute.
        grace_gamma: γ, share of the slack spent waiting after quorum, in [0, 1].
        grace_cap_s: Upper bound of the grace window, seconds; None means ξ_step.
        overlap_steps: τ, inner steps a round may take before its result is due, ≥ 0.
        round_timeout_s: Seconds after opening at which a round without quorum is abandoned.
        ema_alpha: Weight of a new sample in the ξ estimates, in (0, 1].
        max_staleness: Largest accepted ``current version − base version``, ≥ 0.
    """

    quorum: int = 1
    quorum_policy: QuorumPolicy = "wait"
    grace_gamma: float = 0.5
    grace_cap_s: float | None = None
    overlap_steps: float = 1.0
    round_timeout_s: float = 60.0
    ema_alpha: float = 0.2
    max_staleness: int = 4

    def __post_init__(self) -> None:
        _count("quorum", self.quorum, low=1)
        if self.quorum_policy not in ("wait", "shrink"):
            raise CoreError(f"quorum_policy must be 'wait' or 'shrink', got {self.quorum_policy!r}")
        _finite("grace_gamma", self.grace_gamma, low=0.0, high=1.0)
        if self.grace_cap_s is not None:
            _finite("grace_cap_s", self.grace_cap_s, low=0.0)
        _finite("overlap_steps", self.overlap_steps, low=0.0)
        _finite("round_timeout_s", self.round_timeout_s, low=0.0)
        if self.round_timeout_s == 0:
            raise CoreError("round_timeout_s must be > 0")
        _finite("ema_alpha", self.ema_alpha, low=0.0, high=1.0)
        if self.ema_alpha == 0:
            raise CoreError("ema_alpha must be > 0 (0 would never learn)")
        _count("max_staleness", self.max_staleness, low=0)


@dataclass(frozen=True, slots=True)
class Ema:
    """An exponential moving average; ``value`` is None until the first sample.

    Attributes:
        value: The current average (units of the samples), or None.
        n_samples: How many samples were folded in.
    """

    value: float | None = None
    n_samples: int = 0

    def update(self, sample: float, alpha: float) -> Ema:
        """Fold in ``sample``: ``value ← value + α·(sample − value)``; the first sample is kept.

        Raises:
            CoreError: If ``sample`` is not finite or ``alpha`` is outside (0, 1].
        """
        _finite("sample", sample, low=-math.inf)
        _finite("alpha", alpha, low=0.0, high=1.0)
        if alpha == 0:
            raise CoreError("alpha must be > 0")
        value = sample if self.value is None else self.value + alpha * (sample - self.value)
        return Ema(value=value, n_samples=self.n_samples + 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimates:
    """The policy's timing estimates, seconds.

    Attributes:
        step_s: ξ_step, learner inner-step time.
        quorum_s: ξ_quorum, from a round's opening to its quorum.
        sync_s: ξ_sync, pull + merge + outer step + publish.
    """

    step_s: Ema = Ema()
    quorum_s: Ema = Ema()
    sync_s: Ema = Ema()

    def observe(
        self,
        *,
        alpha: float,
        step_s: float | None = None,
        quorum_s: float | None = None,
        sync_s: float | None = None,
    ) -> Estimates:
        """Return the estimates with each given sample (seconds, ≥ 0) folded in."""
        new = self
        for name, sample in (("step_s", step_s), ("quorum_s", quorum_s), ("sync_s", sync_s)):
            if sample is not None:
                _finite(name, sample, low=0.0)
                new = replace(new, **{name: getattr(new, name).update(sample, alpha)})
        return new


@dataclass(frozen=True, slots=True)
class GraceWindow:
    """The grace window and how it was derived.

    Attributes:
        seconds: ξ_grace, seconds to keep accepting after quorum.
        note: Short derivation, e.g. ``"0.5 × slack 0.8 s"`` or ``"cap: no estimates yet"``.
    """

    seconds: float
    note: str


def grace_window(params: PolicyParams, estimates: Estimates) -> GraceWindow:
    """Compute ξ_grace = clamp(γ·(τ·ξ_step − ξ_quorum − ξ_sync), 0, cap) (arXiv 2604.21428).

    Args:
        params: Supplies γ, τ and ``grace_cap_s``.
        estimates: The ξ EMAs; missing ones make the result the cap.

    Returns:
        The window in seconds with a short note on how it was derived.
    """
    step = estimates.step_s.value
    cap_name = "grace_cap_s" if params.grace_cap_s is not None else "ξ_step"
    cap = params.grace_cap_s if params.grace_cap_s is not None else step
    if cap is None:
        return GraceWindow(0.0, "no ξ_step estimate and no grace_cap_s yet")
    emas = {"ξ_step": estimates.step_s, "ξ_quorum": estimates.quorum_s, "ξ_sync": estimates.sync_s}
    unknown = [name for name, ema in emas.items() if ema.value is None]
    quorum_s, sync_s = estimates.quorum_s.value, estimates.sync_s.value
    if step is None or quorum_s is None or sync_s is None:
        return GraceWindow(cap, f"cap {cap_name}: no {', '.join(unknown)} estimate yet")
    budget = params.overlap_steps * step
    slack = budget - quorum_s - sync_s
    wanted = params.grace_gamma * slack
    if slack <= 0:
        busy = f"ξ_quorum + ξ_sync {fmt_s(quorum_s + sync_s)} s"
        return GraceWindow(0.0, f"no slack: τ·ξ_step {fmt_s(budget)} s ≤ {busy}")
    if wanted <= 0:
        return GraceWindow(0.0, f"γ = 0: no grace window (slack {fmt_s(slack)} s unused)")
    if wanted >= cap:
        return GraceWindow(cap, f"capped at {cap_name}; γ·slack = {fmt_s(wanted)} s")
    return GraceWindow(wanted, f"{params.grace_gamma:g} × slack {fmt_s(slack)} s")


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """What to do with a round now, and why.

    Attributes:
        kind: ``wait`` (re-decide at ``wake_at`` or on the next event), ``merge`` (merge
            ``contributors`` now) or ``abandon`` (close the round unmerged; held
            contributions carry over to the fragment's next round).
        reason: Human-readable; the same string goes to logs, the API and the dashboard.
        wake_at: For ``wait``: when to decide again, seconds; None means only on an event
            (a contribution, a join). None for ``merge`` and ``abandon``.
        contributors: Learners holding a contribution (those merged, for ``merge``).
        missing: Live learners without a contribution.
        quorum: The effective quorum K (after a shrink).
        quorum_reached_at_s: When the K-th learner arrived, or None.
        grace_window_s: ξ_grace, when quorum was reached; else None.
    """

    kind: DecisionKind
    reason: str
    wake_at: float | None = None
    contributors: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    quorum: int = 1
    quorum_reached_at_s: float | None = None
    grace_window_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Round:
    """Facts of one decision shared by its branches."""

    now: float
    view: RoundView
    params: PolicyParams
    held: tuple[str, ...]
    missing: tuple[str, ...]
    n_reachable: int
    quorum: int
    prefix: str  # explains a shrunk quorum, else ""
    unacked: int = 0  # entries settled without a merge, acknowledged by the next commit

    @property
    def deadline_s(self) -> float:
        return self.view.opened_at_s + self.params.round_timeout_s

    @property
    def refused(self) -> tuple[str, ...]:
        """Learners that answered this round, were refused and hold nothing."""
        return tuple(sorted(self.view.refused))

    @property
    def tally(self) -> str:
        names = f" ({_names(self.held)})" if self.held else ""
        refused = f"; refused {_names(self.refused)}" if self.refused else ""
        return f"{len(self.held)}/{self.n_reachable} contributed{names}{refused}"

    def decision(
        self,
        kind: DecisionKind,
        reason: str,
        *,
        wake_at: float | None = None,
        grace: GraceWindow | None = None,
    ) -> Decision:
        reached_at = self.view.quorum_at_s(self.quorum) if len(self.held) >= self.quorum else None
        return Decision(
            kind=kind,
            reason=self.prefix + reason,
            wake_at=wake_at,
            contributors=self.held,
            missing=self.missing,
            quorum=self.quorum,
            quorum_reached_at_s=reached_at,
            grace_window_s=None if grace is None else grace.seconds,
        )


def decide(
    now: float,
    view: RoundView,
    live_learners: frozenset[str],
    *,
    params: PolicyParams,
    estimates: Estimates,
    unacked: int = 0,
) -> Decision:
    """Decide whether a fragment round waits, merges or is abandoned (arXiv 2604.21428).

    Args:
        now: Current time, seconds.
        view: The round (``RoundState.view()``).
        live_learners: Learners that may still contribute (not dead), joiners included.
        params: Quorum, grace and timeout knobs.
        estimates: ξ_step, ξ_quorum and ξ_sync EMAs.
        unacked: Entries settled without a merge that the fragment's next commit acknowledges.

    Returns:
        The ``Decision`` with its reason and structured fields.
    """
    held = tuple(sorted(view.contributors))
    reachable = len(frozenset(live_learners) | view.contributors)
    quorum, prefix = params.quorum, ""
    if quorum > reachable and params.quorum_policy == "shrink":
        quorum = max(1, reachable)
        prefix = (
            f"quorum shrunk {params.quorum} → {quorum} "
            f"(only {reachable} learners live or holding a contribution); "
        )
    r = _Round(
        now=now,
        view=view,
        params=params,
        held=held,
        missing=tuple(sorted(frozenset(live_learners) - view.contributors - view.refused)),
        n_reachable=reachable,
        quorum=quorum,
        prefix=prefix,
        unacked=unacked,
    )
    if len(held) < quorum:
        return _below_quorum(r, any_live=bool(live_learners))
    return _quorum_met(r, grace_window(params, estimates), any_live=bool(live_learners))


def _below_quorum(r: _Round, *, any_live: bool) -> Decision:
    if not any_live:
        if r.unacked and r.now >= r.deadline_s:
            kept = _KEPT if r.held else "none held"
            reason = (
                f"no live learners and round timeout {fmt_s(r.params.round_timeout_s)} s passed: "
                f"closing the round to acknowledge {r.unacked} settled entries; {kept}"
            )
            return r.decision("abandon", reason)
        reason = f"no live learners; waiting for one to join; quorum {r.quorum}, {r.tally}"
        if r.unacked:
            reason += f"; {r.unacked} settled entries acknowledged at the round timeout"
            return r.decision("wait", reason, wake_at=r.deadline_s)
        return r.decision("wait", reason)
    if r.refused and not r.missing:
        kept = _KEPT if r.held else "none held"
        reason = (
            f"every live learner answered round {r.view.round_id} without quorum {r.quorum}: "
            f"{r.tally}; nothing more to wait for; {kept}"
        )
        return r.decision("abandon", reason)
    if r.now >= r.deadline_s:
        kept = _KEPT if r.held else "none held"
        reason = (
            f"round timeout {fmt_s(r.params.round_timeout_s)} s passed without quorum {r.quorum}: "
            f"{r.tally}; missing {_names(r.missing)}; {kept}"
        )
        return r.decision("abandon", reason)
    timeout = f"round timeout in {fmt_s(r.deadline_s - r.now)} s"
    if r.quorum > r.n_reachable:
        reason = (
            f"quorum {r.quorum} unreachable: only {r.n_reachable} learners live or holding a "
            f"contribution; {r.tally}; waiting for learners to join (quorum_policy wait); {timeout}"
        )
    else:
        reason = f"waiting for quorum {r.quorum}: {r.tally}; missing {_names(r.missing)}; {timeout}"
    return r.decision("wait", reason, wake_at=r.deadline_s)


def _quorum_met(r: _Round, grace: GraceWindow, *, any_live: bool) -> Decision:
    reached_at = r.view.quorum_at_s(r.quorum)
    if reached_at is None:  # unreachable: the caller checked len(held) ≥ quorum
        raise CoreError("quorum met but no quorum time; RoundView.arrivals is inconsistent")
    stale = _stale_note(r.view)
    if not r.missing:
        if any_live and r.refused:
            who = f"every live learner answered: {r.tally}"
        elif any_live:
            who = f"all live learners contributed ({_names(r.held)})"
        else:
            who = f"quorum {r.quorum} met and no live learner left to wait for; {r.tally}"
        return r.decision("merge", f"{who}; merging at once{stale}", grace=grace)
    status = (
        f"quorum {r.quorum} reached {fmt_s(r.now - reached_at)} s ago; {r.tally}; "
        f"grace window {fmt_s(grace.seconds)} s ({grace.note})"
    )
    merge_at = reached_at + grace.seconds
    if r.now >= merge_at:
        reason = f"{status} elapsed; missing {_names(r.missing)}{stale}"
        return r.decision("merge", reason, grace=grace)
    if r.now >= r.deadline_s:
        reason = (
            f"{status} cut short by round timeout {fmt_s(r.params.round_timeout_s)} s; "
            f"missing {_names(r.missing)}{stale}"
        )
        return r.decision("merge", reason, grace=grace)
    reason = f"{status} ends in {fmt_s(merge_at - r.now)} s; waiting on {_names(r.missing)}"
    return r.decision("wait", reason, wake_at=min(merge_at, r.deadline_s), grace=grace)


def _stale_note(view: RoundView) -> str:
    stale = [f"{learner} {n} behind" for learner, n in view.staleness if n > 0]
    return f"; stale versions: {', '.join(stale)}" if stale else ""


def _names(learners: tuple[str, ...]) -> str:
    if not learners:
        return "none"
    shown = ", ".join(learners[:_MAX_NAMES])
    extra = len(learners) - _MAX_NAMES
    return f"{shown} +{extra} more" if extra > 0 else shown
