"""The synchronizer process: build from the config, pump until told to stop, stop in two stages.

    ddq synchronizer --config config/demo.yaml [--id sync-0] [--allow-config-change]
                     [--init-from model.safetensors]
    python -m dd_queue.services.synchronizer --config config/demo.yaml        (the same)

At start it waits for Redis (``dd_queue.startup``, up to ``run.start_timeout_s``), logging what
it waits for. The first SIGTERM or SIGINT finishes the current iteration, releases the leases
(a standby takes over at once) and exits 0; a second one exits immediately (held contributions
stay pending either way, so nothing is lost). A bus error inside an iteration drops the
in-memory state and rebuilds it from Redis once it answers again (Redis restarting never ends
the process); anything else ends the process non-zero, for the supervisor to restart it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType

from dd_queue.bus import RedisBus
from dd_queue.clock import Clock, SystemClock
from dd_queue.config import DDQConfig
from dd_queue.log import setup_logging
from dd_queue.startup import wait_for
from dd_queue.synchronizer.export import load_init
from dd_queue.synchronizer.source import ModelSource
from dd_queue.synchronizer.synchronizer import Synchronizer
from dd_queue.tracking import open_tracker

__all__ = ["install_two_stage_stop", "pump_until", "serve"]

log = logging.getLogger("dd_queue.synchronizer")
BLOCK_MS = 500
"""Longest wait for contributions in one iteration (a stop is noticed within it)."""


def install_two_stage_stop(stop: threading.Event) -> None:
    """First SIGTERM/SIGINT sets ``stop``; the second exits the process at once."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            log.warning("synchronizer.killed by a second signal %d", signum)
            os._exit(1)
        log.info("synchronizer.stopping on signal %d (send it again to exit at once)", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def pump_until(sync: Synchronizer, clock: Clock, stop: threading.Event) -> None:
    """Start ``sync`` and pump it until ``stop`` is set (the caller closes it)."""
    sync.start()
    while not stop.is_set():
        wake = sync.pump(block_ms=BLOCK_MS)  # blocks on the group read while it owns any
        if not sync.owned and wake is not None and wake > clock.now():
            stop.wait(min(wake - clock.now(), BLOCK_MS / 1000))  # standby: nothing to read


def serve(
    cfg: DDQConfig,
    *,
    synchronizer_id: str,
    allow_config_change: bool = False,
    init_from: str | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Run a synchronizer on the config's Redis until ``stop`` is set; returns the exit code."""
    setup_logging(
        f"synchronizer {synchronizer_id}", level=cfg.run.log_level, fmt=cfg.run.log_format
    )
    log.info("synchronizer.config digest %s: %s", cfg.digest, cfg.public_dict())
    stop = stop or threading.Event()
    clock = SystemClock()
    bus = RedisBus(cfg.redis.url, cfg.run.run_id, options=cfg.redis.options(), clock=clock)
    source: ModelSource | None = load_init(init_from, cfg) if init_from else None
    tracker = open_tracker(cfg, f"synchronizer-{synchronizer_id}")
    sync = Synchronizer(
        cfg,
        bus=bus,
        clock=clock,
        synchronizer_id=synchronizer_id,
        source=source,
        allow_config_change=allow_config_change,
        tracker=tracker,
    )
    try:
        if wait_for(("redis",), cfg=cfg, bus=bus, role="synchronizer", stop=stop, clock=clock):
            pump_until(sync, clock, stop)
    finally:
        sync.close()
        bus.close()
        tracker.close()
    return 0
