"""The in-process runner: M learners and one synchronizer in one process, on a virtual clock.

The very classes the services run (``Learner``, ``Synchronizer``) run here on a ``MemoryBus``
and a ``FakeClock`` (design.md: never a second implementation); only time is simulated. A
discrete-event loop pops the earliest event from a heap (ties: kind, then slot, then order):

- ``STEP`` of slot m (its virtual step finished computing): ``learner.pump()`` (what arrived
  during the step), then ``learner.step()`` (AdamW step, snapshots, apply arrived globals),
  ``learner.pump()`` (publish), ``synchronizer.pump()``; the next step is due after a fresh
  step-time draw. In ``synchronous`` mode a step whose completion would leave a contribution
  unmerged for τ steps (``sync_wait_steps``) waits instead (``blocked``) until the fragment's
  new version has arrived: DiLoCo / Streaming DiLoCo behaviour, with its waiting time booked.
  Synchronous learners send fragments at learner-paced step offsets and K = M, so the quorum
  is a step barrier (lock-step); a restarted one resumes at the group's step count (in phase,
  as a lock-step job restores a worker) or every learner would wait on another forever.
- ``SYNC``: ``synchronizer.pump()`` at the wake-up time it asked for; after every synchronizer
  pump, blocked learners pump (heartbeat, receive) and those now free complete their step.
- ``FAIL`` / ``REJOIN``: a learner crashes (seeded Poisson process), is repaired after a random
  time, spends ``restart_s`` rejoining and restarts as a new ``Learner`` (``slot.py``): fresh
  model and AdamW state, newest globals, counters 0.
- ``EVAL``: the global model Θ (``synchronizer.theta``) is scored on the held-out split.

The run stops when the learners together trained ``token_budget`` tokens or at
``max_virtual_s``; the synchronizer then gets ``drain_s`` more virtual seconds to close the
rounds it holds contributions for, and Θ is evaluated a last time. The data-parallel baseline is
one learner slot of M chips with M× the batch whose fragments never come due (no merges): it is
plain AdamW training, scored on the learner's own parameters. Same seed, same result, bit for
bit: one thread, seeded draws, a virtual clock, and the synchronizer reads contributions inline
on a ``MemoryBus`` (no prefetch thread).

Timing model: a step's compute is the interval between two ``STEP`` events; merges, publishing
and transfers take no virtual time (ξ_sync = 0), and a global published during a learner's step
is applied at the end of that step (τ = 1: ``Learner.step`` trains, then applies).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from dd_queue.bus.memory import MemoryBus
from dd_queue.clock import FakeClock
from dd_queue.config import DDQConfig
from dd_queue.data import Dataset, ShardLoader, ShardSpec
from dd_queue.errors import ConfigError
from dd_queue.learner import StepReport
from dd_queue.runner.evaluate import EvalPoint, GlobalEvaluator
from dd_queue.runner.ledger import IntervalLog, goodput_of
from dd_queue.runner.result import RunResult, learner_rows, read_rounds, summarize_rounds
from dd_queue.runner.slot import LearnerSlot
from dd_queue.runner.spec import RunnerSpec
from dd_queue.runner.timing import EventKind, EventQueue, FailureClock, StepTimer
from dd_queue.synchronizer import Synchronizer

__all__ = ["Runner"]

log = logging.getLogger("dd_queue.runner")
_REPORTED_SYNC_FIELDS = (
    "n_fragments",
    "sync_every_steps",
    "schedule",
    "quorum",
    "quorum_policy",
    "grace_gamma",
    "grace_cap_s",
    "overlap_steps",
    "outer_lr",
    "outer_momentum",
    "merge_rule",
    "weighting",
    "anchor",
)
_MIN_WAKE_FRACTION = 1e-3  # a synchronizer wake-up at "now" is retried this share of a step later
_KEEP_EVERY_ROUND = 2**62  # rounds_maxlen of the in-process bus: the result reads every record


def _no_kill(why: str) -> None:
    """The synchronizer's ``kill`` effect in-process: a clear error, never a SIGKILL."""
    raise ConfigError(
        f"the synchronizer was asked to kill itself ({why}); the in-process runner arms no "
        "synchronizer faults: remove faults.schedule from the experiment's config"
    )


