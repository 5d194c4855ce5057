"""Closing a round: merge + outer step + one fenced commit, or an abandon record.

A merge (Decoupled DiLoCo, synchronizer steps 3-5; Douillard et al., arXiv 2604.21428):

1. re-anchor each held Δ_m at Θ_p(now) (``core.anchor``; a base that left the ring is dropped);
2. merge with token weights w_m = tokens_m · tokens_m / steps_m (``core.merge``, RDA or mean);
3. Nesterov outer step on a copy of Θ_p and the momentum (``core.outer``), skipped when no
   contribution has weight (``no_update``: the version still advances, Θ_p unchanged);
4. stage Θ_p(v+1) and the momentum under the lease's fencing token;
5. **one fenced, idempotent commit** (id ``<fragment>:<round>:<version>``): the new state, the
   ``down`` notification, the round record with every settled entry's outcome, the acks of
   exactly those entries, and the deletion of the blobs the state no longer references.

A merge whose Δ, new Θ_p or momentum is not finite (finite contributions can still overflow
float32 in the merge or the outer step, e.g. values near 3e38) is never staged: ``merge_round``
raises ``RoundFailed`` naming the contributions that cause it (each one whose merge alone is not
finite; all of them when only their combination is), and the loop dead-letters those with the
reason and lets the round go on without them. Bad data never ends the process.

Fault points ``after_merge`` (between 3 and 4), ``before_commit`` (between 4 and 5) and
``after_commit`` (right after 5, before anything else is written or deleted) let tests kill the
synchronizer there. Until the commit, Redis is untouched apart from staged blobs, and
every entry is still pending; after it, the in-memory runtime takes the new version. Contribution
payload blobs are deleted after the commit (their TTL covers a crash in between).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from dd_queue.bus import AckOp, AppendOp, BlobRef, CommitOp, DeleteOp, SetOp, ops
from dd_queue.core.anchor import anchor_contributions
from dd_queue.core.merge import F32, ContributionData, MergeResult, merge_fragment
from dd_queue.core.outer import NesterovState, nesterov_step
from dd_queue.core.policy import Decision, Ema
from dd_queue.errors import CoreError
from dd_queue.fragment_state import FragmentState, VersionRef
from dd_queue.keys import SYNC_GROUP
from dd_queue.messages import ContributorRecord, EntryOutcome, GlobalFragment, RoundRecord
from dd_queue.synchronizer import blobs
from dd_queue.synchronizer.context import Context
from dd_queue.synchronizer.runtime import FragmentRuntime, Held, Settled

__all__ = ["RoundFailed", "abandon_round", "merge_round"]

log = logging.getLogger("dd_queue.synchronizer")


class RoundFailed(Exception):
    """A merge came out non-finite; ``culprits`` are the held contributions to refuse, each
    with its dead-letter reason. Nothing was staged or committed."""

    def __init__(self, culprits: list[tuple[Held, str]]) -> None:
        super().__init__("; ".join(reason for _, reason in culprits))
        self.culprits = culprits


_Closed = tuple[tuple[EntryOutcome, ...], tuple[ContributorRecord, ...], dict[str, float]]
"""What a round record takes from the closing: outcomes, contributors, timings."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Merged:
    """The outcome of steps 1-3 (nothing written yet)."""

    theta: F32
    momentum: NesterovState
    result: MergeResult | None  # None: the merge itself overflowed float32 (nothing is valid)
    outcomes: tuple[EntryOutcome, ...]
    contributors: tuple[ContributorRecord, ...]
    timings_s: dict[str, float]
    scratch: F32  # the merged Δ's buffer (pooled; free once Θ_p is stepped)


