"""Experiment tracking (``dd_queue.tracking``): what each process logs, and how.

TensorBoard files are written for real and read back with tensorboard's ``EventAccumulator``;
W&B (a child process per run) is tested in ``tests/integration/test_tracking_wandb.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dd_queue import tracking
from dd_queue.clock import FakeClock
from dd_queue.config import TrackingConfig, validate_config
from dd_queue.errors import ConfigError
from dd_queue.learner.learner import StepReport
from dd_queue.learner.service import TrainCurve
from dd_queue.messages import ContributorRecord, EntryOutcome, RoundRecord
from dd_queue.tracking import (
    NULL_TRACKER,
    TRACKING_BACKENDS,
    Tracker,
    flat_hparams,
    open_tracker,
    round_scalars,
)
from dd_queue.up.cli import _backends
from dd_queue.up.run import tracking_overrides
from tests.tracking_support import tb_hparams, tb_scalars

pytestmark = pytest.mark.unit


class Recorder:
    """A backend that keeps what it is given."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, dict[str, float], int]] = []
        self.closed = False

    def log(self, section: str, values: dict[str, float], step: int) -> None:
        self.rows.append((section, dict(values), step))

    def close(self) -> None:
        self.closed = True


class Broken(Recorder):
    def log(self, section: str, values: dict[str, float], step: int) -> None:
        raise OSError("disk full")


def _cfg(tmp_path: Path, *backends: str, **extra: Any) -> Any:
    tracking_section = {"backends": list(backends), "dir": str(tmp_path), **extra}
    return validate_config({"tracking": tracking_section, "redis": {"password": "hunter2-x"}})


# ── the tracker ──────────────────────────────────────────────────────────────────────────────
def test_off_by_default_and_the_null_tracker_does_nothing(tmp_path: Path) -> None:
    cfg = validate_config({})
    assert cfg.tracking.backends == ()
    tracker = open_tracker(cfg, "learner-L0")
    assert tracker is NULL_TRACKER and not tracker.enabled
    tracker.log("train", {"loss": 1.0}, step=1)
    tracker.close()


def test_values_that_are_not_numbers_are_skipped_and_ints_become_floats() -> None:
    sink = Recorder()
    Tracker([sink]).log("train", {"loss": 2, "lr": None, "name": "x"}, step=3)  # type: ignore[dict-item]
    assert sink.rows == [("train", {"loss": 2.0}, 3)]


def test_a_failing_backend_is_switched_off_and_the_others_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    good, bad = Recorder(), Broken()
    tracker = Tracker([bad, good])
    tracker.log("train", {"loss": 1.0}, step=1)
    tracker.log("train", {"loss": 0.5}, step=2)
    assert [r[2] for r in good.rows] == [1, 2]
    assert sum("tracking.failed Broken" in r.getMessage() for r in caplog.records) == 1
    tracker.close()
    assert good.closed and not bad.closed  # the broken one was dropped already
    assert not tracker.enabled


def test_a_missing_package_is_a_config_error_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name)
    )
    with pytest.raises(ConfigError, match=r"pip install 'dd_queue\[wandb\]'"):
        open_tracker(_cfg(tmp_path, "tensorboard", "wandb"), "evaluator")
    assert not (tmp_path / "demo").exists()  # refused before anything is written


def test_the_backends_the_config_accepts_are_the_ones_the_tracker_knows() -> None:
    annotation = TrackingConfig.model_fields["backends"].annotation
    (literal, _) = get_args(annotation)
    assert set(get_args(literal)) == set(TRACKING_BACKENDS)
    with pytest.raises(ConfigError, match=r"tracking\.backends: lists a backend twice"):
        validate_config({"tracking": {"backends": ["wandb", "wandb"]}})


# ── what is recorded ─────────────────────────────────────────────────────────────────────────
def test_hparams_are_flat_scalars_with_secrets_masked(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "tensorboard")
    flat = flat_hparams(cfg.public_dict())
    assert flat["synchronizer.quorum"] == cfg.synchronizer.quorum
    assert flat["redis.password"] == "***"
    assert flat["control.admin_token"] == "none"
    assert flat["tracking.backends"] == '["tensorboard"]'
    assert all(isinstance(v, bool | int | float | str) for v in flat.values())
    assert "hunter2-x" not in repr(flat)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(st.text("abc", min_size=1, max_size=3), inner, max_size=3)
        ),
        max_leaves=12,
    ).filter(lambda t: isinstance(t, dict))
)
def test_flat_hparams_keeps_every_leaf_once(tree: dict[str, Any]) -> None:
    def leaves(node: Any) -> int:
        if isinstance(node, dict):
            return sum(leaves(v) for v in node.values())
        return 1

    flat = flat_hparams(tree)  # keys have no dots here, so every path names one leaf
    assert all(isinstance(v, bool | int | float | str) for v in flat.values())
    assert len(flat) == leaves(tree)


