"""One owned fragment in memory: Θ_p, momentum, version ring, the open round and its entries.

A ``FragmentRuntime`` exists only while this synchronizer holds the fragment's lease. It is built
from the committed ``FragmentState`` (``load_fragment``), or by creating version 0 when the run
has no state for the fragment yet (``create_fragment``). On a lost lease or an unknown commit
outcome it is simply dropped: everything it held is still pending in the group, and the next
owner (or this one, after re-acquiring) rebuilds it from Redis.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from dd_queue.bus import BlobRef, CommitOp, Entry, Lease, SetOp, ops, stream_id_ms
from dd_queue.core.anchor import VersionRing
from dd_queue.core.blockwise import Delta
from dd_queue.core.fragments import Fragment, FragmentPlan, flatten_fragment
from dd_queue.core.merge import F32, F64
from dd_queue.core.outer import NesterovState
from dd_queue.core.policy import Decision
from dd_queue.core.rounds import RoundState
from dd_queue.errors import ConfigError, ProtocolError
from dd_queue.fragment_state import FragmentState, fragment_of, segments_of
from dd_queue.messages import (
    Contribution,
    EntryOutcome,
    EntryOutcomeKind,
    GlobalFragment,
    RoundOpen,
)
from dd_queue.synchronizer import blobs
from dd_queue.synchronizer.context import Context
from dd_queue.synchronizer.snapshots import Snapshot
from dd_queue.synchronizer.source import Arrays

__all__ = [
    "FragmentRuntime",
    "FragmentStatus",
    "Held",
    "Settled",
    "create_fragment",
    "load_fragment",
]

log = logging.getLogger("dd_queue.synchronizer")


@dataclass(frozen=True, slots=True, eq=False)
class Held:
    """An admitted contribution, decoded, waiting for its fragment's merge (``sq_norms``: its
    delta's squared segment norms, computed when it was decoded; None: the merge computes them)."""

    entry: Entry
    msg: Contribution
    delta: Delta
    blob: BlobRef
    sq_norms: F64 | None = None


@dataclass(frozen=True, slots=True)
class Settled:
    """An entry the next commit acks with a non-merged outcome (its blob is deleted after).

    ``bytes_in`` counts its payload when it was fetched (a held contribution superseded later);
    ``new_tokens`` are the tokens it carried first (its envelope's; 0 when it was unreadable).
    """

    outcome: EntryOutcome
    blob: BlobRef | None
    bytes_in: int = 0
    new_tokens: int = 0


@dataclass(frozen=True, slots=True)
class FragmentStatus:
    """One owned fragment as the runner, tests and logs see it."""

    fragment_id: int
    version: int
    round_id: int
    announced: bool
    held: tuple[str, ...]
    reason: str


