"""A scripted synchronizer stand-in for the learner's tests and bench, and tests of it.

The stand-in does what docs/protocol.md asks of a synchronizer, by hand and on command: it
publishes global fragments (staged blob + fenced commit of the ``down`` notification), opens
rounds (``RoundOpen`` on the ``open`` stream) and reads contributions through the group. It
merges nothing unless told (``apply_contribution``: Θ_p ← Θ_p − Δ_p, DiLoCo with one learner
and outer SGD(1)). Also a small config and model factory shared by the learner tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from dd_queue.auth import OPEN, Auth
from dd_queue.bus import Bus, Lease, ops
from dd_queue.bus.memory import MemoryBus
from dd_queue.clock import FakeClock
from dd_queue.config import DDQConfig
from dd_queue.core.codec import CodecSpec, encode
from dd_queue.core.fragments import FragmentPlan, flatten_fragment, plan_fragments
from dd_queue.data import Batch
from dd_queue.keys import SYNC_GROUP
from dd_queue.learner import Learner, StepReport
from dd_queue.learner.service import PumpThreads
from dd_queue.messages import Contribution, GlobalFragment, MessageLimits, RoundOpen
from dd_queue.models import build_model
from tests.bus_support import stage_global_fragment

LIMITS = MessageLimits()
TINY = {"preset": "gpt-tiny", "n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16}


def tiny_config(**sections: dict[str, Any]) -> DDQConfig:
    """A tiny learner config: 1-layer GPT, P = 4, H = 4, fp32 contributions, fast heartbeats."""
    raw: dict[str, dict[str, Any]] = {
        "run": {"run_id": "tl"},
        "model": dict(TINY),
        "data": {"batch_size": 2, "max_bytes": 1 << 18},
        "wire": {"codec": "fp32"},
        "learner": {"warmup_steps": 2, "inner_lr": 1e-2, "join_timeout_s": 2.0},
        "synchronizer": {"n_fragments": 4, "sync_every_steps": 4},
        "membership": {
            "heartbeat_interval_s": 0.1,
            "straggling_after_s": 0.5,
            "stalled_after_s": 1.0,
            "dead_after_s": 2.0,
        },
        "faults": {"enabled": True},  # off by default; these tests inject faults
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return DDQConfig.model_validate(raw)


def tiny_model(cfg: DDQConfig, seed: int) -> torch.nn.Module:
    """The config's model, initialised from ``seed``."""
    return build_model(cfg.model.preset, seed=seed, **cfg.model.overrides())


def random_batches(cfg: DDQConfig, seed: int = 0) -> Iterator[Batch]:
    """Endless random token batches of the config's shape (B · T tokens each)."""
    spec = cfg.model.spec()
    gen = torch.Generator().manual_seed(seed)
    while True:
        window = torch.randint(
            0, spec.vocab_size, (cfg.data.batch_size, spec.seq_len + 1), generator=gen
        )
        yield Batch(window[:, :-1].contiguous(), window[:, 1:].contiguous(), window[:, 1:].numel())


