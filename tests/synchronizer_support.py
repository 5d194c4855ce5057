"""Test helpers for the synchronizer: a tiny model, configs, scripted learner stand-ins, and a
replay of the recorded rounds.

A stand-in does what the protocol asks of a learner and nothing more: heartbeat, follow round
openings, publish a contribution (Δ against the newest version it has seen), read globals.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from typing import Any

import numpy as np

from dd_queue.bus import Bus, Entry, ops
from dd_queue.config import DDQConfig, validate_config
from dd_queue.core import codec
from dd_queue.core.anchor import VersionRing, anchor_contributions
from dd_queue.core.codec import CodecSpec, EncodedTensor, encode
from dd_queue.core.merge import ContributionData, merge_fragment
from dd_queue.core.outer import NesterovState, nesterov_step
from dd_queue.fragment_state import fragment_of
from dd_queue.keys import SYNC_GROUP
from dd_queue.messages import Contribution, GlobalFragment, Heartbeat, RoundOpen, RoundRecord
from dd_queue.synchronizer import ArraySource, FragmentState, plan_of

SHAPES = {
    "embed.weight": (16, 8),
    "h.0.w": (8, 12),
    "h.1.w": (12, 8),
    "h.0.b": (12,),
    "head.b": (20,),
}


def tiny_source(seed: int = 0) -> ArraySource:
    """Five small tensors (one embedding), normal(0, 0.1), deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    values = {n: (rng.standard_normal(s) * 0.1).astype(np.float32) for n, s in SHAPES.items()}
    return ArraySource(values, origin=f"tiny seed {seed}")


def make_config(run_id: str = "t", **sync: Any) -> DDQConfig:
    """A test config: 2 fragments, quorum 1, fast pace, short leases; override any
    ``synchronizer`` field by keyword, other sections with ``section__field=value``."""
    raw: dict[str, dict[str, Any]] = {
        "run": {"run_id": run_id},
        "wire": {"codec": "fp32"},
        "redis": {"socket_timeout_s": 3.0, "max_block_ms": 200, "unavailable_after_s": 5.0},
        "synchronizer": {
            "n_fragments": 2,
            "sync_every_steps": 2,
            "round_timeout_s": 5.0,
            "lease_ttl_s": 2.0,
            "claim_idle_ms": 500,
            "initial_step_time_s": 0.05,
            "max_staleness": 3,
            "version_ring": 4,
        },
        "membership": {
            "expected_learners": 3,
            "heartbeat_interval_s": 0.1,
            "straggling_after_s": 0.5,
            "stalled_after_s": 1.0,
            "dead_after_s": 2.0,
        },
        "faults": {"enabled": True},  # off by default; these tests inject faults
    }
    for key, value in sync.items():
        section, _, field = key.partition("__")
        if field:
            raw.setdefault(section, {})[field] = value
        else:
            raw["synchronizer"][key] = value
    return validate_config(raw)


def beat(
    bus: Bus,
    cfg: DDQConfig,
    learner_id: str,
    *,
    step_time_s: float = 0.05,
    host: str | None = None,
    pid: int | None = None,
) -> None:
    """A learner heartbeat (expires after ``membership.dead_after_s``), from this process
    unless ``host`` / ``pid`` say otherwise."""
    hb = Heartbeat(
        run_id=cfg.run.run_id,
        config_digest=cfg.run_digest,
        role="learner",
        member_id=learner_id,
        state="training",
        step=1,
        n_tokens=1,
        step_time_ema_s=step_time_s,
        versions={},
        queue_depths={},
        device="cpu",
        host=socket.gethostname() if host is None else host,
        pid=os.getpid() if pid is None else pid,
        sent_at_s=1.0,
    )
    bus.heartbeat(learner_id, hb.to_bytes(), ttl_s=cfg.membership.dead_after_s)


def contribute(
    bus: Bus,
    cfg: DDQConfig,
    *,
    learner_id: str,
    fragment_id: int,
    round_id: int,
    base_version: int,
    delta: np.ndarray,
    n_steps: int = 4,
    n_tokens: int = 400,
    encoded: EncodedTensor | None = None,
    **changes: Any,
) -> str:
    """Publish one contribution (fp32 unless ``cfg.wire.codec`` says otherwise); its entry id."""
    if encoded is None:
        encoded = encode(np.ascontiguousarray(delta, dtype=np.float32), cfg.wire.codec_spec())
    msg = Contribution(
        run_id=cfg.run.run_id,
        config_digest=cfg.run_digest,
        learner_id=learner_id,
        fragment_id=fragment_id,
        round_id=round_id,
        base_version=base_version,
        n_steps=n_steps,
        n_tokens=n_tokens,
        tensor=encoded.header,
        created_at_s=1.0,
    )
    msg = dataclasses.replace(msg, **changes)
    entry_id, _ = ops.send_contribution(bus, msg, encoded, ttl_s=600)
    return entry_id