def _merge(ctx: Context, rt: FragmentRuntime, held: list[Held]) -> _Merged:
    clock, sync, v = ctx.clock, ctx.sync, rt.state.version
    t0 = clock.now()
    contribs = [
        ContributionData(
            learner_id=h.msg.learner_id,
            delta=h.delta,
            tokens=h.msg.n_tokens,
            steps=h.msg.n_steps,
            base_version=h.msg.base_version,
            sq_norms=h.sq_norms,
        )
        for h in held
    ]
    kept, anchorings = anchor_contributions(contribs, rt.ring, anchor=sync.anchor)
    buffers, size = ctx.buffers, rt.fragment.size
    out = buffers.take(size)
    theta = buffers.take(size)
    momentum = NesterovState(buffers.take(size), rt.momentum.step)
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is checked, not warned
            result = merge_fragment(
                kept, rt.fragment, rule=sync.merge_rule, weighting=sync.weighting, out=out
            )
    except CoreError as exc:  # finite contributions whose merged Δ overflows float32
        log.debug("merge overflow on fragment %d: %s", rt.fragment_id, exc)
        return _Merged(theta, momentum, None, (), (), {}, out)
    t1 = clock.now()
    if result.kind == "merged":  # into new arrays: Θ_p and b stay as committed until the commit
        with np.errstate(over="ignore", invalid="ignore"):
            nesterov_step(
                rt.theta,
                result.delta,
                rt.momentum,
                lr=sync.outer_lr,
                momentum=sync.outer_momentum,
                out=(theta, momentum),
            )
    else:
        np.copyto(theta, rt.theta)
        np.copyto(momentum.momentum_buffer, rt.momentum.momentum_buffer)
    dropped = {a.learner_id: a.reason for a in anchorings if a.dropped}
    weights = dict(zip(result.learner_ids, result.weights, strict=True))
    outcomes = tuple(
        EntryOutcome(
            entry_id=h.entry.id,
            learner_id=h.msg.learner_id,
            round_id=h.msg.round_id,
            outcome="dropped" if h.msg.learner_id in dropped else "merged",
            reason=dropped.get(h.msg.learner_id, f"weight {weights.get(h.msg.learner_id, 0):.4f}"),
        )
        for h in held
    )
    contributors = tuple(
        ContributorRecord(
            learner_id=h.msg.learner_id,
            weight=weights[h.msg.learner_id],
            n_tokens=h.msg.n_tokens,
            n_steps=h.msg.n_steps,
            staleness=v - h.msg.base_version,
        )
        for h in held
        if h.msg.learner_id in weights
    )
    timings = {"merge": t1 - t0, "outer_step": clock.now() - t1}
    return _Merged(theta, momentum, result, outcomes, contributors, timings, out)


def merge_round(ctx: Context, rt: FragmentRuntime, decision: Decision, now: float) -> None:
    """Merge the held contributions into version v+1 and commit it (steps in the module doc).

    Raises:
        LeaseLost: The lease was taken over; nothing was committed (drop the runtime).
    """
    bus, p, r, state = ctx.bus, rt.fragment_id, rt.round.round_id, rt.state
    held = [rt.held[learner] for learner in sorted(rt.held)]
    merged = _merge(ctx, rt, held)
    result = merged.result
    if result is None or not _finite(merged):
        _release(ctx, merged)
        raise RoundFailed(_culprits(ctx, rt, held))
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
    new_state = _merged_state(ctx, rt, decision, now, merged, held, settled, ref, mref, reason)
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
        AppendOp(bus.keys.rounds(p), record.to_fields(), ctx.maxlen),
        AckOp(bus.keys.up(p), SYNC_GROUP, tuple(entry_ids)),
        DeleteOp(blobs.delete_keys_of([*evicted, state.momentum_ref])),
    ]
    ctx.fault("before_commit")
    bus.commit(rt.lease, commit_ops, commit_id=f"{p}:{r}:{version}")
    ctx.fault("after_commit")
    # Committed: the in-memory runtime takes the new version.
    replaced = [rt.theta, rt.momentum.momentum_buffer, merged.scratch, *(h.delta for h in held)]
    rt.theta, rt.momentum, rt.state = merged.theta, merged.momentum, new_state
    rt.ring.push(version, merged.theta)
    rt.round = rt.round.after_merge(round_id=r + ctx.sync.n_fragments, opened_at_s=now)
    rt.announced, rt.decision, rt.held, rt.settled = False, None, {}, []
    ctx.buffers.give(replaced)  # nothing reads them any more
    rt.known.difference_update(entry_ids)
    _delete_payloads(ctx, rt, [*(h.blob for h in held), *(s.blob for s in settled)])
    log.info("round.merged fragment %d round %d → version %d: %s", p, r, version, reason)
    ctx.emit("round.merged", reason, fragment=p, round=r, version=version, contributors=len(held))


