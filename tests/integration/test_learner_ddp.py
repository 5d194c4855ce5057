"""A learner of two ranks (DDP, gloo, CPU) against a real redis-server.

Only rank 0 talks to Redis; received global fragments are broadcast to rank 1; tokens are summed
over ranks; both ranks stop at the same step. Each rank writes what it saw to a file; the test
process plays the synchronizer.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dd_queue.bus import RedisBus
from dd_queue.clock import SystemClock
from dd_queue.learner import Learner, TorchGroup
from dd_queue.learner.service import PumpThreads
from dd_queue.messages import Heartbeat
from tests.ci import require
from tests.integration.conftest import wait_until
from tests.redisproc import RedisProcess, free_port
from tests.unit.test_learner_standin import (
    LIMITS,
    StandIn,
    plan_of,
    random_batches,
    tiny_config,
    tiny_model,
)

WORLD = 2
TOKENS_PER_RANK_STEP = 2 * 16


def _config(url: str, run_id: str):
    redis = {"url": url, "socket_timeout_s": 2.0, "max_block_ms": 200, "unavailable_after_s": 2.0}
    return tiny_config(run={"run_id": run_id}, redis=redis, learner={"max_steps": 3000})


def _rank_main(rank: int, port: int, url: str, run_id: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    cfg = _config(url, run_id)
    bus = RedisBus(url, run_id, options=cfg.redis.options()) if rank == 0 else None
    learner = Learner(
        cfg,
        learner_id="L0",
        model=tiny_model(cfg, seed=1 + rank),
        loader=random_batches(cfg, seed=rank),
        bus=bus,
        clock=SystemClock(),
        group=TorchGroup(),
    )
    learner.join()
    joined = np.concatenate([learner.params.read(p) for p in range(4)])
    applied: dict[str, list[float]] = {}
    tokens = []
    with PumpThreads(learner, receive_block_ms=50):
        while not (report := learner.step()).stop:
            tokens.append(report.n_tokens)
            for p, version in report.applied:
                applied[f"{p}:{version}"] = learner.params.read(p).tolist()
            if rank == 0 and "0:1" in applied:
                learner.request_stop()  # agreed at the next step: both ranks stop together
    np.save(Path(out) / f"joined{rank}.npy", joined)
    np.save(
        Path(out) / f"final{rank}.npy", np.concatenate([learner.params.read(p) for p in range(4)])
    )
    summary = {"steps": learner.step_count, "tokens": tokens, "applied": applied}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(summary))
    learner.leave()
    if bus is not None:
        bus.close()
    dist.destroy_process_group()


def test_two_rank_learner_shares_globals_and_counts_tokens_of_both(
    redis_server: RedisProcess, tmp_path: Path
):
    run_id = f"d{uuid.uuid4().hex[:8]}"
    cfg = _config(redis_server.url, run_id)
    bus = RedisBus(redis_server.url, run_id, options=cfg.redis.options())
    model = tiny_model(cfg, seed=7)
    standin = StandIn(bus, plan_of(cfg, model))
    standin.publish_model(model)
    ctx = mp.start_processes(
        _rank_main,
        args=(free_port(), redis_server.url, run_id, str(tmp_path)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    try:
        got: list = []

        def training() -> bool:
            ctx.join(timeout=0)  # raises if a rank failed
            info = bus.heartbeats().get("L0")
            if info is None:
                return False
            return (
                Heartbeat.from_bytes(info.payload, run_id=run_id, limits=LIMITS).state == "training"
            )

        def contributed() -> bool:
            ctx.join(timeout=0)
            got.extend(standin.contributions())
            return bool(got)

        wait_until(training, 60.0, "both ranks joined")  # rounds opened earlier are not asked
        standin.open_round(0)
        wait_until(contributed, 30.0, "rank 0's contribution to fragment 0")
        msg, delta = got[0]
        assert msg.n_tokens == msg.n_steps * WORLD * TOKENS_PER_RANK_STEP  # summed over ranks
        version = standin.apply_contribution(msg, delta)
        while not ctx.join(timeout=60):
            pass
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
        bus.close()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0]["steps"] == ranks[1]["steps"]  # stopped at the same step
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    assert all(t == WORLD * TOKENS_PER_RANK_STEP for t in ranks[0]["tokens"])
    expected = standin.theta(0, version)
    for r in range(WORLD):  # θ_0 right after the apply is Θ_0(v1), bit-exact, on both ranks
        np.testing.assert_array_equal(np.asarray(ranks[r]["applied"]["0:1"], np.float32), expected)
    for name in ("joined", "final"):  # DDP keeps the replicas identical
        np.testing.assert_array_equal(
            np.load(tmp_path / f"{name}0.npy"), np.load(tmp_path / f"{name}1.npy")
        )


@pytest.fixture(autouse=True)
def _gloo() -> None:
    """torch.distributed with gloo (every CPU wheel of torch has it): fails under CI."""
    require(
        dist.is_available() and dist.is_gloo_available(),
        "torch.distributed with gloo",
        "the CPU wheel of torch==2.13.0",
    )
