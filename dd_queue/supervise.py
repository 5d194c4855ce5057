"""``ddq supervise``: run one service, start it again when it dies, pass signals through.

    python -m dd_queue.supervise --name learner0 -- python -m dd_queue.services.learner --config ...
    ddq supervise --name learner0 -- ddq learner --config ... --learner-id L0      (the same)

Why: honcho (like foreman) ends the whole formation as soon as one process exits, so a
learner killed by a ``kill`` fault would take the run down with it. Every line of the
project's ``Procfile`` runs its service under this wrapper instead:

- **Restarts** follow ``core.restarts``: exit 0 (the service finished) ends the wrapper with
  0; exit 2 (a misconfiguration) ends it with 2, since a restart would fail the same way; any
  other exit (3: a dependency stayed away, 137: a ``kill`` fault, a crash, a signal from
  outside) starts the service again after 1 s, doubling with every quick failure up to 30 s,
  back to 1 s once a run lasted 60 s. Each decision and its reason is logged on stderr.
- **Signals** SIGTERM, SIGINT and SIGHUP are forwarded to the service, and no restart follows:
  the first lets a service stop cleanly (a learner finishes its step and flushes), a second
  one makes it exit at once, exactly as when it runs alone. The wrapper then exits 0 when the
  service stopped (exit 0, or ended by the forwarded signal), else with the service's code.
- **A stop delay** (``--stop-delay-s``, the Procfile's Redis line: 3 s) holds the first signal
  back that long (less if the service exits), so that the services, told to stop at the same
  moment, can still flush to Redis and release their leases before it goes.
- **No orphans.** The service runs in its own session, so a signal to the wrapper's process
  group (honcho signals whole groups) reaches it only once, through the wrapper; on Linux it
  is also killed if the wrapper is (``PR_SET_PDEATHSIG``), e.g. by honcho's final SIGKILL.

It imports nothing heavy (no torch, no config) and adds about 30 ms to a start.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from dd_queue.core.restarts import RestartPolicy, decide_restart, describe_exit
from dd_queue.errors import CoreError
from dd_queue.log import setup_logging

__all__ = ["Supervisor", "main", "register"]

log = logging.getLogger("dd_queue.supervise")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Supervisor:
    """Runs ``argv`` until it finishes, gives up or is told to stop (module docstring).

    Args:
        argv: The service's command line.
        policy: When to restart it.
        name: Who speaks in the log (default: the command's first word).
        stop_delay_s: Hold the first stop signal back this long before forwarding it.
        start: Starts the service (``subprocess.Popen``-like; tests pass their own).
    """

    def __init__(
        self,
        argv: Sequence[str],
        policy: RestartPolicy,
        *,
        name: str | None = None,
        stop_delay_s: float = 0.0,
        start: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen,
    ) -> None:
        if not argv:
            raise ValueError("supervise: no command given (put it after --)")
        self.argv, self.policy, self.start = list(argv), policy, start
        self.name = name or argv[0]
        self.child: subprocess.Popen[bytes] | None = None
        self.stop_signal: int | None = None
        self.stop_delay_s = stop_delay_s
        self.restarts = 0
        self._stopped = threading.Event()
        self._held: threading.Timer | None = None

    def install(self) -> Supervisor:
        """Handle the forwarded signals (call from the main thread)."""
        for sig in FORWARDED:
            signal.signal(sig, self.handle)
        return self

    def handle(self, signum: int, frame: FrameType | None = None) -> None:
        """A stop signal: remember it, forward it to the service, restart no more."""
        first = self.stop_signal is None
        self.stop_signal = signum
        self._stopped.set()
        if first and self.stop_delay_s > 0 and self.child is not None:
            log.info("supervise.holding signal %d for %g s", signum, self.stop_delay_s)
            self._held = threading.Timer(self.stop_delay_s, self._forward, args=(signum,))
            self._held.daemon = True
            self._held.start()
            return
        if self._held is not None:
            self._held.cancel()
        self._forward(signum)

    def _forward(self, signum: int) -> None:
        child = self.child
        if child is not None and child.poll() is None:
            log.info("supervise.forward signal %d to pid %d", signum, child.pid)
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    def run(self) -> int:
        """Supervise until done; returns the wrapper's exit code."""
        attempt = 0
        while True:
            started_s = time.monotonic()
            self.child = self.start(self.argv, start_new_session=True, preexec_fn=_die_with_parent)
            log.info("supervise.started pid %d: %s", self.child.pid, " ".join(self.argv))
            if self.stop_signal is not None:  # a signal between the start and now
                self._forward(self.stop_signal)
            code = self.child.wait()
            ran_s = time.monotonic() - started_s
            if self._held is not None:
                self._held.cancel()
            if self.stop_signal is not None:
                return self._stopped_code(code)
            decision = decide_restart(
                self.policy, exit_code=code, ran_s=ran_s, attempt_before=attempt
            )
            level = logging.WARNING if decision.restart else logging.ERROR
            level = logging.INFO if code == 0 else level
            log.log(level, "supervise.exit %s: %s", self.name, decision.reason)
            if not decision.restart:
                return code if code >= 0 else 128 - code
            attempt = decision.attempt
            if self._stopped.wait(decision.delay_s):
                log.info("supervise.stopped while waiting to restart %s", self.name)
                return 0
            self.restarts += 1

    def _stopped_code(self, code: int) -> int:
        sig = self.stop_signal or 0
        if code in (0, -sig, 128 + sig):
            log.info("supervise.stopped %s: it %s", self.name, describe_exit(code))
            return 0
        log.warning("supervise.stopped %s: it %s", self.name, describe_exit(code))
        return code if code >= 0 else 128 - code


def _add_arguments(p: argparse.ArgumentParser) -> None:
    defaults = RestartPolicy()
    p.add_argument("--name", help="who speaks in the log (default: the command)")
    p.add_argument(
        "--backoff-s", type=float, default=defaults.backoff_s, help="first restart delay"
    )
    p.add_argument(
        "--max-backoff-s", type=float, default=defaults.max_backoff_s, help="longest delay"
    )
    p.add_argument(
        "--stable-after-s",
        type=float,
        default=defaults.stable_after_s,
        help="a run this long resets the backoff",
    )
    p.add_argument(
        "--stop-delay-s",
        type=float,
        default=0.0,
        help="hold the first stop signal back this long (default: %(default)s)",
    )
    p.add_argument(
        "--give-up-on",
        default=",".join(str(c) for c in sorted(defaults.give_up_codes)),
        help="exit codes that are passed on, not restarted (comma-separated; default %(default)s)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the service's command")


def _run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        sys.stderr.write("supervise: error: no command given; put it after --\n")
        return 2
    try:
        codes = frozenset(int(c) for c in args.give_up_on.split(",") if c.strip())
        policy = RestartPolicy(
            backoff_s=args.backoff_s,
            max_backoff_s=args.max_backoff_s,
            stable_after_s=args.stable_after_s,
            give_up_codes=codes,
        )
    except (ValueError, CoreError) as exc:
        sys.stderr.write(f"supervise: error: {exc}\n")
        return 2
    name = args.name or command[0]
    setup_logging(f"supervise {name}")
    try:
        supervisor = Supervisor(command, policy, name=name, stop_delay_s=args.stop_delay_s)
        return supervisor.install().run()
    except OSError as exc:
        log.error("supervise.cannot_start %s: %s", " ".join(command), exc)
        return 2


def register(sub: Any) -> None:
    """Add ``ddq supervise`` to the ``ddq`` subparsers."""
    p = sub.add_parser("supervise", help="run a service, restart it when it dies (Procfile)")
    _add_arguments(p)
    p.set_defaults(func=_run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dd_queue.supervise``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="supervise", description=__doc__.split("\n")[0])
    _add_arguments(parser)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
