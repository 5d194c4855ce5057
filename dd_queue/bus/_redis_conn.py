"""Connections of ``RedisBus``: options, one client per traffic class, bounded retries.

Why several clients: a blocking read holds its connection for up to ``max_block_ms``, and a
64 MB payload holds its connection for ~150 ms; neither may delay an ack or a heartbeat. Each
client has its own pool, so they never wait for each other's connections.

Why the retry lives here, not in redis-py: redis-py's own retry would re-send a command up to
N times with no wall-clock bound. The clients are built with no internal retry, and every bus
call goes through :meth:`Connections.call`, which retries connection errors and timeouts with
``Retry(ExponentialWithJitterBackoff)`` until ``unavailable_after_s`` has passed since the first
failure, then raises ``BusUnavailable``. A retried XADD may be applied twice (the first reply was
lost), and a retried ``XREADGROUP >`` may leave an entry pending unseen: consumers dedupe, and the
reclaim loop picks such entries up. The fenced commit is retried safely: its script leaves a
marker and replays the first result (see ``_scripts``).

On a Redis Cluster (``redis+cluster://host:port[,host:port…]``, ``rediss+cluster://`` for TLS)
each client is a redis-py ``RedisCluster``: it follows MOVED/ASK redirects and refreshes its slot
map after a connection error, and the same bounded retry also covers the replies of a cluster in
the middle of a failover (``CLUSTERDOWN``, ``TRYAGAIN``, a slot with no master yet).

Not retried: a full connection pool ("Too many connections": the server is fine, this process
uses more connections than ``max_connections``), and anything after :meth:`Connections.close`.
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import redis.exceptions as rexc
from pydantic import SecretStr
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import PythonRespSerializer
from redis.retry import Retry

from dd_queue.bus.types import DEFAULT_CHUNK_BYTES
from dd_queue.errors import (
    BusError,
    BusUnavailable,
    ConfigError,
    InvalidArgument,
    LeaseLost,
    NoGroup,
)

T = TypeVar("T")
log = logging.getLogger("dd_queue.bus")

_BLOCK_MARGIN_MS = 1000
_RETRYABLE = (
    redis.ConnectionError,
    redis.TimeoutError,
    builtins.TimeoutError,
    # a Redis Cluster between a master's failure and its replica's promotion:
    rexc.ClusterDownError,
    rexc.TryAgainError,
    rexc.SlotNotCoveredError,
    rexc.RedisClusterUnreachableError,
)
Client = redis.Redis | RedisCluster
"""A client of one server, or of a Redis Cluster (the same commands; keys route by slot)."""

_REFRESH_EVERY_S = 0.5
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


@dataclass(frozen=True, slots=True)
class ClusterSeeds:
    """What a ``redis+cluster://`` URL names: seed nodes (any one suffices), the user name and
    whether the nodes speak TLS."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None
    tls: bool


def cluster_seeds(url: str) -> ClusterSeeds | None:
    """The seeds of a cluster URL (``redis+cluster://[user@]host:port[,host:port…][/0]``), or
    None for a URL of one server.

    Raises:
        ConfigError: A malformed cluster URL, or one naming a database other than 0 (a
            cluster has only database 0).
    """
    parts = urlsplit(url)
    if parts.scheme not in _CLUSTER_SCHEMES:
        return None
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for spec in hosts.split(","):
        host, sep, port = spec.strip().rpartition(":")
        if not (sep and host and port.isdecimal() and 0 < int(port) < 65536):
            raise ConfigError(
                f"redis URL {redact_url(url)}: seed {spec!r} is not host:port; write "
                "redis+cluster://host:port[,host:port...]"
            )
        nodes.append((host.strip("[]"), int(port)))
    if parts.path not in ("", "/", "/0") or parts.query:
        raise ConfigError(
            f"redis URL {redact_url(url)}: a Redis Cluster has only database 0 and takes no "
            "options in the URL; drop the path and the query"
        )
    username = unquote(userinfo.partition(":")[0]) or None if userinfo else None
    return ClusterSeeds(tuple(nodes), username, _CLUSTER_SCHEMES[parts.scheme] == "rediss")


