"""Token fate end to end: real processes (redis-server, a synchronizer, two learners, the
control plane), faults through the HTTP API (slow, drop, corrupt, delay, stall, kill and a
relaunch), then a clean stop. Per learner, the tokens it computed equal the sum of their fates
exactly, every published token is settled (none in flight), and the faults show up as the fates
they cause: a drop as tokens dropped at the learner, a corrupt payload as dead-lettered ones."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_faults_http_support import System, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    with System(tmp_path_factory.mktemp("tokens")) as running:
        yield running


def _fates(system: System) -> dict[str, dict[str, Any]]:
    return {v["learner_id"]: v for v in system.get("/api/tokens")}


def _fault_done(system: System, body: dict[str, Any]) -> None:
    fault = system.post("/api/faults", {**body, "by": "test"})
    wait_until(lambda: system.fault(fault["fault_id"])["status"] == "done", 30, str(body))


def test_every_learner_balances_after_faults_and_a_clean_stop(system: System) -> None:
    merged = system.merged()
    _fault_done(system, {"target": "L0", "kind": "slow", "duration_s": 3, "factor": 3})
    _fault_done(system, {"target": "L1", "kind": "drop", "duration_s": 4})
    system.post("/api/faults", {"target": "L0", "kind": "corrupt", "count": 2, "by": "test"})
    wait_until(
        lambda: _fates(system)["L0"]["token_fragments"].get("dead_lettered", 0) > 0,
        30,
        "L0's corrupt contributions dead-lettered",
    )
    _fault_done(system, {"target": "L0", "kind": "delay", "duration_s": 4, "delay_s": 2})
    _fault_done(system, {"target": "L1", "kind": "stall", "duration_s": 3})
    system.post("/api/faults", {"target": "L1", "kind": "kill", "by": "test"})
    assert system.procs["L1"].wait(timeout=30) == 137
    relaunched = system.start_learner("L1")  # a second incarnation: counts add up in Redis
    wait_until(
        lambda: (
            (l1 := system.learners()["L1"])["pid"] == relaunched.pid
            and l1["state"] == "active"
            and l1["step"] > 20
            and system.merged() > merged + 4
        ),
        90,
        "the relaunched L1 training and merges going on",
    )
    live = _fates(system)
    assert all(v["balanced"] for v in live.values()), live  # while training, too

    for learner in ("L0", "L1"):  # a clean stop: each flushes its outbox and reports
        system.procs[learner].send_signal(signal.SIGTERM)
    for learner in ("L0", "L1"):
        assert system.procs[learner].wait(timeout=30) == 0, system.log_tail(learner)
    fates = _fates(system)
    for _ in range(300):  # every published token settles: the synchronizer drains the streams
        if all(v["fates"]["in_flight"] == 0 for v in fates.values()):
            break
        time.sleep(0.1)
        fates = _fates(system)
    else:
        pytest.fail(f"tokens still in flight 30 s after the learners stopped: {fates}")
    assert set(fates) == {"L0", "L1"}, fates
    for lid, view in fates.items():
        exact = view["token_fragments"]
        parts = {k: n for k, n in exact.items() if k != "computed"}
        assert view["balanced"] and view["reason"].startswith("balanced"), view
        assert exact["computed"] > 0 and sum(parts.values()) == exact["computed"], (lid, exact)
        assert all(n >= 0 for n in parts.values()), (lid, exact)
        assert exact["merged"] > 0, (lid, exact)
        print(lid, exact)  # shown with -s: the run's figures
    assert fates["L1"]["token_fragments"]["dropped_at_learner"] > 0  # the drop window
    assert fates["L0"]["token_fragments"]["dead_lettered"] > 0  # the corrupt payloads
    # /metrics says the same, and the page's data (the snapshot) carries it
    metrics = system.http.get("/metrics").text
    assert 'ddq_learner_token_fate_balanced{learner="L0"} 1.0' in metrics
    assert [t["learner_id"] for t in system.get("/api/snapshot")["tokens"]] == ["L0", "L1"]
