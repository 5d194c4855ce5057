"""The inner optimisation of a learner: one AdamW step per batch.

Learning rate: linear warm-up over ``warmup_steps`` to ``inner_lr``, then cosine decay to
``min_lr_ratio · inner_lr`` over ``decay_steps`` (``max_steps`` when 0; constant when both are 0).
Gradients are clipped to ``grad_clip`` (global L2 norm). On CUDA the forward pass runs under bf16
autocast (parameters, gradients and AdamW state stay fp32) and the model may be wrapped in
``torch.compile``; both are options (``model.autocast``, ``model.compile``).

Tokens are counted exactly: for language models the targets that are not ``IGNORE_INDEX``
(padding), counted on the host batch before it moves to the device (no device sync); for images,
the batch's ``n_tokens`` (images). Decoupled DiLoCo weighs a learner's contribution by them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
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
    """bf16 on CUDA when ``mode == "bf16"``; None (fp32) elsewhere."""
    return torch.bfloat16 if mode == "bf16" and device.type == "cuda" else None


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
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        forward: Callable[..., Any],
        cfg: LearnerConfig,
        device: torch.device,
        autocast: torch.dtype | None = None,
    ) -> None:
        self.model, self._forward, self.cfg = model, forward, cfg
        self.device, self.autocast = device, autocast
        self.optimizer = torch.optim.AdamW(
            param_groups(model, cfg.weight_decay),
            lr=cfg.inner_lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
        )
        self.step_count = 0
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

    def train_step(self, batch: Batch) -> tuple[torch.Tensor, float]:
        """One inner step on ``batch`` (host or device); returns (detached loss, lr used)."""
        lr = self.lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = batch.to(self.device, non_blocking=self.device.type == "cuda")
        ctx = (
            torch.autocast(self.device.type, dtype=self.autocast)
            if self.autocast is not None
            else contextlib.nullcontext()
        )
        with ctx:
            out = self._forward(batch)
        out.loss.backward()
        if self.cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return out.loss.detach(), lr

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state and step count (for the local checkpoint)."""
        return {"optimizer": self.optimizer.state_dict(), "step_count": self.step_count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])


__all__ = ["InnerLoop", "autocast_dtype", "compile_model", "count_tokens", "lr_factor"]
