"""Learner liveness from heartbeat age, and joins/leaves between two snapshots.

In Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) a learner that fails or slows down
only loses its own weight in the next merges; the synchronizer must still know who is alive to
decide how long a round waits (``policy.decide`` takes the live set). States, by the age of the
learner's last heartbeat (seconds, on the synchronizer's clock):

=============  ==============================================================================
active         age ≤ ``straggling_after_s``
straggling     age > ``straggling_after_s`` (or, optionally, its step time is more than
               ``slow_step_factor`` × the median step time of the learners that are not dead)
stalled        age > ``stalled_after_s``: probably paused; it keeps its state and may resume
dead           age > ``dead_after_s``: gone; a restart rejoins as a new member
=============  ==============================================================================

Active, straggling and stalled learners are *live* (they may still contribute); dead ones are not.
Heartbeat times should be stamped on receipt by the reader's clock: a time in the future (clock
skew) counts as age 0.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from dd_queue.core._text import fmt_s
from dd_queue.errors import CoreError

__all__ = [
    "Heartbeat",
    "Liveness",
    "LivenessState",
    "MembershipDiff",
    "MembershipParams",
    "classify",
    "diff_members",
    "live_learners",
]

LivenessState = Literal["active", "straggling", "stalled", "dead"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MembershipParams:
    """Liveness thresholds, seconds since the last heartbeat, strictly increasing.

    Attributes:
        straggling_after_s: Older than this: straggling.
        stalled_after_s: Older than this: stalled.
        dead_after_s: Older than this: dead.
        slow_step_factor: If set (> 1), a learner whose step time exceeds this multiple of the
            median step time is straggling even with a fresh heartbeat.
    """

    straggling_after_s: float
    stalled_after_s: float
    dead_after_s: float
    slow_step_factor: float | None = None

    def __post_init__(self) -> None:
        limits = (self.straggling_after_s, self.stalled_after_s, self.dead_after_s)
        if not all(math.isfinite(x) and x > 0 for x in limits):
            raise CoreError(f"liveness thresholds must be finite seconds > 0, got {limits}")
        if not self.straggling_after_s < self.stalled_after_s < self.dead_after_s:
            raise CoreError(
                "liveness thresholds must increase: straggling_after_s < stalled_after_s < "
                f"dead_after_s, got {limits}"
            )
        factor = self.slow_step_factor
        if factor is not None and not (math.isfinite(factor) and factor > 1):
            raise CoreError(f"slow_step_factor must be None or finite and > 1, got {factor!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """The latest heartbeat seen from one learner.

    Attributes:
        learner_id: The learner, e.g. ``"L3"``.
        last_seen_s: When its last heartbeat was received, seconds on the reader's clock.
        step_time_s: Its reported inner-step time EMA, seconds, if any.
    """

    learner_id: str
    last_seen_s: float
    step_time_s: float | None = None

    def __post_init__(self) -> None:
        if not self.learner_id:
            raise CoreError("learner_id must be a non-empty string")
        if not math.isfinite(self.last_seen_s):
            raise CoreError(f"{self.learner_id}: last_seen_s must be finite")
        step = self.step_time_s
        if step is not None and not (math.isfinite(step) and step > 0):
            raise CoreError(f"{self.learner_id}: step_time_s must be finite and > 0, got {step}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Liveness:
    """One learner's liveness at some ``now``, with its reason.

    Attributes:
        learner_id: The learner.
        state: active / straggling / stalled / dead.
        heartbeat_age_s: Seconds since its last heartbeat (≥ 0).
        reason: E.g. ``"last heartbeat 7.2 s ago > stalled_after_s 5 s"``.
    """

    learner_id: str
    state: LivenessState
    heartbeat_age_s: float
    reason: str

    @property
    def live(self) -> bool:
        """True unless dead: the learner may still contribute."""
        return self.state != "dead"


def classify(
    now: float, heartbeats: Iterable[Heartbeat], params: MembershipParams
) -> tuple[Liveness, ...]:
    """Classify every learner by heartbeat age (and optionally step time).

    Args:
        now: Current time, seconds.
        heartbeats: One latest heartbeat per learner.
        params: Thresholds.

    Returns:
        One ``Liveness`` per learner, sorted by learner id.

    Raises:
        CoreError: If a learner appears twice.
    """
    beats = sorted(heartbeats, key=lambda hb: hb.learner_id)
    counts = Counter(hb.learner_id for hb in beats)
    dupes = sorted(learner for learner, n in counts.items() if n > 1)
    if dupes:
        raise CoreError(f"one heartbeat per learner expected; repeated: {', '.join(dupes)}")
    by_age = [_by_age(now, hb, params) for hb in beats]
    factor = params.slow_step_factor
    if factor is None:
        return tuple(by_age)
    steps = [hb.step_time_s for hb, lv in zip(beats, by_age, strict=True) if lv.live]
    median = _median([s for s in steps if s is not None])
    if median is None:
        return tuple(by_age)
    return tuple(
        _slow(lv, hb.step_time_s, factor, median) for hb, lv in zip(beats, by_age, strict=True)
    )


def _by_age(now: float, hb: Heartbeat, params: MembershipParams) -> Liveness:
    age = max(0.0, now - hb.last_seen_s)
    seen = f"last heartbeat {fmt_s(age)} s ago"
    state: LivenessState
    if age > params.dead_after_s:
        state, reason = "dead", f"{seen} > dead_after_s {fmt_s(params.dead_after_s)} s"
    elif age > params.stalled_after_s:
        state, reason = "stalled", f"{seen} > stalled_after_s {fmt_s(params.stalled_after_s)} s"
    elif age > params.straggling_after_s:
        limit = fmt_s(params.straggling_after_s)
        state, reason = "straggling", f"{seen} > straggling_after_s {limit} s"
    else:
        state, reason = (
            "active",
            f"{seen} ≤ straggling_after_s {fmt_s(params.straggling_after_s)} s",
        )
    return Liveness(learner_id=hb.learner_id, state=state, heartbeat_age_s=age, reason=reason)


def _slow(lv: Liveness, step_s: float | None, factor: float, median: float) -> Liveness:
    if lv.state != "active" or step_s is None or step_s <= factor * median:
        return lv
    reason = f"step time {fmt_s(step_s)} s > {factor:g} × median {fmt_s(median)} s; {lv.reason}"
    return Liveness(
        learner_id=lv.learner_id,
        state="straggling",
        heartbeat_age_s=lv.heartbeat_age_s,
        reason=reason,
    )


def live_learners(statuses: Iterable[Liveness]) -> frozenset[str]:
    """The learners that may still contribute (every state but dead)."""
    return frozenset(lv.learner_id for lv in statuses if lv.live)


@dataclass(frozen=True, slots=True, kw_only=True)
class MembershipDiff:
    """What changed between two liveness snapshots.

    Attributes:
        joined: Live now; absent or dead before. Sorted.
        left: Live before; absent or dead now. Sorted.
        changed: ``(learner_id, state_before, state_now)`` for every state change, None for
            absent, sorted by learner id.
        reason: E.g. ``"L3 joined; L1 left (last heartbeat 31 s ago > dead_after_s 30 s)"``.
    """

    joined: tuple[str, ...]
    left: tuple[str, ...]
    changed: tuple[tuple[str, LivenessState | None, LivenessState | None], ...]
    reason: str


def diff_members(before: Sequence[Liveness], after: Sequence[Liveness]) -> MembershipDiff:
    """Compare two snapshots (e.g. two ``classify`` results).

    Args:
        before: The earlier snapshot.
        after: The later snapshot.

    Returns:
        Joins, leaves and state changes, with a reason ("no change" when nothing changed).
    """
    old = {lv.learner_id: lv for lv in before}
    new = {lv.learner_id: lv for lv in after}
    changed: list[tuple[str, LivenessState | None, LivenessState | None]] = []
    for learner in sorted(old.keys() | new.keys()):
        was = old[learner].state if learner in old else None
        now = new[learner].state if learner in new else None
        if was != now:
            changed.append((learner, was, now))
    was_live = live_learners(before)
    is_live = live_learners(after)
    joined = tuple(sorted(is_live - was_live))
    left = tuple(sorted(was_live - is_live))
    parts = [f"{learner} joined" for learner in joined]
    for learner in left:
        why = new[learner].reason if learner in new else "no longer reported"
        parts.append(f"{learner} left ({why})")
    for learner, was, now in changed:
        if learner not in joined and learner not in left:
            parts.append(f"{learner} {was} → {now}")
    reason = "; ".join(parts) if parts else "no change"
    return MembershipDiff(joined=joined, left=left, changed=tuple(changed), reason=reason)


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
