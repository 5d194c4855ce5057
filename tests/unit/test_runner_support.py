"""Helpers of the runner tests: a tiny experiment, one run, plain-training references."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dd_queue.config import DDQConfig
from dd_queue.data import Dataset, ShardLoader, ShardSpec, build_dataset
from dd_queue.learner import InnerLoop
from dd_queue.models import build_model
from dd_queue.runner import Runner, RunnerSpec
from dd_queue.runner.result import RunResult
from dd_queue.runner.spec import ExperimentSpec, deep_merge

TINY_MODEL = {"preset": "gpt-tiny", "n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16}
BATCH = 2
TOKENS_PER_STEP = BATCH * 16
_DATASETS: dict[int, Dataset] = {}


def tiny_experiment(
    config: dict[str, Any] | None = None, runner: dict[str, Any] | None = None, seed: int = 0
) -> ExperimentSpec:
    """One variant named ``run`` over a 1-layer GPT (seq 16, batch 2), fp32, P = 2, H = 4."""
    base_config: dict[str, Any] = {
        "model": dict(TINY_MODEL),
        "data": {"batch_size": BATCH, "max_bytes": 1 << 18, "eval_batches": 2},
        "wire": {"codec": "fp32"},
        "learner": {"warmup_steps": 2, "inner_lr": 1e-2},
        "synchronizer": {
            "n_fragments": 2,
            "sync_every_steps": 4,
            "initial_step_time_s": 1.0,
            "round_timeout_s": 8.0,
        },
        "membership": {
            "heartbeat_interval_s": 1.0,
            "straggling_after_s": 2.0,
            "stalled_after_s": 3.0,
            "dead_after_s": 4.0,
        },
    }
    base_runner: dict[str, Any] = {"n_learners": 2, "token_budget": 24 * TOKENS_PER_STEP}
    return ExperimentSpec.model_validate(
        {
            "name": "tiny",
            "seed": seed,
            "config": deep_merge(base_config, config or {}),
            "runner": deep_merge(base_runner, runner or {}),
            "variants": [{"name": "run"}],
        }
    )


def dataset_of(cfg: DDQConfig) -> Dataset:
    """The stdlib-text dataset of the tiny config (loaded once per test session)."""
    key = cfg.model.architecture().seq_len
    if key not in _DATASETS:
        data = cfg.data.spec(vocab_size=cfg.model.architecture().vocab_size)
        _DATASETS[key] = build_dataset(data, seq_len=key)
    return _DATASETS[key]


def make_runner(spec: ExperimentSpec, **kw: Any) -> tuple[Runner, DDQConfig, RunnerSpec]:
    """The runner of the experiment's only variant (not yet run)."""
    cfg, runner_spec = spec.resolve(spec.variants[0])
    return Runner(cfg, runner_spec, dataset_of(cfg), **kw), cfg, runner_spec


def run_tiny(**kw: Any) -> tuple[Runner, RunResult]:
    """Build and run ``tiny_experiment(**kw)``."""
    runner, _, _ = make_runner(tiny_experiment(**kw))
    return runner, runner.run()


def global_theta(runner: Runner) -> list[np.ndarray]:
    """Θ_p of every fragment after the run."""
    return [runner.sync.theta(p) for p in range(runner.cfg.synchronizer.n_fragments)]


def plain_training(cfg: DDQConfig, n_steps: int, *, batch_size: int) -> InnerLoop:
    """AdamW on the run's initial model Θ(0) and learner 0's batches (shard 0 of 1), the same
    inner optimizer the learner uses, for ``n_steps`` steps."""
    model = build_model(cfg.model.preset, seed=cfg.run.seed, **cfg.model.overrides())
    loop = InnerLoop(model, forward=model, cfg=cfg.learner, device=torch.device("cpu"))
    loader = ShardLoader(
        dataset_of(cfg),
        batch_size=batch_size,
        shard=ShardSpec(index=0, count=1, seed=cfg.run.seed),
        eval_fraction=cfg.data.eval_fraction,
    )
    for _ in range(n_steps):
        loop.train_step([next(loader)])
    return loop
