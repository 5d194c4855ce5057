"""The dashboard in a real browser (headless Debian chromium driven by Playwright) against a
running system: learners are listed live, a click on a learner's ``stall`` button stalls it,
the table shows the new state, and a screenshot is saved as a test artefact. A second test
clicks every fault button (each fault's effect is observed), the duration input, the chaos
toggle, waits for the eval chart's points, and checks the page through a Redis outage.

Set ``DDQ_DASHBOARD_SCREENSHOT=docs/dashboard.png`` to also copy the screenshot there.
Without chromium the test skips locally and fails under ``CI=true`` (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.ci import import_or_require, require
from tests.e2e.test_faults_http_support import TOKEN, System, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str:
    for name in CHROMIUM:
        if found := shutil.which(name):
            return found
    require(False, "a chromium browser", "apt-get install chromium")
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    with System(tmp_path_factory.mktemp("dashboard")) as running:
        yield running


@contextmanager
def dashboard_page(system: System, errors: list[str]) -> Iterator[Any]:
    """The dashboard, with the admin token, in headless Chromium; page errors go to ``errors``."""
    sync_api = import_or_require("playwright.sync_api", "pip install -e '.[dev]'")
    executable = chromium_path()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=executable, headless=True, args=["--no-sandbox"]
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{system.http.base_url}/#token={TOKEN}")
            yield page
        finally:
            browser.close()


def test_dashboard_lists_learners_and_a_fault_button_changes_a_state(
    system: System, tmp_path: Path
):
    errors: list[str] = []
    with dashboard_page(system, errors) as page:
        for learner in ("L0", "L1"):
            page.wait_for_selector(f"tr[data-learner={learner}][data-state=active]")
        page.wait_for_selector("#conn.ok")
        page.wait_for_selector("#timeline .bars")  # Plotly drew the round timeline
        page.wait_for_function(  # one train-loss curve per learner, from their heartbeats
            "() => { const d = document.getElementById('train').data;"
            " return d && d.length === 2 && d.every((t) => t.y.length > 1); }",
            timeout=60_000,
        )
        for learner in ("L0", "L1"):  # token fate: each learner's row says it balances
            page.wait_for_selector(
                f"#tokens tr[data-learner={learner}] td.ok[data-fate=balance]:has-text('✓')",
                timeout=60_000,
            )
        page.wait_for_selector("#tokens td[data-fate=merged]")
        assert "every learner balances" in page.text_content("#tokens-summary")
        page.click("tr[data-learner=L1] button[data-fault=stall]")
        page.wait_for_selector("#action-msg:has-text('stall sent to L1')")
        page.wait_for_selector("tr[data-learner=L1][data-state=stalled]", timeout=10_000)
        assert "stalled" in page.inner_text("tr[data-learner=L1] td.state")
        page.wait_for_selector("#faults li:has-text('stall L1 by dashboard')")
        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot))
    assert not errors, errors
    assert shot.stat().st_size > 10_000
    print(f"dashboard screenshot: {shot}")
    if copy_to := os.environ.get("DDQ_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(shot, copy_to)
    recorded = wait_until(
        lambda: [f for f in system.get("/api/faults") if f["target"] == "L1"],
        10,
        "the dashboard's fault in the API",
    )
    assert recorded[0]["by"].startswith("dashboard@") and recorded[0]["kind"] == "stall"


def test_a_snapshot_from_before_the_chaos_post_does_not_undo_the_toggle(system: System) -> None:
    """The box the user ticked stays ticked while the POST is in flight, however many snapshots
    (all still saying "chaos off") arrive meanwhile; once the POST lands the server agrees."""
    errors: list[str] = []
    with dashboard_page(system, errors) as page:
        page.wait_for_selector("#conn.ok")
        page.evaluate(
            "() => { window.renders = 0; const draw = window.render;"
            " window.render = (snap) => { window.renders += 1; draw(snap); }; }"
        )
        held: list[Any] = []
        page.route("**/api/chaos", lambda route: held.append(route))
        with page.expect_request("**/api/chaos"):
            page.check("#chaos")
        page.wait_for_function("() => window.renders >= 2", timeout=30_000)
        assert system.get("/api/chaos")["active"] is False  # the POST is still held
        assert page.is_checked("#chaos")
        held[0].continue_()
        page.wait_for_selector("#action-msg:has-text('chaos started')")
        page.wait_for_selector("#chaos-status:has-text('running')")
        assert page.is_checked("#chaos")
        # The stop lands on the server, and a snapshot saying "chaos off" is drawn before the
        # POST's reply reaches the page: the page still says the stop worked.
        with page.expect_request("**/api/chaos"):
            page.uncheck("#chaos")
        response = held[1].fetch()
        assert response.ok, response.text()
        wait_until(lambda: system.get("/api/chaos")["active"] is False, 10, "chaos off")
        drawn = page.evaluate("() => window.renders")
        page.wait_for_function(f"() => window.renders >= {drawn + 2}", timeout=30_000)
        held[1].fulfill(response=response)
        page.wait_for_selector("#action-msg:has-text('chaos stopped')")
        assert not page.is_checked("#chaos")
        page.unroute("**/api/chaos")
    assert not errors, errors


FAULT_KINDS = ("stall", "slow", "drop", "delay", "corrupt", "disconnect", "kill")


def _fault_of(system: System, kind: str, target: str, after_s: float) -> dict[str, object] | None:
    return next(
        (
            f
            for f in system.get("/api/faults", limit=200)
            if f["kind"] == kind and f["target"] == target and f["issued_at_s"] >= after_s
        ),
        None,
    )


def test_every_control_of_the_dashboard_works_in_a_browser(
    system: System, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fault button (with the duration input), the chaos toggle, the eval chart once an
    evaluator runs, and the connection pill while Redis is down and after it is back."""
    monkeypatch.setenv("DDQ__SYNCHRONIZER__EVAL_INTERVAL_S", "2")
    system.spawn("evaluator", "dd_queue.cli", "evaluator")
    errors: list[str] = []
    with dashboard_page(system, errors) as page:
        page.wait_for_selector("#conn.ok")
        page.fill("#fault-duration", "6")
        for kind in FAULT_KINDS:
            wait_until(lambda: system.learners()["L0"]["state"] == "active", 60, "L0 active")
            sent_at = time.time() - 1.0
            page.click(f"tr[data-learner=L0] button[data-fault={kind}]")
            page.wait_for_selector(f"#action-msg:has-text('{kind} sent to L0')")
            fault = wait_until(lambda k=kind, t=sent_at: _fault_of(system, k, "L0", t), 10, kind)
            assert str(fault["by"]).startswith("dashboard@"), fault
            if kind not in ("kill", "corrupt"):
                assert fault["duration_s"] == 6.0, fault  # the duration input was used
            done = wait_until(
                lambda kind=kind, sent_at=sent_at: (
                    (x := _fault_of(system, kind, "L0", sent_at)) is not None
                    and x["status"] in ("effective", "done")
                    and x["effects"]
                    and x
                ),
                75,
                f"the {kind} fault's observed effect",
            )
            assert done["effects"], done
            if kind == "kill":
                assert system.procs["L0"].wait(timeout=20) == 137
                system.start_learner("L0")
                # back before Redis goes down: a learner still waiting for the global model
                # does not react to SIGTERM yet (join's wait sleeps on the clock)
                wait_until(
                    lambda: (
                        system.learners()["L0"]["state"] == "active"
                        and system.learners()["L0"]["restarts"] >= 1
                    ),
                    120,
                    "L0 restarted",
                )
        page.check("#chaos")
        page.wait_for_selector("#action-msg:has-text('chaos started')")
        page.wait_for_selector("#chaos-status:has-text('running')")
        assert system.get("/api/chaos")["active"] is True
        page.uncheck("#chaos")
        page.wait_for_selector("#action-msg:has-text('chaos stopped')")
        wait_until(lambda: system.get("/api/chaos")["active"] is False, 10, "chaos off")
        page.wait_for_function(
            "() => { const d = document.getElementById('eval').data;"
            " return d && d.length && d[0].y.length > 0; }",
            timeout=60_000,
        )
        system.redis.kill()  # Redis down: SSE problem events, the pill says so
        page.wait_for_selector("#conn.bad", timeout=30_000)
        assert "redis" in page.inner_text("#conn").lower()
        system.redis.start()
        page.wait_for_selector("#conn.ok", timeout=60_000)  # and the page recovers
    assert not errors, errors


