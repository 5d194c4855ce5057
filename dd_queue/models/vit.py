"""Vision Transformer classifier (Dosovitskiy et al., arXiv 2010.11929), small-image variant.

Images (B, C, H, W) are cut into non-overlapping P×P patches, each flattened (C·P·P values, in
channel-major order) and projected by ``patch_embed`` (Linear with bias), plus a learned
``pos_embed`` (n_patches × d). Bidirectional pre-norm blocks (no RoPE, no mask), final RMSNorm,
then global mean pooling over patches instead of a CLS token (as in "Better plain ViT baselines",
Beyer et al., arXiv 2205.01580: simpler, one tensor fewer, as accurate) and a linear ``head``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dd_queue.models.base import ModelOutput, TrainBatch
from dd_queue.models.layers import Block
from dd_queue.models.spec import ModelSpec


class ViT(nn.Module):
    """Image classifier; ``forward(batch)`` returns cross-entropy loss, logits and accuracy."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        patch_values = spec.in_channels * spec.patch_size**2
        self.patch_embed = nn.Linear(patch_values, spec.d_model)
        self.pos_embed = nn.Parameter(torch.empty(spec.n_patches, spec.d_model))
        self.blocks = nn.ModuleList(
            Block(spec, causal=False, rope=False) for _ in range(spec.n_layers)
        )
        self.norm_f = nn.RMSNorm(spec.d_model, eps=1e-6)
        self.head = nn.Linear(spec.d_model, spec.n_classes)

    def patchify(self, images: Tensor) -> Tensor:
        """(B, C, H, W) → (B, n_patches, C·P·P), patches in row-major order."""
        batch, channels, height, width = images.shape
        p = self.spec.patch_size
        x = images.reshape(batch, channels, height // p, p, width // p, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(batch, -1, channels * p * p)

    def logits(self, images: Tensor) -> Tensor:
        """Class logits (B, n_classes) for ``images`` (B, C, H, W) float."""
        x = self.patch_embed(self.patchify(images)) + self.pos_embed
        for block in self.blocks:
            x, _ = block(x)
        logits: Tensor = self.head(self.norm_f(x).mean(dim=1))
        return logits

    def forward(self, batch: TrainBatch) -> ModelOutput:
        """Mean cross-entropy (nats/image) and accuracy of ``batch.inputs`` vs labels."""
        logits = self.logits(batch.inputs)
        task_loss = F.cross_entropy(logits.float(), batch.targets)
        with torch.no_grad():
            accuracy = (logits.argmax(dim=-1) == batch.targets).float().mean()
        return ModelOutput(loss=task_loss, task_loss=task_loss, logits=logits, accuracy=accuracy)