def is_cluster_url(url: str) -> bool:
    """``url`` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return urlsplit(url).scheme in _CLUSTER_SCHEMES


def seed_url(url: str) -> str:
    """A ``redis://`` (``rediss://``) URL of the first seed of a cluster URL, with its user name:
    what a plain client pings to see whether the cluster is up. Other URLs come back as they are.
    """
    seeds = cluster_seeds(url)
    if seeds is None:
        return url
    host, port = seeds.nodes[0]
    user = f"{seeds.username}@" if seeds.username else ""
    return f"{'rediss' if seeds.tls else 'redis'}://{user}{host}:{port}/0"


class BusAddress(NamedTuple):
    """How another process reaches the same Redis: its URL and the client options."""

    url: str
    options: RedisOptions


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """Timeouts, retry bound and sizes of a ``RedisBus``.

    Attributes:
        socket_timeout_s: Read timeout of control and reader connections; must exceed
            ``max_block_ms`` by at least 1 s, or a dead server looks like an empty read.
        connect_timeout_s: TCP connect timeout.
        blob_socket_timeout_s: Read timeout of payload transfers (a 64 MB GET takes ~0.15 s
            on loopback, much longer on slow links).
        heartbeat_socket_timeout_s: Read timeout of the heartbeat connection.
        max_block_ms: Longest single ``BLOCK`` sent to the server; longer waits are split.
        unavailable_after_s: Retry connection errors for this long after the first failure,
            then raise ``BusUnavailable``. The worst case adds one attempt: near zero for a
            server that refuses connections, up to a socket timeout for one that hangs.
        retry_base_s: First backoff step (jittered, doubling).
        retry_cap_s: Largest backoff step.
        blob_chunk_bytes: Largest Redis value a payload is split into.
        health_check_interval_s: PING connections idle this long before reuse (0: off).
        max_connections: Pool size of each client.
        password: Redis AUTH password (``AUTH <user> <password>`` with the URL's user name);
            a secret type, so it never shows in a repr, a log or an error.
        tls_ca_file: CA bundle that signed the server's certificate (``rediss://`` only;
            None: the system's CAs).
        tls_cert_file: Client certificate (PEM), for servers that check clients
            (``tls-auth-clients yes``); needs ``tls_key_file``.
        tls_key_file: The client certificate's private key (PEM). Only its path is held here:
            the key itself is read by the TLS library, never by dd_queue.
        tls_check_hostname: Check that the server's certificate names the URL's host.
        commit_replicas: A fenced commit counts as done only once this many replicas
            acknowledged it (``WAIT``, on the commit's own connection); 0: the master's reply.
        commit_wait_ms: Longest ``WAIT`` for them; short of it the commit raises
            ``NotReplicated``.
    """

    socket_timeout_s: float = 10.0
    connect_timeout_s: float = 2.0
    blob_socket_timeout_s: float = 60.0
    heartbeat_socket_timeout_s: float = 5.0
    max_block_ms: int = 2000
    unavailable_after_s: float = 30.0
    retry_base_s: float = 0.05
    retry_cap_s: float = 1.0
    blob_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    health_check_interval_s: float = 30.0
    max_connections: int = 64
    password: SecretStr | None = None
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_check_hostname: bool = True
    commit_replicas: int = 0
    commit_wait_ms: int = 1000

    @property
    def tls_given(self) -> bool:
        """Any TLS file is set."""
        return any(f is not None for f in (self.tls_ca_file, self.tls_cert_file, self.tls_key_file))

    def __post_init__(self) -> None:
        for name in ("socket_timeout_s", "connect_timeout_s", "blob_socket_timeout_s",
                     "heartbeat_socket_timeout_s", "unavailable_after_s", "retry_base_s",
                     "retry_cap_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ConfigError(f"redis {name} must be > 0, got {getattr(self, name)}")
        if self.commit_replicas < 0 or self.commit_wait_ms < 1:
            raise ConfigError("redis commit_replicas must be >= 0 and commit_wait_ms >= 1")
        if self.max_block_ms < 1 or self.blob_chunk_bytes < 1 or self.max_connections < 4:
            raise ConfigError(
                "redis max_block_ms and blob_chunk_bytes must be >= 1 and max_connections >= 4"
            )
        if self.socket_timeout_s * 1000 < self.max_block_ms + _BLOCK_MARGIN_MS:
            raise ConfigError(
                f"redis socket_timeout_s ({self.socket_timeout_s} s) must exceed max_block_ms "
                f"({self.max_block_ms} ms) by at least {_BLOCK_MARGIN_MS} ms; otherwise every "
                "blocking read times out on the socket and a dead server is noticed only late"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError(
                "redis tls_cert_file and tls_key_file go together (a client certificate and "
                "its key): set both or neither"
            )


def client_kwargs(url: str, options: RedisOptions) -> dict[str, object]:
    """The redis-py client arguments for ``url`` that carry credentials: the password, and for a
    ``rediss://`` URL the TLS files (the server's certificate is always verified).

    Raises:
        ConfigError: TLS files are set but ``url`` is not ``rediss://`` (they would be ignored
            and the password would cross the network in clear).
    """
    secret = None if options.password is None else options.password.get_secret_value()
    kwargs: dict[str, object] = {"password": secret}
    tls = urlsplit(url).scheme in ("rediss", "rediss+cluster")
    if options.tls_given and not tls:
        raise ConfigError(
            f"redis tls_* files are set but the URL {redact_url(url)} is not rediss://; "
            "use rediss://host:port/db (or rediss+cluster://host:port,...) for TLS"
        )
    if tls:
        kwargs.update(
            ssl_cert_reqs="required",
            ssl_ca_certs=_path(options.tls_ca_file),
            ssl_certfile=_path(options.tls_cert_file),
            ssl_keyfile=_path(options.tls_key_file),
            ssl_check_hostname=options.tls_check_hostname,
        )
    return kwargs


def _path(path: Path | None) -> str | None:
    return None if path is None else str(path)


def split_password(url: str) -> tuple[str, str | None]:
    """``(url without its password, the password)``; the user name stays in the URL.

    ``redis://alice:s3cret@host:6379/0`` gives ``("redis://alice@host:6379/0", "s3cret")``
    (percent-escapes decoded, as redis-py decodes them); a URL without one gives ``(url, None)``.
    """
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    netloc = f"{user}@{hostport}" if user else hostport
    stripped = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    return stripped, unquote(parts.password)


def redact_url(url: str) -> str:
    """``url`` without user name and password, for messages and logs."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    netloc = parts.netloc.rpartition("@")[2]  # host:port, or a cluster's host:port,host:port
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def bus_error(exc: redis.ResponseError, what: str) -> BusError:
    """Map a server error reply to the error tree (``DDQ_*`` come from our scripts)."""
    message = str(exc)
    if message.startswith("DDQ_LEASE_LOST"):
        return LeaseLost(
            f"{message.removeprefix('DDQ_LEASE_LOST ')}; stop acting for this lease, re-acquire"
        )
    if message.startswith("DDQ_"):
        return BusError(f"{what}: {message.partition(' ')[2]}")
    # fakeredis answers a group read on a missing key with XGROUP's "requires the key to
    # exist" instead of Redis's NOGROUP; both mean the group must be recreated.
    if message.startswith("NOGROUP") or "requires the key to exist" in message:
        return NoGroup(f"{what}: {message}")
    return BusError(f"Redis refused {what}: {message}")


def _client(
    url: str, socket_timeout_s: float, options: RedisOptions, name: str, **extra: object
) -> Client:
    common: dict[str, object] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": options.connect_timeout_s,
        "socket_keepalive": True,
        "retry": Retry(NoBackoff(), 0),  # Connections.call owns retrying (bounded in time)
        "health_check_interval": options.health_check_interval_s,
        "max_connections": options.max_connections,  # on a cluster: per node
        "client_name": f"ddq-{name}",
        **client_kwargs(url, options),
        **extra,
    }
    seeds = cluster_seeds(url)
    if seeds is None:
        return redis.Redis.from_url(url, **common)
    return _cluster_client(seeds, options, common)


