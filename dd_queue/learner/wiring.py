"""How a learner's bus side is put together from its config, and what its heartbeat says."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dd_queue.bus import Bus
from dd_queue.learner import publisher
from dd_queue.learner.pump import Pump, PumpSettings
from dd_queue.learner.receiver import Follower
from dd_queue.messages import Heartbeat

if TYPE_CHECKING:
    from dd_queue.learner.learner import Learner


def build_pump(learner: Learner, bus: Bus) -> Pump:
    """The pump of ``learner`` (rank 0) on ``bus``, configured from ``learner.cfg``."""
    cfg = learner.cfg
    follower = Follower(
        bus,
        plan=learner.plan,
        learner_id=learner.learner_id,
        limits=cfg.wire.message_limits(),
        now=learner.clock.now,
    )
    settings = publisher.PublishSettings(
        run_id=bus.keys.run_id,
        learner_id=learner.learner_id,
        config_digest=learner.config_digest,
        codec=cfg.wire.codec_spec(),
        error_feedback=cfg.learner.error_feedback,
        ttl_s=cfg.redis.contribution_ttl_s,
        maxlen=cfg.redis.stream_maxlen,
    )
    return Pump(
        bus=bus,
        follower=follower,
        publish=settings,
        encoder=publisher.ContributionEncoder(
            settings.codec, error_feedback=settings.error_feedback
        ),
        outbox=learner.outbox,
        inbox=learner.inbox,
        rounds=learner.rounds,
        injector=learner.injector,
        clock=learner.clock,
        status=lambda: heartbeat(learner),
        settings=PumpSettings(
            heartbeat_interval_s=cfg.membership.heartbeat_interval_s,
            heartbeat_ttl_s=cfg.membership.dead_after_s,
            resync_interval_s=cfg.learner.resync_interval_s,
            sweep_interval_s=cfg.membership.heartbeat_interval_s,
            watch_s=cfg.synchronizer.round_timeout_s,
            retry_s=cfg.membership.heartbeat_interval_s,
            request_rounds=cfg.synchronizer.schedule == "synchronizer",
            faults_enabled=cfg.faults.enabled,
        ),
    )


def heartbeat(learner: Learner) -> Heartbeat:
    """The learner's heartbeat: progress, versions held, queue depths, where it runs."""
    assert learner.bus is not None  # heartbeats are rank 0's, which has the bus
    return Heartbeat(
        run_id=learner.bus.keys.run_id,
        config_digest=learner.config_digest,
        role="learner",
        member_id=learner.learner_id,
        state=learner.state,
        step=learner.step_count,
        n_tokens=learner.n_tokens,
        step_time_ema_s=learner.step_time_ema_s,
        versions=learner.versions,
        queue_depths={"publish": learner.outbox.depth(), "receive": learner.inbox.depth()},
        device=str(learner.params.device),
        host=learner.identity.host,
        pid=learner.identity.pid,
        sent_at_s=time.time(),
    )


__all__ = ["build_pump", "heartbeat"]