def with_nan(size: int) -> EncodedTensor:
    """A well-formed fp32 payload (valid checksum) that holds a NaN: only decoding finds it."""
    raw = np.full(size, 0.01, np.float32)
    raw[size // 2] = np.nan
    data = raw.view(np.uint8)
    header = dataclasses.replace(
        encode(np.zeros(size, np.float32), CodecSpec("fp32")).header,
        checksum=codec._checksum(data, "fp32", size, 0, False),
    )
    return EncodedTensor(header, memoryview(data.tobytes()))


def opened(bus: Bus, cfg: DDQConfig) -> list[RoundOpen]:
    """Every round opening on the run's ``open`` stream, oldest first."""
    entries = bus.read(bus.keys.opened_rounds(), count=100_000)
    return [
        RoundOpen.from_fields(e.fields, run_id=cfg.run.run_id, limits=cfg.wire.message_limits())
        for e in entries
    ]


def records(bus: Bus, cfg: DDQConfig, fragment_id: int) -> list[RoundRecord]:
    """Every round record of a fragment, oldest first."""
    entries = bus.read(bus.keys.rounds(fragment_id), count=100_000)
    limits = cfg.wire.message_limits()
    return [
        RoundRecord.from_fields(e.fields, run_id=cfg.run.run_id, limits=limits) for e in entries
    ]


def dead_letters(bus: Bus, fragment_id: int) -> list[Entry]:
    """Every entry of a fragment's dead-letter stream."""
    return bus.read(bus.keys.dlq(fragment_id), count=100_000)


def state_of(bus: Bus, cfg: DDQConfig, fragment_id: int) -> FragmentState:
    raw = bus.get(bus.keys.state(fragment_id))
    assert raw is not None, f"fragment {fragment_id} has no state"
    return FragmentState.from_bytes(raw, run_id=cfg.run.run_id, limits=cfg.wire.message_limits())


def latest_global(bus: Bus, cfg: DDQConfig, fragment_id: int) -> tuple[GlobalFragment, np.ndarray]:
    """The newest published version of a fragment and Θ_p (bit-exact)."""
    entry = ops.latest_global(bus, fragment_id)
    assert entry is not None, f"fragment {fragment_id} has no version"
    return ops.read_global(bus, entry, run_id=cfg.run.run_id, limits=cfg.wire.message_limits())


def versions_published(bus: Bus, cfg: DDQConfig, fragment_id: int) -> list[int]:
    """Versions on a fragment's ``down`` stream, in stream order."""
    limits = cfg.wire.message_limits()
    return [
        GlobalFragment.from_fields(e.fields, run_id=cfg.run.run_id, limits=limits).version
        for e in bus.read(bus.keys.down(fragment_id), count=100_000)
    ]


def pending_count(bus: Bus, fragment_id: int) -> int:
    return bus.pending_summary(bus.keys.up(fragment_id), SYNC_GROUP).count


def settled_outcomes(rounds: list[RoundRecord]) -> dict[str, list[str]]:
    """Entry id → every settling outcome it got (``carried`` is not settling)."""
    out: dict[str, list[str]] = {}
    for record in rounds:
        for e in record.entries:
            if e.outcome != "carried":
                out.setdefault(e.entry_id, []).append(e.outcome)
    return out


def replay(
    cfg: DDQConfig,
    source: ArraySource,
    fragment_id: int,
    rounds: list[RoundRecord],
    sent: Mapping[str, tuple[Contribution, np.ndarray]],
) -> np.ndarray:
    """Θ_p after re-applying every merged round from the contributions as sent (by entry id)."""
    sync = cfg.synchronizer
    plan = plan_of(source, sync)
    fragment = plan.fragments[fragment_id]
    from dd_queue.core.fragments import flatten_fragment

    theta = flatten_fragment(fragment, source.arrays())
    ring = VersionRing(capacity=sync.version_ring, size=fragment.size)
    ring.push(0, theta)
    momentum, version = NesterovState.zeros(fragment.size), 0
    for record in rounds:
        if record.decision != "merge":
            continue
        used = sorted(
            (sent[e.entry_id] for e in record.entries if e.outcome == "merged"),
            key=lambda mc: mc[0].learner_id,
        )
        contribs = [
            ContributionData(m.learner_id, d, m.n_tokens, m.n_steps, m.base_version)
            for m, d in used
        ]
        kept, _ = anchor_contributions(contribs, ring, anchor=sync.anchor)
        result = merge_fragment(kept, fragment, rule=sync.merge_rule, weighting=sync.weighting)
        if result.kind == "merged":
            nesterov_step(
                theta, result.delta, momentum, lr=sync.outer_lr, momentum=sync.outer_momentum
            )
        version += 1
        assert version == record.version_after
        ring.push(version, theta)
    return theta


def fragment_size(cfg: DDQConfig, source: ArraySource, fragment_id: int) -> int:
    return plan_of(source, cfg.synchronizer).fragments[fragment_id].size


__all__ = [
    "SHAPES",
    "CodecSpec",
    "beat",
    "contribute",
    "dead_letters",
    "fragment_of",
    "fragment_size",
    "latest_global",
    "make_config",
    "opened",
    "pending_count",
    "records",
    "replay",
    "settled_outcomes",
    "state_of",
    "tiny_source",
    "versions_published",
    "with_nan",
]