def _cluster_client(
    seeds: ClusterSeeds, options: RedisOptions, common: dict[str, object]
) -> RedisCluster:
    """A ``RedisCluster`` (it reads the slot map at once): a cluster that is not reachable yet
    is retried for ``unavailable_after_s``, as every call is, then ``BusUnavailable``."""
    startup = [ClusterNode(host, port) for host, port in seeds.nodes]  # type: ignore[no-untyped-call]
    kwargs: dict[str, Any] = {**common, "username": seeds.username}
    if seeds.tls:
        kwargs["ssl"] = True
    deadline = time.monotonic() + options.unavailable_after_s
    delay = options.retry_base_s
    while True:
        try:
            return RedisCluster(startup_nodes=startup, **kwargs)
        except _RETRYABLE as exc:
            if time.monotonic() >= deadline:
                where = ",".join(f"{h}:{p}" for h, p in seeds.nodes)
                raise BusUnavailable(
                    f"Redis Cluster at {where} unreachable for {options.unavailable_after_s} s "
                    f"({exc}); check that its nodes run and the URL names at least one"
                ) from exc
            log.warning("bus.cluster.connecting %s", exc)
            time.sleep(delay)
            delay = min(options.retry_cap_s, delay * 2)


def pools(client: Client) -> list[redis.ConnectionPool]:
    """The connection pools behind ``client`` (one per node on a cluster)."""
    if isinstance(client, RedisCluster):
        return [
            n.redis_connection.connection_pool
            for n in client.get_nodes()  # type: ignore[no-untyped-call]
            if n.redis_connection
        ]
    return [client.connection_pool]


