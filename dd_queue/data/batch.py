"""The batch every loader yields and every model takes (it satisfies ``models.TrainBatch``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Batch:
    """One inner step's data.

    Attributes:
        inputs: Token ids (B, T) int64, or images (B, C, H, W) float32.
        targets: Next-token ids (B, T) int64, or labels (B,) int64.
        n_tokens: Target tokens trained (text: B·T, no padding here) or images (vision).
    """

    inputs: Tensor
    targets: Tensor
    n_tokens: int

    def to(self, device: str | torch.device, *, non_blocking: bool = False) -> Batch:
        """The same batch on ``device`` (``non_blocking`` needs pinned memory to overlap)."""
        return Batch(
            self.inputs.to(device, non_blocking=non_blocking),
            self.targets.to(device, non_blocking=non_blocking),
            self.n_tokens,
        )

    def pin_memory(self) -> Batch:
        """The same batch in page-locked host memory (for fast, asynchronous copies to a GPU)."""
        return Batch(self.inputs.pin_memory(), self.targets.pin_memory(), self.n_tokens)
