"""A running system for the control plane's end-to-end tests (no tests here): a private
redis-server, a synchronizer process, two learner processes (tiny GPT, one CPU thread each)
and the control plane process, all started the way the Procfile does, and an HTTP client.

    with System(tmp_path) as system:
        system.post("/api/faults", {"target": "L1", "kind": "stall", "duration_s": 3})

Logs of every process are kept under the system's directory; ``System.close`` ends the
processes it started (SIGTERM, then SIGKILL) and prints the log tails of any that failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from dd_queue.auth import principals, write_keys
from tests.integration.conftest import require_redis_server
from tests.redisproc import RedisProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "e2e-admin-token-0123456789"
LEARNERS = ("L0", "L1")


def write_config(
    path: Path, redis_url: str, port: int, run_id: str, *, keys_dir: Path | None = None
) -> Path:
    """The tiny run every e2e control plane test uses: fast heartbeats and rounds (signed
    messages with the keys in ``keys_dir``, if given)."""
    raw = {
        "extends": str(ROOT / "config" / "base.yaml"),
        "run": {"run_id": run_id, "log_level": "INFO"},
        "redis": {
            "url": redis_url,
            "socket_timeout_s": 2.0,
            "max_block_ms": 200,
            "unavailable_after_s": 5.0,
        },
        "model": {"preset": "gpt-tiny", "n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16},
        "data": {"batch_size": 2, "max_bytes": 1 << 17},
        "wire": {"codec": "fp32"},
        "learner": {
            "warmup_steps": 2,
            "inner_lr": 0.01,
            "join_timeout_s": 120.0,
            "receive_block_ms": 50,
            "device": "cpu",
        },
        "synchronizer": {
            "n_fragments": 2,
            "sync_every_steps": 16,
            "round_timeout_s": 5.0,
            "lease_ttl_s": 2.0,
            "claim_idle_ms": 1000,
            "initial_step_time_s": 0.05,
        },
        "membership": {
            "heartbeat_interval_s": 0.2,
            "straggling_after_s": 1.0,
            "stalled_after_s": 2.0,
            "dead_after_s": 4.0,
        },
        "control": {"port": port, "admin_token": TOKEN, "refresh_s": 0.5},
        "faults": {"enabled": True},  # off in base.yaml
        "auth": {"keys_dir": str(keys_dir) if keys_dir is not None else None},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); fail after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


class System:
    """Redis, a synchronizer, two learners and the control plane, as real processes."""

    def __init__(self, directory: Path, *, signed: bool = False) -> None:
        require_redis_server()
        self.dir = directory
        self.redis = RedisProcess().start()
        self.port = free_port()
        self.keys_dir: Path | None = None
        if signed:  # every service signs and checks (ddq keys, as an operator would run it)
            self.keys_dir = directory / "keys"
            write_keys(self.keys_dir, "e2e", principals(LEARNERS))
        self.config = write_config(
            directory / "run.yaml", self.redis.url, self.port, "e2e", keys_dir=self.keys_dir
        )
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10.0)

    # ── processes ─────────────────────────────────────────────────────────────────────────
    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start ``python -m <args>`` with the run's config; output goes to ``<name>.log``."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with (self.dir / f"{name}.log").open("ab") as log:  # the child keeps its own handle
            proc = subprocess.Popen(
                [sys.executable, "-m", *args, "--config", str(self.config)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.procs[name] = proc
        return proc

    def start_learner(self, learner_id: str) -> subprocess.Popen[bytes]:
        return self.spawn(learner_id, "dd_queue.services.learner", "--learner-id", learner_id)

    def start(self) -> System:
        self.spawn("synchronizer", "dd_queue.services.synchronizer")
        for learner in LEARNERS:
            self.start_learner(learner)
        self.spawn("control", "dd_queue.services.control_plane")
        wait_until(lambda: self.http.get("/readyz").status_code == 200, 120, "/readyz")
        wait_until(
            lambda: (
                all(x["state"] == "active" and x["step"] > 5 for x in self.learners().values())
                and len(self.learners()) == 2
            ),
            180,
            "both learners training",
        )
        return self

    def log_tail(self, name: str, lines: int = 30) -> str:
        text = (self.dir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def close(self) -> None:
        """SIGTERM every service still running; each must stop cleanly (exit 0) within 15 s.

        Raises:
            AssertionError: A service did not exit 0 on SIGTERM (after everything is cleaned up).
        """
        running = [name for name, proc in self.procs.items() if proc.poll() is None]
        for name in running:
            self.procs[name].send_signal(signal.SIGTERM)
        unclean: dict[str, int] = {}
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if name in running and proc.returncode != 0:
                unclean[name] = proc.returncode
                sys.stderr.write(f"--- {name} exited {proc.returncode}:\n{self.log_tail(name)}\n")
        self.http.close()
        self.redis.close()
        assert not unclean, f"services that did not stop cleanly on SIGTERM: {unclean}"

    def __enter__(self) -> System:
        try:
            return self.start()
        except BaseException:
            for name in self.procs:
                sys.stderr.write(f"--- {name}:\n{self.log_tail(name)}\n")
            with contextlib.suppress(AssertionError):  # the start's failure is the news
                self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ── HTTP ──────────────────────────────────────────────────────────────────────────────
    def get(self, path: str, **params: Any) -> Any:
        answer = self.http.get(path, params=params)
        answer.raise_for_status()
        return answer.json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        answer = self.http.post(path, json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code in (200, 201), answer.text
        return answer.json()

    def learners(self) -> dict[str, dict[str, Any]]:
        return {x["learner_id"]: x for x in self.get("/api/learners")}

    def merged(self) -> int:
        return int(self.get("/api/state")["rounds_merged"])

    def fault(self, fault_id: str) -> dict[str, Any]:
        return next(f for f in self.get("/api/faults", limit=100) if f["fault_id"] == fault_id)