@dataclass(eq=False, kw_only=True)
class FragmentRuntime:
    """The in-memory state of one owned fragment.

    Attributes:
        fragment: Layout of Θ_p.
        state: The last committed state (what Redis holds).
        lease: The fragment's lease and fencing token.
        theta: Θ_p at ``state.version`` (float32, owned).
        momentum: The outer Nesterov state after that version.
        ring: Recent versions for re-anchoring.
        round: The core round state (held contributions, admission rules).
        announced: Whether ``round.round_id`` was announced on the ``open`` stream (only then
            does the policy decide; before, it is the placeholder of the next round).
        held: Admitted contributions by learner.
        settled: Entries to ack with their outcome in the next commit.
        known: Entry ids read and not yet committed (redeliveries are skipped).
        decision: The policy's last decision for the open round.
        published_ms: When each recent version's ``down`` notice was committed (its stream id's
            milliseconds, the bus's clock), for the versions this lifetime saw published: the
            current one at load, then each merge's. Bounds how long a contribution can have
            trained (``trained_for_s``).
    """

    fragment: Fragment
    state: FragmentState
    lease: Lease
    theta: F32
    momentum: NesterovState
    ring: VersionRing
    round: RoundState
    announced: bool = False
    held: dict[str, Held] = field(default_factory=dict)
    settled: list[Settled] = field(default_factory=list)
    known: set[str] = field(default_factory=set)
    decision: Decision | None = None
    published_ms: dict[int, int] = field(default_factory=dict)

    @property
    def fragment_id(self) -> int:
        return self.fragment.index

    def trained_for_s(self, base_version: int, entry_id: str) -> float | None:
        """Seconds from ``base_version``'s publication to the arrival of the contribution entry
        ``entry_id`` (both on the bus's clock), or None when that publication is not known."""
        published = self.published_ms.get(base_version)
        if published is None:
            return None
        return (stream_id_ms(entry_id) - published) / 1000.0

    def status(self) -> FragmentStatus:
        """Version, open round, held learners and the last decision's (or commit's) reason."""
        reason = self.decision.reason if self.decision is not None else self.state.last_reason
        return FragmentStatus(
            fragment_id=self.fragment_id,
            version=self.state.version,
            round_id=self.round.round_id,
            announced=self.announced,
            held=tuple(sorted(self.held)),
            reason=reason,
        )

    # ── transitions: the only places that change a runtime's round, entries and version ──
    def first_sight(self, entry_id: str) -> bool:
        """Mark an entry read in this lifetime; False when it was already (a redelivery, e.g.
        reclaimed from ourselves: it is held or settled already)."""
        if entry_id in self.known:
            return False
        self.known.add(entry_id)
        return True

    def settle(
        self,
        entry_id: str,
        learner_id: str,
        round_id: int,
        outcome: EntryOutcomeKind,
        reason: str,
        blob: BlobRef | None,
        bytes_in: int = 0,
        new_tokens: int = 0,
    ) -> None:
        """Queue an entry for the next commit's acks, with its outcome for the round record
        (``bytes_in``: its payload's size when it was fetched; ``new_tokens``: the tokens it
        carried first, for the token fate). A refused answer to the open round counts as the
        learner's answer to it (``RoundState.refusing``)."""
        record = EntryOutcome(
            entry_id=entry_id,
            learner_id=learner_id or "?",
            round_id=round_id,
            outcome=outcome,
            reason=reason,
        )
        self.settled.append(
            Settled(outcome=record, blob=blob, bytes_in=bytes_in, new_tokens=new_tokens)
        )
        if outcome not in ("merged", "carried") and learner_id:  # it answered, and was refused
            self.round = self.round.refusing(learner_id, round_id)
            self.decision = None

    def hold(self, held: Held, round_after: RoundState) -> Held | None:
        """Hold an admitted contribution (``round_after``: the round that admitted it). One of
        the same learner that it replaces is settled as ``superseded`` and returned (its
        buffer is the caller's to give back)."""
        self.round = round_after
        learner = held.msg.learner_id
        old = self.held.get(learner)
        if old is not None:
            why = f"replaced by {learner}'s round {held.msg.round_id} contribution"
            self.settle(
                old.entry.id,
                learner,
                old.msg.round_id,
                "superseded",
                why,
                old.blob,
                old.blob.nbytes,
                old.msg.new_tokens,
            )
        self.held[learner] = held
        return old

    def refuse(self, learner_ids: frozenset[str]) -> None:
        """Drop held contributions (to be dead-lettered) from the round; it is decided anew."""
        for learner in learner_ids:
            self.held.pop(learner, None)
        self.round = self.round.without(learner_ids)
        self.decision = None

    def forget(self, entry_ids: Iterable[str]) -> None:
        """Entries that left the group (committed or dead-lettered): no longer redeliveries."""
        self.known.difference_update(entry_ids)

    def after_merge(
        self,
        *,
        state: FragmentState,
        theta: F32,
        momentum: NesterovState,
        next_round_id: int,
        now: float,
        entry_ids: Iterable[str],
        notice_id: str,
    ) -> list[Delta]:
        """The merge's commit is in (``notice_id``: its ``down`` notice's stream id): take its
        version, open the placeholder of the fragment's next round. Returns the arrays nothing
        reads any more (for the buffer pool)."""
        replaced: list[Delta] = [self.theta, self.momentum.momentum_buffer]
        replaced += [h.delta for h in self.held.values()]
        self.theta, self.momentum, self.state = theta, momentum, state
        self.ring.push(state.version, theta)
        self.published_ms[state.version] = stream_id_ms(notice_id)
        for old in [v for v in self.published_ms if v < self.ring.versions[0]]:
            del self.published_ms[old]  # versions out of the ring
        self.round = self.round.after_merge(round_id=next_round_id, opened_at_s=now)
        self.announced, self.decision, self.held, self.settled = False, None, {}, []
        self.forget(entry_ids)
        return replaced

    def after_abandon(self, *, state: FragmentState, entry_ids: Iterable[str]) -> None:
        """The abandon record is in: settled entries are acked, held ones carried."""
        self.state, self.settled, self.announced, self.decision = state, [], False, None
        self.forget(entry_ids)

    def announce(self, ctx: Context, round_id: int, now: float, reason: str) -> None:
        """Open ``round_id`` (≥ the placeholder) and append its ``RoundOpen`` to the run's
        ``open`` stream, where learners see it."""
        r = self.round
        if round_id > r.round_id:
            self.round = r.reopened(round_id=round_id, opened_at_s=now)
        else:
            self.round = dataclasses.replace(r, opened_at_s=now)
        self.announced, self.decision = True, None
        msg = RoundOpen(
            run_id=ctx.run_id,
            fragment_id=self.fragment_id,
            round_id=self.round.round_id,
            opened_at_s=ctx.wall_at(now),
            reason=reason,
        )
        ctx.bus.append(ctx.bus.keys.opened_rounds(), msg.to_fields(), maxlen=ctx.maxlen)
        log.info(
            "round.opened fragment %d round %d: %s", self.fragment_id, self.round.round_id, reason
        )


