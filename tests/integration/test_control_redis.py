"""The control plane on a real redis-server, served by uvicorn: the SSE stream over real HTTP,
and what a client sees while Redis is down and after it comes back (503 with the reason, never
a 500; ready again without a restart of the control plane)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from dd_queue.bus import RedisBus, RedisOptions
from dd_queue.clock import SystemClock
from dd_queue.config import DDQConfig
from dd_queue.control import create_app
from dd_queue.messages import Heartbeat
from tests.integration.conftest import wait_until
from tests.redisproc import RedisProcess, free_port
from tests.unit.test_control_support import AUTH, config, heartbeat

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def sync_beat(bus: RedisBus, cfg: DDQConfig) -> None:
    hb = Heartbeat(
        run_id=cfg.run.run_id,
        config_digest=cfg.run_digest,
        role="synchronizer",
        member_id="sync-0",
        state="running",
        step=0,
        n_tokens=0,
        step_time_ema_s=None,
        versions={0: 0},
        queue_depths={"held": 0},
        device="cpu",
        host=socket.gethostname(),
        pid=os.getpid(),
        sent_at_s=time.time(),
    )
    bus.heartbeat("sync-0", hb.to_bytes(), ttl_s=cfg.membership.dead_after_s)


class Served:
    """The app on uvicorn in a thread, over ``server``, with live heartbeats of L0 and sync-0."""

    def __init__(self, server: RedisProcess) -> None:
        self.cfg = config("live", refresh_s=0.2)
        options = RedisOptions(unavailable_after_s=0.5, retry_base_s=0.01, retry_cap_s=0.05)
        self.bus = RedisBus(server.url, "live", options=options)
        self.writer = RedisBus(server.url, "live", options=options)
        app = create_app(self.cfg, self.bus, SystemClock())
        self.port = free_port()
        self.uvicorn = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None)
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10.0)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self.uvicorn.run, daemon=True),
            threading.Thread(target=self._beat, daemon=True),
        ]

    def _beat(self) -> None:
        while not self._stop.wait(0.1):
            try:
                heartbeat(self.writer, self.cfg, "L0")
                sync_beat(self.writer, self.cfg)
            except Exception:  # Redis down on purpose: keep trying
                time.sleep(0.1)

    def __enter__(self) -> Served:
        for thread in self._threads:
            thread.start()
        wait_until(lambda: self.uvicorn.started, 20, "uvicorn")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.uvicorn.should_exit = True
        for thread in self._threads:
            thread.join(timeout=10)
        self.http.close()
        self.bus.close()
        self.writer.close()


@pytest.fixture
def served(private_server: RedisProcess) -> Iterator[Served]:
    with Served(private_server) as running:
        yield running


def test_sse_streams_snapshots_over_http(served: Served):
    wait_until(lambda: served.http.get("/readyz").status_code == 200, 10, "ready")
    frames: list[dict] = []
    with served.http.stream("GET", "/api/events") as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("data: "):
                frames.append(json.loads(line[6:]))
            if len(frames) == 3:
                break
    assert [f["learners"][0]["learner_id"] for f in frames] == ["L0"] * 3
    assert frames[0]["generation"] < frames[-1]["generation"]


def test_redis_down_is_503_with_a_reason_and_recovers(served: Served, private_server):
    wait_until(lambda: served.http.get("/readyz").status_code == 200, 10, "ready")
    private_server.kill()
    t0 = time.monotonic()
    down = served.http.get("/readyz")
    assert down.status_code == 503 and "redis unreachable" in down.json()["reason"]
    assert time.monotonic() - t0 < 5.0
    for method, path in (("GET", "/api/learners"), ("GET", "/metrics"), ("POST", "/api/faults")):
        body = {"target": "L0", "kind": "stall", "duration_s": 1} if method == "POST" else None
        answer = served.http.request(method, path, json=body, headers=AUTH)
        assert answer.status_code == 503, (path, answer.text)
        assert "redis unavailable" in answer.json()["detail"]
    private_server.start()
    wait_until(lambda: served.http.get("/readyz").status_code == 200, 20, "ready again")
    assert served.http.get("/api/learners/L0").json()["state"] in ("active", "straggling")
