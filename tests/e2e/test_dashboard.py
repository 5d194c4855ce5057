"""The dashboard in a real browser (headless Debian chromium driven by Playwright) against a
running system: learners are listed live, a click on a learner's ``stall`` button stalls it,
the table shows the new state, and a screenshot is saved as a test artefact.

Set ``DDQ_DASHBOARD_SCREENSHOT=docs/dashboard.png`` to also copy the screenshot there.
Without chromium the test skips locally and fails under ``CI=true`` (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

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


def test_dashboard_lists_learners_and_a_fault_button_changes_a_state(
    system: System, tmp_path: Path
):
    sync_api = import_or_require("playwright.sync_api", "pip install -e '.[dev]'")
    executable = chromium_path()
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=executable, headless=True, args=["--no-sandbox"]
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{system.http.base_url}/#token={TOKEN}")
            for learner in ("L0", "L1"):
                page.wait_for_selector(f"tr[data-learner={learner}][data-state=active]")
            page.wait_for_selector("#conn.ok")
            page.wait_for_selector("#timeline .bars")  # Plotly drew the round timeline
            page.click("tr[data-learner=L1] button[data-fault=stall]")
            page.wait_for_selector("#action-msg:has-text('stall sent to L1')")
            page.wait_for_selector("tr[data-learner=L1][data-state=stalled]", timeout=10_000)
            assert "stalled" in page.inner_text("tr[data-learner=L1] td.state")
            page.wait_for_selector("#faults li:has-text('stall L1 by dashboard')")
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot))
        finally:
            browser.close()
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
