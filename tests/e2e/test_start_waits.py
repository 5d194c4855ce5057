"""Every ``ddq`` service started with Redis down, or before the run exists, waits and says so
in its log instead of exiting; once what it needs comes, it goes on. One test per service, each
with real processes and a real redis-server started late on the port the service was given.
The evaluator also rides out a Redis crash (kill -9, AOF) after it started evaluating; the
control plane's ``/readyz`` turns 503 while the synchronizer's heartbeat is stale (SIGSTOP)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dd_queue.keys import Keys
from tests.e2e.services_support import Services
from tests.integration.conftest import require_redis_server
from tests.redisproc import RedisProcess

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def late_redis() -> Iterator[RedisProcess]:
    """A redis-server (AOF) on a chosen port that is not started yet."""
    require_redis_server()
    server = RedisProcess(appendonly=True)
    try:
        yield server
    finally:
        server.close()


def _merged_rounds(server: RedisProcess, run_id: str = "order") -> int:
    keys, client = Keys(run_id), server.client()
    try:
        return sum(int(client.xlen(keys.rounds(p))) for p in range(2))
    finally:
        client.close()


def test_synchronizer_waits_for_redis_then_creates_the_run(
    tmp_path: Path, late_redis: RedisProcess
) -> None:
    services = Services(tmp_path, late_redis.url)
    try:
        services.start("synchronizer")
        services.wait_log("synchronizer", r"synchronizer\.waiting for Redis at .* s left", 90)
        late_redis.start()
        services.wait_log("synchronizer", r"synchronizer\.ready after .* s: redis", 60)
        services.wait_log(
            "synchronizer", r"synchronizer\.started sync-0 owns fragments \[0, 1\]", 60
        )
    finally:
        services.close()
    assert services.exit_codes == {"synchronizer": 0}


def test_learner_waits_for_redis_then_for_the_run_then_trains(
    tmp_path: Path, late_redis: RedisProcess
) -> None:
    services = Services(tmp_path, late_redis.url)
    try:
        services.start("learner")
        services.wait_log("L0", r"learner L0\.waiting for Redis at .* s left", 90)
        late_redis.start()
        services.wait_log("L0", r"learner\.waiting_for_globals 0/2 fragments published", 60)
        services.start("synchronizer")
        services.wait_for(lambda: _merged_rounds(late_redis) > 0, 120, "a merged round")
    finally:
        services.close()
    assert services.exit_codes == {"L0": 0, "synchronizer": 0}


def test_a_learner_waiting_for_the_global_model_stops_on_one_sigterm(
    tmp_path: Path, late_redis: RedisProcess
) -> None:
    """One SIGTERM ends the wait for the run's first global model at once (the sleeps wake on
    the stop), the learner exits 0 and frees its id, so a restart can take it."""
    late_redis.start()
    services = Services(tmp_path, late_redis.url)
    services.start("learner")
    services.wait_log("L0", r"learner\.waiting_for_globals 0/2 fragments published", 90)
    proc = services.procs["L0"]
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=30)
    took = time.monotonic() - started
    services.close()
    assert code == 0, services.logs()
    assert took < 10.0, f"{took:.1f} s to stop after SIGTERM\n{services.logs()}"
    assert "learner.join_stopped" in services.log("L0")
    client = late_redis.client()
    try:
        keys = Keys("order")
        assert client.hget(keys.heartbeat_data(), "L0") is None, "the id was not freed"
        assert client.zscore(keys.heartbeat_expiry(), "L0") is None, "the id was not freed"
    finally:
        client.close()


def test_evaluator_waits_for_redis_and_the_run_and_rides_out_a_redis_crash(
    tmp_path: Path, late_redis: RedisProcess
) -> None:
    services = Services(tmp_path, late_redis.url)
    try:
        services.start("evaluator")
        services.wait_log("evaluator", r"evaluator\.waiting for Redis at .* s left", 90)
        late_redis.start()
        services.wait_log("evaluator", r"evaluator\.waiting for run 'order' to be created", 60)
        services.start("synchronizer")
        services.wait_for(lambda: services.log("evaluator").count("eval.done") >= 1, 90, "eval")
        late_redis.kill()  # a crash: SIGKILL, then the same port again with the AOF
        services.wait_log("evaluator", r"eval\.waiting", 60)
        late_redis.start()
        done = services.log("evaluator").count("eval.done")
        services.wait_for(
            lambda: services.log("evaluator").count("eval.done") > done, 90, "eval after restart"
        )
        services.wait_log("evaluator", r"eval\.resumed after", 10)
    finally:
        services.close()
    assert services.exit_codes == {"evaluator": 0, "synchronizer": 0}


def test_control_plane_serves_while_redis_is_down_and_recovers(
    tmp_path: Path, late_redis: RedisProcess
) -> None:
    services = Services(tmp_path, late_redis.url)
    try:
        services.start("control")
        services.wait_for(
            lambda: services.http.get("/healthz").status_code == 200, 90, "/healthz answering"
        )
        ready = services.http.get("/readyz")
        assert ready.status_code == 503 and "redis" in ready.json()["reason"], ready.text
        assert services.http.get("/api/state").status_code == 503
        services.wait_log("control", r"control\.waiting for Redis", 30)
        late_redis.start()
        services.wait_for(
            lambda: services.http.get("/api/state").status_code == 200, 30, "/api/state"
        )
        services.wait_log("control", r"control\.redis_back after", 30)
        services.start("synchronizer")
        services.wait_for(
            lambda: services.http.get("/readyz").status_code == 200, 90, "/readyz ready"
        )
        sync = services.procs["synchronizer"]
        sync.send_signal(signal.SIGSTOP)  # alive, but its heartbeat goes stale
        try:
            stale = services.wait_for(
                lambda: (r := services.http.get("/readyz")).status_code == 503 and r,
                30,
                "/readyz 503 on a stale synchronizer heartbeat",
            )
            assert "s old > stalled_after_s" in stale.json()["reason"], stale.text
        finally:
            sync.send_signal(signal.SIGCONT)
        services.wait_for(
            lambda: services.http.get("/readyz").status_code == 200, 60, "/readyz ready again"
        )
    finally:
        services.close()
    assert services.exit_codes == {"control": 0, "synchronizer": 0}
