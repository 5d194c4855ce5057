"""Services started one by one as the README's "Run the services separately" section writes
them (``ddq synchronizer``, ``ddq learner``, ``ddq evaluator``, ``ddq control``), in any
order, for the start-order and start-wait tests (no tests here).

    services = Services(tmp_path, redis_url)
    services.start("learner", "L0")
    services.wait_log("L0", "waiting for Redis", 60)

Each process writes ``<name>.log`` in the directory; ``close`` sends SIGTERM to every one that
still runs and records how each exited.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_faults_http_support import TOKEN, write_config
from tests.redisproc import free_port

ROOT = Path(__file__).resolve().parents[2]
DDQ = str(Path(sys.executable).parent / "ddq")
ROLES = ("synchronizer", "learner", "evaluator", "control")


class Services:
    """The run's services as separate ``ddq`` processes (README order or any other).

    Args:
        directory: Logs and the config file go here.
        redis_url: The run's Redis (it need not be up yet).
        run_id: The run.
    """

    def __init__(self, directory: Path, redis_url: str, run_id: str = "order") -> None:
        self.dir = directory
        self.port = free_port()
        self.config = write_config(directory / "run.yaml", redis_url, self.port, run_id)
        self.env = {
            **os.environ,
            "DDQ__REDIS__URL": redis_url,  # as the README exports it
            "DDQ__SYNCHRONIZER__EVAL_INTERVAL_S": "3",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.exit_codes: dict[str, int] = {}
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10.0)

    def argv(self, role: str, learner_id: str = "L0") -> list[str]:
        """The README's command line of ``role``."""
        extra = ["--learner-id", learner_id] if role == "learner" else []
        return [DDQ, role, "--config", str(self.config), *extra]

    def start(
        self,
        role: str,
        learner_id: str = "L0",
        env: dict[str, str] | None = None,
        wrap: Sequence[str] = (),
        name: str | None = None,
        extra: Sequence[str] = (),
    ) -> str:
        """Start one service (``env``: more variables for it alone; ``wrap``: a command line
        prefix, e.g. ``ip netns exec <ns>``; ``extra``: more arguments, ``name`` then names it,
        e.g. a second synchronizer); returns its name (the learner id for learners)."""
        name = name or (learner_id if role == "learner" else role)
        with (self.dir / f"{name}.log").open("ab") as out:
            self.procs[name] = subprocess.Popen(
                [*wrap, *self.argv(role, learner_id), *extra],
                cwd=ROOT,
                env={**self.env, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return name

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(
            f"--- {n}:\n" + "\n".join(self.log(n).splitlines()[-25:]) for n in self.procs
        )

    def assert_running(self) -> None:
        """Every service started so far still runs."""
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        if dead:
            pytest.fail(f"services exited: {dead}\n{self.logs()}")

    def wait_for(self, predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
        """Poll until ``predicate`` is truthy (returned); every service must keep running."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.assert_running()
            try:
                value = predicate()
            except (httpx.HTTPError, KeyError, ValueError):
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout_s} s waiting for {what}\n{self.logs()}")
            time.sleep(0.3)

    def wait_log(self, name: str, pattern: str, timeout_s: float) -> None:
        """Wait until ``name``'s log has a line matching ``pattern`` (a regex)."""
        self.wait_for(
            lambda: re.search(pattern, self.log(name)), timeout_s, f"{pattern!r} in {name}.log"
        )

    def state(self) -> dict[str, Any]:
        answer = self.http.get("/api/state")
        answer.raise_for_status()
        return dict(answer.json())

    def merging(self, learners: tuple[str, ...] = ("L0",)) -> bool:
        """Rounds merge, every learner's contributions among them, and the evaluator reports."""
        state = self.state()
        found = {x["learner_id"]: x for x in self.http.get("/api/learners").json()}
        return (
            state["rounds_merged"] >= 2
            and bool(state["eval"])
            and all(found[x]["contributions"]["merged"] > 0 for x in learners)
        )

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                self.exit_codes[name] = proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                self.exit_codes[name] = proc.wait()
        self.http.close()


__all__ = ["DDQ", "ROLES", "TOKEN", "Services"]
