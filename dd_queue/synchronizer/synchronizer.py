"""The synchronizer loop: one ``pump()`` at a time, over the ``Bus`` and ``Clock`` interfaces.

Decoupled DiLoCo's synchronizer (Douillard et al., arXiv 2604.21428) holds the global
parameters Θ and the outer momentum, opens rounds at a steady pace, merges the learners'
contributions fragment by fragment under a minimum quorum and an adaptive grace window, and
publishes each new global version. The same class runs in the service (``RedisBus`` +
``SystemClock``, ``pump`` called in a loop) and in the deterministic in-process runner
(``MemoryBus`` + ``FakeClock``, ``pump(block_ms=0)`` from one thread).

One ``pump`` reads as its five steps, after housekeeping (leases, liveness, heartbeat, fault
commands, reclaimed entries) and the opening of the round that is due:

1. **read** new contributions through the group (``contributions.Contributions``: blocking up
   to ``block_ms``, never past the next wake-up, not at all while entries read earlier wait),
   each one fetched, verified and decoded ahead of the loop where a fetch thread or processes
   run;
2. **admit** them, one fragment's batch at a time (``intake.admit``): held for the merge,
   settled with an outcome, or dead-lettered with the reason;
3. **decide** the fragment's open round (``core.policy.decide``): merge, abandon or wait (the
   fast path merges as soon as every live learner contributed);
4. **merge** the held contributions into a new Θ_p and momentum in memory (``merge.merge``);
   a result that is not finite refuses its culprits instead;
5. **commit** the round in one fenced commit (``commit.commit_merge``, or
   ``commit.commit_abandon``).

Every owned round is decided once more before the read (a deadline may have passed) and after
the batches; ``pump`` returns the next wake-up time (clock seconds). ``docs/architecture.md``
follows one contribution through these calls.

Exactly-once rests on two facts: a round's acks are in the same fenced commit as its new version
(so an applied entry is never pending again), and a contribution whose round is at most the last
merged one is refused as late (so a duplicated entry is never applied twice).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from dd_queue.bus import Bus, Lease
from dd_queue.clock import Clock
from dd_queue.config import DDQConfig
from dd_queue.core.fragments import FragmentPlan
from dd_queue.core.policy import decide
from dd_queue.core.schedule import RoundOpening, next_round
from dd_queue.core.sharing import Ownership, plan_ownership
from dd_queue.errors import BlobMissing, BusError, ConfigError, LeaseLost, ProtocolError
from dd_queue.faults import FaultInjector
from dd_queue.fragment_state import FragmentState
from dd_queue.keys import check_name
from dd_queue.synchronizer import intake, recovery, snapshots
from dd_queue.synchronizer.commit import commit_abandon, commit_merge, snapshot
from dd_queue.synchronizer.context import Context, hard_kill
from dd_queue.synchronizer.contributions import Batch, Contributions
from dd_queue.synchronizer.fetchers import available
from dd_queue.synchronizer.members import Commands, Learners, beat
from dd_queue.synchronizer.merge import RoundFailed, merge
from dd_queue.synchronizer.runtime import (
    FragmentRuntime,
    FragmentStatus,
    check_state,
    create_fragment,
    load_fragment,
    read_state,
    restore_fragment,
)
from dd_queue.synchronizer.source import Arrays, ConfigModelSource, ModelSource, plan_of
from dd_queue.tracking import NULL_TRACKER, Tracker

__all__ = ["FragmentStatus", "Synchronizer"]

log = logging.getLogger("dd_queue.synchronizer")
UNREADABLE_RETRY_S = 30.0
"""How long a fragment that could not be loaded is left before the next try."""


class Synchronizer:
    """Merges learners' contributions into new global versions (see the module doc).

    Args:
        cfg: The resolved config (run, wire, redis limits, synchronizer, membership, model).
        bus: The run's bus (``cfg.run.run_id``).
        clock: Monotonic time; ``FakeClock`` in the runner (``pump`` never sleeps then).
        synchronizer_id: Lease owner, consumer and heartbeat name; keep it stable across
            restarts so a restarted synchronizer re-reads its own pending entries.
        source: Initial model of a new run (default: ``cfg.model`` with ``cfg.run.seed``).
        injector: Faults armed against this synchronizer (default: none armed).
        allow_config_change: Continue a run created under another config digest.
        kill: Effect of a ``kill`` fault (default: SIGKILL this process).
        wall: Wall-clock seconds for records and events (default ``time.time``).
        fetch_threads: Threads that fetch and decode contributions ahead of the loop
            (``prefetch``) when there are no fetch processes; default 1 on a ``RedisBus``, 0
            (inline, deterministic) otherwise.
        fetch_processes: Child processes that do it instead (``fetchers``); default
            ``synchronizer.fetch_processes`` on a ``RedisBus`` where they work (Linux), else 0.
        tracker: Where merged rounds' stats go (``dd_queue.tracking``; the caller closes it).

    Raises:
        ConfigError: ``bus`` belongs to another run, or ``synchronizer_id`` is not a safe name.
    """

    def __init__(
        self,
        cfg: DDQConfig,
        *,
        bus: Bus,
        clock: Clock,
        synchronizer_id: str = "sync-0",
        source: ModelSource | None = None,
        injector: FaultInjector | None = None,
        allow_config_change: bool = False,
        kill: Callable[[str], None] = hard_kill,
        wall: Callable[[], float] = time.time,
        fetch_threads: int | None = None,
        fetch_processes: int | None = None,
        tracker: Tracker = NULL_TRACKER,
    ) -> None:
        check_name("synchronizer_id", synchronizer_id)
        if bus.keys.run_id != cfg.run.run_id:
            raise ConfigError(f"bus of run {bus.keys.run_id!r}, config of {cfg.run.run_id!r}")
        self.ctx = Context(
            bus=bus,
            clock=clock,
            wall=wall,
            cfg=cfg,
            owner=synchronizer_id,
            injector=injector or FaultInjector(synchronizer_id, clock=clock),
            kill=kill,
            tracker=tracker,
        )
        self._source = source or ConfigModelSource(cfg.model, cfg.run.seed)
        self._allow_config_change = allow_config_change
        self._plan: FragmentPlan | None = None
        self._arrays: Arrays | None = None
        self.fragments: dict[int, FragmentRuntime] = {}
        self._learners = Learners(self.ctx)
        self._commands: Commands | None = None
        self._pace: tuple[int, float] | None = None  # (last round id, when it was opened)
        self._took_over = False  # fragments taken from a predecessor; no round opened since
        self._timers = {"acquire": 0.0, "beat": 0.0, "reclaim": 0.0}
        self._offline_until = float("-inf")
        self._unreadable: dict[int, float] = {}  # fragment → when to try loading it again
        self._dealt: Ownership | None = None  # the last deal of fragments (share: fair)
        self.rounds_merged = 0
        if fetch_processes is None:  # they need the bus's address, and pay only over a network
            reachable = bus.remote and bus.address is not None and available()
            fetch_processes = cfg.synchronizer.fetch_processes if reachable else 0
        if fetch_threads is None:
            fetch_threads = 1 if bus.remote else 0
        self.contributions = Contributions(
            self.ctx, threads=fetch_threads, processes=fetch_processes
        )

    # ── lifecycle ─────────────────────────────────────────────────────────────────────────
    def start(self) -> None:
        """Plan fragments, take every free fragment (creating version 0 of any the run lacks,
        or loading its state) and beat. Safe to call again (it does nothing then).

        Raises:
            ConfigError: The run holds another model plan, or another config digest and
                ``allow_config_change`` is False.
        """
        if self._plan is not None:
            return
        self.contributions.start()  # warm before any read: a takeover must not wait for start-up
        ctx, now = self.ctx, self.ctx.clock.now()
        # The config's model is covered by the run digest the states are checked against; any
        # other source (arrays, a file) is not, and costs no model build to plan: planned.
        plan, why = None, "the model comes from arrays, not from the config"
        if isinstance(self._source, ConfigModelSource):
            plan, why = recovery.committed_plan(ctx)
        if plan is None:
            log.info("synchronizer.plan from the model config: %s", why)
            plan = plan_of(self._source, ctx.sync)
        else:
            log.info("synchronizer.plan %s; no model built", why)
        self._plan = plan
        # Keep the run's pace: the next round is due one interval after the newest opening
        # (a predecessor's, when this is a restart or a takeover), at once when overdue.
        latest = recovery.latest_opening(ctx)
        if latest is not None:
            since_s = max(0.0, ctx.wall() - latest.opened_at_s)
            self._pace = (latest.round_id, now - since_s)
        self._commands = Commands(ctx)
        if ctx.sync.share == "fair":  # see the peers first, and let them see us
            self._learners.refresh(now)
            self._beat(now)
        self._acquire_free(now)
        self._arrays = None  # only needed while creating the run
        self._learners.refresh(now)
        self._beat(now)
        log.info("synchronizer.started %s owns fragments %s", ctx.owner, sorted(self.fragments))
        ctx.emit("synchronizer.started", f"{ctx.owner} owns {sorted(self.fragments)}")

    def close(self) -> None:
        """Release the leases (a standby takes over at once) and the heartbeat. Held entries
        stay pending; the next owner reclaims them once idle. Before ``start`` it writes nothing
        (a synchronizer stopped while it waited for Redis exits at once)."""
        ctx = self.ctx
        self.contributions.close()
        if self._plan is None:
            return
        for rt in self.fragments.values():
            try:
                ctx.bus.release_lease(rt.lease)
            except BusError as exc:
                log.warning("lease.release_failed fragment %d: %s", rt.fragment_id, exc)
        self.fragments.clear()
        try:
            ctx.bus.remove_heartbeat(ctx.owner)
            ctx.emit("synchronizer.stopped", f"{ctx.owner} stopped")
        except BusError as exc:
            log.warning("synchronizer.close_failed: %s", exc)
        log.info("synchronizer.stopped %s", ctx.owner)

    # ── one iteration ─────────────────────────────────────────────────────────────────────
    def pump(self, *, block_ms: int = 0) -> float | None:
        """Run one iteration (module doc) and return when the next one is due (clock seconds).

        Args:
            block_ms: Longest wait for new contributions, ms (0: never block, as the runner
                calls it); the wait never extends past the next wake-up.

        Raises:
            ConfigError: A fragment taken over belongs to another model or config.
        """
        self.start()
        clock, now = self.ctx.clock, self.ctx.clock.now()
        if now < self._offline_until or self._disconnected(now):
            return self._offline_until
        try:
            self._housekeeping(now)
            self._open_due(now)
            self._each(lambda rt: self._close(rt, now))
            self.contributions.read(self.fragments, block_ms=self._block_ms(block_ms, now))  # 1
            admitted = False
            for batch in self.contributions.batches(self.fragments):
                self._intake(batch)  # 2-5
                admitted = True
            if admitted:
                self._each(lambda rt: self._close(rt, clock.now()))
            return self._wake(clock.now())
        except BusError as exc:
            # A commit whose reply never came may or may not have applied: forget everything
            # and rebuild from Redis once it answers again (``start`` path via ``_acquire_free``).
            log.error("synchronizer.bus_error %s; dropping %d fragments", exc, len(self.fragments))
            self.fragments.clear()
            self.contributions.clear()  # still pending: re-read with each fragment's own entries
            self._timers["acquire"] = now + 1.0
            return now + 1.0

    def _intake(self, batch: Batch) -> None:
        """Steps 2-5 for one fragment's batch: admit, open what fell due meanwhile, close."""
        rt, clock = batch.rt, self.ctx.clock
        try:
            self._admit(rt, batch)
            self._open_due(clock.now())  # on time, also while merging
            self._close(rt, clock.now())
        except LeaseLost as exc:
            self._drop(rt.fragment_id, str(exc))

    def _disconnected(self, now: float) -> bool:
        """Whether a ``disconnect`` fault takes this synchronizer offline now."""
        effect = self.ctx.fault("before_round")
        if effect.offline_until_s is None:
            return False
        self._offline_until = effect.offline_until_s
        log.warning("fault.disconnect for %.3g s", effect.offline_until_s - now)
        return True

    def _each(self, fn: Callable[[FragmentRuntime], None]) -> None:
        """``fn`` on every owned fragment; a lost lease drops the fragment."""
        for p, rt in list(self.fragments.items()):
            try:
                fn(rt)
            except LeaseLost as exc:
                self._drop(p, str(exc))

    def _drop(self, p: int, why: str) -> None:
        if self.fragments.pop(p, None) is not None:
            # its queued entries stay pending for the next owner
            self.contributions.forget(self.ctx.bus.keys.up(p))
            log.warning("lease.lost fragment %d: %s", p, why)
            self.ctx.emit("lease.lost", why, fragment=p)

    # ── housekeeping: leases, liveness, heartbeat, commands, reclaim ─────────────────────
    def _housekeeping(self, now: float) -> None:
        ctx, ttl = self.ctx, self.ctx.sync.lease_ttl_s
        self._each(lambda rt: self._renew(rt, now, early_s=ttl * 2 / 3))
        if now >= self._timers["acquire"]:
            # Often enough that a dead owner's fragments move within its lease + one round.
            pace = self._next_opening(now).interval_s
            self._timers["acquire"] = now + min(ttl / 4, max(0.05, pace))
            self._acquire_free(now)
        self._learners.refresh(now)
        if now >= self._timers["beat"]:
            self._beat(now)
        if now >= self._timers["reclaim"]:
            self._timers["reclaim"] = now + max(0.1, ctx.sync.claim_idle_ms / 2000)
            self._each(lambda rt: self._admit(rt, self._reclaimed(rt)))

    def _renew(self, rt: FragmentRuntime, now: float, *, early_s: float) -> None:
        ttl = self.ctx.sync.lease_ttl_s
        if now >= rt.lease.expires_at_s:
            raise LeaseLost(f"lease expired {now - rt.lease.expires_at_s:.3g} s ago (stalled?)")
        if now >= rt.lease.expires_at_s - early_s:
            rt.lease = self.ctx.bus.renew_lease(rt.lease, ttl_s=ttl)

    def _acquire_free(self, now: float) -> None:
        ctx, limit = self.ctx, self.ctx.sync.max_fragments or self.ctx.sync.n_fragments
        ownership = self._ownership()
        mine = None if ownership is None else ownership.mine(ctx.owner)
        if ownership is not None:
            self._release_foreign(ownership)
        for p in range(ctx.sync.n_fragments):
            if len(self.fragments) >= limit:
                return
            if p in self.fragments or now < self._unreadable.get(p, float("-inf")):
                continue
            if mine is not None and p not in mine:
                continue  # a live peer's (synchronizer.share: fair)
            if (lease := recovery.acquire(ctx, p)) is None:
                continue
            try:
                self._take(p, lease, now)
            except LeaseLost as exc:
                self._drop(p, str(exc))
            except (ProtocolError, BlobMissing) as exc:  # bad data is never a crash
                self._skip_unreadable(p, lease, now, exc)

    def _ownership(self) -> Ownership | None:
        """Who should own which fragment (``synchronizer.share: fair``; None when greedy),
        logged and shown as an event whenever the deal changes."""
        ctx = self.ctx
        if ctx.sync.share != "fair":
            return None
        bus = ctx.bus
        shards = {
            p: bus.shard_of(bus.keys.state(p)) or f"fragment {p}"
            for p in range(ctx.sync.n_fragments)
        }
        ownership = plan_ownership(shards, ctx.owner, self._learners.peers)
        if self._dealt is None or self._dealt.owner_of != ownership.owner_of:
            mine = sorted(ownership.mine(ctx.owner))
            why = f"{ownership.reason}; {ctx.owner} owns {mine}"
            log.info("ownership.dealt %s", why)
            ctx.emit("ownership.dealt", why)
        self._dealt = ownership
        return ownership

    def _release_foreign(self, ownership: Ownership) -> None:
        """Hand one fragment that a live peer should own back to it (its lease released, so
        the peer takes it at once); only between rounds' merges (nothing held)."""
        ctx = self.ctx
        for p, rt in list(self.fragments.items()):
            peer = ownership.owner_of[p]
            if peer == ctx.owner or rt.held:
                continue
            self.fragments.pop(p)
            self.contributions.forget(ctx.bus.keys.up(p))
            try:
                ctx.bus.release_lease(rt.lease)
            except BusError as exc:  # it expires instead: the peer takes it after the TTL
                log.warning("lease.release_failed fragment %d: %s", p, exc)
            why = f"fragment {p} handed to {peer}: {ownership.reason}"
            log.info("ownership.released %s", why)
            ctx.emit("ownership.released", why, fragment=p)
            return

    def _skip_unreadable(self, p: int, lease: Lease, now: float, exc: Exception) -> None:
        """A fragment whose state or Θ (no kept version at all) cannot be read: leave it, with
        the reason, and try again later (an operator may restore it; the others go on)."""
        self.fragments.pop(p, None)
        self._unreadable[p] = now + UNREADABLE_RETRY_S
        why = f"fragment {p} cannot be loaded ({exc}); retrying in {UNREADABLE_RETRY_S:.0f} s"
        log.error("fragment.unreadable %s", why)
        self.ctx.emit("fragment.unreadable", why, fragment=p)
        try:
            self.ctx.bus.release_lease(lease)
        except BusError as err:
            log.warning("lease.release_failed fragment %d: %s", p, err)

    def _take(self, p: int, lease: Lease, now: float) -> None:
        ctx, plan = self.ctx, self._plan
        assert plan is not None  # start() planned first
        state = read_state(ctx, p)
        first = state is None  # created or restored here: snapshot it at once
        if state is None:
            state = self._restore(p, lease, plan, now)
        if state is None:
            if self._arrays is None:
                self._arrays = self._source.arrays()
            state = create_fragment(
                ctx,
                lease,
                plan=plan,
                fragment_id=p,
                arrays=self._arrays,
                origin=self._source.origin,
            )
        else:
            state = check_state(
                ctx, state, plan_digest=plan.digest, allow_config_change=self._allow_config_change
            )
            self._took_over = True
        entries = recovery.pending_entries(ctx, p) + recovery.reclaim_entries(ctx, p)
        # The run's newest opening tells which round of this fragment was announced, but only
        # of the state it was announced on: a state restored (or created again) after Redis lost
        # the run is older than what the ``open`` stream has seen since, whose round of this
        # fragment the learners may have answered and seen merged already. Only the answers
        # pending on the new streams show an open round then; else the next opening announces.
        latest = None if first else recovery.latest_round(ctx)
        round_state, announced = recovery.rebuild_round(ctx, state, entries, latest=latest, now=now)
        rt = load_fragment(ctx, lease, state, round_state=round_state)
        rt.announced = announced
        self.fragments[p] = rt
        if first and ctx.sync.snapshot_dir is not None:  # a restore's bound counts from here
            snapshot(ctx, rt)
        poisoned = recovery.count_takes(ctx, lease, p, entries)  # a take that loaded
        if poisoned:
            intake.dead_letter(ctx, rt, poisoned)
            doomed = {e.id for e, _ in poisoned}
            entries = [e for e in entries if e.id not in doomed]
        log.info(
            "lease.acquired fragment %d token %d: version %d, round %d%s, %d pending",
            p,
            lease.token,
            state.version,
            round_state.round_id,
            " (open)" if announced else "",
            len(entries),
        )
        ctx.emit("lease.acquired", f"{ctx.owner} owns fragment {p}", fragment=p)
        self._admit(rt, self.contributions.batch(rt, entries))
        if ctx.sync.schedule == "learner" and not rt.announced:
            rt.announce(ctx, rt.round.round_id, now, "learner-paced: one round open per fragment")

    def _restore(
        self, p: int, lease: Lease, plan: FragmentPlan, now: float
    ) -> FragmentState | None:
        """A fragment Redis has no state of: restored from its newest usable snapshot
        (``synchronizer.snapshot_dir``), above every version a learner reports; None when
        snapshots are off or there is none (the run is then created, or created again)."""
        ctx, root = self.ctx, self.ctx.sync.snapshot_dir
        if root is None:
            return None
        snap, why = snapshots.latest(
            root, run_id=ctx.run_id, fragment_id=p, plan_digest=plan.digest,
            config_digest=ctx.digest,
        )  # fmt: skip
        if snap is None:
            log.info("snapshot.none fragment %d: %s", p, why)
            return None
        self._learners.next_at = float("-inf")  # the learners' versions as they are now
        self._learners.refresh(now)
        held = self._learners.versions_held.get(p, [])
        version = snapshots.restored_version(snap.version, ctx.sync.snapshot_every_versions, held)
        why += f"; learners hold up to v{max(held, default=snap.version)}"
        return restore_fragment(
            ctx, lease, plan=plan, fragment_id=p, snapshot=snap, version=version, why=why
        )

    def _beat(self, now: float) -> None:
        self._timers["beat"] = now + self.ctx.cfg.membership.heartbeat_interval_s
        held = sum(len(rt.held) for rt in self.fragments.values())
        versions = {p: rt.state.version for p, rt in self.fragments.items()}
        beat(self.ctx, versions=versions, held=held, merged=self.rounds_merged)
        if self._commands is not None:
            self._commands.poll()

    # ── rounds ────────────────────────────────────────────────────────────────────────────
    def _next_opening(self, now: float) -> RoundOpening:
        last_round, last_at = self._pace if self._pace is not None else (None, None)
        return next_round(
            now,
            last_opened_at_s=last_at,
            last_round_id=last_round,
            step_time_s=self._learners.step_time_s,
            sync_every_steps=self.ctx.sync.sync_every_steps,
            n_fragments=self.ctx.sync.n_fragments,
            takeover=self._early_round_allowed(),
        )

    def _early_round_allowed(self) -> bool:
        """A takeover's early round (``core.schedule``): only alone (every fragment ours; a peer
        synchronizer keeps the pace otherwise, and an early round would shift our fragments
        against its own for good) and with no round still open (the predecessor's closes
        first; its merge is the one the learners wait for)."""
        fragments = self.fragments.values()
        alone = len(self.fragments) == self.ctx.sync.n_fragments
        return self._took_over and alone and not any(rt.announced for rt in fragments)

    def _open_due(self, now: float) -> None:
        if self.ctx.sync.schedule != "synchronizer":
            return  # learner-paced: each close opens the fragment's next round
        opening = self._next_opening(now)
        if not opening.open_now:
            return
        self._pace, self._took_over = (opening.round_id, now), False
        rt = self.fragments.get(opening.fragment_id)
        if rt is None:
            return  # another synchronizer's fragment: its owner opens it
        if rt.announced or opening.round_id < rt.round.round_id:
            log.debug(
                "round.skipped %d: fragment %d still has round %d open",
                opening.round_id,
                rt.fragment_id,
                rt.round.round_id,
            )
            return
        try:
            rt.announce(self.ctx, opening.round_id, now, opening.reason)
        except LeaseLost as exc:
            self._drop(rt.fragment_id, str(exc))

    def _close(self, rt: FragmentRuntime, now: float) -> None:
        """Steps 3-5 for one fragment: decide its open round; merge and commit, or abandon."""
        if not rt.announced:
            return
        ctx = self.ctx
        d = decide(
            now,
            rt.round.view(),
            self._learners.live,
            params=ctx.policy,
            estimates=rt.state.estimates(self._learners.step),
            unacked=len(rt.settled),
        )
        previous, rt.decision = rt.decision, d
        if d.kind == "wait":
            if previous is None or previous.quorum_reached_at_s != d.quorum_reached_at_s:
                log.info("round.waiting fragment %d: %s", rt.fragment_id, d.reason)
            return
        self._renew(rt, now, early_s=ctx.sync.lease_ttl_s / 3)
        if d.kind == "merge":
            try:
                merged = merge(ctx, rt)
            except RoundFailed as failed:  # bad data: refuse it, the round goes on without it
                self._refuse(rt, failed)
                return
            commit_merge(ctx, rt, d, merged, now)
            self.rounds_merged += 1
        else:
            commit_abandon(ctx, rt, d, now)
        if ctx.sync.schedule == "learner":
            next_id = rt.round.round_id + (ctx.sync.n_fragments if d.kind == "abandon" else 0)
            rt.announce(ctx, next_id, now, "learner-paced: next round of the fragment")

    def _refuse(self, rt: FragmentRuntime, failed: RoundFailed) -> None:
        """Dead-letter the contributions that made a merge non-finite; the round is decided
        again without them (its next decision may merge the rest, or abandon)."""
        rt.refuse(frozenset(h.msg.learner_id for h, _ in failed.culprits))
        self.ctx.buffers.give([h.delta for h, _ in failed.culprits])
        log.error("round.refused fragment %d round %d: %s", rt.fragment_id, rt.round.round_id,
                  failed)  # fmt: skip
        intake.dead_letter(self.ctx, rt, [(h.entry, reason) for h, reason in failed.culprits])

    # ── contributions ─────────────────────────────────────────────────────────────────────
    def _block_ms(self, block_ms: int, now: float) -> int:
        """How long the read may wait: ``block_ms``, never past the next wake-up, and not at
        all while entries read earlier wait."""
        if block_ms <= 0 or self.contributions.waiting:
            return 0
        return int(min(block_ms, max(0.0, self._wake(now) - now) * 1000))

    def _reclaimed(self, rt: FragmentRuntime) -> Batch:
        return self.contributions.batch(rt, recovery.reclaim_entries(self.ctx, rt.fragment_id))

    def _admit(self, rt: FragmentRuntime, batch: Batch) -> None:
        with batch:
            rejected = intake.admit(self.ctx, rt, batch, self.ctx.clock.now())
        intake.dead_letter(self.ctx, rt, rejected)

    # ── timing and status ─────────────────────────────────────────────────────────────────
    def _wake(self, now: float) -> float:
        ttl = self.ctx.sync.lease_ttl_s
        times = [*self._timers.values(), self._learners.next_at]
        if self.contributions.waiting:
            times.append(now)  # entries read ahead wait for admission
        if self.ctx.sync.schedule == "synchronizer":
            times.append(self._next_opening(now).due_at_s)
        for rt in self.fragments.values():
            times.append(rt.lease.expires_at_s - ttl * 2 / 3)
            if rt.decision is not None and rt.decision.wake_at is not None:
                times.append(rt.decision.wake_at)
        return min(times)

    @property
    def owned(self) -> frozenset[int]:
        """Fragments this synchronizer holds the lease of."""
        return frozenset(self.fragments)

    def versions(self) -> dict[int, int]:
        """Owned fragment → current global version."""
        return {p: rt.state.version for p, rt in sorted(self.fragments.items())}

    def theta(self, fragment_id: int) -> np.ndarray:
        """A copy of Θ_p of an owned fragment (float32)."""
        return self.fragments[fragment_id].theta.copy()

    def status(self) -> list[FragmentStatus]:
        """Every owned fragment's version, open round, held learners and last decision."""
        return [rt.status() for _, rt in sorted(self.fragments.items())]
