"""Joining a run: one live learner per id, and the initial global model.

docs/protocol.md, "Run creation and joining": a learner registers by heartbeat; an id with a
fresh heartbeat from another process (different host or pid) is refused. It then waits (at
start only, with a visible message and a timeout) until every fragment has a ``down`` entry,
loads the newest version of each, and checks it against its own fragment plan (element counts,
and the plan and config digests the synchronizer committed in each fragment's ``state``).

Two learners started at the same moment with the same id can both pass the first check;
``confirm_owner`` re-reads the heartbeat after the wait, and the one whose beat was overwritten
gives up. (A lease would close the race completely; heartbeats keep the key table unchanged.)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dd_queue.auth import OPEN, Auth
from dd_queue.bus import Bus, ops
from dd_queue.clock import Clock
from dd_queue.config import digest_mismatch
from dd_queue.core.fragments import FragmentPlan
from dd_queue.errors import BusError, ConfigError, DDQError, ProtocolError
from dd_queue.fragment_state import FragmentState
from dd_queue.learner.exchange import Received, RoundBook
from dd_queue.learner.pump import Pump
from dd_queue.learner.receiver import Follower
from dd_queue.messages import Heartbeat, MessageLimits, RoundOpen

if TYPE_CHECKING:
    from dd_queue.startup import Stop

log = logging.getLogger("dd_queue.learner")


@dataclass(frozen=True, slots=True)
class Identity:
    """Where this learner process runs (heartbeats carry it)."""

    learner_id: str
    host: str
    pid: int


def live_owner(
    bus: Bus, identity: Identity, *, limits: MessageLimits, auth: Auth = OPEN
) -> tuple[Heartbeat | None, float]:
    """The heartbeat under ``identity.learner_id`` if another process sent it, and its age (s)
    (with a keyring, only one sealed with this learner's key counts: a forged heartbeat cannot
    keep the id's owner out)."""
    info = bus.heartbeats().get(identity.learner_id)
    if info is None:
        return None, 0.0
    try:
        beat = ops.read_heartbeat(
            identity.learner_id, info.payload, run_id=bus.keys.run_id, limits=limits, auth=auth
        )
    except ProtocolError:
        return None, info.age_s  # not a learner heartbeat we can read: no live owner to refuse
    if (beat.host, beat.pid) == (identity.host, identity.pid):
        return None, info.age_s
    return beat, info.age_s


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def refuse_if_live(
    bus: Bus,
    identity: Identity,
    *,
    limits: MessageLimits,
    ttl_s: float,
    alive: Callable[[int], bool] = pid_alive,
    auth: Auth = OPEN,
) -> None:
    """Raise if another live process holds this learner id.

    A holder on this host whose pid is gone is a dead process (a learner killed and started
    again by its supervisor): its id is taken over at once instead of waiting ``ttl_s`` for
    the heartbeat to expire.

    Raises:
        ConfigError: The id has a fresh heartbeat from another host, or from a live pid here.
    """
    beat, age_s = live_owner(bus, identity, limits=limits, auth=auth)
    if beat is None:
        return
    if beat.host == identity.host and not alive(beat.pid):
        log.info(
            "learner.takeover id %s was held by pid %d on this host, which is gone "
            "(heartbeat %.1f s ago); taking it over",
            identity.learner_id,
            beat.pid,
            age_s,
        )
        return
    raise ConfigError(
        f"learner id {identity.learner_id!r} is live on {beat.host} pid {beat.pid} "
        f"(heartbeat {age_s:.1f} s ago, state {beat.state!r}); pick another --learner-id, "
        f"or stop that learner (a dead one's heartbeat expires {ttl_s:g} s after its last)"
    )


def confirm_owner(
    bus: Bus, identity: Identity, *, limits: MessageLimits, auth: Auth = OPEN
) -> None:
    """After registering: raise if another process overwrote this id's heartbeat since.

    Raises:
        ConfigError: Another process registered the same id at the same time.
    """
    beat, _ = live_owner(bus, identity, limits=limits, auth=auth)
    if beat is not None:
        raise ConfigError(
            f"learner id {identity.learner_id!r} was taken at the same time by {beat.host} "
            f"pid {beat.pid}; pick another --learner-id"
        )


def check_run_state(
    bus: Bus, plan: FragmentPlan, *, config_digest: str, limits: MessageLimits
) -> dict[int, FragmentState]:
    """Compare this learner's plan and config digest with each fragment's committed state.

    A fragment without ``state`` (a synchronizer that keeps none, such as a test stand-in) is
    skipped; the element counts of the global fragments are checked on load regardless.

    Returns:
        The fragment states that were checked, by fragment id.

    Raises:
        ConfigError: Another fragment plan, or another config digest (the synchronizer would
            dead-letter every contribution of this learner).
    """
    checked: dict[int, FragmentState] = {}
    for p in range(plan.n_fragments):
        raw = bus.get(bus.keys.state(p))
        if raw is None:
            continue
        state = FragmentState.from_bytes(raw, run_id=bus.keys.run_id, limits=limits)
        if state.plan_digest != plan.digest or state.n_fragments != plan.n_fragments:
            raise ConfigError(
                f"run {bus.keys.run_id!r} was planned as {state.n_fragments} fragments (plan "
                f"{state.plan_digest[:12]}); this learner plans {plan.n_fragments} (plan "
                f"{plan.digest[:12]}): use the run's model and synchronizer.n_fragments"
            )
        if state.config_digest != config_digest:
            raise ConfigError(
                f"run {bus.keys.run_id!r} runs digest {state.config_digest}, this learner "
                f"{config_digest}: it differs in "
                f"{digest_mismatch(state.config_digest, config_digest)}. Its contributions "
                "would be dead-lettered: start it with the run's settings"
            )
        checked[p] = state
    return checked


def register_and_wait(
    pump: Pump,
    *,
    identity: Identity,
    plan: FragmentPlan,
    config_digest: str,
    clock: Clock,
    timeout_s: float,
    rounds: RoundBook,
    stop: Stop | None = None,
) -> list[Received] | None:
    """The whole join of rank 0: refuse a live id, wait for the global model, check it.

    Returns:
        ``None`` when ``stop`` came during the wait (the id is freed again). Else the newest
        valid global of every fragment, by fragment id. The follower then reads
        round openings and commands from now on (learner-paced: it first learns each
        fragment's latest round into ``rounds``).
    """
    bus, follower, limits = pump.bus, pump.follower, pump.follower.limits
    refuse_if_live(
        bus, identity, limits=limits, ttl_s=pump.settings.heartbeat_ttl_s, auth=pump.auth
    )
    try:
        initial = wait_for_globals(
            follower,
            clock=clock,
            timeout_s=timeout_s,
            poll_s=pump.settings.heartbeat_interval_s,
            beat=lambda: pump.beat_if_due(force=True),
            stop=stop,
        )
    except DDQError:
        pump.deregister()  # the id was ours (checked above): free it at once
        raise
    if initial is None:
        pump.deregister()
        return None
    confirm_owner(bus, identity, limits=limits, auth=pump.auth)
    states = check_run_state(bus, plan, config_digest=config_digest, limits=limits)
    follower.start_at_latest(follower.control)
    openings = follower.scan_opens()  # the position ends at the newest opening
    if not pump.settings.request_rounds:
        for opening in openings:
            rounds.announce(
                opening.fragment_id,
                opening.round_id,
                request=False,
                opened_at_s=opening.opened_at_s,
            )
        return initial
    # Synchronizer-paced: answer the rounds that are open now, not only those opened after we
    # joined (else a round opened just before waits its whole timeout for us).
    opened_at = {(o.fragment_id, o.round_id): o.opened_at_s for o in openings}
    for fragment_id, round_id in still_open(openings, states).items():
        when = opened_at[fragment_id, round_id]
        rounds.announce(fragment_id, round_id, request=True, opened_at_s=when)
    return initial


def still_open(
    openings: Sequence[RoundOpen], states: Mapping[int, FragmentState]
) -> dict[int, int]:
    """Fragment → its newest opened round that no merge has closed yet (``states``: the
    fragments' committed states; one without a state, or without a merge yet, counts as open).
    An abandoned round may be named: the learner's contribution to it is then settled with a
    reason, nothing worse."""
    newest: dict[int, int] = {}
    for opening in openings:
        newest[opening.fragment_id] = max(newest.get(opening.fragment_id, -1), opening.round_id)
    merged = {p: state.last_merged_round_id for p, state in states.items()}
    return {
        p: round_id
        for p, round_id in sorted(newest.items())
        if (last := merged.get(p)) is None or round_id > last
    }


def wait_for_globals(
    follower: Follower,
    *,
    clock: Clock,
    timeout_s: float,
    poll_s: float,
    beat: Callable[[], object],
    stop: Stop | None = None,
) -> list[Received] | None:
    """Wait until every fragment has a valid global version; return the newest of each, or
    ``None`` when ``stop`` was set first (a learner told to stop while it waits).

    Args:
        follower: Stream positions; on return each ``down`` position is the loaded entry.
        clock: Time for the deadline and the polling sleeps.
        timeout_s: Give up after this long.
        poll_s: Seconds between checks (heartbeats are sent at the same pace).
        beat: Sends a heartbeat (the learner shows up as ``joining`` while it waits).
        stop: Ends the wait early; the polling sleeps wake on it (without one they are the
            clock's).

    Raises:
        BusError: No complete global model after ``timeout_s``.
        ConfigError: A global fragment does not fit this learner's fragment plan.
    """
    n = follower.plan.n_fragments
    loaded: dict[int, Received] = {}
    deadline = clock.now() + timeout_s
    next_note = clock.now()
    while stop is None or not stop.is_set():
        beat()
        _load_missing(follower, loaded)
        if len(loaded) == n:
            return [loaded[p] for p in range(n)]
        now = clock.now()
        if now >= deadline:
            raise BusError(
                f"no complete global model after {timeout_s:g} s ({len(loaded)}/{n} fragments "
                f"published): is the synchronizer of run {follower.run_id!r} running, with "
                "the same model and n_fragments? (learner.join_timeout_s)"
            )
        if now >= next_note:
            log.info(
                "learner.waiting_for_globals %d/%d fragments published; waiting for the "
                "synchronizer (%.0f s left)",
                len(loaded),
                n,
                deadline - now,
            )
            next_note = now + 5.0
        if stop is None:
            clock.sleep(poll_s)
        else:
            stop.wait(poll_s)
    log.info("learner.join_stopped told to stop while waiting for the global model")
    return None


def _load_missing(follower: Follower, loaded: dict[int, Received]) -> None:
    for p in range(follower.plan.n_fragments):
        if p in loaded:
            continue
        stream = follower.down[p]
        entry = follower.bus.read_latest(stream)
        if entry is None:
            continue
        before = len(follower.rejections)
        received = follower.newest_valid(p, [entry], -1)
        if received is not None:
            loaded[p] = received
            follower.positions[stream] = entry.id
        elif len(follower.rejections) > before and follower.rejections[-1].reason == "incompatible":
            raise ConfigError(f"cannot join: {follower.rejections[-1].message}")


__all__ = [
    "Identity",
    "check_run_state",
    "confirm_owner",
    "live_owner",
    "refuse_if_live",
    "register_and_wait",
    "wait_for_globals",
]