def plan_of(cfg: DDQConfig, model: torch.nn.Module) -> FragmentPlan:
    """The plan both sides derive (docs/protocol.md)."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    sync = cfg.synchronizer
    return plan_fragments(shapes, sync.n_fragments, embedding_patterns=sync.embedding_patterns)


class StandIn:
    """A scripted synchronizer (see the module docstring).

    Args:
        bus: The run's bus.
        plan: The fragment plan.
        auth: The synchronizer's key (signed runs): it signs what it publishes.
    """

    def __init__(self, bus: Bus, plan: FragmentPlan, auth: Auth = OPEN) -> None:
        self.bus, self.plan, self.auth = bus, plan, auth
        self.leases: dict[int, Lease] = {}
        self.versions: dict[int, int] = {}
        self.thetas: dict[tuple[int, int], np.ndarray] = {}
        self.round_id = -1
        self.opened_at: dict[int, float] = {}
        self.commits = 0

    def lease(self, p: int) -> Lease:
        if p not in self.leases:
            lease = self.bus.acquire_lease(self.bus.keys.lease(p), "standin", ttl_s=3600)
            assert lease is not None
            self.leases[p] = lease
        return self.leases[p]

    def publish(self, p: int, values: np.ndarray, *, version: int | None = None) -> int:
        """Publish Θ_p as the next (or the given) version; returns the version."""
        version = self.versions.get(p, -1) + 1 if version is None else version
        values = np.ascontiguousarray(values, dtype=np.float32)
        encoded = encode(values, CodecSpec("fp32"))
        msg = GlobalFragment(
            run_id=self.bus.keys.run_id,
            fragment_id=p,
            version=version,
            round_id=max(self.round_id, 0),
            tensor=encoded.header,
            created_at_s=time.time(),
            reason="stand-in",
        )
        lease = self.lease(p)
        ref = stage_global_fragment(self.bus, lease, msg, encoded, ttl_s=3600, auth=self.auth)
        self.commits += 1
        op = ops.global_notification_op(self.bus, msg, ref, auth=self.auth)
        self.bus.commit(lease, [op], commit_id=f"standin:{p}:{version}:{self.commits}")
        self.versions[p] = max(self.versions.get(p, -1), version)
        self.thetas[(p, version)] = values.copy()
        return version

    def publish_model(self, model: torch.nn.Module) -> None:
        """Version 0 of every fragment from ``model``'s parameters."""
        arrays = {n: p.detach().numpy() for n, p in model.named_parameters()}
        for fragment in self.plan.fragments:
            self.publish(fragment.index, flatten_fragment(fragment, arrays), version=0)

    def theta(self, p: int, version: int | None = None) -> np.ndarray:
        return self.thetas[(p, self.versions[p] if version is None else version)]

    def open_round(self, p: int | None = None) -> tuple[int, int]:
        """Open the next round (for ``p``, or round mod P); returns (fragment, round)."""
        self.round_id += 1
        fragment = self.round_id % self.plan.n_fragments if p is None else p
        msg = RoundOpen(
            run_id=self.bus.keys.run_id,
            fragment_id=fragment,
            round_id=self.round_id,
            opened_at_s=time.time(),
            reason="stand-in",
        )
        self.opened_at[self.round_id] = time.perf_counter()
        self.bus.append(self.bus.keys.opened_rounds(), msg.to_fields())
        return fragment, self.round_id

    def contributions(
        self, *, block_ms: int | None = None
    ) -> list[tuple[Contribution, np.ndarray]]:
        """Every new contribution on any fragment, decoded and acked."""
        found = []
        for p in range(self.plan.n_fragments):
            stream = self.bus.keys.up(p)
            for entry in self.bus.read_group(
                stream, SYNC_GROUP, "standin", count=100, block_ms=block_ms
            ):
                found.append(
                    ops.read_contribution(
                        self.bus, entry, run_id=self.bus.keys.run_id, limits=LIMITS
                    )
                )
                self.bus.ack(stream, SYNC_GROUP, [entry.id])
        return found

    def apply_contribution(self, msg: Contribution, delta: np.ndarray) -> int:
        """Θ_p ← Θ_p(current) − Δ_p as the next version (outer SGD with lr 1)."""
        return self.publish(msg.fragment_id, self.theta(msg.fragment_id) - delta)


class TrainingThread:
    """Steps a learner on a thread of its own (as the service's main thread does), with the
    service's two pump threads; ``stop()`` ends all three and leaves."""

    def __init__(self, learner: Learner, *, receive_block_ms: int = 50) -> None:
        self.learner = learner
        self.reports: list[StepReport] = []
        self.applied: list[tuple[int, int, np.ndarray]] = []
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._pumps = PumpThreads(learner, receive_block_ms=receive_block_ms, send_block_ms=50)
        self._thread = threading.Thread(target=self._run, name="ddq-train", daemon=True)

    def _run(self) -> None:
        try:
            while not self._halt.is_set():
                report = self.learner.step()
                self.reports.append(report)
                for p, version in report.applied:  # θ_p right after the apply
                    self.applied.append((p, version, self.learner.params.read(p)))
                if report.stop:
                    return
                if report.wait_s:
                    self._halt.wait(report.wait_s)
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> TrainingThread:
        self._pumps.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(timeout=30)
        self._pumps.__exit__()
        self.learner.leave(timeout_s=2.0)
        if self.error is not None:
            raise self.error
        if self._pumps.error is not None:
            raise self._pumps.error

    @property
    def steps(self) -> int:
        return self.learner.step_count


# ── tests of the stand-in itself ────────────────────────────────────────────────────────────


def test_standin_publishes_globals_readable_by_read_global():
    cfg = tiny_config()
    bus = MemoryBus("tl", clock=FakeClock(100.0))
    model = tiny_model(cfg, seed=1)
    standin = StandIn(bus, plan_of(cfg, model))
    standin.publish_model(model)
    for fragment in standin.plan.fragments:
        entry = ops.latest_global(bus, fragment.index)
        assert entry is not None
        msg, values = ops.read_global(bus, entry, run_id="tl", limits=LIMITS)
        assert msg.version == 0
        np.testing.assert_array_equal(values, standin.theta(fragment.index, 0))


def test_standin_opens_rounds_in_fragment_order():
    cfg = tiny_config()
    bus = MemoryBus("tl", clock=FakeClock(100.0))
    standin = StandIn(bus, plan_of(cfg, tiny_model(cfg, seed=1)))
    assert [standin.open_round() for _ in range(5)] == [(0, 0), (1, 1), (2, 2), (3, 3), (0, 4)]
    entries = bus.read(bus.keys.opened_rounds())
    assert [
        RoundOpen.from_fields(e.fields, run_id="tl", limits=LIMITS).round_id for e in entries
    ] == [0, 1, 2, 3, 4]
