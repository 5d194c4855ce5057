"""The built wheel, installed into a fresh venv outside the checkout, runs as a user runs it.

The wheel is built from this checkout (``pip wheel --no-deps``) and installed without its
dependencies into a new venv in a temporary directory; that venv reaches the dependencies
(torch, redis, fastapi, ...) through one ``.pth`` line naming this interpreter's
site-packages, so nothing is downloaded and nothing of the checkout is on ``sys.path``. From
there: ``ddq config --config demo``, a config outside the checkout that ``extends: base.yaml``
(the packaged one), ``python -m dd_queue.services.*``, and a ``ddq up`` whose dashboard loads
in headless Chromium with its own script and styles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ci import import_or_require
from tests.e2e.test_dashboard import chromium_path
from tests.e2e.up_support import ddq_up
from tests.integration.conftest import require_redis_server
from tests.redisproc import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


class Installed:
    """A fresh venv holding only the wheel; commands run in a directory outside the checkout."""

    def __init__(self, venv: Path, cwd: Path) -> None:
        self.venv, self.cwd = venv, cwd
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DDQ__")}
        self.env.pop("PYTHONPATH", None)
        self.env["PATH"] = f"{venv / 'bin'}{os.pathsep}{self.env.get('PATH', '')}"

    def run(self, *argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout_s
        )

    def python(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return self.run(str(self.venv / "bin" / "python"), *argv)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    base = tmp_path_factory.mktemp("wheel")
    dist, venv, cwd = base / "dist", base / "venv", base / "elsewhere"
    cwd.mkdir()
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(ROOT)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = dist.glob("dd_queue-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    target = venv / "bin" / "python"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(target), "install", "-q", "--no-deps",
         str(wheel)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert pip.returncode == 0, pip.stdout + pip.stderr
    site = subprocess.run(
        [str(target), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "_ddq_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    yield Installed(venv, cwd)


def test_the_package_comes_from_the_wheel_not_the_checkout(installed: Installed) -> None:
    where = installed.python("-c", "import dd_queue; print(dd_queue.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed.venv), where.stdout
    assert not Path(where.stdout.strip()).is_relative_to(ROOT)


def test_packaged_configs_load_by_name_and_as_a_base(installed: Installed) -> None:
    shown = installed.run("ddq", "config", "--config", "demo", "--json")
    assert shown.returncode == 0, shown.stderr
    demo = json.loads(shown.stdout.strip().splitlines()[-1])
    assert demo["config"]["run"]["run_id"] and demo["run_digest"], demo
    (installed.cwd / "mine.yaml").write_text("extends: base.yaml\nlearner:\n  max_steps: 7\n")
    mine = installed.run("ddq", "config", "--config", "mine.yaml", "--json")
    assert mine.returncode == 0, mine.stderr
    assert json.loads(mine.stdout.strip().splitlines()[-1])["config"]["learner"]["max_steps"] == 7
    missing = installed.run("ddq", "config", "--config", "nosuch")
    assert missing.returncode == 2
    assert "packaged: base, demo, test" in missing.stderr, missing.stderr


@pytest.mark.parametrize("module", ["learner", "synchronizer", "control_plane"])
def test_service_entry_points_ship_in_the_wheel(installed: Installed, module: str) -> None:
    helped = installed.python("-m", f"dd_queue.services.{module}", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--config" in helped.stdout


def test_ddq_up_from_the_wheel_runs_and_its_dashboard_loads(installed: Installed) -> None:
    require_redis_server()
    sync_api = import_or_require("playwright.sync_api", "pip install -e '.[dev]'")
    executable = chromium_path()
    argv = ["ddq", "up", "--duration", "60", "--learners", "2", "--runs-dir", "runs"]
    with ddq_up(argv, free_port(), cwd=installed.cwd, env=installed.env) as up:
        up.wait_for(lambda: up.get("/api/learners").json(), "a learner in the control plane")
        for asset in ("/static/dashboard.js", "/static/dashboard.css"):
            assert up.get(asset).status_code == 200, asset
        errors: list[str] = []
        failed: list[str] = []
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=executable, headless=True, args=["--no-sandbox"]
            )
            try:
                page = browser.new_page()
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.on("requestfailed", lambda req: failed.append(req.url))
                page.goto(up.base + "/")
                page.wait_for_selector("#conn.ok", timeout=30_000)
                page.wait_for_selector("tr[data-learner=L0]", timeout=30_000)
            finally:
                browser.close()
        assert not errors and not failed, (errors, failed)
        summary = up.summary()
    assert summary["rounds_merged"] > 0 and summary["contributed"] == ["L0", "L1"], summary
