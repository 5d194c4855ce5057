"""One learner slot of an in-process run: the ``Learner`` in it, its state, its time ledger.

A slot keeps its learner id, data loader (the shard's position survives a restart: the data is
neither repeated nor skipped), step timer and failure clock. A failure drops the ``Learner``
object as a crash would (no flush, no leave: its heartbeat just ages out); after the repair and
``restart_s`` the slot builds a NEW ``Learner`` (fresh model and inner optimizer, counters 0),
which joins and loads the newest global fragments (../shared/algorithm.md).

States: ``training`` (a step is computing since ``started_s``), ``blocked`` (synchronous mode:
the step finished computing at ``done_s`` but may not complete before a fragment's new version
arrives), ``down`` and ``restarting``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from dd_queue.bus import Bus
from dd_queue.clock import Clock
from dd_queue.config import DDQConfig
from dd_queue.data import Batch
from dd_queue.learner import Learner, StepReport
from dd_queue.models.builder import build
from dd_queue.runner.ledger import IntervalLog
from dd_queue.runner.timing import FailureClock, StepTimer

__all__ = ["LearnerSlot", "SlotState"]

SlotState = Literal["training", "blocked", "down", "restarting"]


@dataclass
class _Outstanding:
    """A fragment contribution waiting for its merge (synchronous mode)."""

    step: int  # the learner's step count when the snapshot was taken
    version: int  # the newest version of the fragment the learner knew of then


@dataclass
class LearnerSlot:
    """One learner position of the run (see the module docstring).

    Attributes:
        index: Slot number (learner id ``L<index>``).
        loader: The shard's batches (kept across restarts).
        timer: Step durations.
        failures: Failure and repair draws.
        log: Time ledger.
        learner: The running ``Learner`` (None while down or restarting).
        state: See the module docstring.
        since_s: When the current state (or the computing step) began, virtual seconds.
        done_s: When a blocked step finished computing, virtual seconds.
        steps: Inner steps completed in this slot, over all restarts.
        tokens: Tokens trained in this slot.
        n_failures: Failures so far.
        last_step_count: The learner's inner-step count when it last failed.
        loss_sum: Sum of training losses since the last evaluation (the runner resets it).
        loss_n: Steps in ``loss_sum``.
    """

    index: int
    loader: Iterator[Batch]
    timer: StepTimer
    failures: FailureClock
    log: IntervalLog
    learner: Learner | None = None
    state: SlotState = "restarting"
    since_s: float = 0.0
    done_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    n_failures: int = 0
    loss_sum: float = 0.0
    loss_n: int = 0
    last_step_count: int = 0
    outstanding: dict[int, _Outstanding] = field(default_factory=dict)

    def oldest_outstanding_step(self) -> int | None:
        """Step of the oldest contribution not yet merged (synchronous mode), or None."""
        return min((held.step for held in self.outstanding.values()), default=None)

    @property
    def learner_id(self) -> str:
        """``L<index>``."""
        return f"L{self.index}"

    def start(
        self,
        cfg: DDQConfig,
        *,
        bus: Bus,
        clock: Clock,
        now: float,
        step_count: int | None = None,
    ) -> float:
        """Build a new ``Learner`` here, join the run and begin the first step at ``now``.

        Args:
            cfg: The run's config.
            bus: The run's bus.
            clock: The run's clock.
            now: Virtual time, seconds.
            step_count: Resume the inner-step count (and so the learning-rate schedule and the
                learner-paced fragment offsets) at this value, as a checkpoint restore does
                (``InnerLoop.load_state_dict``); the AdamW moments still start fresh.

        Returns:
            When the first step finishes computing, virtual seconds.
        """
        model = build(cfg.model.architecture(), seed=cfg.run.seed)
        self.learner = Learner(
            cfg,
            learner_id=self.learner_id,
            model=model,
            loader=self.loader,
            bus=bus,
            clock=clock,
            config_digest=cfg.run_digest,
        )
        self.learner.join()
        if step_count is not None:
            inner = self.learner.inner
            inner.load_state_dict(
                {"optimizer": inner.optimizer.state_dict(), "step_count": step_count}
            )
        self.outstanding.clear()
        return self.begin_step(now)

    def begin_step(self, now: float) -> float:
        """Start computing a step at ``now``; returns when it finishes computing."""
        self.state, self.since_s = "training", now
        return now + self.timer.next_s()

    def completed(self, report: StepReport, now: float) -> None:
        """Book a completed step: its training time, any wait, tokens, loss, snapshots."""
        if self.state == "blocked":
            self.log.add("training", self.since_s, self.done_s)
            self.log.add("waiting", self.done_s, now)
        else:
            self.log.add("training", self.since_s, now)
        self.state, self.since_s = "training", now
        self.steps += 1
        self.tokens += report.n_tokens
        if report.loss_t is not None:
            self.loss_sum += float(report.loss_t)
            self.loss_n += 1
        assert self.learner is not None  # a step completed, so a learner runs here
        for p, version in report.applied:
            held = self.outstanding.get(p)
            if held is not None and version > held.version:
                del self.outstanding[p]
        for p, _round in report.snapshots:
            known = self.learner.inbox.known_version(p)
            self.outstanding[p] = _Outstanding(step=report.step, version=known)

    def may_complete(self, wait_steps: int) -> bool:
        """Synchronous mode: may the step that is due complete now?

        The step completing now is number ``step_count + 1``; a contribution snapshotted at
        step s must be merged (its fragment's newer version received) before step s + τ
        completes, where τ = ``wait_steps``: the learner applies it at the end of that step.
        """
        learner = self.learner
        assert learner is not None  # only running slots are asked
        completing = learner.step_count + 1
        for p, held in self.outstanding.items():
            if (
                completing >= held.step + wait_steps
                and learner.inbox.known_version(p) <= held.version
            ):
                return False
        return True

    def block(self, now: float) -> None:
        """The due step has computed but must wait (synchronous mode)."""
        self.state, self.done_s = "blocked", now

    def fail(self, now: float) -> None:
        """Crash at ``now``: the partial (or blocked) step is lost, the learner is gone."""
        assert self.learner is not None  # only a running learner fails
        self.last_step_count = self.learner.step_count
        if self.state == "training":
            self.log.add("restarting", self.since_s, now)  # work thrown away
        elif self.state == "blocked":
            self.log.add("restarting", self.since_s, self.done_s)
            self.log.add("waiting", self.done_s, now)
        self.learner = None
        self.n_failures += 1
        self.state, self.since_s = "down", now

    def repaired(self, now: float) -> None:
        """The repair is done at ``now``: rejoining begins."""
        self.log.add("down", self.since_s, now)
        self.state, self.since_s = "restarting", now

    def rejoined(self, now: float) -> None:
        """Rejoining took from the repair until ``now``."""
        self.log.add("restarting", self.since_s, now)

    def close(self, now: float) -> None:
        """End of the run at ``now``: book the state in progress (a computing step counts as
        training: it would complete)."""
        if self.state == "training":
            self.log.add("training", self.since_s, now)
        elif self.state == "blocked":
            self.log.add("training", self.since_s, self.done_s)
            self.log.add("waiting", self.done_s, now)
        else:
            self.log.add(self.state if self.state == "down" else "restarting", self.since_s, now)
        self.since_s = now
