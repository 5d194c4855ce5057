"""Waiting at start for what a service needs: Redis, the run, a live synchronizer.

The services start in any order: a Procfile starts them all at once, compose and systemd one by
one, an operator whenever. So each one waits for what it needs before its first real step,
logging every 5 s what it is waiting for and how long is left, and gives up only when
``run.start_timeout_s`` has passed (``NotReady``: exit code 3, which a supervisor restarts):

- synchronizer: Redis.
- learner: Redis, then the initial global model (``learner.join_timeout_s``).
- evaluator: Redis, then the run (every fragment's state and a published version).
- control plane: nothing; it serves at once and answers 503 (``/readyz`` says why) until
  Redis answers, logging that it waits.

``ddq wait --for redis,run,synchronizer`` runs the same checks from the shell (compose health
checks use it); ``--for member:L0`` checks that one member's own heartbeat is fresh (a learner's
health check). After the start, a service whose dependency goes away and comes back (Redis or
the synchronizer restarting) keeps running: the bus retries, loops log and carry on.

Each check returns None when met, else what is missing and what to do, as one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import ssl
import sys
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import redis

from dd_queue.auth import Auth
from dd_queue.bus import Bus, RedisBus, ops
from dd_queue.bus._redis_conn import RedisOptions, client_kwargs, redact_url, seed_url
from dd_queue.clock import Clock, SystemClock
from dd_queue.config import CONFIG_HELP, DDQConfig, load_config
from dd_queue.errors import DDQError, NotReady, exit_code

__all__ = ["NEEDS", "Need", "Stop", "register", "unmet", "wait_for"]

log = logging.getLogger("dd_queue.startup")

Need = str
"""``redis``, ``run``, ``synchronizer`` (any live one) or ``member:<id>`` (that member is live:
a learner id, a synchronizer id)."""
NEEDS: tuple[Need, ...] = ("redis", "run", "synchronizer")
"""The fixed needs, in the order they come true (``member:<id>`` besides)."""


def unknown_needs(needs: Sequence[str]) -> list[str]:
    """The entries of ``needs`` that name nothing to wait for (sorted)."""
    return sorted(n for n in set(needs) if n not in NEEDS and not _MEMBER.fullmatch(n))


NOTE_EVERY_S = 5.0
"""Seconds between two ``waiting`` log lines."""
_PROBE_TIMEOUT_S = 2.0
_MEMBER = re.compile(r"member:[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class Stop(Protocol):
    """What ends a wait early: ``threading.Event`` or the learner's ``TwoStageStop``."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> object: ...


def _redis_missing(url: str, options: RedisOptions) -> str | None:
    client = redis.Redis.from_url(
        seed_url(url),  # a cluster: its first seed node
        socket_connect_timeout=_PROBE_TIMEOUT_S,
        socket_timeout=_PROBE_TIMEOUT_S,
        **client_kwargs(url, options),
    )
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise NotReady(f"Redis at {redact_url(url)} refused the credentials: {exc}") from exc
    except redis.RedisError as exc:
        if _tls_failed(exc):  # a certificate either side refuses: waiting would not help
            raise NotReady(f"TLS to Redis at {redact_url(url)} failed: {exc}") from exc
        return (
            f"Redis at {redact_url(url)} ({exc}; start redis-server, or set redis.url / "
            "DDQ__REDIS__URL)"
        )
    finally:
        client.close()
    return None


