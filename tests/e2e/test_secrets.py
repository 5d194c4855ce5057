"""No secret reaches any output of a whole ``ddq up`` run.

The Redis password and the admin token come from files (``redis.password_file``,
``control.admin_token_file``, as Docker and Kubernetes mount secrets). The private Redis then
requires the password, and every service uses it. The test greps for both secrets in: the
command's output, every file of the run directory (each process's log, the Redis log, and the
AOF: every write to Redis, so every stream entry and key), every GET answer of the API
(including ``/metrics``, the SSE stream, the OpenAPI document and the dashboard's page and
script), and every process's command line while the run is up.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import httpx
import pytest
import redis
from pydantic import SecretStr

from dd_queue.up.procs import RedisServer
from tests.e2e.up_support import ddq_up
from tests.integration.conftest import require_redis_server
from tests.redisproc import free_port, redis_server_path

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "pw-Qx7-never-print-me"
TOKEN = "tk-Zr4-never-print-me-either"
SECRETS = (PASSWORD.encode(), TOKEN.encode())


def leaks(blob: bytes) -> list[str]:
    return [s.decode() for s in SECRETS if s in blob]


def command_lines() -> bytes:
    out = b""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                out += (proc / "cmdline").read_bytes() + b"\n"
            except OSError:
                continue  # gone meanwhile
    return out


def test_no_secret_reaches_logs_streams_api_or_command_lines(tmp_path: Path) -> None:
    require_redis_server()
    (tmp_path / "redis-password").write_text(PASSWORD + "\n")
    (tmp_path / "admin-token").write_text(TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDQ__")}
    env["DDQ__REDIS__PASSWORD_FILE"] = str(tmp_path / "redis-password")
    env["DDQ__CONTROL__ADMIN_TOKEN_FILE"] = str(tmp_path / "admin-token")
    argv = [sys.executable, "-m", "dd_queue.cli", "up", "--duration", "45", "--learners", "2"]
    argv += ["--runs-dir", str(tmp_path / "runs")]
    answers = ""
    with ddq_up(argv, free_port(), cwd=ROOT, env=env) as up:
        up.wait_for(
            lambda: len(up.get("/api/learners").json()) == 2 and up.get("/api/rounds").json(),
            "two learners and a merged round",
        )
        fault = {"target": "L1", "kind": "stall", "duration_s": 2}
        refused = httpx.post(f"{up.base}/api/faults", json=fault, timeout=5)
        assert refused.status_code == 401  # writes need the token ...
        auth = {"Authorization": f"Bearer {TOKEN}"}
        sent = httpx.post(f"{up.base}/api/faults", json=fault, headers=auth, timeout=5)
        assert sent.status_code in (200, 201, 202), sent.text  # ... the one from the file
        spec = up.get("/openapi.json").json()
        paths = [p for p, ops in spec["paths"].items() if "get" in ops and "{" not in p]
        assert {"/api/state", "/api/learners", "/api/faults", "/metrics"} <= set(paths), paths
        for path in [*paths, "/", "/static/dashboard.js", "/openapi.json"]:
            if path.endswith("/events"):  # the SSE stream: read its first events only
                with httpx.stream("GET", up.base + path, headers=auth, timeout=5) as stream:
                    for n, chunk in enumerate(stream.iter_text()):
                        answers += chunk
                        if n >= 5:
                            break
                continue
            answers += up.get(path, headers=auth).text
        processes = command_lines()
        summary = up.summary()
    assert summary["rounds_merged"] > 0, summary
    run_dir = Path(summary["run_dir"])
    logs = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert any(p.name == "synchronizer.log" for p in logs) and any(".aof" in p.name for p in logs)
    assert leaks(answers.encode()) == [], "an API answer"
    assert leaks(processes) == [], "a command line"
    assert leaks((up.out + up.err).encode()) == [], "ddq up's output"
    assert {str(p): leaks(b) for p, b in logs.items() if leaks(b)} == {}


def test_the_private_redis_requires_the_password(tmp_path: Path) -> None:
    """``ddq up``'s Redis takes ``requirepass`` on its stdin: no password, no access."""
    require_redis_server()
    server = RedisServer(str(redis_server_path()), tmp_path, password=SecretStr(PASSWORD))
    server.start()
    try:
        port = int(re.findall(r":(\d+)/", server.url)[0])
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        assert redis.Redis(port=port, password=PASSWORD).ping()
        assert leaks(command_lines()) == []
    finally:
        server.stop()
