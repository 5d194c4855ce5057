"""From ``up`` stream entries to held contributions: validate, dead-letter, admit.

Per entry, in order (the first that applies decides):

1. a redelivery of an entry already read in this lifetime is skipped (by the ``Batch``);
2. a trimmed entry (no fields) is settled as ``dropped``;
3. the entry was read and verified whole by the ``contributions.Batch`` (``ops.read_contribution``,
   perhaps ahead of time: envelope, run, stream, reference, blob framing, checksum, NaN/Inf, size
   limits), then its counters are checked for plausibility (``core.rounds.implausible``: at most
   ``max_tokens_per_step`` tokens per step, and ``max_steps_per_s`` steps a second since its
   base version was published) and its config digest and size compared
   with ours: any failure dead-letters it with the reason. One exception: a
   missing payload of an entry that could not merge anyway (a duplicate or late twin of a
   merged one, whose commit deleted the shared payload) is settled by its outcome instead;
4. ``core.rounds.RoundState.admit`` says duplicate / late / invalid / stale / superseded: the
   entry is settled with that outcome (acked by the fragment's next commit, never merged);
5. otherwise it is held (decoded) for the merge, and a contribution of the same learner it
   replaced is settled as ``superseded``.

Dead-lettering is a fenced commit of ``DeadLetterOp`` s (the move and the ack in one step), made
once per batch of entries, with the ``dead_lettered`` counter of the fragment's state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import cast

from dd_queue.bus import DeadLetterOp, Entry, SetOp, ops
from dd_queue.config import digest_mismatch
from dd_queue.core.rounds import Admission, ContributionMeta, implausible
from dd_queue.core.tallies import dead_letter_increments
from dd_queue.errors import BlobMissing, DDQError, IncompatibleMessage, ProtocolError
from dd_queue.keys import SYNC_GROUP
from dd_queue.messages import Contribution, EntryOutcomeKind
from dd_queue.synchronizer.context import Context
from dd_queue.synchronizer.contributions import Item
from dd_queue.synchronizer.runtime import FragmentRuntime, Held

__all__ = ["Rejected", "admit", "dead_letter"]

log = logging.getLogger("dd_queue.synchronizer")

Rejected = tuple[Entry, str]
"""An entry to dead-letter and the reason."""


def admit(ctx: Context, rt: FragmentRuntime, items: Iterable[Item], now: float) -> list[Rejected]:
    """Offer the items of a ``contributions.Batch`` (entries of the fragment's ``up`` stream,
    each with what reading it gave) to the fragment's round.

    Returns:
        The entries to dead-letter, with their reasons (``dead_letter`` moves them).
    """
    rejected: list[Rejected] = []
    for item in items:
        reason = _offer(ctx, rt, item, now)
        if reason is not None:
            rejected.append((item.entry, reason))
    return rejected


def _offer(ctx: Context, rt: FragmentRuntime, item: Item, now: float) -> str | None:
    """Admit, settle or refuse one entry; returns the dead-letter reason of a refusal."""
    entry, exc = item.entry, item.error
    if isinstance(exc, BlobMissing):
        # A duplicate or late entry may name a payload its merged twin's commit deleted:
        # settle it by its admission outcome; an entry that could still merge is lost.
        return _offer_without_payload(ctx, rt, entry, now, f"{ops.rejection_reason(exc)}: {exc}")
    if exc is not None:
        return f"{ops.rejection_reason(exc)}: {exc}"
    if item.read is None:
        rt.settle(entry.id, "", rt.round.round_id, "dropped", "trimmed while pending", None)
        return None
    msg, delta, sq_norms = item.read
    try:
        _check_compatible(ctx, rt, msg, entry, delta.size)
    except ProtocolError as err:
        ctx.buffers.give([delta])
        return f"{ops.rejection_reason(err)}: {err}"
    round_after, admission = rt.round.admit(
        ContributionMeta.of(msg, entry.id), now=now, max_staleness=ctx.sync.max_staleness
    )
    ref = ops.blob_ref(entry)
    if not admission.admitted:
        ctx.buffers.give([delta])
        outcome = cast(EntryOutcomeKind, admission.kind)  # not admitted: an outcome kind
        rt.settle(
            entry.id,
            msg.learner_id,
            msg.round_id,
            outcome,
            admission.reason,
            ref,
            ref.nbytes,
            msg.new_tokens,
        )
        _log_admission(rt, admission)
        return None
    held = Held(entry=entry, msg=msg, delta=delta, blob=ref, sq_norms=sq_norms)
    replaced = rt.hold(held, round_after)
    if replaced is not None:
        ctx.buffers.give([replaced.delta])  # its successor holds its place
    _log_admission(rt, admission)
    return None


def _offer_without_payload(
    ctx: Context, rt: FragmentRuntime, entry: Entry, now: float, reason: str
) -> str | None:
    try:
        msg = Contribution.from_fields(entry.fields, run_id=ctx.run_id, limits=ctx.limits)
    except ProtocolError as exc:
        return f"{ops.rejection_reason(exc)}: {exc}"
    _, admission = rt.round.admit(
        ContributionMeta.of(msg, entry.id), now=now, max_staleness=ctx.sync.max_staleness
    )
    if admission.admitted:
        return reason
    outcome = cast(EntryOutcomeKind, admission.kind)
    rt.settle(
        entry.id, msg.learner_id, msg.round_id, outcome, admission.reason, None, 0, msg.new_tokens
    )
    _log_admission(rt, admission)
    return None


def _check_compatible(
    ctx: Context, rt: FragmentRuntime, msg: Contribution, entry: Entry, size: int
) -> None:
    why = implausible(
        msg,
        max_tokens_per_step=ctx.max_tokens_per_step,
        max_steps_per_s=ctx.sync.max_steps_per_s,
        trained_for_s=rt.trained_for_s(msg.base_version, entry.id),
    )
    if why is not None:
        raise ProtocolError(why, reason="implausible")
    if msg.config_digest != ctx.digest:
        raise IncompatibleMessage(
            f"config digest {msg.config_digest} differs from the run's {ctx.digest} in "
            f"{digest_mismatch(ctx.digest, msg.config_digest)}"
        )
    if size != rt.fragment.size:
        raise IncompatibleMessage(
            f"{size} elements; fragment {rt.fragment_id} has {rt.fragment.size}"
        )


def dead_letter(ctx: Context, rt: FragmentRuntime, rejected: Sequence[Rejected]) -> None:
    """Move refused entries to the fragment's ``dlq`` with their reasons, fenced, in one commit
    that also counts them in the fragment's state.

    Raises:
        LeaseLost: The lease was taken over; nothing was moved.
    """
    if not rejected:
        return
    bus, p = ctx.bus, rt.fragment_id
    named = [_learner_of(ctx, entry, reason) for entry, reason in rejected]
    state = rt.state.counted({"dead_lettered": len(rejected), **dead_letter_increments(named)})
    commit_ops: list[DeadLetterOp | SetOp] = [
        DeadLetterOp(entry, SYNC_GROUP, bus.keys.dlq(p), reason, ctx.maxlen)
        for entry, reason in rejected
    ]
    commit_ops.append(SetOp(bus.keys.state(p), state.to_bytes()))
    bus.commit(rt.lease, commit_ops, commit_id=f"{p}:dlq:{rejected[0][0].id}")
    rt.state = state
    rt.forget(entry.id for entry, _ in rejected)
    for entry, reason in rejected:
        log.warning("contribution.dead_lettered fragment %d entry %s: %s", p, entry.id, reason)
        ctx.emit("contribution.dead_lettered", reason, fragment=p, entry=entry.id)


def _learner_of(ctx: Context, entry: Entry, reason: str) -> tuple[str, str, int]:
    """``(learner, reason, new_tokens)`` of a refused entry: ``("?", reason, 0)`` when its
    envelope does not decode."""
    try:
        msg = Contribution.from_fields(entry.fields, run_id=ctx.run_id, limits=ctx.limits)
    except DDQError:
        return "?", reason, 0
    return msg.learner_id, reason, msg.new_tokens


def _log_admission(rt: FragmentRuntime, admission: Admission) -> None:
    level = logging.DEBUG if admission.admitted else logging.INFO
    kind = "accepted" if admission.admitted else admission.kind
    log.log(level, "contribution.%s fragment %d: %s", kind, rt.fragment_id, admission.reason)
