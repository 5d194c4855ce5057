"""The learner process: build, join, train on the main thread, pump on two background threads.

    ddq learner --config config/demo.yaml --learner-id L0
    python -m dd_queue.services.learner --config config/demo.yaml --learner-id L0
    torchrun --nproc-per-node 2 -m dd_queue.services.learner --config demo --learner-id L0

At start rank 0 waits for Redis (``dd_queue.startup``, ``run.start_timeout_s``), then for the
synchronizer's global model (``learner.join_timeout_s``), logging what it waits for; a
learner id still held by a dead process of this host (a restart) is taken over at once.

Threads: the main thread only steps (it never waits on the network); one thread runs
``pump_receive`` (it blocks on round openings, up to ``learner.receive_block_ms``), one runs
``pump_send`` (it blocks on the outbox), so a snapshot is published the moment it is taken.
An unexpected error on a pump thread is fatal (logged; exit code 1).

Shutdown in two stages: the first SIGTERM/SIGINT finishes the current step, flushes waiting
contributions (``learner.leave_timeout_s``), saves the local checkpoint and removes the
heartbeat; a second one exits at once. A ``kill`` fault exits at once with code 137.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType

from dd_queue.bus import RedisBus
from dd_queue.clock import SystemClock
from dd_queue.config import DDQConfig
from dd_queue.learner.build import build_learner, resolve_device
from dd_queue.learner.dist import group_from_env
from dd_queue.learner.learner import Learner, StepReport
from dd_queue.learner.pump import PumpReport
from dd_queue.learner.steplog import StepLog
from dd_queue.log import fields, setup_logging
from dd_queue.startup import wait_for
from dd_queue.tracking import NULL_TRACKER, Tracker, open_tracker

log = logging.getLogger("dd_queue.learner")

KILLED_EXIT_CODE = 137
_PROGRESS_EVERY_S = 10.0


class TwoStageStop:
    """First signal: stop after the step and leave cleanly. Second: exit at once."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signals = 0

    def install(self) -> TwoStageStop:
        """Handle SIGTERM and SIGINT (call from the main thread)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        if self.signals > 1:
            log.error("learner.exit_now second signal %d: exiting without flushing", signum)
            os._exit(128 + signum)
        log.warning(
            "learner.stopping signal %d: finishing the step, then leaving "
            "(send it again to exit at once)",
            signum,
        )
        self._event.set()

    @property
    def requested(self) -> bool:
        """Whether a first signal arrived."""
        return self._event.is_set()

    def is_set(self) -> bool:
        """The same as ``requested`` (a ``startup.Stop``)."""
        return self._event.is_set()

    def request(self) -> None:
        """Ask for the first stage without a signal (a learner run as a thread of another
        process, which cannot install signal handlers)."""
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep ``timeout`` seconds, waking early on a signal; True when one came."""
        return self._event.wait(timeout)


class PumpThreads:
    """The two background threads of a learner (rank 0 only)."""

    def __init__(
        self,
        learner: Learner,
        *,
        receive_block_ms: int,
        send_block_ms: int = 200,
        name: str = "ddq",
    ):
        self.learner = learner
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._loop,
                args=(learner.pump_receive, receive_block_ms),
                name=f"{name}-receive",
                daemon=True,
            ),
            threading.Thread(
                target=self._loop,
                args=(learner.pump_send, send_block_ms),
                name=f"{name}-send",
                daemon=True,
            ),
        ]

    def _loop(self, pump: Callable[..., PumpReport], block_ms: int) -> None:
        try:
            while not self._stop.is_set():
                pump(block_ms=block_ms)
        except Exception as exc:  # fatal: the training loop checks `error`
            log.exception("learner.pump_failed %s", threading.current_thread().name)
            self.error = exc

    def __enter__(self) -> PumpThreads:
        if self.learner.is_rank0:
            for thread in self._threads:
                thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.learner.outbox.wake()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=30.0)


class TrainCurve:
    """The learner's points for the tracker: every ``every`` inner steps, the step's loss and
    learning rate, the tokens/s since the last point and the step-time EMA."""

    def __init__(self, learner: Learner, tracker: Tracker, *, every: int) -> None:
        self.learner, self.tracker, self.every = learner, tracker, every
        self._last: tuple[float, int] = (learner.clock.now(), learner.n_tokens)

    def after(self, report: StepReport) -> None:
        """Log a point when ``report`` trained the step that is due (reads the loss: a GPU
        sync, once every ``every`` steps)."""
        if report.loss_t is None or report.step % self.every:
            return
        now, tokens = self.learner.clock.now(), self.learner.n_tokens
        then, tokens_then = self._last
        self._last = (now, tokens)
        rate = (tokens - tokens_then) / (now - then) if now > then else None
        values = {
            "loss": report.loss,
            "lr": report.lr,
            "tokens_per_s": rate,
            "step_time_s": self.learner.step_time_ema_s,
            "tokens": tokens,
        }
        self.tracker.log("train", values, step=report.step)


