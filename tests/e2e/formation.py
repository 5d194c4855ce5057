"""The project's Procfile run by ``honcho start`` in a scratch directory (no tests here).

    with Formation(tmp_path) as f:
        f.wait_for(lambda: f.state()["rounds_merged"] > 0, 180, "a merge")

Free ports for Redis and the control plane (``DDQ_REDIS_PORT``, ``DDQ_CONTROL_PORT``), a chosen
admin token, ``config/demo.yaml`` as the Procfile's default. honcho's output goes to
``honcho.log``. Every wait also checks that the formation is still whole: honcho is running
and no process has stopped (honcho prints ``<name>.1 stopped (rc=N)`` for each one that does,
and then ends them all).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.ci import require
from tests.integration.conftest import require_redis_server
from tests.redisproc import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "procfile-e2e-token-0123456789"
SERVICES = ("redis", "synchronizer", "evaluator", "learner0", "learner1", "learner2", "control")


def honcho_path() -> str:
    """honcho from the test's environment; fails under ``CI=true`` when missing, else skips."""
    found = shutil.which("honcho") or str(Path(sys.executable).parent / "honcho")
    require(Path(found).exists(), "honcho", "pip install -e '.[dev]'")
    return found


class Formation:
    """``honcho start`` on the project's Procfile, with an HTTP client for its control plane."""

    def __init__(self, directory: Path, *, env: dict[str, str] | None = None) -> None:
        require_redis_server()
        self.dir = directory
        self.redis_port, self.port = free_port(), free_port()
        self.env = {
            **os.environ,
            "DDQ_REDIS_PORT": str(self.redis_port),
            "DDQ_CONTROL_PORT": str(self.port),
            "DDQ__CONTROL__ADMIN_TOKEN": TOKEN,
            "DDQ_CONFIG": str(ROOT / "config" / "demo.yaml"),
            "PYTHONPATH": str(ROOT),  # `python -m services.*` from the scratch directory
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.env.pop("DDQ__REDIS__URL", None)
        self.log_path = directory / "honcho.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10.0)
        self.started_s = 0.0

    # ── the formation ─────────────────────────────────────────────────────────────────────
    def start(self) -> Formation:
        argv = [honcho_path(), "-f", str(ROOT / "Procfile"), "-d", str(self.dir), "start"]
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, cwd=self.dir, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        self.started_s = time.monotonic()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stopped_lines(self) -> list[str]:
        """honcho's ``<name>.1 stopped (rc=N)`` lines."""
        return re.findall(r"^.*\| \S+ stopped \(rc=-?\d+\)$", self.log(), flags=re.M)

    def assert_whole(self) -> None:
        """honcho runs and no process of the formation has stopped."""
        assert self.proc is not None
        stopped = self.stopped_lines()
        if self.proc.poll() is not None or stopped:
            pytest.fail(
                f"the formation went down (honcho rc={self.proc.poll()}; {stopped}):\n"
                + self.tail(80)
            )

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> int:
        """Ctrl-C: SIGINT to honcho, which sends SIGTERM to every process; returns honcho's rc."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        self.http.close()

    def __enter__(self) -> Formation:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ── waiting ───────────────────────────────────────────────────────────────────────────
    def wait_for(self, predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
        """Poll ``predicate`` until truthy (returned), checking the formation stays whole."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.assert_whole()
            try:
                value = predicate()
            except (httpx.HTTPError, KeyError, StopIteration):
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout_s} s waiting for {what}:\n{self.tail()}")
            time.sleep(0.5)

    def hold(self, seconds: float) -> None:
        """Keep checking the formation for ``seconds``."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.assert_whole()
            time.sleep(0.5)

    # ── HTTP ──────────────────────────────────────────────────────────────────────────────
    def get(self, path: str, **params: Any) -> Any:
        answer = self.http.get(path, params=params)
        answer.raise_for_status()
        return answer.json()

    def state(self) -> dict[str, Any]:
        return dict(self.get("/api/state"))

    def learners(self) -> dict[str, dict[str, Any]]:
        return {x["learner_id"]: x for x in self.get("/api/learners")}

    def synchronizer_pids(self) -> set[int]:
        return {s["pid"] for s in self.state()["synchronizers"] if s["state"] == "running"}
