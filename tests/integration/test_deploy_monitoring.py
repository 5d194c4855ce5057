"""The shipped monitoring (deploy/): Prometheus config and alert rules pass promtool (check and
unit tests), the Grafana board queries only metrics we export, compose runs both with the
shipped files, and the README lists every alert."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from dd_queue.control.metrics import CATALOGUE
from tests.ci import require

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BOARD = DEPLOY / "grafana" / "dashboards" / "ddq.json"
_SERIES = re.compile(r"\b(ddq_[a-z0-9_]+)")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    require(tool, "promtool", "apt-get install -y prometheus")
    assert tool is not None
    return subprocess.run([tool, *args], cwd=DEPLOY, capture_output=True, text=True, timeout=120)


def _exported(series: str) -> bool:
    """Whether a series name is one we export (histograms with their _bucket/_sum/_count)."""
    names = {s.name for s in CATALOGUE}
    base = re.sub(r"_(bucket|sum|count)$", "", series)
    return series in names or base in {s.name for s in CATALOGUE if s.kind == "histogram"}


def test_promtool_checks_the_config_and_the_rules() -> None:
    for args in (("check", "config", "prometheus.yml"), ("check", "rules", "alerts.yml")):
        done = _promtool(*args)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout + done.stderr


def test_promtool_unit_tests_every_alert() -> None:
    done = _promtool("test", "rules", "alerts.test.yml")
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", (DEPLOY / "alerts.test.yml").read_text()))
    assert tested == set(_alerts()), "every alert has a unit test"


def _alerts() -> dict[str, str]:
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}


def test_alerts_name_only_exported_metrics() -> None:
    for name, expr in _alerts().items():
        used = set(_SERIES.findall(expr))
        assert used or name == "DDQExporterDown", name
        assert all(_exported(s) for s in used), (name, used)


def test_the_grafana_board_parses_and_queries_only_exported_metrics() -> None:
    board = json.loads(BOARD.read_text())
    assert board["uid"] and board["title"]
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    for expr in exprs:
        used = set(_SERIES.findall(expr))
        assert used and all(_exported(s) for s in used), (expr, used)
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for topic in (
        "loss",
        "tokens",
        "learners",
        "quorum",
        "grace",
        "round",
        "dead letters",
        "redis",
    ):
        assert topic in titles, topic
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_compose_runs_prometheus_and_grafana_with_the_shipped_files() -> None:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    prom, grafana = services["prometheus"], services["grafana"]
    mounts = " ".join(prom["volumes"] + grafana["volumes"])
    for shipped in ("deploy/prometheus.yml", "deploy/alerts.yml", "deploy/grafana/provisioning",
                    "deploy/grafana/dashboards"):  # fmt: skip
        assert f"./{shipped}:" in mounts, shipped
        assert (ROOT / shipped).exists(), shipped
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["control:8000"]  # the compose service
    assert config["rule_files"] == ["alerts.yml"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/ddq.yml").read_text())
    assert provider["providers"][0]["options"]["path"] in " ".join(grafana["volumes"])
    source = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert source["datasources"][0]["url"] == "http://prometheus:9090"


def test_the_readme_lists_every_alert() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Metrics and monitoring", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(DDQ\w+)`", section, flags=re.M)
    assert sorted(listed) == sorted(_alerts())
