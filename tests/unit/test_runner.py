"""The in-process runner end to end: determinism, the special cases of ../shared/algorithm.md,
synchronous waiting, failures and goodput. Tiny model (1 layer, width 32, seq 16, batch 2)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dd_queue.learner import StepReport
from dd_queue.runner.slot import LearnerSlot
from tests.unit.test_runner_support import (
    TOKENS_PER_STEP,
    global_theta,
    make_runner,
    plain_training,
    run_tiny,
    tiny_experiment,
)

SGD1 = {"outer_lr": 1.0, "outer_momentum": 0.0, "quorum": 1}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_same_seed_gives_bit_identical_parameters_and_records():
    kw = {
        "runner": {"n_learners": 3, "jitter": 0.2, "slow_fraction": 0.34, "slow_factor": 1.5,
                   "failures": {"mtbf_s": 8.0, "repair_mean_s": 3.0, "restart_s": 1.0}},
    }  # fmt: skip
    first, a = run_tiny(**kw)
    second, b = run_tiny(**kw)
    for x, y in zip(global_theta(first), global_theta(second), strict=True):
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))
    assert a.round_rows == b.round_rows and a.learners == b.learners
    assert [e.loss for e in a.evals] == [e.loss for e in b.evals]
    assert sum(row["failures"] for row in a.learners) > 0  # the failures were exercised too
    other, _ = run_tiny(seed=1, **kw)
    assert not np.array_equal(global_theta(first)[0], global_theta(other)[0])


def test_one_learner_outer_sgd1_is_plain_training():
    """1 learner, K = 1, outer SGD(lr 1, μ 0), fp32: Θ = plain AdamW training (float tolerance).

    P = 1 and H = N (learner-paced): the only contribution is sent after step N, before any
    global has been applied, and merged in the drain: Θ(1) = Θ(0) − (Θ(0) − θ_N) = θ_N.
    (With more merges the learner overwrites θ with Θ(v) τ = 1 step after its snapshot, which
    discards that step's update: see the next two tests.)
    """
    n = 12
    spec = tiny_experiment(
        config={"synchronizer": {**SGD1, "n_fragments": 1, "sync_every_steps": n,
                                 "schedule": "learner"}},
        runner={"n_learners": 1, "token_budget": n * TOKENS_PER_STEP},
    )  # fmt: skip
    runner, cfg, _ = make_runner(spec)
    result = runner.run()
    assert result.rounds.merged == 1 and runner.sync.versions() == {0: 1}
    reference = _fragment_of(runner, plain_training(cfg, n, batch_size=cfg.data.batch_size), 0)
    theta = global_theta(runner)[0]
    assert np.abs(theta - reference).max() < 1e-6
    initial = _fragment_of(runner, plain_training(cfg, 0, batch_size=2), 0)
    assert np.abs(theta - initial).max() > 1e-2


def _record_snapshots_and_globals(cfg_sync: dict, alpha: float, n_steps: int):
    spec = tiny_experiment(
        config={"synchronizer": {**SGD1, **cfg_sync, "schedule": "learner"},
                "learner": {"mix_alpha": alpha}},
        runner={"n_learners": 1, "token_budget": n_steps * TOKENS_PER_STEP},
    )  # fmt: skip
    snapshots: dict[int, list[tuple[int, np.ndarray]]] = {}
    globals_: dict[int, list[tuple[int, np.ndarray]]] = {}

    def on_step(slot: LearnerSlot, report: StepReport) -> None:
        learner = slot.learner
        assert learner is not None
        applied = {p for p, _ in report.applied}
        for p, _round in report.snapshots:
            assert p not in applied  # offsets: a fragment is never sent and received at once
            snapshots.setdefault(p, []).append((report.step, learner.params.read(p)))
        if alpha == 0.0:  # the overwrite is the last thing a step does: θ_p = Θ_p(v) exactly
            for p, version in report.applied:
                globals_.setdefault(p, []).append((version, learner.params.read(p)))

    runner, cfg, _ = make_runner(spec, on_step=on_step)
    runner.run()
    return runner, cfg, snapshots, globals_


def test_global_equals_the_learners_model_after_every_merge():
    """algorithm.md: 1 learner, K = 1, outer SGD(1): after every merge Θ_p equals the learner's
    θ_p at its snapshot (P = 2, H = 4, several merges per fragment, mix_alpha 0)."""
    _, _, snapshots, globals_ = _record_snapshots_and_globals(
        {"n_fragments": 2, "sync_every_steps": 4}, alpha=0.0, n_steps=24
    )
    for p in (0, 1):
        assert len(globals_[p]) >= 4
        for version, theta in globals_[p]:
            _, snap = snapshots[p][version - 1]  # version v merged the v-th snapshot
            assert np.abs(theta - snap).max() < 1e-6


def test_every_merge_is_plain_training_when_the_learner_keeps_its_parameters():
    """With mix_alpha 1 (θ ← 1·θ + 0·Θ: no overwrite on receipt) the learner trains plainly, and
    every merged Θ_p(v) is plain AdamW training at the step of the v-th snapshot (P = 2, H = 2)."""
    n = 16
    runner, cfg, snapshots, _ = _record_snapshots_and_globals(
        {"n_fragments": 2, "sync_every_steps": 2}, alpha=1.0, n_steps=n
    )
    loop = plain_training(cfg, n, batch_size=cfg.data.batch_size)
    learner = runner.slots[0].learner
    assert learner is not None
    for p in (0, 1):
        np.testing.assert_array_equal(learner.params.read(p), _fragment_of(runner, loop, p))
        steps = [step for step, _ in snapshots[p]]
        assert runner.sync.versions()[p] == len(steps) >= 7
        last = _fragment_of(runner, plain_training(cfg, steps[-1], batch_size=2), p)
        assert np.abs(runner.sync.theta(p) - last).max() < 1e-6


def _fragment_of(runner, loop, p: int) -> np.ndarray:
    from dd_queue.learner import FragmentParams

    return FragmentParams(runner.slots[0].learner.plan, loop.model).read(p)


def test_synchronous_learners_wait_for_the_merge_and_decoupled_ones_never_do():
    hetero = {"n_learners": 2, "speed_factors": [1.0, 2.0], "token_budget": 30 * TOKENS_PER_STEP}
    _, sync = run_tiny(runner={**hetero, "mode": "synchronous"})
    _, dec = run_tiny(runner={**hetero, "mode": "decoupled"})
    fast_sync, slow_sync = sync.learners
    assert fast_sync["waiting_s"] > 0.3 * sync.stop_s  # the fast one waits for the slow one
    assert sync.goodput.goodput < 0.85 and sync.goodput.waiting_chip_s > 0
    assert sync.rounds.merged > 0
    merged = [row for row in sync.round_rows if row[2] == "merge"]
    assert all(row[4] == 2 for row in merged)  # K = M: every merge has both learners
    assert fast_sync["steps"] <= slow_sync["steps"] + 4  # lock-step: within H steps
    assert all(row["waiting_s"] == 0 for row in dec.learners)
    assert dec.goodput.goodput == pytest.approx(1.0)
    assert dec.learners[0]["steps"] > 1.6 * dec.learners[1]["steps"]


def test_failures_give_down_intervals_restarts_and_the_run_goes_on():
    _, result = run_tiny(
        runner={"n_learners": 3, "token_budget": 60 * TOKENS_PER_STEP,
                "failures": {"mtbf_s": 10.0, "repair_mean_s": 4.0, "repair_min_s": 1.0,
                             "restart_s": 1.0}},
    )  # fmt: skip
    failures = sum(row["failures"] for row in result.learners)
    assert failures >= 2
    assert all(row["down_s"] >= 1.0 * row["failures"] for row in result.learners)
    assert result.goodput.down_chip_s > 0 and result.goodput.restarting_chip_s > 0
    assert result.tokens >= 60 * TOKENS_PER_STEP  # the budget was reached despite failures
    assert result.goodput.uptime > 0.95  # some learner was training nearly all the time
    assert result.rounds.merged >= 10
    assert math.isfinite(result.final.loss) and result.final.loss < result.evals[0].loss


def test_goodput_ledger_covers_every_learner_for_the_whole_run():
    _, result = run_tiny(
        runner={"n_learners": 3, "mode": "synchronous", "speed_factors": [1.0, 1.0, 1.5],
                "failures": {"mtbf_s": 15.0, "repair_mean_s": 3.0}},
    )  # fmt: skip
    g = result.goodput
    kinds = g.training_chip_s + g.waiting_chip_s + g.down_chip_s + g.restarting_chip_s
    assert kinds == pytest.approx(g.allocated_chip_s)
    assert g.allocated_chip_s == pytest.approx(3 * result.stop_s)
    assert 0 < g.goodput < 1 and g.goodput <= g.uptime <= 1
    assert g.goodput == pytest.approx(g.training_chip_s / g.allocated_chip_s)
    for row in result.learners:
        total = row["training_s"] + row["waiting_s"] + row["down_s"] + row["restarting_s"]
        assert total == pytest.approx(result.stop_s)


def test_data_parallel_is_plain_training_with_m_times_the_batch():
    runner, result = run_tiny(runner={"mode": "data-parallel", "n_learners": 2,
                                      "token_budget": 10 * 2 * TOKENS_PER_STEP})  # fmt: skip
    cfg = runner.cfg
    assert cfg.data.batch_size == 4 and result.rounds.merged == 0
    loop = plain_training(cfg, 10, batch_size=4)
    learner = runner.slots[0].learner
    assert learner is not None and learner.step_count == 10
    for p in range(cfg.synchronizer.n_fragments):
        np.testing.assert_array_equal(learner.params.read(p), _fragment_of(runner, loop, p))
    assert result.goodput.allocated_chip_s == pytest.approx(2 * result.stop_s)  # M chips


def test_eval_points_rise_in_tokens_and_time_and_end_after_the_drain():
    _, result = run_tiny(runner={"eval_every_s": 3.0})
    times = [e.virtual_s for e in result.evals]
    tokens = [e.tokens for e in result.evals]
    assert times == sorted(times) and tokens == sorted(tokens)
    assert result.evals[0].tokens == 0 and result.final.tokens == result.tokens
    assert result.end_s == pytest.approx(result.stop_s + 4 * 1.0)  # drain: H steps
    assert result.final.loss < result.evals[0].loss


def test_image_models_report_held_out_accuracy(tmp_path):
    """vit-tiny through the npz loader (synthetic, trivially separable 8×8 images: a bright
    pixel where the label says): the global model's accuracy is reported and rises."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 600)
    images = rng.normal(0.0, 0.1, (600, 8, 8)).astype(np.float32)
    images[np.arange(600), 2 + labels // 5 * 3, labels % 5] += 3.0
    path = tmp_path / "blobs.npz"
    np.savez(path, images=images, labels=labels)
    spec = tiny_experiment(
        config={"model": {"preset": "vit-tiny", "n_layers": None, "d_model": None,
                          "n_heads": None, "seq_len": None},
                "data": {"source": "npz", "path": str(path), "batch_size": 16},
                "learner": {"inner_lr": 3e-3}},
        runner={"token_budget": 2 * 40 * 16, "eval_every_s": 10.0},
    )  # fmt: skip
    runner, _, _ = make_runner(spec)
    result = runner.run()
    assert result.evals[0].accuracy is not None and result.final.accuracy is not None
    assert result.final.accuracy > max(0.3, result.evals[0].accuracy + 0.2)  # chance: 0.1
    assert result.tokens == 2 * 40 * 16  # images count as tokens