class Runner:
    """One simulated run (see the module docstring).

    Args:
        cfg: The variant's config, mode already applied (``RunnerSpec.derive``).
        spec: The runner settings.
        dataset: The examples (shared by every learner's shard loader and the evaluator).
        name: The variant's name (results).
        eval_batch_size: Examples per held-out batch (default: a learner's batch size).
        on_step: Called after every completed inner step with the slot and its report, before
            the learner pumps (tests and traces read the learner's parameters there).
    """

    def __init__(
        self,
        cfg: DDQConfig,
        spec: RunnerSpec,
        dataset: Dataset,
        *,
        name: str = "run",
        eval_batch_size: int | None = None,
        on_step: Callable[[LearnerSlot, StepReport], None] | None = None,
    ) -> None:
        # the result summarizes every round record: the in-process bus keeps them all
        keep = cfg.redis.model_copy(update={"rounds_maxlen": _KEEP_EVERY_ROUND})
        cfg = cfg.model_copy(update={"redis": keep})
        self.cfg, self.spec, self.name, self.on_step = cfg, spec, name, on_step
        self.dp = spec.mode == "data-parallel"
        self.clock = FakeClock(0.0)
        self.bus = MemoryBus(cfg.run.run_id, clock=self.clock)
        self.sync = Synchronizer(
            cfg, bus=self.bus, clock=self.clock, wall=self.clock.now, kill=_no_kill
        )
        batch = cfg.data.batch_size // spec.n_learners if self.dp else cfg.data.batch_size
        self.evaluator = GlobalEvaluator(
            cfg, dataset, batch_size=eval_batch_size or batch, n_batches=cfg.data.eval_batches
        )
        self.slots = self._build_slots(dataset)
        self.queue = EventQueue()
        self.tokens = 0
        self.stop_s: float | None = None
        self.evals: list[EvalPoint] = []
        self._min_wake_s = spec.step_time_s * _MIN_WAKE_FRACTION

    def _build_slots(self, dataset: Dataset) -> list[LearnerSlot]:
        cfg, spec, seed = self.cfg, self.spec, self.cfg.run.seed
        factors = spec.factors()
        n_slots = 1 if self.dp else spec.n_learners
        chips = spec.n_learners if self.dp else 1
        slots = []
        for i in range(n_slots):
            loader = ShardLoader(
                dataset,
                batch_size=cfg.data.batch_size,
                shard=ShardSpec(index=i, count=n_slots, seed=seed),
                eval_fraction=cfg.data.eval_fraction,
            )
            timer = StepTimer(
                seed,
                i,
                base_s=spec.step_time_s,
                factor=max(factors) if self.dp else factors[i],
                jitter=spec.jitter,
                chips=chips,
            )
            slots.append(
                LearnerSlot(
                    index=i,
                    loader=loader,
                    timer=timer,
                    failures=FailureClock(seed, i, spec.failures),
                    log=IntervalLog(f"L{i}", chips=chips),
                )
            )
        return slots

    # ── the loop ──────────────────────────────────────────────────────────────────────────
    def run(self) -> RunResult:
        """Simulate the whole run and return its result.

        Raises:
            ConfigError: A learner stopped training or the synchronizer was told to die (fault
                injection is not part of the simulation: failures come from ``runner.failures``).
        """
        started = time.perf_counter()
        self.sync.start()
        for slot in self.slots:
            self._start_slot(slot, 0.0)
        self._pump_sync(0.0)
        self.queue.schedule(0.0, EventKind.EVAL)
        handlers: dict[EventKind, Callable[[int, float], None]] = {
            EventKind.STEP: self._on_step,
            EventKind.SYNC: lambda _slot, now: self._pump_sync(now),
            EventKind.FAIL: self._on_fail,
            EventKind.REJOIN: self._on_rejoin,
            EventKind.EVAL: self._on_eval,
        }
        while self.stop_s is None and (event := self.queue.pop()) is not None:
            at_s, kind, index = event
            limit = self.spec.max_virtual_s
            if limit is not None and at_s > limit:
                self._advance(limit)
                self._stop(limit)
                break
            self._advance(at_s)
            handlers[kind](index, at_s)
        if self.stop_s is None:  # nothing left to happen (unreachable with a live synchronizer)
            self._stop(self.clock.now())
        self._drain()
        return self._result(time.perf_counter() - started)

    def _advance(self, at_s: float) -> None:
        self.clock.advance(max(0.0, at_s - self.clock.now()))

    def _start_slot(self, slot: LearnerSlot, now: float, *, rejoin: bool = False) -> None:
        phase = self._group_phase(slot) if rejoin and self.spec.mode == "synchronous" else None
        done_s = slot.start(self.cfg, bus=self.bus, clock=self.clock, now=now, step_count=phase)
        self.queue.schedule(done_s, EventKind.STEP, slot.index)
        failure_s = slot.failures.next_failure_s(now)
        if failure_s is not None:
            self.queue.schedule(failure_s, EventKind.FAIL, slot.index)

    def _group_phase(self, joining: LearnerSlot) -> int:
        """The step count a rejoining synchronous learner resumes at, so that it is in phase
        with the lock-step group (learner-paced offsets): its next step is the one at which the
        others sent their oldest contribution still waiting (for the failed learner's part),
        else the others' step; alone, its own count when it failed."""
        others = [s for s in self.slots if s is not joining and s.learner is not None]
        waiting = [step for s in others if (step := s.oldest_outstanding_step()) is not None]
        if waiting:
            return min(waiting) - 1
        if others:
            return min(s.learner.step_count for s in others if s.learner is not None)
        return joining.last_step_count

    # ── handlers ──────────────────────────────────────────────────────────────────────────
    def _on_step(self, index: int, now: float) -> None:
        slot = self.slots[index]
        learner = slot.learner
        assert learner is not None  # STEP events are cancelled when a learner fails
        learner.pump()
        if self.spec.mode == "synchronous" and not slot.may_complete(self.spec.sync_wait_steps):
            if slot.state != "blocked":
                slot.block(now)
            return
        report = learner.step()
        if report.action != "trained":
            raise ConfigError(
                f"learner {slot.learner_id} did not train ({report.action}); the runner arms "
                "no learner faults and sets no learner.max_steps"
            )
        slot.completed(report, now)
        if self.on_step is not None:
            self.on_step(slot, report)
        learner.pump()
        self.tokens += report.n_tokens
        if self.spec.token_budget is not None and self.tokens >= self.spec.token_budget:
            self._stop(now)
            return
        self.queue.schedule(slot.begin_step(now), EventKind.STEP, index)
        self._pump_sync(now)

    def _pump_sync(self, now: float) -> None:
        wake = self.sync.pump(block_ms=0)
        for slot in self.slots:
            if slot.state != "blocked" or slot.learner is None:
                continue
            slot.learner.pump()  # heartbeat, and the versions it waits for
            if slot.may_complete(self.spec.sync_wait_steps):
                self.queue.schedule(now, EventKind.STEP, slot.index)
        if wake is not None:
            self.queue.schedule(max(wake, now + self._min_wake_s), EventKind.SYNC)

    def _on_fail(self, index: int, now: float) -> None:
        slot = self.slots[index]
        slot.fail(now)
        self.queue.cancel(EventKind.STEP, index)
        repair_s = slot.failures.repair_s()
        log.info("runner.fail %s at %.1f s; repaired in %.1f s", slot.learner_id, now, repair_s)
        self.queue.schedule(now + repair_s, EventKind.REJOIN, index)

    def _on_rejoin(self, index: int, now: float) -> None:
        slot = self.slots[index]
        if slot.state == "down":
            slot.repaired(now)
            restart_s = self.spec.failures.restart_s if self.spec.failures else 0.0
            self.queue.schedule(now + restart_s, EventKind.REJOIN, index)
            return
        slot.rejoined(now)
        self._start_slot(slot, now, rejoin=True)
        self._pump_sync(now)

    def _on_eval(self, _index: int, now: float) -> None:
        self.evals.append(self._evaluate(now))
        self.queue.schedule(now + self.spec.eval_every_s, EventKind.EVAL)

    # ── stopping ──────────────────────────────────────────────────────────────────────────
    def _stop(self, now: float) -> None:
        self.stop_s = now
        for slot in self.slots:
            slot.close(now)

    def _drain(self) -> None:
        """Let the synchronizer close its rounds for ``drain_s`` virtual seconds, no steps."""
        assert self.stop_s is not None
        if self.dp:
            return  # nothing to merge
        default = self.cfg.synchronizer.sync_every_steps * self.spec.step_time_s
        until = self.stop_s + (self.spec.drain_s if self.spec.drain_s is not None else default)
        now = self.stop_s
        while now < until:
            wake = self.sync.pump(block_ms=0)
            step = max((wake if wake is not None else until) - now, self._min_wake_s)
            now = min(until, now + step)
            self._advance(now)
        self.sync.pump(block_ms=0)

    def _evaluate(self, now: float) -> EvalPoint:
        if self.dp:
            learner = self.slots[0].learner
            assert learner is not None  # the data-parallel baseline never fails
            fragment: Callable[[int], np.ndarray] = learner.params.read
            versions = learner.versions
        else:
            fragment, versions = self.sync.theta, self.sync.versions()
        loss, accuracy = self.evaluator.score(fragment)
        loss_sum = sum(s.loss_sum for s in self.slots)
        loss_n = sum(s.loss_n for s in self.slots)
        for slot in self.slots:
            slot.loss_sum, slot.loss_n = 0.0, 0
        return EvalPoint(
            virtual_s=now,
            tokens=self.tokens,
            loss=loss,
            accuracy=accuracy,
            versions=versions,
            train_loss=loss_sum / loss_n if loss_n else None,
        )

    def _result(self, elapsed_s: float) -> RunResult:
        assert self.stop_s is not None
        final = self._evaluate(self.clock.now())
        limits = self.cfg.wire.message_limits()
        records = read_rounds(self.bus, self.cfg.synchronizer.n_fragments, limits=limits)
        summary, rows = summarize_rounds(records)
        sync = self.cfg.synchronizer
        settings = {
            "runner": self.spec.model_dump(mode="json"),
            "synchronizer": {k: getattr(sync, k) for k in _REPORTED_SYNC_FIELDS},
            "codec": self.cfg.wire.codec,
            "batch_size": self.cfg.data.batch_size,
            "seq_len": self.cfg.model.architecture().seq_len,
        }
        return RunResult(
            name=self.name,
            mode=self.spec.mode,
            n_learners=self.spec.n_learners,
            tokens=self.tokens,
            stop_s=self.stop_s,
            end_s=self.clock.now(),
            final=final,
            evals=(*self.evals, final),
            goodput=goodput_of([s.log for s in self.slots], (0.0, self.stop_s)),
            rounds=summary,
            round_rows=rows,
            learners=learner_rows(self.slots),
            settings=settings,
            elapsed_s=elapsed_s,
        )
