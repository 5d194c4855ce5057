"""A private ``redis-server`` for tests and benchmarks: free loopback port, own data dir.

Never touches a shared server: it starts its own process on ``127.0.0.1:<free port>`` with no
persistence by default (AOF when asked), ``maxmemory-policy noeviction`` (eviction would drop
payloads silently) and its files under a temporary directory. ``kill()`` (SIGKILL) and
``restart()`` on the same port let tests exercise server crashes.

    with RedisProcess() as server:
        client = redis.Redis.from_url(server.url)
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

REDIS_SERVER = "redis-server"


@dataclass(frozen=True)
class Pki:
    """PEM files of a throwaway CA, a server certificate for 127.0.0.1 and a client's."""

    ca_file: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def make(cls, directory: Path, hosts: tuple[str, ...] = ()) -> Pki:
        """A new CA and two certificates under ``directory`` (``trustme``; no network); the
        server's is for 127.0.0.1, localhost and ``hosts``."""
        import trustme  # test-only dependency

        directory.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA(organization_name="dd_queue tests")
        server = ca.issue_cert("127.0.0.1", "localhost", *hosts)
        client = ca.issue_cert("ddq-client")
        pki = cls(*(directory / n for n in ("ca.pem", "server.pem", "server.key", "client.pem",
                                            "client.key")))  # fmt: skip
        ca.cert_pem.write_to_path(str(pki.ca_file))
        server.cert_chain_pems[0].write_to_path(str(pki.server_cert))
        server.private_key_pem.write_to_path(str(pki.server_key))
        client.cert_chain_pems[0].write_to_path(str(pki.client_cert))
        client.private_key_pem.write_to_path(str(pki.client_key))
        return pki

    def client_kwargs(self) -> dict[str, str]:
        """redis-py arguments of a client that verifies the server and shows its certificate."""
        return {
            "ssl_ca_certs": str(self.ca_file),
            "ssl_certfile": str(self.client_cert),
            "ssl_keyfile": str(self.client_key),
        }


def redis_server_path() -> str | None:
    """Path of the ``redis-server`` binary, or None when it is not installed."""
    return shutil.which(REDIS_SERVER)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisProcess:
    """One private redis-server process.

    Args:
        port: Port to listen on (default: a free one, kept across restarts).
        appendonly: Enable AOF persistence (``appendfsync everysec``).
        extra_args: More ``--name value`` arguments for redis-server.
        start_timeout_s: How long to wait for PING after starting.
        binary: The server binary (default: ``redis-server`` on PATH; e.g. a valkey-server).
        tls: Serve TLS only (no plain-TCP port), with these certificates; clients must show a
            certificate of the same CA (``tls-auth-clients yes``). The URL is ``rediss://``.
        login: ``(user, password)`` this object's own clients log in with (a server whose
            default user is off, e.g. started with an ``--aclfile``).
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        appendonly: bool = False,
        extra_args: tuple[str, ...] = (),
        start_timeout_s: float = 10.0,
        binary: str | None = None,
        tls: Pki | None = None,
        login: tuple[str, str] | None = None,
    ) -> None:
        binary = binary or redis_server_path()
        if binary is None:
            raise FileNotFoundError(
                f"{REDIS_SERVER} is not installed (apt-get install redis-server)"
            )
        self.binary = binary
        self.port = port or free_port()
        self._pick_port = port is None  # until the first start succeeds
        self.host = "127.0.0.1"
        self.appendonly = appendonly
        self.extra_args = extra_args
        self.tls = tls
        self.login = login
        self.start_timeout_s = start_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="ddq-redis-")
        self.dir = Path(self._tmp.name)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0`` (``rediss://`` with TLS)."""
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The running server's process id (None when stopped)."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    def _command(self) -> list[str]:
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "everysec"]
            if self.appendonly
            else ["--appendonly", "no"]
        )
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            ports = [
                "--port", "0",
                "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls.server_cert),
                "--tls-key-file", str(self.tls.server_key),
                "--tls-ca-cert-file", str(self.tls.ca_file),
                "--tls-auth-clients", "yes",
            ]  # fmt: skip
        return [
            self.binary,
            *ports,
            "--bind", self.host,
            "--save", "",
            *persistence,
            "--dir", str(self.dir),
            "--logfile", str(self.log_path),
            "--maxmemory-policy", "noeviction",
            "--daemonize", "no",
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> RedisProcess:
        """Start the server and wait (polling PING, with a deadline) until it answers.

        A port picked automatically can be taken between picking and binding; the first start
        then retries on other ports. Restarts always reuse the port.
        """
        if self._proc is not None:
            raise RuntimeError("redis-server is already running")
        for attempt in range(3):
            self._proc = subprocess.Popen(
                self._command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                self._wait_ready()
                break
            except RuntimeError:
                if not self._pick_port or attempt == 2:
                    raise
                self.port = free_port()
        self._pick_port = False
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        probe = self.client(socket_timeout=0.5)
        try:
            while True:
                if self._proc is not None and self._proc.poll() is not None:
                    self._proc = None
                    raise RuntimeError(f"redis-server exited at start:\n{self.log_tail()}")
                try:
                    if probe.ping():
                        return
                except redis.exceptions.BusyLoadingError:
                    pass  # AOF still loading: ready soon
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise TimeoutError(
                        f"redis-server on port {self.port} did not answer PING within "
                        f"{self.start_timeout_s} s:\n{self.log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            probe.close()

    def log_tail(self, lines: int = 20) -> str:
        """Last lines of the server log (for failure messages)."""
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful stop (SIGTERM: Redis flushes AOF and exits)."""
        self._end(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """Crash stop (SIGKILL): nothing is flushed."""
        self._end(signal.SIGKILL, 10.0)

    def _end(self, sig: signal.Signals, timeout_s: float) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self, *, graceful: bool = False) -> None:
        """Stop (SIGKILL, or SIGTERM when ``graceful``) and start again on the same port."""
        if graceful:
            self.stop()
        else:
            self.kill()
        self.start()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain redis-py client for this server (caller closes it); over TLS, with the
        client certificate."""
        if self.tls is not None:
            kwargs = {"ssl": True, **self.tls.client_kwargs(), **kwargs}
        if self.login is not None:
            kwargs = {"username": self.login[0], "password": self.login[1], **kwargs}
        return redis.Redis(host=self.host, port=self.port, **kwargs)  # type: ignore[arg-type]

    def close(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        self._tmp.cleanup()

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
