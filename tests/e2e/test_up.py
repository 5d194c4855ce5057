"""``ddq up --duration 90 --learners 3 --json`` as a user runs it: the demo learns.

The summary (last stdout line, JSON) must show merged rounds, a held-out loss that fell and a
merged contribution from every learner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import require_redis_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_ddq_up_demo_learns(tmp_path: Path) -> None:
    require_redis_server()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDQ__")}
    proc = subprocess.run(
        [
            sys.executable, "-m", "dd_queue.cli", "up",
            "--duration", "90", "--learners", "3", "--json", "--runs-dir", str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=270,
    )  # fmt: skip
    out = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, f"ddq up exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    summary = json.loads(out[-1])
    assert any(line.startswith("[") and "rounds" in line for line in out), "no progress lines"
    assert summary["rounds_merged"] > 0, summary
    assert summary["evals"] >= 2, summary
    assert summary["loss_fell"] is True, summary
    assert summary["contributed"] == ["L0", "L1", "L2"], summary
    assert summary["stopped_by"] == "duration"
    assert 0.5 < summary["goodput"] <= 1.0 and 0.5 < summary["uptime"] <= 1.0, summary
    assert any(line.startswith("ddq up: redis server ") for line in out), "which Redis: not said"
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "appendonlydir").is_dir(), "Redis AOF not in the run dir"
    for name in ("synchronizer", "L0", "L1", "L2", "evaluator", "control"):
        assert (run_dir / f"{name}.log").stat().st_size > 0, name
