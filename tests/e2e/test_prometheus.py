"""A real Prometheus (Debian's) scrapes a live ``ddq up`` with the shipped config and rules.

Through Prometheus's HTTP API it sees tokens flowing from every learner and three active
learners; every query of the shipped Grafana board evaluates; the shipped alert rules load. A
kill fault shows as the learner leaving ``active`` and the fault counter rising. Then the
control plane (the run's exporter) is killed with SIGKILL and comes back (``ddq up`` restarts
it), and no counter the run keeps reset: ``resets()`` over the whole run is 0 for every series
except the killed learner's own step and token counts (its process started again from zero,
which is a counter reset by Prometheus's rules).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from dd_queue.control.metrics import CATALOGUE
from dd_queue.up.procs import free_port
from tests.ci import require
from tests.e2e.up_support import UpProcess, ddq_up
from tests.integration.conftest import require_redis_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TOKEN = "prometheus-e2e-admin-token-0123456789"


class Prometheus:
    """A Prometheus server on a free loopback port; ``query`` answers instant vectors."""

    def __init__(self, tmp: Path, target: str) -> None:
        tool = shutil.which("prometheus")
        require(tool, "prometheus", "apt-get install -y prometheus")
        assert tool is not None
        config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        # the shipped config, pointed at this run, scraping every second to keep the test short
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(DEPLOY / "alerts.yml")]
        [job] = config["scrape_configs"]
        job["static_configs"][0]["targets"] = [target]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.base = f"http://127.0.0.1:{free_port()}"
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                tool,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address={self.base.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params: str) -> Any:
        answer = httpx.get(f"{self.base}/api/v1/{path}", params=params, timeout=10)
        body = answer.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _until(check: Callable[[], object], what: str, up: UpProcess, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return
        except (httpx.HTTPError, AssertionError, ValueError) as exc:
            last = exc
        assert up.proc.poll() is None, f"ddq up exited {up.proc.returncode}"
        time.sleep(1)
    pytest.fail(f"{what}: not within {timeout_s} s (last: {last!r})")


def _children(pid: int) -> Iterator[tuple[int, str]]:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(fields[1]) == pid:
            yield int(stat.parent.name), cmdline


@pytest.fixture
def prometheus_and_run(tmp_path: Path) -> Iterator[tuple[Prometheus, UpProcess]]:
    require_redis_server()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDQ__")}
    env["DDQ__CONTROL__ADMIN_TOKEN"] = TOKEN
    port = free_port()
    argv = [sys.executable, "-m", "dd_queue.cli", "up", "--duration", "240", "--learners", "3"]
    argv += ["--runs-dir", str(tmp_path / "runs")]
    with ddq_up(argv, port, cwd=ROOT, env=env) as up:
        up.wait_for(lambda: up.get("/readyz").status_code == 200, "control plane ready")
        prom = Prometheus(tmp_path, f"127.0.0.1:{port}")
        try:
            yield prom, up
        finally:
            prom.close()


def _value(result: list[dict[str, Any]]) -> float:
    return float(result[0]["value"][1]) if result else float("nan")


def test_a_real_prometheus_scrapes_alerts_and_survives_an_exporter_restart(
    prometheus_and_run: tuple[Prometheus, UpProcess],
) -> None:
    prom, up = prometheus_and_run
    _until(lambda: len(prom.query("rate(ddq_tokens_total[30s]) > 0")) == 3, "tokens flow", up)
    _until(lambda: prom.query('ddq_learners{state="active"} == 3'), "3 active learners", up)
    _until(lambda: prom.query('ddq_rounds_total{decision="merge"} > 0'), "merges", up)
    # the shipped rules load and are healthy; every board query evaluates
    groups = prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 9 and all(r["health"] == "ok" for r in rules), rules
    board = json.loads((DEPLOY / "grafana" / "dashboards" / "ddq.json").read_text())
    for panel in board["panels"]:
        for target in panel["targets"]:
            prom.query(target["expr"].replace("$instance", ".*"))  # raises on a bad query
    assert prom.query('ddq_run_info{run_id="demo", job="ddq"} == 1')

    # a kill fault: the learner leaves "active", the fault counter rises
    answer = up.get("/api/learners")
    assert {x["learner_id"] for x in answer.json()} == {"L0", "L1", "L2"}
    sent = httpx.post(
        f"{up.base}/api/faults",
        json={"target": "L1", "kind": "kill"},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert sent.status_code == 201, sent.text
    _until(lambda: prom.query('ddq_faults_total{kind="kill"} == 1'), "kill counted", up)
    _until(
        lambda: prom.query(
            'min_over_time(ddq_learner_state{learner="L1",state="active"}[2m]) == 0'
        ),
        "L1 left active",
        up,
    )
    # the exporter dies (SIGKILL) and comes back on the same port
    [control] = [pid for pid, cmd in _children(up.proc.pid) if "dd_queue.cli control" in cmd]
    os.kill(control, signal.SIGKILL)
    _until(lambda: prom.query('min_over_time(up{job="ddq"}[1m]) == 0'), "scrape failed", up)
    _until(lambda: _value(prom.query('up{job="ddq"}')) == 1, "exporter back", up)
    scrapes = _value(prom.query('count_over_time(up{job="ddq"}[10m])'))
    time.sleep(5)  # a few scrapes of the new exporter
    assert _value(prom.query('count_over_time(up{job="ddq"}[10m])')) > scrapes
    allowed = {"ddq_learner_steps_total", "ddq_tokens_total"}  # L1's new process started at 0
    wrong = []
    for spec in CATALOGUE:
        suffixes = ("_bucket", "_count", "_sum") if spec.kind == "histogram" else ("",)
        if spec.kind == "gauge":
            continue
        for suffix in suffixes:
            for r in prom.query(f"resets({spec.name}{suffix}[10m]) > 0"):
                if not (spec.name in allowed and r["metric"].get("learner") == "L1"):
                    wrong.append((spec.name + suffix, r["metric"], r["value"]))
    assert not wrong, wrong
    # after the restart the run's counters carry on from where they were
    assert prom.query('ddq_faults_total{kind="kill"} == 1')
    assert prom.query('ddq_rounds_total{decision="merge"} > 0')
