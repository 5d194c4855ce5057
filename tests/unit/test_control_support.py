"""Shared set-up of the control plane tests (no tests here): a run on fakeredis with a real
in-process synchronizer, heartbeats written by hand, and a TestClient over the app.

The scenario: learners L0 and L1 beat; the synchronizer creates the run and merges one round of
fragment 0 with L0's contribution; L1 sends a NaN payload, which is dead-lettered.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fakeredis
import numpy as np
from fastapi.testclient import TestClient

from dd_queue.bus import RedisBus, RedisOptions, ops
from dd_queue.clock import Clock, FakeClock
from dd_queue.config import DDQConfig
from dd_queue.control import create_app
from dd_queue.messages import FaultCommand, Heartbeat
from dd_queue.synchronizer import Synchronizer, plan_of
from tests.synchronizer_support import contribute, make_config, tiny_source, with_nan

TOKEN = "admin-token-for-tests-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def fake_bus(run_id: str, server: fakeredis.FakeServer, clock: Clock | None = None) -> RedisBus:
    """A RedisBus over fakeredis (one client per role), giving up on Redis after 0.5 s.

    ``clock`` is the one its leases' local expiry estimates use: give the synchronizer's bus the
    synchronizer's clock, or it compares a ``FakeClock`` with the machine's monotonic clock.
    """
    control, reader, blobs, beat = (fakeredis.FakeRedis(server=server) for _ in range(4))
    options = RedisOptions(unavailable_after_s=0.5, retry_base_s=0.01, retry_cap_s=0.05)
    return RedisBus.from_clients(
        run_id, control, reader=reader, blobs=blobs, heartbeat=beat, options=options, clock=clock
    )


# Heartbeat ages are measured on Redis's clock, which fakeredis takes from the machine, while
# these scenarios run on fake clocks. The synchronizer tests' 0.5 s straggling threshold made a
# loaded CI machine see the learners straggle between their last beat and the read; states
# here come from what a heartbeat reports, so the age thresholds sit far beyond any test.
_MEMBERSHIP = {
    "membership__straggling_after_s": 60.0,
    "membership__stalled_after_s": 120.0,
    "membership__dead_after_s": 240.0,
}


def config(run_id: str, **control: Any) -> DDQConfig:
    """The synchronizer tests' config with a control section (admin token by default) and age
    thresholds no test reaches."""
    extra = {"admin_token": TOKEN, **control}
    return make_config(run_id, **_MEMBERSHIP, **{f"control__{k}": v for k, v in extra.items()})


def heartbeat(
    bus: RedisBus,
    cfg: DDQConfig,
    learner_id: str,
    *,
    state: str = "training",
    step: int = 10,
    step_time_s: float | None = 0.05,
    pid: int | None = None,
    train_loss: float | None = 3.5,
) -> None:
    """Write a learner heartbeat, as a learner's pump does."""
    hb = Heartbeat(
        run_id=cfg.run.run_id,
        config_digest=cfg.run_digest,
        role="learner",
        member_id=learner_id,
        state=state,
        step=step,
        n_tokens=step * 32,
        step_time_ema_s=step_time_s,
        versions={0: 1, 1: 0},
        queue_depths={"publish": 0},
        device="cpu",
        host=socket.gethostname(),
        pid=pid or os.getpid(),
        sent_at_s=1.0,
        train_loss=train_loss,
    )
    bus.heartbeat(learner_id, hb.to_bytes(), ttl_s=cfg.membership.dead_after_s)


def commands(bus: RedisBus, cfg: DDQConfig, target: str) -> list[FaultCommand]:
    """The fault commands on ``target``'s control stream, oldest first."""
    entries = bus.read(bus.keys.control(target), count=1000)
    limits = cfg.wire.message_limits()
    return [
        FaultCommand.from_fields(e.fields, run_id=cfg.run.run_id, limits=limits) for e in entries
    ]


@dataclass
class Run:
    """A run on fakeredis with a synchronizer, and the control plane app over it."""

    cfg: DDQConfig
    bus: RedisBus
    clock: FakeClock
    sync: Synchronizer
    sync_clock: FakeClock
    client: TestClient
    server: fakeredis.FakeServer

    @property
    def plane(self) -> Any:
        return self.client.app.state.plane  # type: ignore[attr-defined]

    def beat_all(self, **states: str) -> None:
        """Heartbeats of L0 and L1 (``state`` per learner, default training) and the sync's."""
        for learner in ("L0", "L1"):
            heartbeat(self.bus, self.cfg, learner, state=states.get(learner, "training"))
        self.sync_clock.advance(self.cfg.membership.heartbeat_interval_s)  # its beat is due
        self.sync.pump()


def _merge_one_round(sync: Synchronizer, clock: FakeClock, run: Run) -> None:
    cfg, bus = run.cfg, run.bus
    for _ in range(200):
        sync.pump()
        status = {s.fragment_id: s for s in sync.status()}
        if status[0].announced:
            round_id = status[0].round_id
            break
        clock.advance(0.01)
    else:
        raise AssertionError("no round opened")
    size = plan_of(tiny_source(), cfg.synchronizer).fragments[0].size
    delta = np.full(size, 0.01, np.float32)
    # each learner's own token counts: 400 tokens for each of the P fragments, one sent
    n_frag = cfg.synchronizer.n_fragments
    for learner in ("L0", "L1"):
        ops.report_tokens(bus, learner, {"computed": 400 * n_frag, "published": 400})
    contribute(
        bus,
        cfg,
        learner_id="L0",
        fragment_id=0,
        round_id=round_id,
        base_version=0,
        delta=delta,
        new_tokens=400,
    )
    contribute(
        bus,
        cfg,
        learner_id="L1",
        fragment_id=0,
        round_id=round_id,
        base_version=0,
        delta=delta,
        encoded=with_nan(size),
        new_tokens=400,
    )
    for _ in range(400):
        heartbeat(bus, cfg, "L0")
        heartbeat(bus, cfg, "L1")
        sync.pump()
        if sync.versions()[0] >= 1:
            return
        clock.advance(0.05)
    raise AssertionError("round 0 never merged")


def make_run(**control: Any) -> Iterator[Run]:
    """Build the scenario; yields it, closes everything after."""
    run_id = f"c{uuid.uuid4().hex[:8]}"
    server = fakeredis.FakeServer()
    cfg = config(run_id, **control)
    sync_clock, clock = FakeClock(1000.0), FakeClock(50.0)
    bus = fake_bus(run_id, server)
    sync_bus = fake_bus(run_id, server, sync_clock)
    heartbeat(bus, cfg, "L0")
    heartbeat(bus, cfg, "L1")
    sync = Synchronizer(
        cfg,
        bus=sync_bus,
        clock=sync_clock,
        synchronizer_id="sync-0",
        source=tiny_source(),
        wall=sync_clock.now,
        kill=_no_kill,
    )
    sync.start()
    app = create_app(cfg, bus, clock, ticker=False, min_refresh_s=0.0, seed=1)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        run = Run(cfg, bus, clock, sync, sync_clock, client, server)
        _merge_one_round(sync, sync_clock, run)
        try:
            yield run
        finally:
            sync.close()
            sync_bus.close()
            bus.close()


def _no_kill(point: str) -> None:
    raise AssertionError(f"unexpected kill at {point}")