def create_fragment(
    ctx: Context, lease: Lease, *, plan: FragmentPlan, fragment_id: int, arrays: Arrays, origin: str
) -> FragmentState:
    """Commit version 0 of a fragment: Θ_p(0) from ``arrays``, zero momentum, state, ``down``.

    Returns:
        The committed state.
    """
    fragment = plan.fragments[fragment_id]
    return _commit_first(
        ctx,
        lease,
        plan=plan,
        fragment_id=fragment_id,
        theta=flatten_fragment(fragment, arrays),
        momentum=NesterovState.zeros(fragment.size),
        version=0,
        last_merged_round_id=None,
        reason=f"run created from {origin}",
        commit_id=f"{fragment_id}:create",
        event="fragment.created",
        detail=origin,
    )


def restore_fragment(
    ctx: Context,
    lease: Lease,
    *,
    plan: FragmentPlan,
    fragment_id: int,
    snapshot: Snapshot,
    version: int,
    why: str,
) -> FragmentState:
    """Commit a fragment Redis lost from its snapshot on disk, as ``version``
    (``snapshots.restored_version``): Θ_p and the momentum bit for bit, the round counter.

    Raises:
        ConfigError: The snapshot's tensors are unusable or of another size.
    """
    theta, buffer = snapshot.load()
    size = plan.fragments[fragment_id].size
    if theta.shape != (size,) or buffer.shape != (size,):
        raise ConfigError(f"snapshot {snapshot.path} holds {theta.shape}, fragment needs {size}")
    state = _commit_first(
        ctx,
        lease,
        plan=plan,
        fragment_id=fragment_id,
        theta=np.ascontiguousarray(theta, np.float32),
        momentum=NesterovState(np.ascontiguousarray(buffer, np.float32), snapshot.outer_steps),
        version=version,
        last_merged_round_id=snapshot.last_merged_round_id,
        reason=f"restored from snapshot v{snapshot.version} as version {version}: {why}",
        commit_id=f"{fragment_id}:restore:{version}",
        event="fragment.restored",
        detail=f"from snapshot v{snapshot.version}: {why}",
    )
    return state