def _record(**kw: Any) -> RoundRecord:
    base: dict[str, Any] = {
        "run_id": "demo",
        "fragment_id": 2,
        "round_id": 10,
        "version_before": 4,
        "version_after": 5,
        "decision": "merge",
        "reason": "quorum",
        "contributors": (
            ContributorRecord(learner_id="L0", weight=0.75, n_tokens=300, n_steps=20, staleness=0),
            ContributorRecord(learner_id="L1", weight=0.25, n_tokens=100, n_steps=20, staleness=2),
        ),
        "entries": (
            EntryOutcome(entry_id="1-0", learner_id="L0", round_id=10, outcome="merged", reason=""),
            EntryOutcome(entry_id="2-0", learner_id="L1", round_id=10, outcome="merged", reason=""),
            EntryOutcome(entry_id="3-0", learner_id="L2", round_id=6, outcome="late", reason="x"),
            EntryOutcome(
                entry_id="4-0", learner_id="L2", round_id=10, outcome="carried", reason=""
            ),
            EntryOutcome(entry_id="5-0", learner_id="L3", round_id=10, outcome="stale", reason="y"),
        ),
        "opened_at_s": 100.0,
        "quorum_at_s": 101.5,
        "closed_at_s": 102.0,
        "timings_s": {"grace_window": 0.5, "merge": 0.03, "stage": 0.03},
    }
    return RoundRecord(**{**base, **kw})


def test_round_scalars_of_a_merged_round() -> None:
    got = round_scalars(_record())
    assert got["contributors"] == 2 and got["tokens"] == 400
    assert got["weight_max"] == 0.75
    assert got["staleness_mean"] == 1.0 and got["staleness_max"] == 2
    assert got["late"] == 1 and got["unmerged"] == 2  # late + stale; carried is still pending
    assert got["grace_window_s"] == 0.5
    assert got["open_to_quorum_s"] == pytest.approx(1.5)
    assert got["quorum_to_merge_s"] == pytest.approx(0.5)
    assert got["merge_to_commit_s"] == pytest.approx(0.06)


def test_round_scalars_without_quorum_or_contributors_are_none_not_zero() -> None:
    got = round_scalars(_record(contributors=(), entries=(), quorum_at_s=None, timings_s={}))
    assert got["contributors"] == 0 and got["tokens"] == 0
    for name in ("weight_max", "staleness_mean", "staleness_max", "grace_window_s"):
        assert got[name] is None, name
    assert got["open_to_quorum_s"] is None and got["quorum_to_merge_s"] is None


def test_tensorboard_files_hold_the_scalars_and_the_config(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "tensorboard")
    tracker = open_tracker(cfg, "learner-L0")
    for step in (10, 20, 30):
        tracker.log("train", {"loss": 5.0 - step / 10, "lr": 1e-3}, step=step)
    tracker.log("fragment1", {"contributors": 2}, step=1)
    tracker.close()
    where = tmp_path / "demo" / "learner-L0"
    scalars = tb_scalars(where)
    assert [s for s, _ in scalars["train/loss"]] == [10, 20, 30]
    assert [v for _, v in scalars["train/loss"]] == [4.0, 3.0, 2.0]
    assert scalars["fragment1/contributors"] == [(1, 2.0)]
    hparams = tb_hparams(where)
    assert hparams["run_digest"] == cfg.run_digest and hparams["config_digest"] == cfg.digest
    assert hparams["process"] == "learner-L0" and hparams["redis.password"] == "***"


# ── the learner's curve ──────────────────────────────────────────────────────────────────────
def test_the_learner_logs_every_n_steps_with_its_token_rate() -> None:
    clock = FakeClock(0.0)
    learner = SimpleNamespace(clock=clock, n_tokens=0, step_time_ema_s=0.25)
    sink = Recorder()
    curve = TrainCurve(learner, Tracker([sink]), every=5)  # type: ignore[arg-type]
    for step in range(1, 16):
        clock.advance(0.25)
        learner.n_tokens += 100
        curve.after(StepReport(action="trained", step=step, n_tokens=100, lr=1e-3))
        curve.after(StepReport(action="stalled", step=step))  # nothing trained: no point
    rows = [r for r in sink.rows if r[0] == "train"]
    assert [r[2] for r in rows] == []  # no loss tensor: nothing to log
    import torch

    for step in range(16, 26):
        clock.advance(0.25)
        learner.n_tokens += 100
        report = StepReport(
            action="trained", step=step, n_tokens=100, loss_t=torch.tensor(2.0), lr=1e-3
        )
        curve.after(report)
    assert [r[2] for r in sink.rows] == [20, 25]
    last = sink.rows[-1][1]
    assert last["loss"] == 2.0 and last["lr"] == pytest.approx(1e-3)
    assert last["tokens_per_s"] == pytest.approx(400.0)  # 500 tokens in 1.25 s
    assert last["step_time_s"] == 0.25 and last["tokens"] == 2500


# ── ddq up --track ───────────────────────────────────────────────────────────────────────────
def test_ddq_up_track_takes_a_comma_list() -> None:
    assert _backends("tensorboard, wandb") == ("tensorboard", "wandb")
    assert _backends("wandb,wandb") == ("wandb",)
    for bad in ("", "mlflow", "tensorboard,mlflow"):
        with pytest.raises(argparse.ArgumentTypeError, match="--track takes"):
            _backends(bad)


def test_ddq_up_puts_the_curves_in_the_run_dir_unless_the_config_names_one(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    on = validate_config({"tracking": {"backends": ["tensorboard"]}})
    assert tracking_overrides(on, run_dir) == {"DDQ__TRACKING__DIR": str(run_dir / "tracking")}
    assert tracking_overrides(validate_config({}), run_dir) == {}
    named = validate_config({"tracking": {"backends": ["wandb"], "dir": "/data/curves"}})
    assert tracking_overrides(named, run_dir) == {}
    assert tracking.tracking_dir(named) == Path("/data/curves/demo")
