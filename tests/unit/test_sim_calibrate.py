"""Calibration: predict a short recorded run's goodput and compare with what it measured."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from dd_queue.errors import ConfigError
from dd_queue.sim import cli as sim_cli
from dd_queue.sim.calibrate import calibrate, load_recording

T0, T1 = 100.0, 1300.0
OUTAGES = {"L1": [(300.0, 360.0), (1000.0, 1100.0)], "L2": [(500.0, 620.0)], "L3": [(900.0, 930.0)]}


def recording() -> dict[str, Any]:
    """A 4-learner, 20-minute run with four kills, written the way the services record it."""
    learners = [f"L{i}" for i in range(4)]
    intervals, faults = [], []
    for name in learners:
        t = T0
        for k, (a, b) in enumerate(OUTAGES.get(name, [])):
            intervals.append(
                {"group_id": name, "kind": "training", "start_s": t, "end_s": a, "chips": 2}
            )
            intervals.append(
                {"group_id": name, "kind": "down", "start_s": a, "end_s": b - 5, "chips": 2}
            )
            intervals.append(
                {"group_id": name, "kind": "restarting", "start_s": b - 5, "end_s": b, "chips": 2}
            )
            faults.append(
                {
                    "fault_id": f"{name}-{k}",
                    "learner_id": name,
                    "kind": "kill",
                    "at_s": a,
                    "recovered_at_s": b,
                }
            )
            t = b
        intervals.append(
            {"group_id": name, "kind": "training", "start_s": t, "end_s": T1, "chips": 2}
        )
    rounds = []
    for r in range(int(T1 - T0)):
        opened = T0 + r
        down = {n for n, spans in OUTAGES.items() if any(a <= opened < b for a, b in spans)}
        rounds.append(
            {
                "fragment_id": r % 24,
                "round_id": r,
                "opened_at_s": opened,
                "closed_at_s": opened + 0.6,
                "decision": "merge",
                "contributors": [n for n in learners if n not in down][:2],
            }
        )
    steps = [0.98, 1.0, 1.02, 1.0]
    return {
        "schema": "ddq.sim.recording",
        "schema_version": 1,
        "run_id": "test",
        "window_s": [T0, T1],
        "learners": [{"learner_id": n, "chips": 2, "step_times_s": steps} for n in learners],
        "faults": faults,
        "rounds": rounds,
        "intervals": intervals,
        "policy": {"quorum": 1, "overlap_steps": 2.0},
    }


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(recording()), encoding="utf-8")
    return path


def test_predicted_goodput_matches_the_recorded_run(recorded: Path) -> None:
    cal = calibrate(load_recording(recorded), repetitions=40, seed=1)
    outage_s = sum(b - a for spans in OUTAGES.values() for a, b in spans)
    assert cal.measured["goodput"] == pytest.approx(1 - outage_s / (4 * 1200))
    assert cal.measured["uptime"] == 1.0
    assert cal.measured["mean_quorum"] == 2.0 and cal.measured["merges_per_hour"] == 3600
    # Replaying the recorded faults: only the partial step lost at each kill differs.
    assert cal.replay["goodput"] == pytest.approx(cal.measured["goodput"], abs=0.002)
    assert cal.replay["uptime"] == 1.0
    # Fitted rates forecast the run within the spread of such short runs.
    assert cal.fit["faults_per_learner_hour"] == pytest.approx(4 / (4 * 1200 - outage_s) * 3600)
    gap = abs(cal.fitted_mean["goodput"] - cal.measured["goodput"])
    assert gap < max(2 * cal.fitted_std["goodput"], 0.01)


def test_bad_recordings_are_rejected_with_the_format_named(tmp_path: Path) -> None:
    data = recording()
    data["faults"][0]["learner_id"] = "L9"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"ddq.sim.recording v1.*L9"):
        load_recording(path)
    path.write_text("{", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_recording(path)


def test_calibrate_command_prints_json_last(
    recorded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    sim_cli.register(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--calibrate", str(recorded), "--reps", "5", "--json"])
    assert args.func(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("calibration of") and "| goodput |" in "\n".join(out)
    payload = json.loads(out[-1])
    assert payload["kind"] == "calibration" and set(payload["measured"]) >= {"goodput", "uptime"}
