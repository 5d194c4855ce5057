"""The merge step: the held contributions of a round into a new Θ_p and momentum, in memory.

Decoupled DiLoCo's synchronizer steps 3-4 (Douillard et al., arXiv 2604.21428):

1. re-anchor each held Δ_m at Θ_p(now) (``core.anchor``; a base that left the ring is dropped);
2. merge with token weights w_m = tokens_m · tokens_m / steps_m (``core.merge``, RDA or mean);
3. Nesterov outer step into new arrays for Θ_p and the momentum (``core.outer.OuterStep``,
   taken by the merge: a weighted mean steps each piece of Δ while it is in cache and never
   stores Δ), skipped when no contribution has weight (``no_update``: the version still
   advances, Θ_p unchanged).

Nothing is written here; ``commit`` stages and commits the result. A merge whose Δ, new Θ_p or
momentum is not finite (finite contributions can still overflow float32 in the merge or the
outer step, e.g. values near 3e38) is never committed: ``merge`` raises ``RoundFailed`` naming
the contributions that cause it (each one whose merge alone is not finite; all of them when only
their combination is), and the loop dead-letters those with the reason and lets the round go on
without them. Bad data never ends the process.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from dd_queue.core.anchor import anchor_contributions
from dd_queue.core.merge import F32, ContributionData, MergeResult, merge_fragment
from dd_queue.core.outer import NesterovState, OuterStep
from dd_queue.errors import CoreError
from dd_queue.messages import ContributorRecord, EntryOutcome
from dd_queue.synchronizer.context import Context
from dd_queue.synchronizer.runtime import FragmentRuntime, Held

__all__ = ["Merged", "RoundFailed", "merge", "release"]

log = logging.getLogger("dd_queue.synchronizer")


class RoundFailed(Exception):
    """A merge came out non-finite; ``culprits`` are the held contributions to refuse, each
    with its dead-letter reason. Nothing was staged or committed."""

    def __init__(self, culprits: list[tuple[Held, str]]) -> None:
        super().__init__("; ".join(reason for _, reason in culprits))
        self.culprits = culprits


@dataclasses.dataclass(frozen=True, slots=True)
class Merged:
    """The outcome of steps 1-3 (nothing written yet): the new Θ_p and momentum, in pooled
    arrays, and what the round record takes from them."""

    held: tuple[Held, ...]

    theta: F32
    momentum: NesterovState
    result: MergeResult | None  # None: the merge itself overflowed float32 (nothing is valid)
    outcomes: tuple[EntryOutcome, ...]
    contributors: tuple[ContributorRecord, ...]
    timings_s: dict[str, float]
    scratch: F32  # the merged Δ's buffer (pooled; free once Θ_p is stepped)


def merge(ctx: Context, rt: FragmentRuntime) -> Merged:
    """Steps 1-3 on the fragment's held contributions, in learner order: the new Θ_p and
    momentum (nothing written; ``commit.commit_merge`` commits them, or ``release`` gives
    their arrays back).

    Raises:
        RoundFailed: The result is not finite; it names the contributions that cause it.
    """
    held = [rt.held[learner] for learner in sorted(rt.held)]
    merged = _combine(ctx, rt, held)
    if merged.result is None or not _finite(merged):
        release(ctx, merged)
        raise RoundFailed(_culprits(ctx, rt, held))
    return merged


def _combine(ctx: Context, rt: FragmentRuntime, held: Sequence[Held]) -> Merged:
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
    # the outer step writes new arrays: Θ_p and b stay as committed until the commit (and
    # survive a merge that fails); a weighted mean steps each piece of Δ while it is in cache
    step = OuterStep(
        rt.theta,
        rt.momentum,
        lr=sync.outer_lr,
        momentum=sync.outer_momentum,
        out=(theta, momentum),
    )
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is checked, not warned
            result = merge_fragment(
                kept,
                rt.fragment,
                rule=sync.merge_rule,
                weighting=sync.weighting,
                out=out,
                workers=ctx.workers,
                step=step,
            )
    except CoreError as exc:  # finite contributions whose merged Δ overflows float32
        log.debug("merge overflow on fragment %d: %s", rt.fragment_id, exc)
        return Merged(tuple(held), theta, momentum, None, (), (), {}, out)
    if result.kind == "no_update":
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
    timings = {"merge": clock.now() - t0}  # with the outer step (one pass for a mean)
    return Merged(tuple(held), theta, momentum, result, outcomes, contributors, timings, out)


def _finite(merged: Merged) -> bool:
    """The merge came out whole: no overflow, Θ_p and the momentum finite."""
    return merged.result is not None and bool(
        np.isfinite(merged.theta).all() and np.isfinite(merged.momentum.momentum_buffer).all()
    )


def release(ctx: Context, merged: Merged) -> None:
    """Give back the new arrays of a merge that will not be committed."""
    ctx.buffers.give([merged.theta, merged.momentum.momentum_buffer, merged.scratch])


def _culprits(ctx: Context, rt: FragmentRuntime, held: Sequence[Held]) -> list[tuple[Held, str]]:
    """The held contributions that make the merge non-finite: each whose merge alone is; if
    none is alone, all of them (their combination overflows)."""
    alone = []
    for h in held:
        solo = _combine(ctx, rt, [h])
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
        release(ctx, solo)
    if alone:
        return alone
    why = f"overflow: the {len(held)} contributions of round {rt.round.round_id} together make "
    return [(h, why + "the merge non-finite") for h in held]
