"""The learner against the real synchronizer, in one thread on MemoryBus + FakeClock (the way
the in-process runner drives them): the protocol of docs/protocol.md end to end.

Special case of ../shared/algorithm.md: one learner, K = 1, outer SGD with lr 1 and no momentum,
weighted mean, fp32 contributions: each merged global version equals the learner's fragment as
it was snapshotted for that round (up to fp32 rounding of Θ − (Θ − θ)).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dd_queue.bus import ops
from dd_queue.bus.memory import MemoryBus
from dd_queue.clock import FakeClock
from dd_queue.errors import ConfigError
from dd_queue.learner import Learner
from dd_queue.synchronizer import Synchronizer
from tests.unit.test_learner_standin import LIMITS, random_batches, tiny_config, tiny_model

STEP_S = 0.05


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_one_learner_with_outer_sgd_1_publishes_its_own_snapshots():
    cfg = tiny_config(synchronizer={"outer_lr": 1.0, "outer_momentum": 0.0, "merge_rule": "mean"})
    clock = FakeClock(100.0)
    bus = MemoryBus(cfg.run.run_id, clock=clock)
    sync = Synchronizer(cfg, bus=bus, clock=clock)
    sync.start()
    learner = Learner(
        cfg,
        learner_id="L0",
        model=tiny_model(cfg, seed=3),
        loader=random_batches(cfg),
        bus=bus,
        clock=clock,
    )
    assert learner.join() == dict.fromkeys(range(4), 0)
    snapped: dict[int, np.ndarray] = {}  # round → θ_p at its snapshot
    for _ in range(24):
        report = learner.step()
        applied = {p for p, _ in report.applied}
        snapped.update({r: learner.params.read(p) for p, r in report.snapshots if p not in applied})
        clock.advance(STEP_S)
        learner.pump()
        sync.pump(block_ms=0)
    assert min(learner.versions.values()) >= 3
    checked = 0
    for p in range(4):
        for entry in bus.read(bus.keys.down(p)):
            msg, theta = ops.read_global(bus, entry, run_id=cfg.run.run_id, limits=LIMITS)
            if msg.version > 0 and msg.round_id in snapped:
                np.testing.assert_allclose(theta, snapped[msg.round_id], rtol=0, atol=1e-6)
                checked += 1
    assert checked >= 8


def test_a_learner_of_another_plan_is_refused_at_join():
    cfg = tiny_config()
    clock = FakeClock(100.0)
    bus = MemoryBus(cfg.run.run_id, clock=clock)
    Synchronizer(cfg, bus=bus, clock=clock).start()
    other = tiny_config(synchronizer={"sync_every_steps": 8})  # another run digest
    learner = Learner(
        other,
        learner_id="L0",
        model=tiny_model(other, seed=3),
        loader=random_batches(other),
        bus=bus,
        clock=clock,
    )
    with pytest.raises(ConfigError, match="would be dead-lettered"):
        learner.join()
