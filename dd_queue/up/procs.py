"""Child processes of ``ddq up``: a private redis-server and the run's services.

Every child writes its output to ``<run dir>/<name>.log``. Stopping is two-stage: ``stop()``
sends SIGTERM to every child and waits; ``kill()`` sends SIGKILL to what is left.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import redis
from pydantic import SecretStr

from dd_queue.core.restarts import RestartPolicy, decide_restart
from dd_queue.errors import DDQError

__all__ = ["Child", "Children", "RedisServer", "free_port"]

log = logging.getLogger("dd_queue.up")
RESTART_POLICY = RestartPolicy()
"""When a crashed child starts again: the rule ``ddq supervise`` follows (``core.restarts``)."""
RESTART_BACKOFF_S = RESTART_POLICY.backoff_s
"""Seconds between a crashed child's first exit and its restart (the in-process mode's pause)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def redis_command(binary: str, port: int, directory: Path) -> list[str]:
    """The redis-server command line: loopback, AOF everysec, no eviction, files in a dir."""
    return [
        binary,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--dir", str(directory),
        "--logfile", str(directory / "redis.log"),
        "--maxmemory-policy", "noeviction",
        "--client-output-buffer-limit", "normal 256mb 128mb 60",
        "--daemonize", "no",
    ]  # fmt: skip


@dataclass
class Child:
    """One service process.

    Attributes:
        name: Short name (``synchronizer``, ``L0``, ...); its log is ``<name>.log``.
        argv: The command line.
        restart: Start it again when it exits with an error while the run goes on.
        proc: The running process (None before the first start).
        restarts: Times it was started again.
    """

    name: str
    argv: list[str]
    restart: bool = False
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    started_at_s: float = 0.0
    restart_at_s: float | None = None
    attempt: int = 0


class Children:
    """Starts, supervises and stops the run's processes.

    Args:
        run_dir: Where the logs go.
        env: Environment of every child.
        cwd: Working directory of every child.
    """

    def __init__(self, run_dir: Path, env: Mapping[str, str], cwd: Path) -> None:
        self.run_dir, self.env, self.cwd = run_dir, dict(env), cwd
        self.children: dict[str, Child] = {}

    def start(self, name: str, argv: Sequence[str], *, restart: bool = False) -> Child:
        """Start a child (output to ``<run dir>/<name>.log``)."""
        child = self.children.get(name) or Child(name, list(argv), restart)
        with (self.run_dir / f"{name}.log").open("ab") as out:  # the child keeps its own handle
            child.proc = subprocess.Popen(
                child.argv,
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches ddq up only; it stops the children
            )
        child.started_at_s = time.monotonic()
        self.children[name] = child
        log.debug("up.started %s pid %d: %s", name, child.proc.pid, " ".join(child.argv))
        return child

    def supervise(self, now_s: float | None = None) -> list[str]:
        """Restart children that exited and may be restarted; returns notes.

        ``core.restarts`` decides: exit 0 or 2 (finished, misconfigured) stays down, any other
        exit restarts after a backoff (1 s, doubling for quick failures in a row).
        """
        now_s = time.monotonic() if now_s is None else now_s
        notes = []
        for child in list(self.children.values()):
            code = child.proc.poll() if child.proc is not None else None
            if code is not None:
                child.exit_codes.append(code)
                child.proc = None
                decision = decide_restart(
                    RESTART_POLICY,
                    exit_code=code,
                    ran_s=max(0.0, now_s - child.started_at_s),
                    attempt_before=child.attempt,
                )
                restart = child.restart and decision.restart
                verb = f"will restart in {decision.delay_s:g} s" if restart else "stays down"
                notes.append(f"{child.name} exited with code {code}: {verb} (see its log)")
                log.info("up.exit %s: %s", child.name, decision.reason)
                child.restart, child.attempt = restart, decision.attempt
                child.restart_at_s = now_s + decision.delay_s if restart else None
            elif (
                child.proc is None
                and child.restart
                and child.restart_at_s is not None
                and now_s >= child.restart_at_s
            ):
                child.restarts += 1
                child.restart_at_s = None
                notes.append(f"{child.name} restarted")
                self.start(child.name, child.argv, restart=True)
        return notes

    def signal_all(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every running child."""
        for child in self.children.values():
            if child.proc is not None and child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> bool:
        """Wait until every child has exited, at most ``timeout_s``; True when all did."""
        deadline = time.monotonic() + timeout_s
        for child in self.children.values():
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self, timeout_s: float) -> bool:
        """SIGTERM every child and wait up to ``timeout_s``; True when all exited."""
        self.signal_all(signal.SIGTERM)
        return self.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL every child still running and reap it."""
        self.signal_all(signal.SIGKILL)
        self.wait(10.0)

    def restarts(self) -> int:
        """Restarts of all children together."""
        return sum(c.restarts for c in self.children.values())


class RedisServer:
    """A private redis-server with AOF in ``directory`` on a free loopback port.

    Args:
        binary: redis-server path.
        directory: Data and log directory (the run dir).
        port: Port, or 0 for a free one.
        password: Require this password (``requirepass``). It reaches the server on its
            standard input, never on its command line (which ``ps`` shows to every user) nor
            in a file.
    """

    def __init__(
        self, binary: str, directory: Path, port: int = 0, password: SecretStr | None = None
    ) -> None:
        self.binary, self.dir = binary, directory
        self.port = port or free_port()
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> RedisServer:
        """Start the server and poll PING until it answers (deadline ``timeout_s``).

        Raises:
            DDQError: It exited or did not answer in time (the message has its log tail).
        """
        argv = redis_command(self.binary, self.port, self.dir)
        secret = None if self.password is None else self.password.get_secret_value()
        if secret is not None:
            argv.insert(1, "-")  # the rest of the config from stdin
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL if secret is None else subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches ddq up, which stops Redis last
        )
        if secret is not None and self.proc.stdin is not None:
            quoted = secret.replace("\\", "\\\\").replace('"', '\\"')
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write(f'requirepass "{quoted}"\n'.encode())
            self.proc.stdin.close()
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, password=secret)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                with contextlib.suppress(redis.RedisError):
                    if probe.ping():
                        return self
                time.sleep(0.05)
        finally:
            probe.close()
        self.stop()
        raise DDQError(f"redis-server on port {self.port} did not start:\n{self.log_tail()}")

    def log_tail(self, lines: int = 10) -> str:
        """Last lines of the server log."""
        try:
            return "\n".join((self.dir / "redis.log").read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (Redis rewrites nothing, flushes the AOF and exits), then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def service_argv(module: str, config: Path, *extra: str) -> list[str]:
    """``python -m dd_queue.services.<module> --config <config> ...`` with this interpreter."""
    return [sys.executable, "-m", f"dd_queue.services.{module}", "--config", str(config), *extra]


def child_env(base: Mapping[str, str], overrides: Mapping[str, str]) -> dict[str, str]:
    """The children's environment: ``base`` + ``overrides``, one CPU thread per process."""
    env = {**base, **overrides}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