def _zero_copy_packer() -> PythonRespSerializer:
    # With hiredis installed, redis-py packs each command into one new bytes object: a copy of
    # every payload (~0.5-1 ms per MB here, half the cost of a SET). The pure-Python packer
    # hands values above its 6000-byte cutoff, and memoryviews, to sendall() as they are.
    # Measured on loopback: blob writes 1.5-3x faster. Replies are still parsed by hiredis.
    return PythonRespSerializer(6000, _encode_arg)


def _encode_arg(value: object) -> bytes | memoryview:
    """Command argument → bytes, as redis-py's Encoder does (bytes and memoryview pass as is)."""
    if isinstance(value, bytes | memoryview):
        return value
    if isinstance(value, bytearray):
        return memoryview(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()
    raise redis.DataError(f"invalid command argument of type {type(value).__name__}")


class Connections:
    """The four clients of a bus plus the bounded retry every call goes through.

    Args:
        control: Small commands: acks, leases, commits, pending inspection.
        reader: Blocking stream reads.
        blobs: Payload writes and reads.
        heartbeat: Heartbeats only.
        options: Retry bound and backoff.
        where: How to name the server in messages (URL without password).
    """

    def __init__(
        self,
        *,
        control: Client,
        reader: Client,
        blobs: Client,
        heartbeat: Client,
        options: RedisOptions,
        where: str,
    ) -> None:
        self.control, self.reader, self.blobs, self.heartbeat = control, reader, blobs, heartbeat
        self._options = options
        self._where = where
        self._closed = False
        self.cluster = isinstance(control, RedisCluster)
        self._refreshed_at = float("-inf")
        self._retry = Retry(
            ExponentialWithJitterBackoff(cap=options.retry_cap_s, base=options.retry_base_s),
            retries=-1,  # unbounded count; the time bound is enforced in `call`
            supported_errors=_RETRYABLE,
        )

    @classmethod
    def from_url(cls, url: str, options: RedisOptions) -> Connections:
        """Four clients with separate pools for ``url``."""
        return cls(
            control=_client(url, options.socket_timeout_s, options, "control"),
            reader=_client(url, options.socket_timeout_s, options, "reader"),
            blobs=_client(
                url,
                options.blob_socket_timeout_s,
                options,
                "blobs",
                command_packer=_zero_copy_packer(),
            ),
            heartbeat=_client(url, options.heartbeat_socket_timeout_s, options, "heartbeat"),
            options=options,
            where=redact_url(url),
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _refuse_if_closed(self, what: str, error: Exception | None = None) -> None:
        if self._closed:
            raise BusError(f"bus closed: {what} after close() (build a new bus)") from error

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying connection failures for up to ``unavailable_after_s``.

        Raises:
            BusUnavailable: The server stayed unreachable for the whole bound.
            BusError: The server refused the command (mapped by :func:`bus_error`), the
                connection pool is exhausted, or the bus was closed (also while ``fn`` was
                blocked: :meth:`close` breaks the connection and the retry stops).
            InvalidArgument: redis-py refused an argument before sending it.
        """
        self._refuse_if_closed(what)
        first_failure_s: float | None = None

        def fail(error: Exception, failures: int) -> None:
            nonlocal first_failure_s
            self._refuse_if_closed(what, error)
            if isinstance(error, redis.ConnectionError) and "Too many connections" in str(error):
                raise BusError(
                    f"connection pool exhausted during {what}: more than "
                    f"{self._options.max_connections} connections of one client in use at once; "
                    "raise redis.max_connections or use fewer threads per bus"
                ) from error
            now = time.monotonic()
            self._refresh_slot_maps(now)
            if first_failure_s is None:
                first_failure_s = now
                log.warning("bus.reconnecting %s: %s", what, error, extra=self._extra(what))
            if now - first_failure_s >= self._options.unavailable_after_s:
                log.error(
                    "bus.unavailable %s after %d tries", what, failures, extra=self._extra(what)
                )
                raise BusUnavailable(
                    f"Redis at {self._where} unreachable for {now - first_failure_s:.1f} s "
                    f"during {what} ({error}); check that redis-server is running and the URL "
                    "is right, or raise redis.unavailable_after_s to ride out longer restarts"
                ) from error

        try:
            result = self._retry.call_with_retry(fn, fail, with_failure_count=True)
        except redis.ResponseError as exc:
            self._refuse_if_closed(what, exc)
            raise bus_error(exc, what) from exc
        except redis.DataError as exc:
            raise InvalidArgument(f"{what}: {exc}") from exc
        if self._closed:  # fn raced close() and opened a new connection: drop it again
            self._disconnect_all()
        if first_failure_s is not None:
            log.info("bus.reconnected %s", what, extra=self._extra(what))
        return result

    def _refresh_slot_maps(self, now: float) -> None:
        """After a failed call on a cluster, re-read every client's slot map (at most every
        ``_REFRESH_EVERY_S``): redis-py asks for a refresh after some failures but not all
        (a blocking ``XREADGROUP`` to a killed master kept failing for as long as we retried),
        and a promoted replica must be found by every client. A cluster still electing a
        master answers with a slot map it cannot use: kept, tried again next time."""
        if not self.cluster or now - self._refreshed_at < _REFRESH_EVERY_S:
            return
        self._refreshed_at = now
        for client in self._distinct():
            if isinstance(client, RedisCluster):
                try:
                    client.nodes_manager.initialize()
                except (redis.RedisError, rexc.RedisClusterException) as exc:
                    log.debug("bus.cluster.refresh %s", exc)

    def _distinct(self) -> list[Client]:
        seen: dict[int, Client] = {}
        for client in (self.control, self.reader, self.blobs, self.heartbeat):
            seen.setdefault(id(client), client)
        return list(seen.values())

    def _extra(self, what: str) -> dict[str, dict[str, str]]:
        return {"ddq": {"op": what, "server": self._where}}

    def close(self) -> None:
        """Close every distinct client (they may be the same object when injected).

        In-use connections are closed too: a thread blocked in a read gets a connection error,
        which :meth:`call` turns into ``BusError("bus closed")`` instead of reconnecting.
        """
        self._closed = True
        self._disconnect_all()

    def _disconnect_all(self) -> None:
        for client in self._distinct():
            try:
                client.close()
                for pool in pools(client):
                    pool.disconnect(inuse_connections=True)
            except (OSError, ValueError, redis.RedisError) as exc:  # best effort
                # (fakeredis cannot shut down a socket another thread is reading from;
                # that reader then stops at its next BLOCK split, within max_block_ms)
                log.debug("bus.close %s", exc)
