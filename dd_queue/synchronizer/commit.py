"""The commit step: a round's outcome into Redis in one fenced, idempotent commit.

After a merge (``merge.merge``; Decoupled DiLoCo's synchronizer step 5):

1. stage Θ_p(v+1) and the momentum under the lease's fencing token;
2. **one fenced, idempotent commit** (id ``<fragment>:<round>:<version>``): the new state, the
   ``down`` notification, the round record with every settled entry's outcome, the acks of
   exactly those entries, and the deletion of the blobs the state no longer references.

An abandoned round commits its record instead: settled entries are acked, held ones carried.

Fault points ``after_merge`` (before 1), ``before_commit`` (between 1 and 2) and
``after_commit`` (right after 2, before anything else is written or deleted) let tests kill the
synchronizer there. Until the commit, Redis is untouched apart from staged blobs, and every
entry is still pending; after it, the in-memory runtime takes the new version
(``FragmentRuntime.after_merge``). Contribution payload blobs are deleted after the commit (their
TTL covers a crash in between).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from dd_queue.bus import AckOp, AppendOp, BlobRef, CommitOp, DeleteOp, SetOp, ops
from dd_queue.core.policy import Decision, Ema
from dd_queue.core.tallies import Observed, round_increments
from dd_queue.fragment_state import FragmentState, VersionRef
from dd_queue.keys import SYNC_GROUP
from dd_queue.messages import ContributorRecord, EntryOutcome, GlobalFragment, RoundRecord
from dd_queue.synchronizer import blobs, snapshots
from dd_queue.synchronizer.context import Context
from dd_queue.synchronizer.merge import Merged
from dd_queue.synchronizer.runtime import FragmentRuntime, Held, Settled
from dd_queue.tracking import round_scalars

__all__ = ["commit_abandon", "commit_merge", "snapshot"]

log = logging.getLogger("dd_queue.synchronizer")

_Closed = tuple[tuple[EntryOutcome, ...], tuple[ContributorRecord, ...], dict[str, float]]
"""What a round record takes from the closing: outcomes, contributors, timings."""


def commit_merge(
    ctx: Context, rt: FragmentRuntime, decision: Decision, merged: Merged, now: float
) -> None:
    """Stage ``merged`` as version v+1 and commit it with the round (module doc).

    Raises:
        LeaseLost: The lease was taken over; nothing was committed (drop the runtime).
    """
    bus, p, r, state = ctx.bus, rt.fragment_id, rt.round.round_id, rt.state
    held, result = list(merged.held), merged.result
    assert result is not None  # merge() returns only finite, whole results
    ctx.fault("after_merge")
    t_stage, version = ctx.clock.now(), state.version + 1
    ref, header, mref = blobs.stage(
        bus,
        rt.lease,
        fragment_id=p,
        version=version,
        theta=merged.theta,
        state=merged.momentum,
        auth=ctx.auth,
    )
    merged.timings_s["stage"] = ctx.clock.now() - t_stage
    reason = f"{decision.reason}; {result.reason}"
    settled = [*rt.settled]
    new_state = _next_state(ctx, rt, decision, now, merged, held, settled, ref, mref, reason)
    evicted = [v.ref for v in state.ring if v not in new_state.ring]
    closed = (merged.outcomes, merged.contributors, merged.timings_s)
    record = _record(ctx, rt, decision, now, reason, closed, settled, version=version)
    notice = GlobalFragment(
        run_id=ctx.run_id,
        fragment_id=p,
        version=version,
        round_id=r,
        tensor=header,
        created_at_s=ctx.wall(),
        reason=reason,
    )
    entry_ids = [o.entry_id for o in merged.outcomes] + [s.outcome.entry_id for s in settled]
    commit_ops: list[CommitOp] = [
        SetOp(bus.keys.state(p), new_state.to_bytes()),
        ops.global_notification_op(bus, notice, ref.ref, maxlen=ctx.maxlen, auth=ctx.auth),
        AppendOp(bus.keys.rounds(p), record.to_fields(), ctx.rounds_maxlen),
        AckOp(bus.keys.up(p), SYNC_GROUP, tuple(entry_ids)),
        DeleteOp(blobs.delete_keys_of([*evicted, state.momentum_ref])),
    ]
    ctx.fault("before_commit")
    committed = bus.commit(rt.lease, commit_ops, commit_id=f"{p}:{r}:{version}")
    ctx.fault("after_commit")
    # Committed: the in-memory runtime takes the new version.
    replaced = rt.after_merge(
        state=new_state,
        theta=merged.theta,
        momentum=merged.momentum,
        next_round_id=r + ctx.sync.n_fragments,
        now=now,
        entry_ids=entry_ids,
        notice_id=committed.entry_ids[0],  # the first append: the down notice
    )
    ctx.buffers.give([*replaced, merged.scratch])  # nothing reads them any more
    if ctx.sync.snapshot_dir is not None and version % ctx.sync.snapshot_every_versions == 0:
        snapshot(ctx, rt)
    _delete_payloads(ctx, rt, [*(h.blob for h in held), *(s.blob for s in settled)])
    log.info("round.merged fragment %d round %d → version %d: %s", p, r, version, reason)
    if ctx.tracker.enabled:
        ctx.tracker.log(f"fragment{p}", round_scalars(record), step=version)
    ctx.emit("round.merged", reason, fragment=p, round=r, version=version, contributors=len(held))


def snapshot(ctx: Context, rt: FragmentRuntime) -> None:
    """Write the fragment's snapshot (``snapshots``); a failed write is reported, never a crash
    (the run goes on; the next snapshot may succeed)."""
    assert ctx.sync.snapshot_dir is not None
    state = rt.state
    try:
        snap = snapshots.write(
            ctx.sync.snapshot_dir,
            run_id=ctx.run_id,
            fragment_id=rt.fragment_id,
            version=state.version,
            theta=rt.theta,
            momentum=rt.momentum.momentum_buffer,
            outer_steps=rt.momentum.step,
            last_merged_round_id=state.last_merged_round_id,
            plan_digest=state.plan_digest,
            config_digest=state.config_digest,
            keep=ctx.sync.snapshot_keep,
        )
    except OSError as exc:
        why = f"fragment {rt.fragment_id} version {state.version}: {exc}"
        log.error("snapshot.failed %s", why)
        ctx.emit("snapshot.failed", why, fragment=rt.fragment_id)
        return
    log.info("snapshot.written fragment %d version %d: %s", rt.fragment_id, snap.version, snap.path)


def _next_state(
    ctx: Context,
    rt: FragmentRuntime,
    decision: Decision,
    now: float,
    merged: Merged,
    held: list[Held],
    settled: list[Settled],
    ref: VersionRef,
    momentum: BlobRef,
    reason: str,
) -> FragmentState:
    """The state after the merge: version + 1, the ring with Θ_p(v+1), counters and EMAs."""
    state = rt.state
    quorum_s, sync_s = _quorum_sample(rt, decision), max(0.0, ctx.clock.now() - now)
    # The first round waits for learners to start and join, and runs cold: counted in the
    # histograms, but no sample of the EMAs (it held the grace window shut for many rounds).
    cold = state.version == 0
    estimates = state.estimates(Ema()).observe(
        alpha=ctx.sync.ema_alpha,
        quorum_s=None if cold else quorum_s,
        sync_s=None if cold else sync_s,
    )
    reached = decision.quorum_reached_at_s
    new_state = _counted(
        state,
        merged.outcomes,
        settled,
        held,
        rounds="rounds_merged",
        contributors=merged.contributors,
        durations_s={
            "open_to_quorum_s": quorum_s,
            "quorum_to_merge_s": None if reached is None else max(0.0, now - reached),
            "merge_to_commit_s": sync_s,
        },
    )
    return dataclasses.replace(
        new_state.with_estimates(estimates).counted({"bytes_out": ref.ref.nbytes}),
        version=ref.version,
        last_merged_round_id=rt.round.round_id,
        ring=(*state.ring, ref)[-ctx.sync.version_ring :],
        momentum=momentum.to_bytes().decode(),
        last_reason=reason,
        committed_by=ctx.owner,
    )


def commit_abandon(ctx: Context, rt: FragmentRuntime, decision: Decision, now: float) -> None:
    """Commit an abandoned round's record: settled entries are acked, held ones carried (they
    stay pending and count toward the fragment's next round).

    Raises:
        LeaseLost: The lease was taken over; nothing was committed (drop the runtime).
    """
    bus, p, r, state = ctx.bus, rt.fragment_id, rt.round.round_id, rt.state
    held = [rt.held[learner] for learner in sorted(rt.held)]
    carried = tuple(
        EntryOutcome(
            entry_id=h.entry.id,
            learner_id=h.msg.learner_id,
            round_id=h.msg.round_id,
            outcome="carried",
            reason="held for the fragment's next round",
        )
        for h in held
    )
    settled = [*rt.settled]
    new_state = _counted(
        state,
        (),
        settled,
        [],
        rounds="rounds_abandoned",
        durations_s={"open_to_quorum_s": _quorum_sample(rt, decision)},
    )
    new_state = dataclasses.replace(new_state, last_reason=decision.reason, committed_by=ctx.owner)
    record = _record(
        ctx, rt, decision, now, decision.reason, (carried, (), {}), settled, version=state.version
    )
    entry_ids = tuple(s.outcome.entry_id for s in settled)
    commit_ops: list[CommitOp] = [
        SetOp(bus.keys.state(p), new_state.to_bytes()),
        AppendOp(bus.keys.rounds(p), record.to_fields(), ctx.rounds_maxlen),
    ]
    if entry_ids:
        commit_ops.append(AckOp(bus.keys.up(p), SYNC_GROUP, entry_ids))
    bus.commit(rt.lease, commit_ops, commit_id=f"{p}:{r}:{state.version}:abandon")
    rt.after_abandon(state=new_state, entry_ids=entry_ids)
    _delete_payloads(ctx, rt, [s.blob for s in settled])
    log.info("round.abandoned fragment %d round %d: %s", p, r, decision.reason)
    ctx.emit("round.abandoned", decision.reason, fragment=p, round=r, version=state.version)


def _record(
    ctx: Context,
    rt: FragmentRuntime,
    decision: Decision,
    now: float,
    reason: str,
    closed: _Closed,
    settled: list[Settled],
    *,
    version: int,
) -> RoundRecord:
    outcomes, contributors, timings_s = closed
    quorum_at = decision.quorum_reached_at_s
    timings = dict(timings_s)
    if decision.grace_window_s is not None:
        timings["grace_window"] = decision.grace_window_s
    return RoundRecord(
        run_id=ctx.run_id,
        fragment_id=rt.fragment_id,
        round_id=rt.round.round_id,
        version_before=rt.state.version,
        version_after=version,
        decision="merge" if decision.kind == "merge" else "abandon",
        reason=reason,
        contributors=contributors,
        entries=(*outcomes, *(s.outcome for s in settled)),
        opened_at_s=ctx.wall_at(rt.round.opened_at_s),
        quorum_at_s=None if quorum_at is None else ctx.wall_at(quorum_at),
        closed_at_s=ctx.wall_at(now),
        timings_s={k: max(0.0, t) for k, t in timings.items()},
    )


def _counted(
    state: FragmentState,
    outcomes: tuple[EntryOutcome, ...],
    settled: list[Settled],
    held: list[Held],
    *,
    rounds: str,
    contributors: Sequence[ContributorRecord] = (),
    durations_s: dict[str, float | None],
) -> FragmentState:
    """The state with the round counted: totals by outcome and decision, bytes in, and the
    per-learner counts and histograms of ``core.tallies``."""
    entries = (*outcomes, *(s.outcome for s in settled))
    counts: dict[str, int] = {rounds: 1}
    for outcome in entries:
        counts[outcome.outcome] = counts.get(outcome.outcome, 0) + 1
    counts["bytes_in"] = sum(h.blob.nbytes for h in held) + sum(s.bytes_in for s in settled)
    observed = Observed(
        entries=tuple((o.learner_id or "?", o.outcome) for o in entries),
        contributors=tuple((c.learner_id, c.n_tokens, c.staleness) for c in contributors),
        durations_s=durations_s,
        fates=(
            *(
                (h.msg.learner_id, o.outcome, h.msg.new_tokens)
                for h, o in zip(held, outcomes, strict=True)
            ),
            *((s.outcome.learner_id, s.outcome.outcome, s.new_tokens) for s in settled),
        ),
    )
    return state.counted(counts).counted(round_increments(observed))


def _quorum_sample(rt: FragmentRuntime, decision: Decision) -> float | None:
    reached = decision.quorum_reached_at_s
    return None if reached is None else max(0.0, reached - rt.round.opened_at_s)


def _delete_payloads(ctx: Context, rt: FragmentRuntime, refs: Sequence[BlobRef | None]) -> None:
    """Delete settled contributions' payloads, except those a still-held entry refers to (a
    duplicate entry names the same blob key as the original)."""
    keep = {h.blob.key for h in rt.held.values()}
    doomed = [ref for ref in refs if ref is not None and ref.key not in keep]
    if doomed:
        ctx.bus.delete_blobs(doomed)