def test_the_alerts_panel_fires_on_a_dead_learner_and_links_to_it(
    system: System, tmp_path: Path
) -> None:
    """A killed learner: DDQLearnerDead is pending, then firing after the rule's 30 s, in the
    API and on the page; its link shows the learner's row; the page makes no request outside
    its own origin and logs no console error; back to no alert once the learner returns."""
    errors: list[str] = []
    with dashboard_page(system, errors) as page:
        outside: list[str] = []
        page.on(
            "request",
            lambda r: (
                None if r.url.startswith(str(system.http.base_url)) else outside.append(r.url)
            ),
        )
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.wait_for_selector("#conn.ok")

        def dead_alerts() -> list[dict[str, Any]]:
            alerts = system.get("/api/alerts")["alerts"]
            return [a for a in alerts if a["name"] == "DDQLearnerDead"]

        # earlier tests dead-lettered a corrupt contribution: that alert may still be on
        wait_until(lambda: not dead_alerts(), 60, "no dead learner at first")
        page.wait_for_selector("#alerts li")
        rules = [r["name"] for r in system.get("/api/alerts")["rules"]]
        assert "DDQLearnerDead" in rules and len(rules) == 9, rules
        system.post("/api/faults", {"target": "L1", "kind": "kill", "by": "test"})
        assert system.procs["L1"].wait(timeout=20) == 137
        page.wait_for_selector("#alerts li.pending[data-alert=DDQLearnerDead]", timeout=30_000)
        page.wait_for_selector("#alerts li.firing[data-alert=DDQLearnerDead]", timeout=60_000)
        (alert,) = dead_alerts()
        assert alert["state"] == "firing" and alert["subject"] == "learner L1", alert
        assert alert["link"] == "#learner-L1"
        page.click("#alerts li[data-alert=DDQLearnerDead] a")
        assert page.evaluate("() => location.hash") == "#learner-L1"
        assert page.evaluate("() => document.querySelector(':target').dataset.learner") == "L1"
        shot = tmp_path / "dashboard-alerts.png"
        page.locator("#alerts-panel").scroll_into_view_if_needed()
        page.screenshot(path=str(shot))
        system.start_learner("L1")
        wait_until(lambda: not dead_alerts(), 90, "the alert resolved")
        page.wait_for_selector("#alerts li[data-alert=DDQLearnerDead]", state="detached")
    assert not errors, errors
    assert not outside, outside
    if copy_to := os.environ.get("DDQ_ALERTS_SCREENSHOT"):
        shutil.copyfile(shot, copy_to)