def _finite(merged: _Merged) -> bool:
    """The merge came out whole: no overflow, Θ_p and the momentum finite."""
    return merged.result is not None and bool(
        np.isfinite(merged.theta).all() and np.isfinite(merged.momentum.momentum_buffer).all()
    )


def _release(ctx: Context, merged: _Merged) -> None:
    """Give back the new arrays of a merge that will not be committed."""
    ctx.buffers.give([merged.theta, merged.momentum.momentum_buffer, merged.scratch])


def _culprits(ctx: Context, rt: FragmentRuntime, held: list[Held]) -> list[tuple[Held, str]]:
    """The held contributions that make the merge non-finite: each whose merge alone is; if
    none is alone, all of them (their combination overflows)."""
    alone = []
    for h in held:
        solo = _merge(ctx, rt, [h])
        if not _finite(solo):
            peak = (
                f"max |Δ| {float(np.max(np.abs(h.delta))):.3g}, "
                if isinstance(h.delta, np.ndarray) and h.delta.size
                else ""
            )
            why = f"fragment {rt.fragment_id}'s Θ or momentum non-finite"
            alone.append(
                (h, f"overflow: merged alone it makes {why} ({peak}{h.msg.n_tokens} tokens)")
            )
        _release(ctx, solo)
    if alone:
        return alone
    why = f"overflow: the {len(held)} contributions of round {rt.round.round_id} together make "
    return [(h, why + "the merge non-finite") for h in held]


def _merged_state(
    ctx: Context,
    rt: FragmentRuntime,
    decision: Decision,
    now: float,
    merged: _Merged,
    held: list[Held],
    settled: list[Settled],
    ref: VersionRef,
    momentum: BlobRef,
    reason: str,
) -> FragmentState:
    """The state after the merge: version + 1, the ring with Θ_p(v+1), counters and EMAs."""
    state = rt.state
    estimates = state.estimates(Ema()).observe(
        alpha=ctx.sync.ema_alpha,
        quorum_s=_quorum_sample(rt, decision),
        sync_s=max(0.0, ctx.clock.now() - now),
    )
    new_state = _counted(state, merged.outcomes, settled, held, rounds="rounds_merged")
    return dataclasses.replace(
        new_state.with_estimates(estimates).counted({"bytes_out": ref.ref.nbytes}),
        version=ref.version,
        last_merged_round_id=rt.round.round_id,
        ring=(*state.ring, ref)[-ctx.sync.version_ring :],
        momentum=momentum.to_bytes().decode(),
        last_reason=reason,
        committed_by=ctx.owner,
    )


def abandon_round(ctx: Context, rt: FragmentRuntime, decision: Decision, now: float) -> None:
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
    new_state = _counted(state, (), settled, [], rounds="rounds_abandoned")
    new_state = dataclasses.replace(new_state, last_reason=decision.reason, committed_by=ctx.owner)
    record = _record(
        ctx, rt, decision, now, decision.reason, (carried, (), {}), settled, version=state.version
    )
    entry_ids = tuple(s.outcome.entry_id for s in settled)
    commit_ops: list[CommitOp] = [
        SetOp(bus.keys.state(p), new_state.to_bytes()),
        AppendOp(bus.keys.rounds(p), record.to_fields(), ctx.maxlen),
    ]
    if entry_ids:
        commit_ops.append(AckOp(bus.keys.up(p), SYNC_GROUP, entry_ids))
    bus.commit(rt.lease, commit_ops, commit_id=f"{p}:{r}:{state.version}:abandon")
    rt.state, rt.settled, rt.announced, rt.decision = new_state, [], False, None
    rt.known.difference_update(entry_ids)
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
) -> FragmentState:
    counts: dict[str, int] = {rounds: 1}
    for outcome in (*outcomes, *(s.outcome for s in settled)):
        counts[outcome.outcome] = counts.get(outcome.outcome, 0) + 1
    counts["bytes_in"] = sum(h.blob.nbytes for h in held) + sum(s.bytes_in for s in settled)
    return state.counted(counts)


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