def _tls_failed(exc: BaseException) -> bool:
    """``exc`` was caused by a TLS handshake failure (not a server that is not up yet)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _run_missing(bus: Bus, cfg: DDQConfig) -> str | None:
    n = cfg.synchronizer.n_fragments
    created = sum(
        1
        for p in range(n)
        if bus.get(bus.keys.state(p)) is not None and ops.latest_global(bus, p) is not None
    )
    if created == n:
        return None
    return (
        f"run {cfg.run.run_id!r} to be created ({created}/{n} fragments published; "
        "start a synchronizer with the same config)"
    )


def _beat_missing(bus: Bus, cfg: DDQConfig, member: str | None) -> str | None:
    """None when a heartbeat fresher than ``membership.stalled_after_s`` is there: of ``member``
    (a learner id, a synchronizer id), or of any synchronizer when ``member`` is None."""
    fresh_s, limits = cfg.membership.stalled_after_s, cfg.wire.message_limits()
    auth = Auth.load(cfg.auth, cfg.run.run_id, None)  # a forged heartbeat is no live member
    ages = []
    for name, info in bus.heartbeats().items():
        try:
            beat = ops.read_heartbeat(
                name, info.payload, run_id=cfg.run.run_id, limits=limits, auth=auth
            )
        except DDQError:
            continue
        if beat.member_id == member or (member is None and beat.role == "synchronizer"):
            if info.age_s <= fresh_s:
                return None
            ages.append(info.age_s)
    seen = f"; the last beat {min(ages):.1f} s ago" if ages else ""
    who = (
        f"a live synchronizer of run {cfg.run.run_id!r}"
        if member is None
        else f"a live {member!r} in run {cfg.run.run_id!r}"
    )
    start = "ddq synchronizer" if member is None else "it"
    return (
        f"{who} (a heartbeat fresher than membership.stalled_after_s {fresh_s:g} s{seen}; "
        f"start {start})"
    )


def unmet(needs: Sequence[Need], *, cfg: DDQConfig, bus: Bus | None) -> str | None:
    """The first of ``needs`` that is not met now, as a line saying what to do; None if all are.

    Args:
        needs: What to check, e.g. ``("redis", "run")``.
        cfg: The run's config (Redis URL, run id, fragments, liveness thresholds).
        bus: The bus for the run and synchronizer checks (None: only ``redis`` may be asked).
            Redis is PINGed at the bus's URL (or ``cfg.redis.url`` without a bus); a bus with
            no URL (in memory, or over injected clients) is taken as reachable.

    Raises:
        NotReady: Redis refused the credentials (waiting would not help).
    """
    unknown = unknown_needs(needs)
    if unknown:
        raise ValueError(f"unknown needs {unknown}; choose from {', '.join(NEEDS)}, member:<id>")
    address = None if bus is None else bus.address
    url = cfg.redis.url if bus is None else None if address is None else address.url
    if url is not None:  # a bus on a server (not in memory, not an injected client): PING it
        missing = _redis_missing(url, cfg.redis.options())
        if missing is not None:
            return missing
    for need in needs:
        if need == "redis":
            continue
        if bus is None:
            raise ValueError(f"checking {need!r} needs a bus")
        if need == "run":
            missing = _run_missing(bus, cfg)
        else:
            missing = _beat_missing(bus, cfg, need.partition(":")[2] or None)
        if missing is not None:
            return missing
    return None


def wait_for(
    needs: Sequence[Need],
    *,
    cfg: DDQConfig,
    bus: Bus | None,
    role: str,
    stop: Stop,
    clock: Clock | None = None,
    timeout_s: float | None = None,
    poll_s: float = 0.5,
) -> bool:
    """Wait until every need is met; True when met, False when ``stop`` was set first.

    Args:
        needs: What the service needs (module table).
        cfg: The run's config.
        bus: The service's bus.
        role: Who waits, for the log (``evaluator``, ``synchronizer sync-0``, ...).
        stop: Set by the first stop signal: the wait ends early.
        clock: Time for the deadline (default: the system clock).
        timeout_s: Give up after this long (default: ``run.start_timeout_s``).
        poll_s: Seconds between checks.

    Raises:
        NotReady: A need was still unmet after ``timeout_s`` (or Redis refused the login).
    """
    clock = clock or SystemClock()
    timeout_s = cfg.run.start_timeout_s if timeout_s is None else timeout_s
    start_s = clock.now()
    next_note_s = start_s
    while not stop.is_set():
        try:
            missing = unmet(needs, cfg=cfg, bus=bus)
        except NotReady:
            raise
        except DDQError as exc:  # Redis went away between two checks
            missing = f"Redis ({exc})"
        now = clock.now()
        if missing is None:
            if now > start_s + poll_s:
                log.info("%s.ready after %.1f s: %s", role, now - start_s, ", ".join(needs))
            return True
        if now - start_s >= timeout_s:
            raise NotReady(
                f"{role}: still waiting for {missing} after {timeout_s:g} s "
                "(run.start_timeout_s, env DDQ__RUN__START_TIMEOUT_S)"
            )
        if now >= next_note_s:
            left_s = timeout_s - (now - start_s)
            log.warning("%s.waiting for %s (%.0f s left)", role, missing, left_s)
            next_note_s = now + NOTE_EVERY_S
        stop.wait(poll_s)
    return False


def register(sub: Any) -> None:
    """Add ``ddq wait`` to the ``ddq`` subparsers."""
    p = sub.add_parser(
        "wait", help="wait for Redis, the run or a live synchronizer (health checks, scripts)"
    )
    p.add_argument("--config", default="base", help=CONFIG_HELP)
    p.add_argument(
        "--for",
        dest="needs",
        default="redis,run,synchronizer",
        help="comma-separated needs among redis, run, synchronizer, member:<id> (a learner or "
        "synchronizer id with a fresh heartbeat) (default: %(default)s)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="give up after this long, exit 3 (default: run.start_timeout_s; 0: check once)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=_cmd_wait)


def _cmd_wait(args: argparse.Namespace) -> int:
    needs = [n.strip() for n in args.needs.split(",") if n.strip()]
    unknown = unknown_needs(needs)
    if unknown or not needs:
        choices = f"{', '.join(NEEDS)}, member:<id>"
        sys.stderr.write(f"ddq: error: --for: unknown {unknown}; choose from {choices}\n")
        return 2
    cfg = load_config(args.config, os.environ)
    bus = RedisBus(cfg.redis.url, cfg.run.run_id, options=cfg.redis.options())
    waiting_for: str | None = None
    code = 0
    try:
        wait_for(
            needs,
            cfg=cfg,
            bus=bus,
            role="wait",
            stop=threading.Event(),
            timeout_s=args.timeout_s,
        )
    except NotReady as exc:
        waiting_for, code = str(exc), exit_code(exc)
    finally:
        bus.close()
    if args.json:
        sys.stdout.write(
            json.dumps({"ready": code == 0, "needs": needs, "waiting_for": waiting_for})
        )
        sys.stdout.write("\n")
    elif code == 0:
        sys.stdout.write(f"ready: {', '.join(needs)}\n")
    else:
        sys.stdout.write(f"not ready: {waiting_for}\n")
    return code
