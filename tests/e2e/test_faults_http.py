"""Faults injected through the control plane's HTTP API into real processes (a synchronizer,
two learners, redis-server): each fault shows its effect in ``/api/learners``,
``/api/rounds`` and the fault's record, while merges continue.

kill: the learner process exits (137), goes dead, is restarted by the test and comes back;
stall: stalled, then active; slow: its step time rises; drop: rounds merge without it;
corrupt: its contributions are dead-lettered; disconnect: its heartbeat stops, then resumes;
delay: its contributions arrive too late, so rounds merge without them. The synchronizer obeys
``stall`` and ``disconnect`` from its own control stream: nothing merges meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_faults_http_support import TOKEN, System, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    with System(tmp_path_factory.mktemp("faults")) as running:
        yield running


def effects(system: System, fault_id: str) -> list[str]:
    return [e["note"] for e in system.fault(fault_id)["effects"]]


def noted(system: System, fault_id: str, words: str) -> None:
    wait_until(lambda: any(words in n for n in effects(system, fault_id)), 15, repr(words))


def merges_continue(system: System, since: int) -> None:
    wait_until(lambda: system.merged() > since + 2, 30, "merges to continue")


def test_stall_makes_a_learner_stalled_then_active(system: System):
    merged = system.merged()
    fault = system.post("/api/faults", {"target": "L1", "kind": "stall", "duration_s": 3})
    wait_until(lambda: system.learners()["L1"]["state"] == "stalled", 10, "L1 stalled")
    merges_continue(system, merged)
    wait_until(lambda: system.learners()["L1"]["state"] == "active", 20, "L1 active again")
    notes = wait_until(
        lambda: (
            system.fault(fault["fault_id"])["status"] == "done"
            and effects(system, fault["fault_id"])
        ),
        20,
        "the record",
    )
    assert notes[0].startswith("L1 went stalled") and any("active again" in n for n in notes)


def test_slow_multiplies_the_step_time(system: System):
    before = system.learners()["L0"]["step_time_s"]
    merged = system.merged()
    fault = system.post(
        "/api/faults", {"target": "L0", "kind": "slow", "duration_s": 6, "factor": 5}
    )
    wait_until(lambda: system.learners()["L0"]["step_time_s"] > 2 * before, 15, "L0 slower")
    merges_continue(system, merged)
    noted(system, fault["fault_id"], "step time of L0")


def test_drop_lets_rounds_merge_without_the_learner(system: System):
    merged = system.merged()
    t0 = time.time()
    fault = system.post("/api/faults", {"target": "L1", "kind": "drop", "duration_s": 5})
    noted(system, fault["fault_id"], "during the drop window")  # the window is over
    rounds = system.get("/api/rounds", limit=1000)
    window = [r for r in rounds if t0 + 1.0 <= r["closed_at_s"] <= t0 + 5.0]
    assert window and all(r["decision"] == "merge" for r in window), window
    without = [r for r in window if "L1" not in {c["learner_id"] for c in r["contributors"]}]
    assert len(without) >= len(window) - 1, [r["contributors"] for r in window]
    assert system.merged() > merged


def test_corrupt_contributions_are_dead_lettered(system: System):
    before = system.learners()["L0"]["contributions"]["dead_lettered"]
    merged = system.merged()
    fault = system.post("/api/faults", {"target": "L0", "kind": "corrupt", "count": 2})
    wait_until(
        lambda: system.learners()["L0"]["contributions"]["dead_lettered"] >= before + 2,
        20,
        "two dead-lettered contributions of L0",
    )
    merges_continue(system, merged)
    assert system.get("/api/state")["contributions"]["dead_lettered"] >= before + 2
    noted(system, fault["fault_id"], "dead-lettered")


def test_disconnect_silences_the_heartbeat_then_it_returns(system: System):
    merged = system.merged()
    fault = system.post("/api/faults", {"target": "L0", "kind": "disconnect", "duration_s": 3})
    wait_until(
        lambda: system.learners()["L0"]["state"] in ("straggling", "stalled", "dead"),
        10,
        "L0 silent",
    )
    merges_continue(system, merged)
    wait_until(lambda: system.learners()["L0"]["state"] == "active", 20, "L0 back")
    notes = wait_until(
        lambda: (
            system.fault(fault["fault_id"])["status"] == "done"
            and effects(system, fault["fault_id"])
        ),
        20,
        "the record",
    )
    assert notes[0].startswith("L0 went ") and any("active again" in n for n in notes)


def _rounds_closed(system: System, start: float, end: float) -> list[dict[str, object]]:
    rounds = system.get("/api/rounds", limit=1000)
    return [r for r in rounds if start <= float(r["closed_at_s"]) <= end]


def test_delay_holds_contributions_back_so_rounds_merge_without_them(system: System):
    merged = system.merged()
    t0 = time.time()
    fault = system.post(
        "/api/faults", {"target": "L0", "kind": "delay", "duration_s": 5, "delay_s": 2}
    )
    noted(system, fault["fault_id"], "during the delay window")
    window = _rounds_closed(system, t0 + 1.0, t0 + 5.0)
    with_l0 = [r for r in window if "L0" in {c["learner_id"] for c in r["contributors"]}]
    # each contribution waits 2 s before it is sent: rounds close on L1's without it
    assert len(window) >= 3 and len(with_l0) <= 1, [r["contributors"] for r in window]
    merges_continue(system, merged)


@pytest.mark.parametrize("kind", ["stall", "disconnect"])
def test_synchronizer_obeys_stall_and_disconnect_from_its_control_stream(system: System, kind: str):
    merges_continue(system, system.merged())
    t0 = time.time()
    fault = system.post("/api/faults", {"target": "synchronizer", "kind": kind, "duration_s": 4})
    noted(system, fault["fault_id"], "went silent")
    # nothing merges while it sleeps (stall) or acts as if Redis were gone (disconnect)
    assert _rounds_closed(system, t0 + 1.5, t0 + 3.5) == []
    merged = system.merged()
    merges_continue(system, merged)
    noted(system, fault["fault_id"], "active again")


def test_kill_exits_the_process_and_a_restart_comes_back(system: System):
    proc = system.procs["L1"]
    merged = system.merged()
    fault = system.post("/api/faults", {"target": "L1", "kind": "kill"})
    assert proc.wait(timeout=20) == 137
    wait_until(lambda: system.learners()["L1"]["state"] == "dead", 15, "L1 dead")
    merges_continue(system, merged)
    refused = system.http.post(
        "/api/faults",
        json={"target": "L1", "kind": "kill"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert refused.status_code == 409
    system.start_learner("L1")
    wait_until(
        lambda: (x := system.learners()["L1"])["state"] == "active" and x["restarts"] >= 1,
        120,
        "L1 restarted",
    )
    notes = wait_until(
        lambda: (
            system.fault(fault["fault_id"])["status"] == "done"
            and effects(system, fault["fault_id"])
        ),
        30,
        "the record",
    )
    assert any("went dead" in n for n in notes) and any("restarted (pid" in n for n in notes)


def test_the_api_documents_itself(system: System, tmp_path: Path):
    spec = system.get("/openapi.json")
    assert {"/api/faults", "/api/chaos", "/api/events", "/metrics"} <= set(spec["paths"])
