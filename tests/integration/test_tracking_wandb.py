"""The W&B backend for real (offline, its ``wandb-core`` child process): runs named and grouped
by the run, the config and digests as W&B config, each section on its own x axis, and several
runs open at once in one process (the in-process ``ddq up`` holds every learner in one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dd_queue.config import validate_config
from dd_queue.tracking import open_tracker
from tests.tracking_support import wandb_run, wandb_run_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_offline_runs_hold_the_scalars_config_and_digests(tmp_path: Path) -> None:
    cfg = validate_config({"tracking": {"backends": ["wandb"], "dir": str(tmp_path)}})
    learners = [open_tracker(cfg, f"learner-L{i}") for i in range(2)]
    sync = open_tracker(cfg, "synchronizer-sync-0")
    for step in (10, 20):
        for i, tracker in enumerate(learners):
            tracker.log("train", {"loss": 3.0 - step / 100 - i, "lr": 1e-3}, step=step)
    sync.log("fragment0", {"contributors": 2, "late": 1}, step=1)
    sync.log("fragment1", {"contributors": 1, "late": 0}, step=1)  # another x axis: allowed
    sync.log("fragment0", {"contributors": 3, "late": 0}, step=2)
    for tracker in (*learners, sync):
        tracker.close()

    for i in range(2):
        (run_file,) = wandb_run_files(tmp_path / "demo" / f"learner-L{i}")
        got = wandb_run(run_file)
        assert got["run"] == {"group": "demo", "name": f"demo/learner-L{i}", "job_type": "learner"}
        assert got["config"]["run_digest"] == cfg.run_digest
        assert got["config"]["synchronizer.quorum"] == cfg.synchronizer.quorum
        rows = [r for r in got["history"] if "train/loss" in r]
        assert [r["train/step"] for r in rows] == [10, 20]
        assert [r["train/loss"] for r in rows] == pytest.approx([2.9 - i, 2.8 - i])
    (run_file,) = wandb_run_files(tmp_path / "demo" / "synchronizer-sync-0")
    rows = wandb_run(run_file)["history"]
    f0 = [(r["fragment0/step"], r["fragment0/contributors"]) for r in rows if "fragment0/step" in r]
    assert f0 == [(1, 2), (2, 3)]
    assert [r["fragment1/late"] for r in rows if "fragment1/step" in r] == [0]
