"""Every route of the control plane through TestClient over fakeredis: reads, auth failures,
bad bodies, fault delivery and records, chaos, metrics, SSE, the dashboard, Redis down."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator

import pytest

from tests.unit.test_control_support import AUTH, Run, commands, heartbeat, make_run


@pytest.fixture
def run() -> Iterator[Run]:
    yield from make_run()


# ── health ──────────────────────────────────────────────────────────────────────────────────


def test_healthz_answers_without_redis(run: Run):
    run.server.connected = False
    assert run.client.get("/healthz").json()["status"] == "ok"


def test_readyz_needs_a_fresh_synchronizer_heartbeat(run: Run):
    ok = run.client.get("/readyz")
    assert ok.status_code == 200 and "synchronizer sync-0 heartbeat" in ok.json()["reason"]
    run.bus.remove_heartbeat("sync-0")
    gone = run.client.get("/readyz")
    assert gone.status_code == 503 and "no synchronizer heartbeat" in gone.json()["reason"]


def test_readyz_and_reads_answer_503_when_redis_is_down(run: Run):
    run.server.connected = False
    down = run.client.get("/readyz")
    assert down.status_code == 503 and "redis unreachable" in down.json()["reason"]
    for path in ("/api/learners", "/api/state", "/metrics"):
        answer = run.client.get(path)
        assert answer.status_code == 503, path
        assert "redis unavailable" in answer.json()["detail"]


# ── learners, state, rounds ─────────────────────────────────────────────────────────────────


def test_learners_show_state_progress_and_contributions(run: Run):
    learners = {x["learner_id"]: x for x in run.client.get("/api/learners").json()}
    assert set(learners) == {"L0", "L1"}
    l0, l1 = learners["L0"], learners["L1"]
    assert l0["state"] == "active" and "straggling_after_s" in l0["reason"]
    assert l0["contributions"]["merged"] == 1 and l0["last_weights"] == {"0": 1.0}
    assert l1["contributions"]["dead_lettered"] == 1 and l1["contributions"]["merged"] == 0
    assert l0["versions"] == {"0": 1, "1": 0} and l0["step"] == 10 and l0["pid"] > 0


def test_token_fates_balance_per_learner(run: Run):
    n = run.cfg.synchronizer.n_fragments
    fates = {v["learner_id"]: v for v in run.client.get("/api/tokens").json()}
    assert set(fates) == {"L0", "L1"}
    l0, l1 = fates["L0"], fates["L1"]
    assert l0["computed"] == l1["computed"] == 400  # 400 tokens for each fragment
    assert l0["token_fragments"] == {
        "computed": 400 * n,
        "merged": 400,
        "dropped_at_learner": 0,
        "unsent": 400 * (n - 1),
        "in_flight": 0,
    }
    assert l1["token_fragments"]["dead_lettered"] == 400  # its payload held NaN
    for view in (l0, l1):
        assert view["balanced"] and view["reason"].startswith("balanced"), view
        assert sum(view["fates"].values()) == pytest.approx(view["computed"])
    snapshot = run.client.get("/api/snapshot").json()
    assert [t["learner_id"] for t in snapshot["tokens"]] == ["L0", "L1"]


def test_one_learner_and_unknown_or_malformed_ids(run: Run):
    assert run.client.get("/api/learners/L1").json()["learner_id"] == "L1"
    missing = run.client.get("/api/learners/L9")
    assert missing.status_code == 404 and "unknown learner 'L9'" in missing.json()["detail"]
    assert run.client.get("/api/learners/%7Bbad%7D").status_code == 422


def test_reported_stall_and_expired_heartbeat_show_as_states(run: Run):
    heartbeat(run.bus, run.cfg, "L1", state="stalled")
    l1 = run.client.get("/api/learners/L1").json()
    assert l1["state"] == "stalled" and "reports 'stalled'" in l1["reason"]
    run.bus.remove_heartbeat("L0")  # gone while fresh: a clean leave
    assert run.client.get("/api/learners/L0").json()["state"] == "left"


def test_state_has_fragments_totals_quorum_and_goodput(run: Run):
    state = run.client.get("/api/state").json()
    assert state["run_id"] == run.cfg.run.run_id and state["config_digest"] == run.cfg.digest
    versions = {f["fragment_id"]: f["version"] for f in state["fragments"]}
    assert versions == {0: 1, 1: 0}
    assert state["rounds_merged"] == 1 and state["contributions"]["dead_lettered"] == 1
    assert state["bytes_in"] > 0 and state["bytes_out"] > 0
    assert state["quorum"]["quorum"] == 1 and state["quorum"]["live_learners"] == 2
    assert state["last_decisions"][0]["decision"] == "merge"
    assert 0.0 <= state["goodput"]["goodput"] <= 1.0 and state["writes_enabled"] is True
    assert state["synchronizers"][0]["synchronizer_id"] == "sync-0"


def test_rounds_newest_first_with_contributors_and_bytes(run: Run):
    [record] = run.client.get("/api/rounds", params={"limit": 5}).json()
    assert record["fragment_id"] == 0 and record["version_after"] == 1
    assert record["contributors"][0]["learner_id"] == "L0" and record["bytes_out"] > 0
    assert run.client.get("/api/rounds", params={"fragment_id": 1}).json() == []


@pytest.mark.parametrize(
    "query", [{"limit": 0}, {"limit": 1001}, {"limit": "x"}, {"fragment_id": -1}]
)
def test_rounds_refuses_bad_queries(run: Run, query):
    assert run.client.get("/api/rounds", params=query).status_code == 422


# ── faults: auth, validation, delivery, records ─────────────────────────────────────────────

STALL = {"target": "L1", "kind": "stall", "duration_s": 2.0}


@pytest.mark.parametrize(
    ("headers", "words"),
    [
        ({}, "missing 'Authorization: Bearer"),
        ({"Authorization": "Bearer nope"}, "wrong bearer"),
        ({"Authorization": "Basic abc"}, "missing"),
    ],
)
def test_fault_injection_needs_the_token(run: Run, headers, words):
    answer = run.client.post("/api/faults", json=STALL, headers=headers)
    assert answer.status_code == 401 and words in answer.json()["detail"]
    assert answer.headers["www-authenticate"].startswith("Bearer")
    assert commands(run.bus, run.cfg, "L1") == []


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({**STALL, "colour": "red"}, "extra"),
        ({**STALL, "duration_s": 0}, "greater than 0"),
        ({**STALL, "duration_s": 1e9}, "less than or equal"),
        ({**STALL, "duration_s": "5"}, "valid number"),
        ({"target": "L1", "kind": "stall"}, "needs duration_s"),
        ({"target": "L1", "kind": "kill", "duration_s": 3}, "no duration"),
        ({"target": "L1", "kind": "melt", "duration_s": 3}, "kill"),
        ({**STALL, "factor": 2}, "factor applies only to kind 'slow'"),
        ({"target": "synchronizer", "kind": "slow", "duration_s": 3}, "synchronizer takes"),
        ({"target": "L{1}", "kind": "kill"}, "pattern"),
        ({"target": "L1", "kind": "corrupt", "count": 2, "duration_s": 3}, "not both"),
        ({**STALL, "point": "before_step"}, "point applies only to kind 'kill'"),
        ({"target": "L1", "kind": "kill", "point": "after_merge"}, "not a safe point of a learner"),
        (
            {"target": "synchronizer", "kind": "kill", "point": "before_publish"},
            "not a safe point of the synchronizer",
        ),
        ({"target": "L1", "kind": "kill", "point": "anywhere"}, "before_publish"),
    ],
)
def test_bad_fault_bodies_are_422_with_the_reason(run: Run, body, words):
    answer = run.client.post("/api/faults", json=body, headers=AUTH)
    assert answer.status_code == 422
    assert words in json.dumps(answer.json()["detail"])


@pytest.mark.parametrize(
    "raw", [b"{", b"[1, 2]", b'{"target": "L1", "kind": "stall", "duration_s": NaN}']
)
def test_malformed_json_is_422(run: Run, raw):
    headers = {**AUTH, "Content-Type": "application/json"}
    assert run.client.post("/api/faults", content=raw, headers=headers).status_code == 422


def test_unknown_and_dead_targets_are_refused(run: Run):
    unknown = run.client.post("/api/faults", json={"target": "L7", "kind": "kill"}, headers=AUTH)
    assert unknown.status_code == 404 and "unknown learner 'L7'" in unknown.json()["detail"]
    run.bus.remove_heartbeat("L1")
    gone = run.client.post("/api/faults", json={"target": "L1", "kind": "kill"}, headers=AUTH)
    assert gone.status_code == 409 and "restart it first" in gone.json()["detail"]


def test_fault_goes_to_the_target_control_stream_and_is_recorded(run: Run):
    answer = run.client.post("/api/faults", json={**STALL, "by": "alice"}, headers=AUTH)
    assert answer.status_code == 201, answer.text
    fault = answer.json()
    [cmd] = commands(run.bus, run.cfg, "L1")
    assert (cmd.fault_id, cmd.kind, cmd.duration_s, cmd.target) == (
        fault["fault_id"],
        "stall",
        2.0,
        "L1",
    )
    assert fault["by"] == "alice@testclient" and fault["status"] == "sent"
    assert fault["command_ids"] and fault["issued_at_s"] > 0
    [listed] = run.client.get("/api/faults").json()
    assert listed["fault_id"] == fault["fault_id"]
    learner = run.client.get("/api/learners/L1").json()
    assert learner["active_faults"] == [fault["fault_id"]]


def test_a_kill_carries_its_point_to_the_target(run: Run):
    body = {"target": "L1", "kind": "kill", "point": "before_publish"}
    answer = run.client.post("/api/faults", json=body, headers=AUTH)
    assert answer.status_code == 201, answer.text
    [cmd] = commands(run.bus, run.cfg, "L1")
    assert (cmd.kind, cmd.params) == ("kill", {"point": "before_publish"})
    assert answer.json()["params"] == {"point": "before_publish"}


def test_corrupt_count_random_target_and_synchronizer_kill(run: Run):
    corrupt = {"target": "L0", "kind": "corrupt", "count": 3}
    assert run.client.post("/api/faults", json=corrupt, headers=AUTH).status_code == 201
    assert [c.fault_id[-2:] for c in commands(run.bus, run.cfg, "L0")] == ["-1", "-2", "-3"]
    picked = run.client.post(
        "/api/faults", json={"target": "random", "kind": "drop", "duration_s": 1}, headers=AUTH
    ).json()
    assert picked["target"] in ("L0", "L1")
    sync = run.client.post(
        "/api/faults", json={"target": "synchronizer", "kind": "kill"}, headers=AUTH
    )
    assert sync.status_code == 201
    assert commands(run.bus, run.cfg, "synchronizer")[0].kind == "kill"


def test_observed_effects_fill_the_record(run: Run):
    fault = run.client.post("/api/faults", json=STALL, headers=AUTH).json()
    run.beat_all(L1="stalled")
    run.plane.tick()
    run.clock.advance(2.5)
    run.beat_all()
    run.plane.tick()
    [record] = run.client.get("/api/faults").json()
    notes = [e["note"] for e in record["effects"]]
    assert record["fault_id"] == fault["fault_id"] and record["status"] == "done", notes
    assert notes[0].startswith("L1 went stalled after") and "active again" in notes[1]
    assert "closed after" in notes[-1]


def test_writes_are_off_without_a_configured_token(caplog):
    caplog.set_level(logging.WARNING, "dd_queue.control")
    for run in make_run(admin_token=None):
        answer = run.client.post("/api/faults", json=STALL, headers=AUTH)
        assert answer.status_code == 403 and "disabled" in answer.json()["detail"]
        assert run.client.get("/api/state").json()["writes_enabled"] is False
    assert sum("control.token generated" in r.message for r in caplog.records) == 1


def test_generated_token_works_when_writes_are_enabled(caplog):
    caplog.set_level(logging.WARNING, "dd_queue.control")
    for run in make_run(admin_token=None, enable_writes=True):
        found = (re.search(r"admin token (\S+);", r.message) for r in caplog.records)
        token = next(m.group(1) for m in found if m)
        headers = {"Authorization": f"Bearer {token}"}
        assert run.client.post("/api/faults", json=STALL, headers=headers).status_code == 201
        assert run.client.post("/api/faults", json=STALL, headers=AUTH).status_code == 401


# ── chaos ───────────────────────────────────────────────────────────────────────────────────

START = {"action": "start", "seed": 7, "duration_s": 30, "rates_per_min": {"stall": 20, "slow": 10}}


def test_chaos_start_fires_due_faults_then_stops_and_replays(run: Run):
    started = run.client.post("/api/chaos", json=START, headers=AUTH).json()
    schedule = started["schedule"]
    assert started["active"] and schedule["seed"] == 7 and schedule["targets"] == ["L0", "L1"]
    assert run.client.post("/api/chaos", json=START, headers=AUTH).status_code == 409
    run.clock.advance(10.0)
    run.beat_all()
    run.plane.tick()
    fired = run.client.get("/api/chaos").json()["fired"]
    faults = run.client.get("/api/faults").json()
    assert fired > 0 and len(faults) == fired
    assert all(f["chaos"] == schedule["schedule_id"] for f in faults)
    stopped = run.client.post("/api/chaos", json={"action": "stop"}, headers=AUTH).json()
    assert not stopped["active"]
    assert run.client.post("/api/chaos", json={"action": "stop"}, headers=AUTH).status_code == 409
    again = run.client.post("/api/chaos", json={"action": "replay"}, headers=AUTH).json()
    assert again["schedule"]["replay_of"] == schedule["schedule_id"]
    assert again["schedule"]["planned"] == schedule["planned"] and again["schedule"]["seed"] == 7


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"action": "start", "duration_s": 10, "rates_per_min": {"stall": 0}}, 422),
        ({"action": "start", "duration_s": 10, "rates_per_min": {"melt": 1}}, 422),
        ({"action": "start", "duration_s": 86400, "rates_per_min": {"stall": 60}}, 422),
        ({"action": "stop", "seed": 1}, 422),
        ({"action": "dance"}, 422),
        ({"action": "replay", "schedule_id": "nope"}, 404),
        ({**START, "targets": ["L9"]}, 404),
    ],
)
def test_bad_chaos_requests(run: Run, body, status):
    assert run.client.post("/api/chaos", json=body, headers=AUTH).status_code == status
    assert run.client.post("/api/chaos", json=START).status_code == 401


# ── metrics, SSE, dashboard ─────────────────────────────────────────────────────────────────


def test_events_stream_snapshots(run: Run):
    with run.client.stream("GET", "/api/events", params={"limit": 2}) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        text = "".join(answer.iter_text())
    frames = [f for f in text.split("\n\n") if "event: snapshot" in f]
    assert len(frames) == 2
    data = json.loads(frames[0].split("data: ", 1)[1])
    assert {x["learner_id"] for x in data["learners"]} == {"L0", "L1"}
    assert data["state"]["rounds_merged"] == 1
    assert run.client.get("/api/snapshot").json()["rounds"][0]["fragment_id"] == 0


def test_dashboard_page_assets_and_plotly_from_the_package(run: Run):
    page = run.client.get("/")
    assert page.status_code == 200 and '<table id="learners">' in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert run.client.get("/static/dashboard.js").status_code == 200
    plotly = run.client.get("/vendor/plotly.min.js")
    assert plotly.status_code == 200 and len(plotly.content) > 1_000_000
