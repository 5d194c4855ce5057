"""The Procfile and compose.yaml: valid for their tools, and starting the same services."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.ci import require
from tests.e2e.formation import honcho_path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("synchronizer", "evaluator", "learner0", "learner1", "learner2", "control")


def _procfile() -> dict[str, str]:
    lines = (ROOT / "Procfile").read_text().splitlines()
    pairs = (line.split(":", 1) for line in lines if line and not line.startswith("#"))
    return {name.strip(): command.strip() for name, command in pairs}


def test_honcho_check_passes() -> None:
    done = subprocess.run([honcho_path(), "check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "Valid procfile" in done.stderr + done.stdout


def test_procfile_runs_redis_with_aof_and_every_service() -> None:
    procs = _procfile()
    assert set(procs) == {"redis", *SERVICES}
    assert "--appendonly yes" in procs["redis"] and "noeviction" in procs["redis"]
    for i in range(3):
        assert "dd_queue.services.learner --config" in procs[f"learner{i}"]
        assert procs[f"learner{i}"].endswith(f"--learner-id L{i}")
    assert "dd_queue.services.synchronizer" in procs["synchronizer"]
    assert "dd_queue.services.control_plane" in procs["control"]
    for name, command in procs.items():  # one dead process must not end the formation
        assert "python -m dd_queue.supervise --name" in command, name
    assert "--stop-delay-s" in procs["redis"]  # services flush before Redis stops
    assert "DDQ_CONTROL_PORT" in procs["control"]


def test_compose_has_healthy_redis_and_the_same_services() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", *SERVICES, "prometheus", "grafana"}  # + monitoring
    assert "--appendonly yes" in services["redis"]["command"][-1]
    redis_check = services["redis"]["healthcheck"]["test"]
    assert redis_check[0] == "CMD-SHELL" and "redis-cli ping" in redis_check[1]
    assert '--requirepass "$$DDQ_REDIS_PASSWORD"' in services["redis"]["command"][-1]
    assert all("healthcheck" in services[name] for name in SERVICES), "every service is checked"
    for name in SERVICES:
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in ("evaluator", "learner0", "learner1", "learner2"):
        assert services[name]["depends_on"]["synchronizer"]["condition"] == "service_healthy"
    check = services["synchronizer"]["healthcheck"]["test"]
    assert check[:3] == ["CMD", "ddq", "wait"] and "synchronizer" in check
    assert "healthcheck" in services["control"]
    for i in range(3):  # a learner is healthy while its own heartbeat is fresh
        assert f"member:L{i}" in services[f"learner{i}"]["healthcheck"]["test"]


def test_the_image_installs_the_package_alone_and_runs_unprivileged() -> None:
    lines = [line.split() for line in (ROOT / "Dockerfile").read_text().splitlines() if line]
    users = [words[1] for words in lines if words[0] == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    copied = {words[1] for words in lines if words[0] == "COPY"}
    assert copied == {"pyproject.toml", "dd_queue"}  # services and configs ship in the package
    compose = (ROOT / "compose.yaml").read_text()
    assert "config/" not in compose and "-m services." not in compose


def test_docker_compose_config_passes() -> None:
    require(shutil.which("docker-compose"), "docker-compose", "apt-get install -y docker-compose")
    done = subprocess.run(
        ["docker-compose", "-f", "compose.yaml", "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "DDQ_REDIS_PASSWORD": "compose-check"},
    )
    assert done.returncode == 0, done.stderr
    unset = {k: v for k, v in os.environ.items() if k != "DDQ_REDIS_PASSWORD"}
    refused = subprocess.run(
        ["docker-compose", "-f", "compose.yaml", "config", "-q"],
        cwd=ROOT, capture_output=True, text=True, env=unset,
    )  # fmt: skip
    assert refused.returncode != 0 and "set DDQ_REDIS_PASSWORD" in refused.stderr
