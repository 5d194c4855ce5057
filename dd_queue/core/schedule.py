"""When fragment rounds happen: synchronizer-paced rounds and learner-paced offsets.

Two modes, both pure (time and steps are arguments):

**Synchronizer-paced (default).** Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) opens
rounds at a steady pace: rounds are numbered globally (``round_id`` = 0, 1, 2, ...), round
``r`` belongs to fragment ``r mod P``, and one round opens per ``H / P`` estimated inner-step
times, so every fragment is merged about once every ``H`` learner inner steps. In the paper
``P = H``, which makes the pace exactly one round per inner-step time. When ``P ≠ H`` the pace is
``H / P`` inner steps per round: ``P < H`` opens rounds less often than once a step (each
fragment still waits ``H`` steps); ``P > H`` opens several rounds per step time.

The pace never catches up: if the synchronizer falls behind (it was busy, or down), the next
round opens once, now, and the one after it a full interval later. A burst of rounds would
only ask learners for contributions they have no new steps for.

**After a takeover** (a restart, a standby taking over, fragments rebuilt after Redis came
back) the next round opens at once when at least half an interval has passed since the last
opening: the learners have trained H/2 steps or more that nothing merges, and the rest of the
interval, spent waiting, is what a synchronizer's death would otherwise cost them. Earlier
than that the pace holds (a round would carry too few steps to be worth its traffic).

**Learner-paced.** As in Streaming DiLoCo (Douillard et al., arXiv 2501.18512), each learner
sends fragment ``p`` when its local inner-step count satisfies ``step mod H == offset_p``, with
the ``P`` offsets spread evenly over ``[0, H)`` so that bandwidth is smooth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dd_queue.core._text import fmt_s
from dd_queue.errors import CoreError

__all__ = [
    "RoundOpening",
    "due_fragments",
    "fragment_for_round",
    "fragment_offsets",
    "fragment_round_index",
    "next_round",
    "round_interval_s",
]


@dataclass(frozen=True, slots=True)
class RoundOpening:
    """Whether to open the next round now, which one, and when the one after is due.

    Attributes:
        open_now: True when the round ``round_id`` should be opened at ``now``.
        round_id: Global number of the round to open (``last_round_id + 1``).
        fragment_id: The fragment that round belongs to (``round_id mod P``).
        due_at_s: When ``round_id`` is (or was) due, seconds on the caller's clock. If
            ``open_now`` is False, the caller sleeps until then and asks again.
        interval_s: Seconds between two round openings at the current pace.
        reason: Human-readable explanation, for logs, the API and the dashboard.
    """

    open_now: bool
    round_id: int
    fragment_id: int
    due_at_s: float
    interval_s: float
    reason: str


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CoreError(f"{name} must be an integer ≥ 1, got {value!r}")


def _check_positive_seconds(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise CoreError(f"{name} must be a finite number of seconds > 0, got {value!r}")


def fragment_for_round(round_id: int, n_fragments: int) -> int:
    """Return the fragment a global round belongs to: ``round_id mod P``.

    Args:
        round_id: Global round number, ≥ 0.
        n_fragments: Number of fragments P, ≥ 1.

    Returns:
        The fragment id in ``[0, P)``.

    Raises:
        CoreError: If ``round_id`` is negative or ``n_fragments`` < 1.
    """
    _check_positive_int("n_fragments", n_fragments)
    if isinstance(round_id, bool) or not isinstance(round_id, int) or round_id < 0:
        raise CoreError(f"round_id must be an integer ≥ 0, got {round_id!r}")
    return round_id % n_fragments


def fragment_round_index(round_id: int, n_fragments: int) -> int:
    """Return how many earlier rounds the same fragment had: ``round_id // P``.

    Args:
        round_id: Global round number, ≥ 0.
        n_fragments: Number of fragments P, ≥ 1.

    Returns:
        The fragment-local round index (0 for each fragment's first round).

    Raises:
        CoreError: If ``round_id`` is negative or ``n_fragments`` < 1.
    """
    fragment_for_round(round_id, n_fragments)  # validates both arguments
    return round_id // n_fragments


def round_interval_s(step_time_s: float, *, sync_every_steps: int, n_fragments: int) -> float:
    """Seconds between two round openings: ``ξ_step · H / P``.

    Args:
        step_time_s: Estimated learner inner-step time ξ_step, seconds, > 0.
        sync_every_steps: H, inner steps between two merges of the same fragment, ≥ 1.
        n_fragments: P, number of fragments, ≥ 1.

    Returns:
        The interval in seconds; equal to ``step_time_s`` when ``P = H`` (the paper's setting).

    Raises:
        CoreError: On a non-positive step time or counts < 1.
    """
    _check_positive_seconds("step_time_s", step_time_s)
    _check_positive_int("sync_every_steps", sync_every_steps)
    _check_positive_int("n_fragments", n_fragments)
    return step_time_s * sync_every_steps / n_fragments


def next_round(
    now: float,
    *,
    last_opened_at_s: float | None,
    last_round_id: int | None,
    step_time_s: float,
    sync_every_steps: int,
    n_fragments: int,
    takeover: bool = False,
) -> RoundOpening:
    """Decide whether the synchronizer opens its next round now (synchronizer-paced mode).

    The shell seeds ``step_time_s`` with a configured guess until the ξ_step EMA exists.

    Args:
        now: Current time, seconds.
        last_opened_at_s: When the previous round opened, seconds; None before the first round.
        last_round_id: Global id of the previous round; None before the first round.
        step_time_s: Estimated learner inner-step time ξ_step, seconds, > 0.
        sync_every_steps: H, inner steps between two merges of one fragment, ≥ 1.
        n_fragments: P, number of fragments, ≥ 1.
        takeover: This is the caller's first opening since it took the run's fragments over
            from a predecessor (module doc): open once half an interval has passed.

    Returns:
        A ``RoundOpening``; the first round (id 0, fragment 0) opens at once.

    Raises:
        CoreError: On invalid arguments, or when only one of the two ``last_*`` is None.
    """
    interval = round_interval_s(
        step_time_s, sync_every_steps=sync_every_steps, n_fragments=n_fragments
    )
    if (last_opened_at_s is None) != (last_round_id is None):
        raise CoreError("last_opened_at_s and last_round_id must both be None or both be set")
    if last_opened_at_s is None or last_round_id is None:
        return RoundOpening(
            open_now=True,
            round_id=0,
            fragment_id=0,
            due_at_s=now,
            interval_s=interval,
            reason="first round: opening round 0 (fragment 0)",
        )
    round_id = last_round_id + 1
    fragment_id = fragment_for_round(round_id, n_fragments)
    due_at = last_opened_at_s + interval
    pace = f"one round per {fmt_s(interval)} s (ξ_step {fmt_s(step_time_s)} s × H/P = "
    pace += f"{sync_every_steps}/{n_fragments})"
    if now >= due_at:
        late_s = now - due_at
        behind = f", {fmt_s(late_s)} s behind pace" if late_s >= interval else ""
        reason = f"round {round_id} (fragment {fragment_id}) due: {pace}{behind}"
        return RoundOpening(True, round_id, fragment_id, due_at, interval, reason)
    since_s = now - last_opened_at_s
    if takeover and since_s >= interval / 2:
        reason = (
            f"round {round_id} (fragment {fragment_id}) opens at once after a takeover: the last "
            f"opening was {fmt_s(since_s)} s ago (≥ half the interval), on pace it was due in "
            f"{fmt_s(due_at - now)} s: {pace}"
        )
        return RoundOpening(True, round_id, fragment_id, due_at, interval, reason)
    reason = f"round {round_id} (fragment {fragment_id}) due in {fmt_s(due_at - now)} s: {pace}"
    return RoundOpening(False, round_id, fragment_id, due_at, interval, reason)


def fragment_offsets(n_fragments: int, sync_every_steps: int) -> tuple[int, ...]:
    """Spread the P fragments' sync offsets evenly over ``[0, H)`` (Streaming DiLoCo).

    ``offset_p = floor(p · H / P)``. When ``P > H`` several fragments share an offset and are
    sent at the same step.

    Args:
        n_fragments: P, number of fragments, ≥ 1.
        sync_every_steps: H, inner steps between two syncs of one fragment, ≥ 1.

    Returns:
        One offset per fragment, non-decreasing, each in ``[0, H)``.

    Raises:
        CoreError: If either count is < 1.
    """
    _check_positive_int("n_fragments", n_fragments)
    _check_positive_int("sync_every_steps", sync_every_steps)
    return tuple(p * sync_every_steps // n_fragments for p in range(n_fragments))


def due_fragments(step: int, offsets: tuple[int, ...], sync_every_steps: int) -> tuple[int, ...]:
    """Fragments a learner sends after its ``step``-th inner step (learner-paced mode).

    Fragment ``p`` is due when ``step mod H == offsets[p]``. ``step`` counts completed inner
    steps, so nothing is due at step 0 (nothing has been trained yet).

    Args:
        step: Completed local inner steps, ≥ 0.
        offsets: Per-fragment offsets, each in ``[0, H)`` (see ``fragment_offsets``).
        sync_every_steps: H, ≥ 1.

    Returns:
        The due fragment ids, ascending (possibly empty).

    Raises:
        CoreError: On a negative step or an offset outside ``[0, H)``.
    """
    _check_positive_int("sync_every_steps", sync_every_steps)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CoreError(f"step must be an integer ≥ 0, got {step!r}")
    bad = [o for o in offsets if not 0 <= o < sync_every_steps]
    if bad:
        raise CoreError(f"offsets must lie in [0, H={sync_every_steps}); got {bad}")
    if step == 0:
        return ()
    phase = step % sync_every_steps
    return tuple(p for p, offset in enumerate(offsets) if offset == phase)
