"""The control plane process: the app on uvicorn, bound to ``control.host:control.port``.

    ddq control --config config/demo.yaml
    python -m dd_queue.services.control_plane --config config/demo.yaml

Binds 127.0.0.1 unless ``control.host`` says otherwise. With no ``control.admin_token`` the
token is generated and logged once (WARNING) and writes stay off unless
``control.enable_writes``. SIGTERM/SIGINT stop it (open SSE streams get 5 s to end) and it
exits 0. It needs nothing at start: with Redis down it serves at once, answers 503 (``/readyz``
says why) and logs that it waits for Redis every 5 s until Redis answers.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from types import FrameType

import uvicorn

from dd_queue.bus import RedisBus, RedisOptions
from dd_queue.clock import SystemClock
from dd_queue.config import DDQConfig
from dd_queue.control.app import create_app
from dd_queue.control.guard import LOOPBACK_NAMES
from dd_queue.log import setup_logging

__all__ = ["bus_options", "serve"]

log = logging.getLogger("dd_queue.control")
_UNAVAILABLE_AFTER_S = 2.0
"""The control plane gives up on Redis sooner than workers do: it answers 503 instead."""


def bus_options(cfg: DDQConfig) -> RedisOptions:
    """The control plane's Redis options: ``cfg.redis``'s, giving up on Redis within 2 s."""
    limit_s = min(cfg.redis.unavailable_after_s, _UNAVAILABLE_AFTER_S)
    return dataclasses.replace(cfg.redis.options(), unavailable_after_s=limit_s)


def _stopped(signum: int, frame: FrameType | None) -> None:
    log.info("control.stopped on signal %d", signum)


def serve(cfg: DDQConfig) -> int:
    """Serve the control plane until a signal; returns the exit code."""
    setup_logging("control", level=cfg.run.log_level, fmt=cfg.run.log_format)
    log.info("control.config digest %s", cfg.digest, extra={"ddq": {"config": cfg.public_dict()}})
    bus = RedisBus(cfg.redis.url, cfg.run.run_id, options=bus_options(cfg))
    if cfg.control.host not in LOOPBACK_NAMES:
        log.warning(
            "control.exposed bound to %s: read-only routes answer anyone who can reach it "
            "(mutating ones still need the token); prefer 127.0.0.1 behind a proxy",
            cfg.control.host,
        )
    try:
        app = create_app(cfg, bus, SystemClock())
        log.info("control.listening http://%s:%d/", cfg.control.host, cfg.control.port)
        # uvicorn re-raises the stop signal to the handler it found once it has shut down:
        # make that one a log line, so a clean stop exits 0 instead of dying by SIGTERM.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _stopped)
        uvicorn.run(
            app,
            host=cfg.control.host,
            port=cfg.control.port,
            log_config=None,
            access_log=cfg.run.log_level == "DEBUG",
            timeout_graceful_shutdown=5,
        )
    finally:
        bus.close()
    return 0
