"""The learner as a real process (``python -m dd_queue.services.learner`` / ``ddq learner``) on a
real redis-server: joins, trains, publishes, leaves cleanly on SIGTERM, exits at once on a kill
fault, and refuses a learner id that is already live."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from dd_queue.bus import RedisBus, ops
from dd_queue.clock import SystemClock
from dd_queue.config import DDQConfig
from dd_queue.learner import Learner
from dd_queue.learner.service import KILLED_EXIT_CODE, PumpThreads
from dd_queue.messages import FaultCommand, Heartbeat
from tests.integration.conftest import wait_until
from tests.redisproc import RedisProcess
from tests.unit.test_learner_standin import (
    LIMITS,
    StandIn,
    plan_of,
    random_batches,
    tiny_config,
    tiny_model,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def setup(redis_server: RedisProcess, tmp_path: Path) -> Iterator[tuple[DDQConfig, Path, StandIn]]:
    redis = {
        "url": redis_server.url,
        "socket_timeout_s": 2.0,
        "max_block_ms": 200,
        "unavailable_after_s": 2.0,
    }
    cfg = tiny_config(
        run={"run_id": f"p{uuid.uuid4().hex[:8]}", "log_level": "DEBUG"},
        redis=redis,
        data={"max_bytes": 1 << 17},
    )
    path = tmp_path / "learner.yaml"
    path.write_text(yaml.safe_dump(cfg.public_dict()))
    bus = RedisBus(cfg.redis.url, cfg.run.run_id, options=cfg.redis.options())
    model = tiny_model(cfg, seed=7)
    standin = StandIn(bus, plan_of(cfg, model))
    standin.publish_model(model)
    try:
        yield cfg, path, standin
    finally:
        bus.close()


def start(
    path: Path, *args: str, module: str = "dd_queue.services.learner"
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", module, *args, "--config", str(path), "--learner-id", "L0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def beat(standin: StandIn) -> Heartbeat | None:
    info = standin.bus.heartbeats().get("L0")
    return (
        Heartbeat.from_bytes(info.payload, run_id=standin.bus.keys.run_id, limits=LIMITS)
        if info
        else None
    )


def finish(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"learner process did not exit:\n{out}")
    return proc.returncode, out


def test_service_trains_publishes_and_leaves_cleanly_on_sigterm(setup):
    _, path, standin = setup
    proc = start(path)
    try:
        wait_until(lambda: (b := beat(standin)) is not None and b.step > 2, 60.0, "training")
        got: list = []
        for _ in range(3):
            _, round_id = standin.open_round()

            def arrived(round_id: int = round_id) -> bool:
                got.extend(standin.contributions())
                return any(m.round_id == round_id for m, _ in got)

            wait_until(arrived, 10.0, f"contribution to round {round_id}")
        proc.send_signal(signal.SIGTERM)
        code, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, out
    assert "learner.stopping" in out and "learner.left" in out
    assert beat(standin) is None  # deregistered
    assert {m.round_id for m, _ in got} >= {0, 1, 2}


def test_kill_fault_command_exits_at_once(setup):
    cfg, path, standin = setup
    proc = start(path, "learner", module="dd_queue.cli")
    try:
        wait_until(lambda: (b := beat(standin)) is not None and b.step > 0, 60.0, "training")
        cmd = FaultCommand(
            run_id=cfg.run.run_id,
            fault_id="k1",
            target="L0",
            kind="kill",
            params={},
            duration_s=None,
            issued_at_s=time.time(),
        )
        ops.send_command(standin.bus, "L0", cmd.to_fields())
        code, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == KILLED_EXIT_CODE, out
    assert "learner.killed" in out and "learner.left" not in out


def test_a_live_learner_id_is_refused_with_a_clear_error(setup):
    cfg, path, _ = setup
    torch.set_num_threads(1)
    bus = RedisBus(cfg.redis.url, cfg.run.run_id, options=cfg.redis.options())
    learner = Learner(
        cfg,
        learner_id="L0",
        model=tiny_model(cfg, seed=1),
        loader=random_batches(cfg),
        bus=bus,
        clock=SystemClock(),
    )
    try:
        learner.join()
        with PumpThreads(learner, receive_block_ms=50):  # keeps its heartbeat fresh
            code, out = finish(start(path))
    finally:
        learner.leave()
        bus.close()
    assert code == 2, out
    assert "learner id 'L0' is live on" in out and "pick another --learner-id" in out
