"""The control plane's alerts (``GET /api/alerts``, the snapshot's ``alerts``) and the learners'
train-loss curves (heartbeats → snapshot, ``/api/learners``, ``ddq_learner_train_loss``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dd_queue.control.app import tick
from tests.unit.test_control_support import Run, heartbeat, make_run

pytestmark = pytest.mark.unit


@pytest.fixture
def run() -> Iterator[Run]:
    yield from make_run()


def _alerts(run: Run) -> list[dict[str, object]]:
    """The alerts, less DDQNoMerge: this fixture's synchronizer writes its records on a fake
    wall clock (second 1000 of the epoch), so to the plane its last merge is 56 years old."""
    return [a for a in run.client.get("/api/alerts").json()["alerts"] if a["name"] != "DDQNoMerge"]


def test_every_rule_is_listed_and_a_healthy_run_has_no_alert(run: Run) -> None:
    tick(run.plane)
    body = run.client.get("/api/alerts").json()
    assert [r["name"] for r in body["rules"]][:2] == ["DDQExporterDown", "DDQLearnerDead"]
    assert len(body["rules"]) == 9 and body["evaluated_at_s"] is not None
    assert _alerts(run) == []


def test_a_dead_learner_goes_pending_then_firing_then_away(run: Run) -> None:
    tick(run.plane)
    states: list[set[tuple[object, object, object]]] = []
    for _ in range(8):  # L1 reports itself killed; 5 s a tick on the plane's clock
        heartbeat(run.bus, run.cfg, "L0")
        heartbeat(run.bus, run.cfg, "L1", state="killed")
        run.clock.advance(5.0)
        tick(run.plane)
        states.append({(a["name"], a["subject"], a["state"]) for a in _alerts(run)})
    dead = ("DDQLearnerDead", "learner L1")
    assert [(*dead, "pending") in s for s in states[:6]] == [True] * 6  # 0 .. 25 s
    assert (*dead, "firing") in states[6] and (*dead, "firing") in states[7]  # 30 s on
    assert not any("learner L0" in s for states_now in states for s in states_now)
    (alert,) = [a for a in _alerts(run) if a["subject"] == "learner L1"]
    assert alert["link"] == "#learner-L1" and alert["severity"] == "warning"
    snap = run.client.get("/api/snapshot").json()
    assert [a for a in snap["alerts"] if a["subject"] == "learner L1"] == [alert]
    heartbeat(run.bus, run.cfg, "L1", step=99)  # back: its alert ends at the next tick
    tick(run.plane)
    assert not [a for a in _alerts(run) if a["subject"] == "learner L1"]


def test_train_loss_from_heartbeats_one_point_per_step(run: Run) -> None:
    for step, loss in ((10, 5.5), (10, 5.5), (20, 4.25), (30, None)):
        heartbeat(run.bus, run.cfg, "L0", step=step, train_loss=loss)
        run.plane.refresh()
    snap = run.client.get("/api/snapshot").json()
    assert [(p[1], p[2]) for p in snap["train_loss"]["L0"]] == [(10, 5.5), (20, 4.25)]
    heartbeat(run.bus, run.cfg, "L0", step=40, train_loss=3.0)
    (l0,) = [x for x in run.client.get("/api/learners").json() if x["learner_id"] == "L0"]
    assert l0["train_loss"] == 3.0
    metrics = run.client.get("/metrics").text
    assert 'ddq_learner_train_loss{learner="L0"} 3.0' in metrics


def test_the_merged_token_share_is_merged_tokens_per_fragment_over_tokens_trained(
    run: Run,
) -> None:
    run.plane.refresh()
    state = run.client.get("/api/state").json()
    merged = sum(
        f["counters"].get(f"learner/{lid}/tokens_merged", 0)
        for f in state["fragments"]
        for lid in ("L0", "L1")
    )
    trained = sum(x["n_tokens"] for x in run.client.get("/api/learners").json())
    assert merged > 0 and trained > 0
    share = merged / len(state["fragments"]) / trained
    assert state["merged_token_share"] == pytest.approx(share)
    assert f"ddq_merged_token_share_ratio {share}" in run.client.get("/metrics").text