def _commit_first(
    ctx: Context,
    lease: Lease,
    *,
    plan: FragmentPlan,
    fragment_id: int,
    theta: F32,
    momentum: NesterovState,
    version: int,
    last_merged_round_id: int | None,
    reason: str,
    commit_id: str,
    event: str,
    detail: str,
) -> FragmentState:
    """The first state of a fragment in this Redis (created or restored), committed; logged as
    ``event`` with ``detail`` (where its Θ_p came from), emitted with the reason."""
    fragment = plan.fragments[fragment_id]
    bus = ctx.bus
    ref, header, staged = blobs.stage(
        bus,
        lease,
        fragment_id=fragment_id,
        version=version,
        theta=theta,
        state=momentum,
        auth=ctx.auth,
    )
    state = FragmentState(
        run_id=ctx.run_id,
        fragment_id=fragment_id,
        n_fragments=plan.n_fragments,
        plan_digest=plan.digest,
        config_digest=ctx.digest,
        segments=segments_of(fragment),
        version=version,
        last_merged_round_id=last_merged_round_id,
        ring=(ref,),
        momentum=staged.to_bytes().decode(),
        quorum_ema_s=None,
        sync_ema_s=None,
        ema_samples=(0, 0),
        counters={"bytes_out": ref.ref.nbytes},
        last_reason=reason,
        committed_by=ctx.owner,
    )
    notice = GlobalFragment(
        run_id=ctx.run_id,
        fragment_id=fragment_id,
        version=version,
        round_id=last_merged_round_id or 0,
        tensor=header,
        created_at_s=ctx.wall(),
        reason=reason,
    )
    commit_ops: list[CommitOp] = [
        SetOp(bus.keys.state(fragment_id), state.to_bytes()),
        ops.global_notification_op(bus, notice, ref.ref, maxlen=ctx.maxlen, auth=ctx.auth),
    ]
    bus.commit(lease, commit_ops, commit_id=commit_id)
    log.info("%s %d: version %d (%s)", event, fragment_id, version, detail)
    ctx.emit(event, reason, fragment=fragment_id, version=version)
    return state


def read_state(ctx: Context, fragment_id: int) -> FragmentState | None:
    """The committed state of a fragment, or None when the run has none for it yet."""
    raw = ctx.bus.get(ctx.bus.keys.state(fragment_id))
    if raw is None:
        return None
    return FragmentState.from_bytes(raw, run_id=ctx.run_id, limits=ctx.limits)


def check_state(
    ctx: Context, state: FragmentState, *, plan_digest: str, allow_config_change: bool
) -> FragmentState:
    """Refuse a state of another model plan, or of another config unless allowed.

    Returns:
        The state, with this config's digest when a change was allowed.

    Raises:
        ConfigError: The plan differs, or the config digest differs and is not allowed to.
    """
    p = state.fragment_id
    if state.plan_digest != plan_digest or state.n_fragments != ctx.sync.n_fragments:
        raise ConfigError(
            f"fragment {p} of run {ctx.run_id!r} was planned for another model or "
            f"n_fragments ({state.n_fragments} fragments, plan {state.plan_digest[:12]}); this "
            f"config plans {ctx.sync.n_fragments} (plan {plan_digest[:12]}). Use the run's "
            "model config, or start a new run_id"
        )
    if state.config_digest == ctx.digest:
        return state
    if not allow_config_change:
        raise ConfigError(
            f"run {ctx.run_id!r} was created with config digest {state.config_digest}; this "
            f"config's digest is {ctx.digest}. Use the run's config, or pass "
            "--allow-config-change to continue the run under the new one"
        )
    log.warning("fragment.config_changed %d: %s → %s", p, state.config_digest, ctx.digest)
    return dataclasses.replace(state, config_digest=ctx.digest)


def load_fragment(
    ctx: Context, lease: Lease, state: FragmentState, *, round_state: RoundState
) -> FragmentRuntime:
    """Build the runtime of a committed state: fetch Θ_p, the ring and the momentum."""
    fragment = fragment_of(state)
    ring, theta = blobs.load_ring(
        ctx.bus,
        state,
        capacity=ctx.sync.version_ring,
        limits=ctx.limits,
        size=fragment.size,
        auth=ctx.auth,
    )
    momentum = blobs.load_momentum(ctx.bus, state, size=fragment.size)
    published = _published_ms(ctx, state)
    log.info(
        "fragment.loaded %d: version %d, ring v%s..v%d",
        state.fragment_id,
        state.version,
        ring.versions[0],
        state.version,
    )
    return FragmentRuntime(
        fragment=fragment,
        state=state,
        lease=lease,
        theta=np.ascontiguousarray(theta),
        momentum=momentum,
        ring=ring,
        round=round_state,
        published_ms=published,
    )


def _published_ms(ctx: Context, state: FragmentState) -> dict[int, int]:
    """``{version: ms}`` of the current version, from the latest ``down`` notice of the
    fragment when it announces that version; empty when it does not (trimmed, or unreadable)."""
    entry = ops.latest_global(ctx.bus, state.fragment_id)
    if entry is None:
        return {}
    try:
        notice = GlobalFragment.from_fields(entry.fields, run_id=ctx.run_id, limits=ctx.limits)
    except ProtocolError:
        return {}
    return {state.version: stream_id_ms(entry.id)} if notice.version == state.version else {}
