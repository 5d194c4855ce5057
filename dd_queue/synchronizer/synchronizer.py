"""The synchronizer loop: one ``pump()`` at a time, over the ``Bus`` and ``Clock`` interfaces.

Decoupled DiLoCo's synchronizer (Douillard et al., arXiv 2604.21428) holds the global
parameters Θ and the outer momentum, opens rounds at a steady pace, merges the learners'
contributions fragment by fragment under a minimum quorum and an adaptive grace window, and
publishes each new global version. The same class runs in the service (``RedisBus`` +
``SystemClock``, ``pump`` called in a loop) and in the deterministic in-process runner
(``MemoryBus`` + ``FakeClock``, ``pump(block_ms=0)`` from one thread).

One ``pump``, in order:

1. fault point ``before_round``; housekeeping: renew leases (a lost one drops its fragment),
   take free or expired fragments over, refresh learner liveness, beat, poll fault commands,
   reclaim idle pending entries;
2. open the round that is due (synchronizer-paced) on the ``open`` stream;
3. decide every open round (``core.policy.decide``): merge, abandon or wait;
4. read new contributions through the group (blocking up to ``block_ms``, never past the next
   wake-up; not at all while entries read earlier wait), validate, dead-letter or admit them
   stream by stream, deciding each fragment as soon as its entries are in (the fast path merges
   as soon as every live learner contributed) and opening rounds that fell due meanwhile; then
   decide again;
5. return the next wake-up time (clock seconds).

With a fetch thread (``prefetch``; on a ``RedisBus``), payloads are fetched and decoded ahead
of admission, and just before a fragment's merge the group is read once more without blocking,
so the entries that arrived meanwhile are decoded during the merge; they are admitted by the
next ``pump``, first thing. Without one (``MemoryBus``, the deterministic runner), each entry
is read when admission reaches it, as a plain loop would.

Exactly-once rests on two facts: a round's acks are in the same fenced commit as its new version
(so an applied entry is never pending again), and a contribution whose round is at most the last
merged one is refused as late (so a duplicated entry is never applied twice).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from dd_queue.bus import Bus, Entry, Lease, RedisBus
from dd_queue.clock import Clock
from dd_queue.config import DDQConfig
from dd_queue.core.fragments import FragmentPlan
from dd_queue.core.policy import decide
from dd_queue.core.schedule import RoundOpening, next_round
from dd_queue.errors import BusError, ConfigError, LeaseLost
from dd_queue.faults import FaultInjector
from dd_queue.fetchers import available
from dd_queue.keys import SYNC_GROUP, check_name
from dd_queue.synchronizer import recovery
from dd_queue.synchronizer.closing import RoundFailed, abandon_round, merge_round
from dd_queue.synchronizer.context import Context, hard_kill
from dd_queue.synchronizer.intake import admit_entries, dead_letter, to_read
from dd_queue.synchronizer.members import Commands, Learners, beat
from dd_queue.synchronizer.prefetch import Prefetcher
from dd_queue.synchronizer.runtime import (
    FragmentRuntime,
    FragmentStatus,
    check_state,
    create_fragment,
    load_fragment,
    read_state,
)
from dd_queue.synchronizer.source import Arrays, ConfigModelSource, ModelSource, plan_of

__all__ = ["FragmentStatus", "Synchronizer"]

log = logging.getLogger("dd_queue.synchronizer")
READ_COUNT = 64
"""Entries read per ``up`` stream per pump."""


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
        fetch_processes: Child processes that do it instead (``dd_queue.fetchers``); default
            ``synchronizer.fetch_processes`` on a ``RedisBus`` where they work (Linux), else 0.

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
        )
        self._source = source or ConfigModelSource(cfg.model, cfg.run.seed)
        self._allow_config_change = allow_config_change
        self._plan: FragmentPlan | None = None
        self._arrays: Arrays | None = None
        self.fragments: dict[int, FragmentRuntime] = {}
        self._learners = Learners(self.ctx)
        self._commands: Commands | None = None
        self._pace: tuple[int, float] | None = None  # (last round id, when it was opened)
        self._timers = {"acquire": 0.0, "beat": 0.0, "reclaim": 0.0}
        self._offline_until = float("-inf")
        self.rounds_merged = 0
        redis_url = bus.url if isinstance(bus, RedisBus) else None
        if fetch_processes is None:
            by_url = redis_url is not None and available()
            fetch_processes = cfg.synchronizer.fetch_processes if by_url else 0
        if fetch_threads is None:
            fetch_threads = 1 if isinstance(bus, RedisBus) else 0
        self._prefetch = Prefetcher(self.ctx, threads=fetch_threads, processes=fetch_processes)
        self._incoming: deque[Entry] = deque()  # read from the group, not yet admitted

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
        self._prefetch.start()  # warm before any read: a takeover must not wait for start-up
        ctx, now = self.ctx, self.ctx.clock.now()
        self._plan = plan_of(self._source, ctx.sync)
        latest = recovery.latest_round(ctx)
        self._pace = None if latest is None else (latest, now)
        self._commands = Commands(ctx)
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
        self._prefetch.close()
        if self._plan is None:
            return
        self._incoming.clear()
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
        ctx = self.ctx
        now = ctx.clock.now()
        if now < self._offline_until:
            return self._offline_until
        try:
            fault = ctx.fault("before_round")
            if fault is not None and fault.kind == "disconnect":
                self._offline_until = now + fault.remaining_s(now)
                log.warning("fault.disconnect for %.3g s", fault.remaining_s(now))
                return self._offline_until
            self._housekeeping(now)
            if ctx.sync.schedule == "synchronizer":
                self._open_due(now)
            self._decide_all(now)
            wait_s = 0.0 if self._incoming else self._wake(now) - now
            self._queue(self._read(block_ms, wait_s))
            if self._incoming:
                self._intake()
                self._decide_all(ctx.clock.now())
            return self._wake(ctx.clock.now())
        except LeaseLost:
            raise  # unreachable: handled per fragment by _each
        except BusError as exc:
            # A commit whose reply never came may or may not have applied: forget everything
            # and rebuild from Redis once it answers again (``start`` path via ``_acquire_free``).
            log.error("synchronizer.bus_error %s; dropping %d fragments", exc, len(self.fragments))
            self.fragments.clear()
            self._incoming.clear()  # still pending: re-read with each fragment's own entries
            self._prefetch.clear()
            self._timers["acquire"] = now + 1.0
            return now + 1.0

    def _each(self, fn: Callable[[FragmentRuntime], None]) -> None:
        for p, rt in list(self.fragments.items()):
            try:
                fn(rt)
            except LeaseLost as exc:
                self._drop(p, str(exc))

    def _drop(self, p: int, why: str) -> None:
        if self.fragments.pop(p, None) is not None:
            stream = self.ctx.bus.keys.up(p)  # its queued entries stay pending for the next owner
            self._prefetch.discard(e for e in self._incoming if e.stream == stream)
            self._incoming = deque(e for e in self._incoming if e.stream != stream)
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
            self._each(lambda rt: self._admit(rt, recovery.reclaim_entries(ctx, rt.fragment_id)))

    def _renew(self, rt: FragmentRuntime, now: float, *, early_s: float) -> None:
        ttl = self.ctx.sync.lease_ttl_s
        if now >= rt.lease.expires_at_s:
            raise LeaseLost(f"lease expired {now - rt.lease.expires_at_s:.3g} s ago (stalled?)")
        if now >= rt.lease.expires_at_s - early_s:
            rt.lease = self.ctx.bus.renew_lease(rt.lease, ttl_s=ttl)

    def _acquire_free(self, now: float) -> None:
        ctx, limit = self.ctx, self.ctx.sync.max_fragments or self.ctx.sync.n_fragments
        for p in range(ctx.sync.n_fragments):
            if len(self.fragments) >= limit:
                return
            if p not in self.fragments and (lease := recovery.acquire(ctx, p)) is not None:
                try:
                    self._take(p, lease, now)
                except LeaseLost as exc:
                    self._drop(p, str(exc))

    def _take(self, p: int, lease: Lease, now: float) -> None:
        ctx, plan = self.ctx, self._plan
        assert plan is not None  # start() planned first
        state = read_state(ctx, p)
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
        entries = recovery.pending_entries(ctx, p) + recovery.reclaim_entries(ctx, p)
        latest = recovery.latest_round(ctx)
        round_state, announced = recovery.rebuild_round(ctx, state, entries, latest=latest, now=now)
        rt = load_fragment(ctx, lease, state, round_state=round_state)
        rt.announced = announced
        self.fragments[p] = rt
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
        self._admit(rt, entries)
        if ctx.sync.schedule == "learner" and not rt.announced:
            rt.announce(ctx, rt.round.round_id, now, "learner-paced: one round open per fragment")

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
        )

    def _open_due(self, now: float) -> None:
        opening = self._next_opening(now)
        if not opening.open_now:
            return
        self._pace = (opening.round_id, now)
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

    def _decide_all(self, now: float) -> None:
        self._each(lambda rt: self._decide(rt, now))

    def _decide(self, rt: FragmentRuntime, now: float) -> None:
        if not rt.announced:
            return
        ctx = self.ctx
        estimates = rt.state.estimates(self._learners.step)
        d = decide(
            now,
            rt.round.view(),
            self._learners.live,
            params=ctx.policy,
            estimates=estimates,
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
                merge_round(ctx, rt, d, now)
            except RoundFailed as failed:  # bad data: refuse it, the round goes on without it
                self._refuse(rt, failed)
                return
            self.rounds_merged += 1
        else:
            abandon_round(ctx, rt, d, now)
        if ctx.sync.schedule == "learner":
            next_id = rt.round.round_id + (ctx.sync.n_fragments if d.kind == "abandon" else 0)
            rt.announce(ctx, next_id, now, "learner-paced: next round of the fragment")

    def _refuse(self, rt: FragmentRuntime, failed: RoundFailed) -> None:
        """Dead-letter the contributions that made a merge non-finite; the round is decided
        again without them (its next decision may merge the rest, or abandon)."""
        for h, _ in failed.culprits:
            rt.held.pop(h.msg.learner_id, None)
        rt.round = rt.round.without(frozenset(h.msg.learner_id for h, _ in failed.culprits))
        self.ctx.buffers.give([h.delta for h, _ in failed.culprits])
        rt.decision = None
        log.error("round.refused fragment %d round %d: %s", rt.fragment_id, rt.round.round_id,
                  failed)  # fmt: skip
        dead_letter(self.ctx, rt, [(h.entry, reason) for h, reason in failed.culprits])

    # ── contributions ─────────────────────────────────────────────────────────────────────
    def _read(self, block_ms: int, wait_s: float) -> list[Entry]:
        ctx = self.ctx
        block = int(min(block_ms, max(0.0, wait_s) * 1000)) if block_ms > 0 else 0
        streams = [ctx.bus.keys.up(p) for p in sorted(self.fragments)]
        if not streams:
            return []  # standby: the caller waits until the next wake-up
        return ctx.bus.read_group(
            streams, SYNC_GROUP, ctx.owner, count=READ_COUNT, block_ms=block or None
        )

    def _queue(self, entries: Sequence[Entry]) -> None:
        """Queue entries read from the group for admission, and for reading ahead."""
        self._incoming.extend(entries)
        by_stream = {self.ctx.bus.keys.up(p): rt for p, rt in self.fragments.items()}
        for stream in dict.fromkeys(e.stream for e in entries):
            if (rt := by_stream.get(stream)) is not None:
                todo = to_read(rt, (e for e in entries if e.stream == stream))
                self._prefetch.submit(todo, fragment=rt.fragment)

    def _intake(self) -> None:
        """Admit the queued entries, stream by stream, deciding each fragment as soon as its
        entries are in. With a fetch thread, the entries that arrived meanwhile are read from
        the group (without blocking) before the last merge, so they are fetched and decoded
        during it; they are admitted by the next ``pump``."""
        clock, by_stream = (
            self.ctx.clock,
            {self.ctx.bus.keys.up(p): rt for p, rt in self.fragments.items()},
        )
        batch, self._incoming = self._incoming, deque()
        try:
            while batch:
                stream, run = batch[0].stream, []
                while batch and batch[0].stream == stream:
                    run.append(batch.popleft())
                rt = by_stream.get(stream)
                if rt is None or self.fragments.get(rt.fragment_id) is not rt:
                    self._prefetch.discard(run)  # the lease was lost: the next owner reclaims
                    continue
                try:
                    self._admit(rt, run, clock.now())
                    if self.ctx.sync.schedule == "synchronizer":
                        self._open_due(clock.now())  # on time, also while merging
                    if self._prefetch.threaded and not batch and not self._incoming:
                        self._queue(self._read(0, 0.0))
                    self._decide(rt, clock.now())
                except LeaseLost as exc:
                    self._drop(rt.fragment_id, str(exc))
        finally:
            batch.extend(self._incoming)  # an error left some unadmitted: keep the order
            self._incoming = batch

    def _admit(
        self, rt: FragmentRuntime, entries: Sequence[Entry], now: float | None = None
    ) -> None:
        at = self.ctx.clock.now() if now is None else now
        prefetch = self._prefetch
        prefetch.submit(to_read(rt, entries), fragment=rt.fragment)
        try:
            read = functools.partial(prefetch.read, fragment=rt.fragment)
            rejected = admit_entries(self.ctx, rt, entries, at, read)
        finally:
            prefetch.discard(entries)  # those it did not read (seen before, or an error)
        dead_letter(self.ctx, rt, rejected)

    # ── timing and status ─────────────────────────────────────────────────────────────────
    def _wake(self, now: float) -> float:
        ttl = self.ctx.sync.lease_ttl_s
        times = [*self._timers.values(), self._learners.next_at]
        if self._incoming:
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