def train(
    learner: Learner,
    stop: TwoStageStop,
    threads: PumpThreads,
    *,
    exit_on_kill: bool = True,
    tracker: Tracker = NULL_TRACKER,
    steps: StepLog | None = None,
) -> int:
    """Step until done, stopped or killed; returns the exit code.

    A ``kill`` fault exits the process at once (code 137); with ``exit_on_kill`` False (a
    learner thread inside another process) it returns ``KILLED_EXIT_CODE`` instead. Every
    ``tracking.every_steps`` steps a point goes to ``tracker``; every step a line goes to
    ``steps`` (``learner.step_log``).
    """
    next_note = learner.clock.now() + _PROGRESS_EVERY_S
    curve = (
        TrainCurve(learner, tracker, every=learner.cfg.tracking.every_steps)
        if tracker.enabled
        else None
    )
    while True:
        if threads.error is not None:
            return 1
        report = learner.step()
        if steps is not None and report.action == "trained":
            steps.step(
                report.step,
                tokens=learner.n_tokens,
                loss=report.loss if steps.wants_loss(report.step) else None,
                applied=report.applied,
                snapshots=report.snapshots,
            )
        if report.action == "killed":
            if steps is not None:
                steps.write("killed", step=report.step)
            if not exit_on_kill:
                log.error("learner.killed by a fault: %s stops at once", learner.learner_id)
                return KILLED_EXIT_CODE
            log.error("learner.killed by a fault: exiting at once")
            logging.shutdown()
            os._exit(KILLED_EXIT_CODE)
        if curve is not None:
            curve.after(report)
        if report.stop:
            return 0
        if stop.requested:
            learner.request_stop()
        if report.wait_s > 0:
            stop.wait(report.wait_s)
        if learner.clock.now() >= next_note and report.loss_t is not None:
            next_note = learner.clock.now() + _PROGRESS_EVERY_S
            log.info(
                "learner.progress step %d loss %.4f lr %.2e tokens %d versions %s",
                report.step,
                report.loss,
                report.lr,
                learner.n_tokens,
                learner.versions,
                extra=fields(learner=learner.learner_id),
            )


def run(cfg: DDQConfig, learner_id: str, *, environ: Mapping[str, str]) -> int:
    """Run one learner process (or one torchrun rank of it) to the end; returns the exit code."""
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    device = resolve_device(cfg.learner.device, local_rank=local_rank)
    group = group_from_env(environ, device=device)
    rank = f" rank {group.rank}" if group.world_size > 1 else ""
    setup_logging(f"learner {learner_id}{rank}", level=cfg.run.log_level, fmt=cfg.run.log_format)
    log.info(
        "learner.config digest %s run digest %s device %s",
        cfg.digest,
        cfg.run_digest,
        device,
        extra={"ddq": {"config": cfg.public_dict()}},
    )
    bus = (
        RedisBus(cfg.redis.url, cfg.run.run_id, options=cfg.redis.options())
        if group.rank == 0
        else None
    )
    stop = TwoStageStop().install()
    # rank 0 writes the curves; a missing tracking package stops the learner here, untrained
    tracker = open_tracker(cfg, f"learner-{learner_id}") if group.rank == 0 else NULL_TRACKER
    steps = (
        StepLog(cfg.learner.step_log, learner_id=learner_id, loss_every=cfg.tracking.every_steps)
        if cfg.learner.step_log and group.rank == 0
        else None
    )
    if steps is not None:
        steps.write("start", learner=learner_id)
    try:
        role = f"learner {learner_id}"
        if bus is not None and not wait_for(("redis",), cfg=cfg, bus=bus, role=role, stop=stop):
            return 0  # stopped while waiting for Redis
        learner = build_learner(
            cfg, learner_id, group=group, bus=bus, clock=SystemClock(), device=device
        )
        versions = learner.join(stop=stop)
        if versions is None:
            return 0  # stopped while waiting for the global model
        if steps is not None:
            steps.joined(learner.inner.step_count, versions)
        with PumpThreads(learner, receive_block_ms=cfg.learner.receive_block_ms) as threads:
            code = train(learner, stop, threads, tracker=tracker, steps=steps)
        learner.leave()
        if steps is not None:
            steps.write("left", step=learner.inner.step_count, code=code)
        return code
    finally:
        tracker.close()
        if steps is not None:
            steps.close()
        if bus is not None:
            bus.close()
        group.close()


__all__ = ["KILLED_EXIT_CODE", "PumpThreads", "TrainCurve", "TwoStageStop", "run", "train"]
