"""Smoke test of ``bench/bench_resilience.py``: the steady scenario on a tiny model, real
processes (Redis, synchronizer, control plane, evaluator, two learners, two plain workers), our
side only, under a minute. The bench itself is not part of CI; this proves its harness runs and
that its figures come from the processes' own step records and round records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import require_redis_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_steady_smoke_runs_and_reports_from_the_records(tmp_path: Path) -> None:
    require_redis_server()
    done = subprocess.run(
        [sys.executable, "bench/bench_resilience.py", "--smoke", "--json", "--work", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    [steady] = summary["results"]["steady"]
    assert set(steady["plain_steps_per_s"]) == set(steady["learner_steps_per_s"]) == {"L0", "L1"}
    assert all(v and v > 0 for v in steady["plain_steps_per_s"].values())
    assert all(v and v > 0 for v in steady["learner_steps_per_s"].values())
    assert steady["ratio"] > 0 and steady["merged_rounds"] >= 1
    assert {"synchronizer", "control", "evaluator", "redis"} <= set(steady["cpu_share"])
    # the rates come from the learners' own step logs: 60 steps each, one process each
    for lid in ("L0", "L1"):
        lines = (
            (tmp_path / "dd_queue" / "steady-0" / "run" / "steps" / f"{lid}.jsonl")
            .read_text()
            .splitlines()
        )
        records = [json.loads(line) for line in lines]
        assert [r["step"] for r in records if r["ev"] == "step"] == list(range(1, 61))
        assert {r["pid"] for r in records} == {records[0]["pid"]}
        assert [r["ev"] for r in records if r["ev"] != "step"] == ["start", "joined", "left"]
    assert summary["table"][0]["measurement"].startswith("steady")
