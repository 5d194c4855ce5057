"""``ddq simulate``: config loading, flags, the tables, --json, --csv, --plot and --sweep."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import pytest

from dd_queue import cli as ddq_cli
from dd_queue.errors import ConfigError
from dd_queue.sim import cli as sim_cli
from dd_queue.sim import plots
from dd_queue.sim.config import SimConfig, load_sim_config
from tests.ci import require

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--chips", "8192", "--days", "0.1", "--set", "decoupled.policy_rounds=500"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    parser = argparse.ArgumentParser()
    sim_cli.register(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out.strip().splitlines()


def test_registered_with_ddq() -> None:
    assert "dd_queue.sim.cli" in ddq_cli.COMMAND_MODULES


def test_default_yaml_states_the_model_defaults() -> None:
    assert load_sim_config(ROOT / "config/sim/default.yaml") == SimConfig()
    for path in sorted((ROOT / "config/sim").glob("*.yaml")):
        load_sim_config(path)  # every shipped config validates


def test_overrides_and_errors(tmp_path: Path) -> None:
    cfg = load_sim_config(None, {"cluster.chips": "4096", "run.regimes": "[plain_dp]"})
    assert (cfg.cluster.chips, cfg.run.regimes) == (4096, ("plain_dp",))
    with pytest.raises(ConfigError, match=r"cluster\.chipz: unknown key"):
        load_sim_config(None, {"cluster.chipz": "1"})
    with pytest.raises(ConfigError, match="unknown section"):
        load_sim_config(None, {"clusters.chips": "1"})
    with pytest.raises(ConfigError, match="each learner needs at least one slice"):
        load_sim_config(None, {"cluster.chips": "512", "decoupled.learners": "4"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("repair: {median_s: 600, p99_s: 60}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"p99_s 60.0 must be ≥ median_s"):
        load_sim_config(bad)


def test_single_run_table_json_and_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run([*SMALL, "--learners", "4", "--json", "--csv", str(tmp_path / "r.csv")], capsys)
    assert out[0].startswith("parameters: 8,192 chips (32 slices × 256)")
    assert any(line.startswith("| decoupled_M4 |") for line in out)
    payload = json.loads(out[-1])
    assert payload["kind"] == "single" and payload["config"]["cluster"]["chips"] == 8192
    labels = [r["label"] for r in payload["results"]]
    assert labels == ["plain_dp", "elastic_dp", "decoupled_M4"]
    dd = payload["results"][-1]
    assert 0 < dd["goodput"] <= 1 and len(dd["token_share"]) == 4 and dd["mean_quorum"] >= 1
    with (tmp_path / "r.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["regime"] for r in rows] == ["plain_dp", "elastic_dp", "decoupled"]


def test_sweep_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require(plots.matplotlib_available(), "matplotlib", "pip install -e '.[plots]'")
    argv = [
        "--set",
        "sweep.chips=[4096, 16384]",
        "--set",
        "sweep.learners=[2, 4]",
        "--set",
        "sweep.duration_days=0.05",
        "--set",
        "decoupled.policy_rounds=300",
        "--sweep",
        "--json",
        "--plot",
        str(tmp_path),
    ]
    out = run(argv, capsys)
    text = "\n".join(out)
    assert "| chips (goodput) | plain_dp | elastic_dp | decoupled_M2 | decoupled_M4 |" in text
    assert "| 16,384 |" in text
    assert json.loads(out[-1])["kind"] == "sweep"
    assert (tmp_path / "goodput_vs_chips.png").stat().st_size > 1000


def test_timeline_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require(plots.matplotlib_available(), "matplotlib", "pip install -e '.[plots]'")
    run([*SMALL, "--learners", "2", "--plot", str(tmp_path), "--timeline-window-s", "300"], capsys)
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def test_plots_skipped_with_a_message_without_matplotlib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sim_cli, "matplotlib_available", lambda: False)
    parser = argparse.ArgumentParser()
    sim_cli.register(parser.add_subparsers())
    args = parser.parse_args(["simulate", *SMALL, "--plot", str(tmp_path)])
    assert args.func(args) == 0
    assert "plots skipped: matplotlib is not installed" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_bad_set_is_a_config_error() -> None:
    parser = argparse.ArgumentParser()
    sim_cli.register(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--set", "cluster.chips"])
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        args.func(args)
