"""A learner whose data would not be the run's is refused when it joins, told which setting.

The run digest hashes the prepared data's identity (dataset fingerprint, tokenizer hash) and
``membership.expected_learners`` (it deals the shards). A learner started with another
tokenizer, another corpus or another shard count must not train: its join fails with a
``ConfigError`` that names the part, before it computes a step. Real Redis, real synchronizer,
real learner, data from ``ddq prepare``'s library function.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from dd_queue.bus import RedisBus
from dd_queue.clock import SystemClock
from dd_queue.errors import ConfigError
from dd_queue.learner.build import build_learner
from dd_queue.learner.dist import SingleProcess
from dd_queue.synchronizer import Synchronizer
from tests.synchronizer_support import make_config

pytest.importorskip("tokenizers")

WORDS = ("river", "stone", "light", "green", "house", "quiet", "north", "bread", "winter")


def _corpus(directory: Path, seed: int) -> Path:
    rng = random.Random(seed)
    directory.mkdir()
    for i in range(40):
        text = " ".join(rng.choice(WORDS) for _ in range(120))
        (directory / f"d{i}.txt").write_text(text + "\n")
    return directory


def _prepared(tmp_path: Path, name: str, *, corpus_seed: int, vocab: int) -> Path:
    from dd_queue.data.prepare import prepare

    out = tmp_path / name
    prepare([_corpus(tmp_path / f"{name}-corpus", corpus_seed)], out, vocab_size=vocab)
    return out


def _cfg(run_id: str, data: Path, learners: int = 2) -> Any:
    return make_config(
        run_id,
        model__vocab_size=512,
        model__seq_len=16,
        data__source="prepared",
        data__path=str(data),
        membership__expected_learners=learners,
    )


@pytest.fixture
def run_data(tmp_path: Path) -> Path:
    return _prepared(tmp_path, "run", corpus_seed=0, vocab=300)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("another tokenizer", "the data"),
        ("another corpus", "the data"),
        ("another shard count", "membership.expected_learners"),
    ],
)
def test_a_learner_with_other_data_is_refused_and_told_which_setting(
    bus: RedisBus, run_id: str, tmp_path: Path, run_data: Path, case: str, words: str
) -> None:
    run_cfg = _cfg(run_id, run_data)
    if case == "another tokenizer":  # the same documents, a BPE of another size
        learner_cfg = _cfg(run_id, _prepared(tmp_path, "tok", corpus_seed=0, vocab=280))
    elif case == "another corpus":
        learner_cfg = _cfg(run_id, _prepared(tmp_path, "other", corpus_seed=1, vocab=300))
    else:  # the same data, dealt into 3 shards instead of 2: shard 0 of 3 overlaps shard 1 of 2
        learner_cfg = _cfg(run_id, run_data, learners=3)
    assert learner_cfg.run_digest != run_cfg.run_digest
    sync = Synchronizer(run_cfg, bus=bus, clock=SystemClock(), synchronizer_id="s0")
    sync.start()
    learner = build_learner(
        learner_cfg,
        "L0",
        group=SingleProcess(),
        bus=bus,
        clock=SystemClock(),
        device=torch.device("cpu"),
    )
    try:
        with pytest.raises(ConfigError, match=words) as refused:
            learner.join(timeout_s=10.0)
        assert "differs in" in str(refused.value)
        assert learner.inner.step_count == 0  # refused before a single step
    finally:
        learner.leave(timeout_s=1.0)
        sync.close()


def test_a_learner_with_the_runs_data_joins(bus: RedisBus, run_id: str, run_data: Path) -> None:
    cfg = _cfg(run_id, run_data)
    sync = Synchronizer(cfg, bus=bus, clock=SystemClock(), synchronizer_id="s0")
    sync.start()
    learner = build_learner(
        cfg, "L0", group=SingleProcess(), bus=bus, clock=SystemClock(), device=torch.device("cpu")
    )
    try:
        assert learner.join(timeout_s=10.0) is not None
    finally:
        learner.leave(timeout_s=1.0)
        sync.close()
