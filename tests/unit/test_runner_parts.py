"""The runner's parts: experiment files and runner settings, seeded timing, the event queue,
the time ledger, and ``ddq experiment`` end to end on a tiny file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from dd_queue.cli import main
from dd_queue.errors import ConfigError, CoreError
from dd_queue.runner import FailureSpec, RunnerSpec, load_experiment
from dd_queue.runner.ledger import IntervalLog, goodput_of
from dd_queue.runner.spec import NO_SYNC_STEPS
from dd_queue.runner.timing import EventKind, EventQueue, FailureClock, StepTimer
from tests.unit.test_runner_support import TINY_MODEL, TOKENS_PER_STEP, tiny_experiment

DP_FAILURES = {"mtbf_s": 5, "repair_mean_s": 1}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


# ── settings ──────────────────────────────────────────────────────────────────────────────
def test_modes_set_what_they_imply_on_the_config():
    spec = tiny_experiment(runner={"n_learners": 3})
    cfg, runner = spec.resolve(spec.variants[0])
    assert cfg.membership.expected_learners == 3 and cfg.synchronizer.quorum == 1
    assert runner.factors() == (1.0, 1.0, 1.0)
    sync = tiny_experiment(runner={"n_learners": 3, "mode": "synchronous"})
    cfg, _ = sync.resolve(sync.variants[0])
    assert cfg.synchronizer.quorum == 3 and cfg.synchronizer.schedule == "learner"
    dp = tiny_experiment(runner={"n_learners": 3, "mode": "data-parallel"})
    cfg, _ = dp.resolve(dp.variants[0])
    assert cfg.data.batch_size == 3 * 2 and cfg.membership.expected_learners == 1
    assert cfg.synchronizer.sync_every_steps == NO_SYNC_STEPS
    assert cfg.run.seed == 0 and dp.seed == 0


def test_slow_fraction_makes_the_last_learners_slow():
    spec = RunnerSpec(n_learners=4, slow_fraction=0.5, slow_factor=1.2, token_budget=1)
    assert spec.factors() == (1.0, 1.0, 1.2, 1.2)
    assert RunnerSpec(n_learners=2, speed_factors=(1.0, 3.0), token_budget=1).factors() == (
        1.0,
        3.0,
    )


@pytest.mark.parametrize(
    ("runner", "match"),
    [
        ({"n_learners": 2}, "token_budget or max_virtual_s"),
        ({"token_budget": 10, "speed_factors": [1.0]}, "speed_factors has 1 entries"),
        ({"token_budget": 10, "mode": "data-parallel", "failures": DP_FAILURES}, "fault-free"),
        ({"token_budget": 10, "bogus": 1}, "bogus"),
    ],
)
def test_bad_runner_settings_are_refused_with_the_reason(runner, match):
    spec = tiny_experiment()
    bad = spec.model_copy(update={"runner": runner})
    with pytest.raises(ConfigError, match=match):
        bad.resolve(bad.variants[0])


def test_learner_max_steps_is_refused_in_favour_of_the_budget():
    spec = tiny_experiment(config={"learner": {"max_steps": 10}})
    with pytest.raises(ConfigError, match="token_budget"):
        spec.resolve(spec.variants[0])


def test_repair_minimum_cannot_exceed_the_mean():
    with pytest.raises(ValueError, match="repair_min_s"):
        FailureSpec(mtbf_s=10, repair_mean_s=1, repair_min_s=2)


def test_experiment_files_are_validated(tmp_path: Path):
    path = tmp_path / "e.yaml"
    path.write_text("name: x\nvariants: []\n")
    with pytest.raises(ConfigError, match="variants"):
        load_experiment(path)
    path.write_text("name: x\nvariants: [{name: a}, {name: a}]\n")
    with pytest.raises(ConfigError, match="unique"):
        load_experiment(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_experiment(tmp_path / "missing.yaml")


def test_every_shipped_experiment_file_resolves():
    files = sorted((Path(__file__).resolve().parents[2] / "config/experiments").glob("*.yaml"))
    assert files, "config/experiments/ holds the benchmark experiments"
    for file in files:
        spec = load_experiment(file)
        for variant in spec.variants:
            spec.resolve(variant)


# ── timing ────────────────────────────────────────────────────────────────────────────────
def test_step_times_are_seeded_per_slot_and_independent_of_failures():
    a = [StepTimer(0, 1, base_s=1.0, factor=1.2, jitter=0.1).next_s() for _ in range(1)]
    t1, t2 = (StepTimer(0, 1, base_s=1.0, factor=1.2, jitter=0.1) for _ in range(2))
    draws = [t1.next_s() for _ in range(50)]
    assert draws == [t2.next_s() for _ in range(50)] and a[0] == draws[0]
    assert abs(sum(draws) / 50 - 1.2) < 0.1 and min(draws) > 0
    other = StepTimer(0, 2, base_s=1.0, factor=1.2, jitter=0.1)
    assert [other.next_s() for _ in range(5)] != draws[:5]
    assert StepTimer(0, 0, base_s=2.0, factor=1.5, jitter=0.0).next_s() == 3.0
    lockstep = StepTimer(0, 1, base_s=1.0, factor=1.0, jitter=0.1, chips=8)
    assert sum(lockstep.next_s() for _ in range(50)) / 50 > 1.08  # waits for the slowest chip


def test_failures_are_poisson_with_random_repairs():
    spec = FailureSpec(mtbf_s=10.0, repair_mean_s=4.0, repair_min_s=1.0)
    clock = FailureClock(3, 0, spec)
    gaps = [clock.next_failure_s(100.0) - 100.0 for _ in range(2000)]
    repairs = [clock.repair_s() for _ in range(2000)]
    assert abs(sum(gaps) / len(gaps) - 10.0) < 0.8 and min(gaps) > 0
    assert abs(sum(repairs) / len(repairs) - 4.0) < 0.3 and min(repairs) >= 1.0
    assert FailureClock(3, 0, None).next_failure_s(0.0) is None


def test_event_queue_breaks_ties_by_kind_then_slot_and_cancels():
    q = EventQueue()
    q.schedule(2.0, EventKind.EVAL)
    q.schedule(1.0, EventKind.SYNC)
    q.schedule(1.0, EventKind.STEP, 3)
    q.schedule(1.0, EventKind.STEP, 1)
    q.schedule(1.0, EventKind.FAIL, 2)
    q.schedule(5.0, EventKind.STEP, 2)
    q.schedule(0.5, EventKind.STEP, 2)  # replaces the one at 5.0
    q.schedule(0.7, EventKind.REJOIN, 4)
    q.cancel(EventKind.REJOIN, 4)
    order = []
    while (event := q.pop()) is not None:
        order.append(event)
    assert order == [
        (0.5, EventKind.STEP, 2),
        (1.0, EventKind.FAIL, 2),
        (1.0, EventKind.STEP, 1),
        (1.0, EventKind.STEP, 3),
        (1.0, EventKind.SYNC, -1),
        (2.0, EventKind.EVAL, -1),
    ]


def test_interval_log_feeds_the_core_goodput_ledger():
    a, b = IntervalLog("L0"), IntervalLog("L1", chips=2)
    a.add("training", 0.0, 6.0)
    a.add("down", 6.0, 10.0)
    b.add("training", 0.0, 5.0)
    b.add("waiting", 5.0, 10.0)
    b.add("training", 10.0, 10.0)  # empty: skipped
    summary = goodput_of([a, b], (0.0, 10.0))
    assert summary.allocated_chip_s == 30.0 and summary.training_chip_s == 16.0
    assert summary.goodput == pytest.approx(16 / 30) and summary.uptime == pytest.approx(0.6)
    assert a.seconds("down") == 4.0 and b.seconds("training") == 5.0
    a.add("training", 9.0, 12.0)
    with pytest.raises(CoreError, match="overlap"):
        goodput_of([a], (0.0, 12.0))


# ── the command line ──────────────────────────────────────────────────────────────────────
def test_ddq_experiment_writes_json_and_png_and_prints_json_last(tmp_path: Path, capsys):
    spec = {
        "name": "cli-tiny",
        "description": "two variants of a tiny run",
        "seed": 1,
        "config": tiny_experiment().config,
        "runner": {"n_learners": 2, "token_budget": 8 * TOKENS_PER_STEP, "eval_every_s": 2.0},
        "variants": [{"name": "dec"}, {"name": "dp", "runner": {"mode": "data-parallel"}}],
    }
    assert spec["config"]["model"] == TINY_MODEL
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(spec))
    code = main(["experiment", "--config", str(path), "--out", str(tmp_path), "--json",
                 "--quiet"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "| dec | decoupled | 2 |" in out and "| dp | data-parallel | 2 |" in out
    payload = json.loads(out.strip().splitlines()[-1])
    assert [r["name"] for r in payload["runs"]] == ["dec", "dp"]
    assert "round_rows" not in payload["runs"][0]
    full = json.loads((tmp_path / "cli-tiny.json").read_text())
    assert full["runs"][0]["round_columns"][0] == "fragment"
    assert (tmp_path / "cli-tiny.png").stat().st_size > 1000
    only = main(["experiment", "--config", str(path), "--out", str(tmp_path), "--only", "dp",
                 "--no-plot", "--quiet"])  # fmt: skip
    assert only == 0


def test_ddq_experiment_reports_a_bad_file_as_an_error(tmp_path: Path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nrunner: {token_budget: 1}\nvariants: [{name: a, runner: {m: 1}}]\n")
    assert main(["experiment", "--config", str(path), "--out", str(tmp_path)]) == 2
    assert "invalid runner settings" in capsys.readouterr().err
