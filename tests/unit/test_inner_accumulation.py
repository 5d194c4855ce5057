"""Gradient accumulation and fp16 loss scaling in the inner loop (CPU; the scaler is the real
``torch.amp.GradScaler``, which runs on CPU as on CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch

from dd_queue.data import Batch
from dd_queue.learner import InnerLoop
from dd_queue.learner.inner import grad_scaler
from tests.unit.test_learner import make_rig
from tests.unit.test_learner_standin import random_batches, tiny_config, tiny_model

CPU = torch.device("cpu")


def _halves(batch: Batch) -> list[Batch]:
    n = batch.inputs.shape[0] // 2
    tokens = batch.n_tokens // 2
    return [
        Batch(batch.inputs[:n], batch.targets[:n], tokens),
        Batch(batch.inputs[n:], batch.targets[n:], tokens),
    ]


def _loop(model: torch.nn.Module, cfg, scaler=None) -> InnerLoop:
    return InnerLoop(model, forward=model, cfg=cfg.learner, device=CPU, scaler=scaler)


def test_two_micro_batches_step_like_their_union():
    """Accumulating the two halves of a batch gives the step of the whole batch (equal token
    counts, mean losses): same parameters, same reported loss."""
    cfg = tiny_config()
    whole_model = tiny_model(cfg, seed=0)
    split_model = copy.deepcopy(whole_model)
    whole, split = _loop(whole_model, cfg), _loop(split_model, cfg)
    for batch in [next(random_batches(cfg)) for _ in range(3)]:
        loss_whole, _ = whole.train_step([batch])
        loss_split, _ = split.train_step(_halves(batch))
        torch.testing.assert_close(loss_split, loss_whole, rtol=1e-5, atol=1e-6)
    for a, b in zip(whole_model.parameters(), split_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert whole.step_count == split.step_count == 3


def test_an_empty_step_is_refused():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="at least one micro-batch"):
        _loop(tiny_model(cfg, seed=0), cfg).train_step([])


def test_the_learner_takes_grad_accum_steps_batches_and_counts_their_tokens():
    rig = make_rig(tiny_config(learner={"grad_accum_steps": 3}))
    report = rig.learner.step()
    assert report.action == "trained"
    assert report.n_tokens == 3 * rig.cfg.data.batch_size * rig.cfg.model.architecture().seq_len


def test_the_scaler_steps_like_no_scaler_on_finite_gradients():
    """A scaled backward, unscaled before clipping, steps the same parameters as fp32."""
    cfg = tiny_config()
    plain_model = tiny_model(cfg, seed=0)
    scaled_model = copy.deepcopy(plain_model)
    plain = _loop(plain_model, cfg)
    scaled = _loop(scaled_model, cfg, torch.amp.GradScaler("cpu", init_scale=2.0**10))
    for batch in [next(random_batches(cfg)) for _ in range(3)]:
        plain.train_step([batch])
        scaled.train_step([batch])
    for a, b in zip(plain_model.parameters(), scaled_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert scaled.skipped_steps == 0


def test_an_overflowing_step_is_skipped_and_the_scale_halves():
    """An inf gradient (fp16's overflow) leaves every parameter as it was, counts a skipped
    step, halves the scale, and the scale survives a checkpoint round trip."""
    cfg = tiny_config()
    model = tiny_model(cfg, seed=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    loop = _loop(model, cfg, scaler)
    batch = next(random_batches(cfg))
    loop.train_step([batch])
    before = [p.detach().clone() for p in model.parameters()]
    first = next(iter(model.parameters()))
    hook = first.register_hook(lambda g: torch.full_like(g, float("inf")))
    loop.train_step([batch])
    hook.remove()
    assert loop.skipped_steps == 1 and scaler.get_scale() == 2.0**15
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    restored = _loop(copy.deepcopy(model), cfg, torch.amp.GradScaler("cpu", init_scale=1.0))
    restored.load_state_dict(loop.state_dict())
    assert restored.scaler is not None and restored.scaler.get_scale() == 2.0**15
    assert restored.step_count == 2


def test_a_scaler_only_for_fp16():
    assert grad_scaler(CPU, None) is None
    assert grad_scaler(CPU, torch.bfloat16) is None
    assert isinstance(grad_scaler(CPU, torch.float16), torch.amp.GradScaler)
