"""Taking a fragment on: its lease, its committed state (or version 0), and its open round.

After a restart or a takeover, nothing in memory is trusted: the runtime is rebuilt from what
Redis holds. The fragment plan comes from the committed states too (``committed_plan``: each
holds its fragment's layout), when the model is the config's and this config is the run's:
then no model is built (no torch import, no meta build: ~2 s of a restarted synchronizer's
start on two busy cores, which also slowed the learners' steps). The model is built only to
create a run or to check a changed config against it (a user's factory whose code changed
under the same config is then caught by the learners' plan check, not here). The state gives
Θ_p, the momentum and the ring; the round is rebuilt from

- the latest round opening on the run's ``open`` stream (the newest round of this fragment at
  or before it, ``r ≡ p mod P``, is treated as open unless the state says it merged), and
- the entries still pending in the group: this synchronizer's own (``read_own_pending``, its
  consumer name is stable across restarts) and those idle longer than ``claim_idle_ms`` under
  other consumers (``reclaim``: a dead or fenced former owner's). They are offered to the round
  again; an entry applied by an earlier commit was acked by that same commit, so it is not
  pending, and a duplicate of it is refused as ``late`` (its round is at most the last merged).

Poison pills: an entry that crashes the synchronizer (a bug the checks do not catch) would
crash every restart, since each restart reads it again. Each take counts, in the fragment's
``takes`` key (fenced), how many takes found each entry still pending; one found more than
``synchronizer.max_takes`` times is dead-lettered as ``poison`` instead of offered again.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence

import msgpack

from dd_queue.bus import Entry, Lease, SetOp
from dd_queue.core.fragments import FragmentPlan, plan_of_fragments
from dd_queue.core.rounds import RoundState
from dd_queue.errors import ProtocolError
from dd_queue.fragment_state import FragmentState, fragment_of
from dd_queue.keys import SYNC_GROUP
from dd_queue.messages import Contribution, RoundOpen
from dd_queue.synchronizer.context import Context
from dd_queue.synchronizer.runtime import read_state

__all__ = [
    "committed_plan",
    "count_takes",
    "latest_opening",
    "latest_round",
    "pending_entries",
    "rebuild_round",
    "reclaim_entries",
    "takes_after",
]

log = logging.getLogger("dd_queue.synchronizer")

PAGE = 500
"""Pending entries read per call."""


def committed_plan(ctx: Context) -> tuple[FragmentPlan | None, str]:
    """The run's plan from its committed states (module doc), or None and why not: a fragment
    has no state yet, one was committed under another config digest, or their layouts do not
    make the plan digest they carry. Unreadable states are None too (the take reports them).
    """
    states: list[FragmentState] = []
    for p in range(ctx.sync.n_fragments):
        try:
            state = read_state(ctx, p)
        except ProtocolError as exc:
            return None, f"fragment {p}'s state is unreadable ({exc})"
        if state is None:
            return None, f"fragment {p} has no committed state yet"
        if state.config_digest != ctx.digest:
            return None, f"fragment {p} was committed under config digest {state.config_digest}"
        states.append(state)
    plan = plan_of_fragments([fragment_of(s) for s in states])
    if any(s.plan_digest != plan.digest or s.n_fragments != len(states) for s in states):
        return None, "the committed layouts do not make the plan digest the states carry"
    return plan, f"the run's plan from its {len(states)} committed states (this config's digest)"


def latest_opening(ctx: Context) -> RoundOpen | None:
    """The newest round opening on the run's ``open`` stream (any fragment), or None."""
    entry = ctx.bus.read_latest(ctx.bus.keys.opened_rounds())
    if entry is None:
        return None
    try:
        return RoundOpen.from_fields(entry.fields, run_id=ctx.run_id, limits=ctx.limits)
    except ProtocolError as exc:
        log.warning("round.open_unreadable %s: %s", entry.id, exc)
        return None


def latest_round(ctx: Context) -> int | None:
    """The newest round id announced on the run's ``open`` stream (any fragment), or None."""
    opening = latest_opening(ctx)
    return None if opening is None else opening.round_id


def pending_entries(ctx: Context, fragment_id: int) -> list[Entry]:
    """This synchronizer's own pending entries of the fragment's ``up`` stream, all pages."""
    stream, out, after = ctx.bus.keys.up(fragment_id), [], "0-0"
    ctx.bus.ensure_group(stream, SYNC_GROUP)
    while True:
        page = ctx.bus.read_own_pending(stream, SYNC_GROUP, ctx.owner, count=PAGE, after_id=after)
        out += page
        if len(page) < PAGE:
            return out
        after = page[-1].id


