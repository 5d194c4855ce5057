"""How a learner's bus side is put together from its config: the pump of rank 0."""

from __future__ import annotations

from collections.abc import Callable

from dd_queue.auth import Auth, learner_principal
from dd_queue.bus import Bus
from dd_queue.clock import Clock
from dd_queue.config import DDQConfig
from dd_queue.core.fragments import FragmentPlan
from dd_queue.faults import FaultInjector
from dd_queue.learner import publisher
from dd_queue.learner.exchange import Inbox, Outbox, RoundBook
from dd_queue.learner.pump import Pump, PumpSettings
from dd_queue.learner.receiver import Follower
from dd_queue.learner.tokens import TokenBook
from dd_queue.messages import Heartbeat


def build_pump(
    cfg: DDQConfig,
    bus: Bus,
    *,
    plan: FragmentPlan,
    learner_id: str,
    config_digest: str,
    queues: tuple[Outbox, Inbox, RoundBook],
    injector: FaultInjector,
    clock: Clock,
    status: Callable[[], Heartbeat],
    tokens: TokenBook,
) -> Pump:
    """The pump of one learner (rank 0) on ``bus``, configured from ``cfg``.

    Args:
        cfg: The run's config (wire, redis, membership, learner, synchronizer, faults).
        bus: Rank 0's bus.
        plan: The learner's fragment plan.
        learner_id: Its id.
        config_digest: Stamped on its contributions (the run digest, unless a test says).
        queues: The outbox it publishes from, the inbox it fills, its round book.
        injector: The learner's faults (the pump applies the send-side ones).
        clock: Time for pacing and retries.
        status: The learner's heartbeat now (``Learner.heartbeat``).
        tokens: The learner's token counts, reported by the pump.
    """
    outbox, inbox, rounds = queues
    auth = Auth.load(cfg.auth, bus.keys.run_id, learner_principal(learner_id))
    follower = Follower(
        bus,
        plan=plan,
        learner_id=learner_id,
        limits=cfg.wire.message_limits(),
        now=clock.now,
        auth=auth,
        max_command_age_s=cfg.auth.max_command_age_s,
    )
    settings = publisher.PublishSettings(
        run_id=bus.keys.run_id,
        learner_id=learner_id,
        config_digest=config_digest,
        codec=cfg.wire.codec_spec(),
        error_feedback=cfg.learner.error_feedback,
        ttl_s=cfg.redis.contribution_ttl_s,
        maxlen=cfg.redis.stream_maxlen,
        auth=auth,
    )
    return Pump(
        bus=bus,
        follower=follower,
        publish=settings,
        encoder=publisher.ContributionEncoder(
            settings.codec, error_feedback=settings.error_feedback
        ),
        outbox=outbox,
        inbox=inbox,
        rounds=rounds,
        injector=injector,
        clock=clock,
        status=status,
        tokens=tokens,
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


__all__ = ["build_pump"]
