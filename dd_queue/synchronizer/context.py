"""What every part of the synchronizer shares: the bus, the clocks, the settings, the fault hooks.

Built once by :class:`~dd_queue.synchronizer.Synchronizer` and passed to the helpers, so each
helper module is a few plain functions over (context, fragment runtime).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dd_queue.auth import SYNCHRONIZER, Auth, Refusals
from dd_queue.bus import Bus, ops
from dd_queue.clock import Clock
from dd_queue.config import DDQConfig, SynchronizerConfig
from dd_queue.core.membership import MembershipParams
from dd_queue.core.policy import PolicyParams
from dd_queue.errors import DDQError, ProtocolError
from dd_queue.faults import Effect, FaultInjector
from dd_queue.log import fields
from dd_queue.messages import Event, MessageLimits, Scalar
from dd_queue.synchronizer.buffers import BufferPool
from dd_queue.synchronizer.workers import ThreadWorkers, merge_threads, shared_workers
from dd_queue.tracking import NULL_TRACKER, Tracker

__all__ = ["Context", "hard_kill"]

log = logging.getLogger("dd_queue.synchronizer")


def hard_kill(point: str) -> None:
    """The ``kill`` fault of a real process: SIGKILL itself (nothing is flushed or released)."""
    log.warning("fault.kill at %s: exiting with SIGKILL", point)
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True, slots=True, kw_only=True)
class Context:
    """The synchronizer's dependencies and derived settings.

    Attributes:
        bus: The run's bus.
        clock: Monotonic seconds (``FakeClock`` in the in-process runner).
        wall: Wall-clock seconds since the epoch, for records and events.
        cfg: The whole resolved config.
        owner: This synchronizer's id: lease owner, consumer name and heartbeat member.
        injector: Faults armed against this synchronizer.
        kill: Effect of a ``kill`` fault at a named point (``hard_kill`` in a service).
        digest: The config's run digest (contributions must carry the same), derived once.
        limits: Decode limits of every message, derived once.
        policy: The quorum policy's knobs, derived once.
        membership: The liveness thresholds, derived once.
        max_tokens_per_step: A contribution's n_tokens ÷ n_steps above this is implausible.
        buffers: Fragment-sized float32 arrays for reuse (decoded contributions, Θ_p, ...).
        auth: The synchronizer's key and the run's keyring (``dd_queue.auth``): it signs
            global fragments and checks contributions, heartbeats and fault commands.
        refusals: Heartbeats and fault commands it refused, by kind and reason (reported as
            ``message.refused`` events; refused contributions are dead-lettered instead).
        tracker: Where each merged round's stats go (``dd_queue.tracking``; off by default).
        workers: The threads that share the merge and outer step (``merge_threads``, logged
            with its reason at start; None for one: the loop's own thread).
    """

    bus: Bus
    clock: Clock
    wall: Callable[[], float]
    cfg: DDQConfig
    owner: str
    injector: FaultInjector
    kill: Callable[[str], None]
    tracker: Tracker = NULL_TRACKER
    digest: str = field(init=False)
    limits: MessageLimits = field(init=False)
    policy: PolicyParams = field(init=False)
    membership: MembershipParams = field(init=False)
    max_tokens_per_step: int = field(init=False)
    buffers: BufferPool = field(init=False, default_factory=BufferPool)
    auth: Auth = field(init=False)
    refusals: Refusals = field(init=False, default_factory=Refusals)
    workers: ThreadWorkers | None = field(init=False)

    def __post_init__(self) -> None:
        # Derived once (hashing the tree per message is far too slow). The run digest covers
        # only what all processes must agree on; Redis URLs, devices and codecs may differ.
        object.__setattr__(self, "digest", self.cfg.run_digest)
        object.__setattr__(self, "limits", self.cfg.wire.message_limits())
        object.__setattr__(self, "policy", self.cfg.synchronizer.policy_params())
        object.__setattr__(self, "membership", self.cfg.membership.params())
        bound = self.cfg.synchronizer.max_tokens_per_step or (
            1024
            * self.cfg.data.batch_size
            * self.cfg.learner.grad_accum_steps
            * self.cfg.model.architecture().seq_len
        )
        object.__setattr__(self, "max_tokens_per_step", bound)
        sync = self.cfg.synchronizer
        width, why = merge_threads(sync.merge_threads, sync.fetch_processes)
        log.info("merge on %d thread(s) (%s)", width, why)
        object.__setattr__(self, "workers", shared_workers(width))
        object.__setattr__(
            self, "auth", Auth.load(self.cfg.auth, self.cfg.run.run_id, SYNCHRONIZER)
        )

    @property
    def sync(self) -> SynchronizerConfig:
        """The ``synchronizer`` section."""
        return self.cfg.synchronizer

    @property
    def run_id(self) -> str:
        return self.cfg.run.run_id

    @property
    def maxlen(self) -> int:
        """Approximate cap of every stream the synchronizer appends to but the round records."""
        return self.cfg.redis.stream_maxlen

    @property
    def rounds_maxlen(self) -> int:
        """Approximate cap of each fragment's round-record stream (its own: records are big)."""
        return self.cfg.redis.rounds_maxlen

    def wall_at(self, t: float) -> float:
        """Wall-clock time of monotonic time ``t`` (≥ 0, as records require)."""
        return max(0.0, self.wall() - (self.clock.now() - t))

    def emit(self, kind: str, message: str, **fields: Scalar) -> None:
        """Append an event to the run's event stream (after the commit it reports; best effort
        is not needed: a bus error here propagates like any other)."""
        event = Event(
            run_id=self.run_id, kind=kind, message=message, fields=fields, at_s=self.wall()
        )
        ops.emit_event(self.bus, event.to_fields(), maxlen=self.maxlen)

    def refused(self, kind: str, what: str, exc: DDQError) -> None:
        """Count a refused heartbeat or command (``what`` names it in the log); report the
        counts as ``message.refused`` events at most every few seconds."""
        reason = exc.reason if isinstance(exc, ProtocolError) else type(exc).__name__
        due = self.refusals.add(kind, reason, self.clock.now())
        level = logging.WARNING if due else logging.DEBUG  # a flood logs once an interval
        log.log(level, "message.refused %s %s: %s", kind, what, exc, extra=fields(reason=reason))
        self._report(due)

    def flush_refusals(self) -> None:
        """Report refusals still pending (on the synchronizer's regular loop)."""
        self._report(self.refusals.flush(self.clock.now()))

    def _report(self, due: Mapping[tuple[str, str], int]) -> None:
        ops.report_refused(self.bus, self.owner, due, at_s=self.wall(), maxlen=self.maxlen)

    def fault(self, point: str) -> Effect:
        """Apply the effect of the fault armed at ``point``: a kill calls ``kill``, a stall
        sleeps. Returns it (a caller acts on ``offline_until_s`` itself)."""
        effect = self.injector.effect(point)
        if not effect:
            return effect
        log.warning("fault.fired %s at %s", effect.kind, point, extra=fields(fault=effect.fault_id))
        if effect.kill:
            self.kill(point)
        if effect.stall_s is not None:
            self.clock.sleep(effect.stall_s)
        return effect
