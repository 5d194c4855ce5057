"""The inner optimisation of a learner: one AdamW step per batch.

Learning rate: linear warm-up over ``warmup_steps`` to ``inner_lr``, then cosine decay to
``min_lr_ratio · inner_lr`` over ``decay_steps`` (``max_steps`` when 0; constant when both are 0).
Gradients are clipped to ``grad_clip`` (global L2 norm). One inner step may accumulate the
gradients of ``learner.grad_accum_steps`` micro-batches (each of ``data.batch_size``; under DDP
only the last one all-reduces), so a small GPU trains the batch of a large one. On CUDA the
forward pass runs under autocast (parameters, gradients and AdamW state stay fp32): bf16, or fp16
with a ``GradScaler`` for GPUs without bf16 (a step whose scaled gradients overflow is skipped and
the scale halves, counted in ``skipped_steps``). The model may be wrapped in ``torch.compile``.
All are options (``model.autocast``, ``model.compile``, ``learner.grad_accum_steps``).

Tokens are counted exactly: for language models the targets that are not ``IGNORE_INDEX``
(padding), counted on the host batch before it moves to the device (no device sync); for images,
the batch's ``n_tokens`` (images). Decoupled DiLoCo weighs a learner's contribution by them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dd_queue.config import LearnerConfig
from dd_queue.data import Batch
from dd_queue.models import IGNORE_INDEX, param_groups


def lr_factor(step: int, *, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate for the inner step after ``step`` completed ones.

    Args:
        step: Completed inner steps, ≥ 0.
        warmup_steps: Linear warm-up length; step 0 trains at ``1 / warmup_steps``.
        decay_steps: Cosine length after warm-up (0: constant after warm-up).
        min_lr_ratio: Floor of the cosine, as a share of the peak.

    Returns:
        A factor in ``(0, 1]``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def count_tokens(batch: Batch) -> int:
    """Tokens a batch trains: non-padding LM targets, or images (see the module docstring)."""
    targets = batch.targets
    if targets.dim() >= 2 and not targets.is_floating_point():
        return int((targets != IGNORE_INDEX).sum())
    return int(batch.n_tokens)


def autocast_dtype(device: torch.device, mode: str) -> torch.dtype | None:
    """The forward pass's compute dtype: bf16 or fp16 on CUDA as ``mode`` says; None (fp32) on
    other devices and for ``"off"``."""
    if device.type != "cuda":
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)


def grad_scaler(device: torch.device, autocast: torch.dtype | None) -> torch.amp.GradScaler | None:
    """A ``GradScaler`` where fp16 autocast needs one (fp16's range underflows small gradients);
    None for bf16 and fp32."""
    return torch.amp.GradScaler(device.type) if autocast is torch.float16 else None


def compile_model(model: nn.Module, *, backend: str = "inductor") -> Callable[..., Any]:
    """``torch.compile(model)``; parameters stay shared with ``model``."""
    return torch.compile(model, backend=backend)


class InnerLoop:
    """AdamW over a model with warm-up + cosine learning rate, clipping and autocast.

    Args:
        model: The plain module (its parameters are optimised; names index the groups).
        forward: What to call with a batch: the model itself, its DDP wrapper or a compiled
            version; it must share ``model``'s parameters.
        cfg: The learner section (learning rate, decay, clipping, betas).
        device: Where batches go.
        autocast: Compute dtype of the forward pass (None: fp32).
        scaler: Loss scaling for fp16 (``grad_scaler``); None steps the gradients as they are.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        forward: Callable[..., Any],
        cfg: LearnerConfig,
        device: torch.device,
        autocast: torch.dtype | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.model, self._forward, self.cfg = model, forward, cfg
        self.device, self.autocast, self.scaler = device, autocast, scaler
        self.optimizer = torch.optim.AdamW(
            param_groups(model, cfg.weight_decay),
            lr=cfg.inner_lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
        )
        self.step_count = 0
        self.skipped_steps = 0  # fp16 steps the scaler skipped (inf or nan gradients)
        self._decay_steps = cfg.decay_steps or cfg.max_steps

    def lr(self) -> float:
        """Learning rate of the next inner step."""
        factor = lr_factor(
            self.step_count,
            warmup_steps=self.cfg.warmup_steps,
            decay_steps=self._decay_steps,
            min_lr_ratio=self.cfg.min_lr_ratio,
        )
        return self.cfg.inner_lr * factor

    def train_step(self, batches: Sequence[Batch]) -> tuple[torch.Tensor, float]:
        """One inner step on the micro-batches ``batches`` (host or device; their gradients
        add up, each loss weighted ``1 / len(batches)``); returns (detached mean loss, lr used).

        Raises:
            ValueError: ``batches`` is empty.
        """
        if not batches:
            raise ValueError("an inner step needs at least one micro-batch")
        lr = self.lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        no_sync = getattr(self._forward, "no_sync", None)  # DDP: all-reduce once, at the end
        losses = []
        for i, batch in enumerate(batches):
            defer = i < len(batches) - 1
            with no_sync() if defer and no_sync is not None else contextlib.nullcontext():
                losses.append(self._micro_step(batch, len(batches)))
        self._optimizer_step()
        self.step_count += 1
        return (losses[0] if len(losses) == 1 else torch.stack(losses).mean()), lr

    def _micro_step(self, batch: Batch, n_micro: int) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its detached loss."""
        batch = batch.to(self.device, non_blocking=self.device.type == "cuda")
        ctx = (
            torch.autocast(self.device.type, dtype=self.autocast)
            if self.autocast is not None
            else contextlib.nullcontext()
        )
        with ctx:
            out = self._forward(batch)
        loss = out.loss
        scaled = loss / n_micro if n_micro > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        detached: torch.Tensor = loss.detach()
        return detached

    def _optimizer_step(self) -> None:
        """Clip (on unscaled gradients) and step; under fp16 the scaler may skip the step."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if self.scaler is None:
            self.optimizer.step()
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < scale:  # the scaler found inf/nan and skipped the step
                self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state, step count and the fp16 scaler's state (for the local checkpoint)."""
        state: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "step_count": self.step_count,
        }
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved (a checkpoint without a scaler state keeps the
        scaler's initial scale)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


__all__ = [
    "InnerLoop",
    "autocast_dtype",
    "compile_model",
    "count_tokens",
    "grad_scaler",
    "lr_factor",
]