def reclaim_entries(ctx: Context, fragment_id: int) -> list[Entry]:
    """Entries of the fragment idle ≥ ``claim_idle_ms`` under any consumer, now ours."""
    stream = ctx.bus.keys.up(fragment_id)
    claimed = ctx.bus.reclaim(
        stream, SYNC_GROUP, ctx.owner, min_idle_ms=ctx.sync.claim_idle_ms, count=PAGE
    )
    if claimed.deleted_ids:
        log.warning(
            "contribution.lost fragment %d: %d pending entries were trimmed before they were "
            "settled: %s",
            fragment_id,
            len(claimed.deleted_ids),
            claimed.deleted_ids[:8],
        )
    return claimed.entries


def rebuild_round(
    ctx: Context, state: FragmentState, entries: Iterable[Entry], *, latest: int | None, now: float
) -> tuple[RoundState, bool]:
    """The fragment's round after a (re)start, and whether it counts as announced.

    Args:
        ctx: The synchronizer's context.
        state: The fragment's committed state.
        entries: Its pending entries (their round ids show rounds learners answered).
        latest: The newest announced round id of the run (``latest_round``).
        now: Current time, seconds (the rebuilt round's opening time).
    """
    p, n = state.fragment_id, state.n_fragments
    answered = [r for r in (_round_of(ctx, e) for e in entries) if r is not None and r % n == p]
    candidates = list(answered)
    if latest is not None and latest - (latest - p) % n >= 0:
        candidates.append(latest - (latest - p) % n)
    last = state.last_merged_round_id
    newest = max(candidates, default=None)
    if newest is not None and (last is None or newest > last):
        round_id, announced = newest, True
    else:
        round_id, announced = (p if last is None else last + n), False
    round_state = RoundState(
        fragment_id=p,
        round_id=round_id,
        opened_at_s=now,
        current_version=state.version,
        last_merged_round_id=last,
    )
    return round_state, announced


def _round_of(ctx: Context, entry: Entry) -> int | None:
    if entry.deleted:
        return None
    try:
        return Contribution.from_fields(entry.fields, run_id=ctx.run_id, limits=ctx.limits).round_id
    except ProtocolError:
        return None


def acquire(ctx: Context, fragment_id: int) -> Lease | None:
    """Take the fragment's lease if it is free, expired or already ours; None otherwise."""
    return ctx.bus.acquire_lease(
        ctx.bus.keys.lease(fragment_id), ctx.owner, ttl_s=ctx.sync.lease_ttl_s
    )


def takes_after(
    counts: Mapping[str, int], pending: Sequence[str], *, max_takes: int
) -> tuple[dict[str, int], list[str]]:
    """One more take of a fragment (pure): the new counts, for exactly the entries still
    pending, and those now found pending more than ``max_takes`` times (to dead-letter)."""
    after = {entry_id: counts.get(entry_id, 0) + 1 for entry_id in dict.fromkeys(pending)}
    return after, [entry_id for entry_id, n in after.items() if n > max_takes]


def count_takes(
    ctx: Context, lease: Lease, fragment_id: int, entries: Sequence[Entry]
) -> list[tuple[Entry, str]]:
    """Count this take of the fragment against its pending ``entries`` (fenced) and return
    those to dead-letter as poison, with the reason.

    Raises:
        LeaseLost: The lease was taken over; nothing was written.
    """
    key, limit = ctx.bus.keys.takes(fragment_id), ctx.sync.max_takes
    raw = ctx.bus.get(key) or b""
    try:
        counts = {str(k): int(v) for k, v in msgpack.unpackb(raw).items()} if raw else {}
    except (ValueError, TypeError, AttributeError, msgpack.UnpackException) as exc:
        log.warning("takes.unreadable fragment %d: %s; counting from zero", fragment_id, exc)
        counts = {}
    after, poisoned = takes_after(counts, [e.id for e in entries], max_takes=limit)
    if after or counts:
        packed = msgpack.packb(after)
        digest = hashlib.sha256(raw + b"|" + packed).hexdigest()[:16]
        ctx.bus.commit(lease, [SetOp(key, packed)], commit_id=f"{fragment_id}:takes:{digest}")
    why = (
        f"poison: still pending after {limit + 1} takes of fragment {fragment_id} (synchronizer "
        f"restarts or takeovers; synchronizer.max_takes {limit}): it may be what stops them"
    )
    doomed = set(poisoned)
    return [(e, why) for e in entries if e.id in doomed]
