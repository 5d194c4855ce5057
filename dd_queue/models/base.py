"""What every model takes and returns, so one generic learner loop can train any of them.

A model's ``forward(batch)`` takes a ``TrainBatch`` and returns a ``ModelOutput`` whose ``loss``
is the scalar to back-propagate. The learner weighs its contribution by ``batch.n_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100
"""Target value that is not trained on (padding); it does not count in ``n_tokens``."""


class TrainBatch(Protocol):
    """One inner step's data, already on the model's device.

    Attributes:
        inputs: Token ids (B, T) int64 for LMs; images (B, C, H, W) float32 for the ViT.
        targets: Next-token ids (B, T) int64 (``IGNORE_INDEX`` = not trained) or labels (B,).
        n_tokens: Training units this batch actually trains: non-ignored target tokens for LMs,
            images for the ViT. The merge weighs learners by it (tokens · tokens/steps).
    """

    @property
    def inputs(self) -> Tensor: ...

    @property
    def targets(self) -> Tensor: ...

    @property
    def n_tokens(self) -> int: ...


class ModelOutput(NamedTuple):
    """What ``forward`` returns (a NamedTuple: ``torch.compile`` traces it without breaks).

    Attributes:
        loss: Scalar to back-propagate: ``task_loss + aux_loss_weight · aux_loss``.
        task_loss: Mean cross-entropy over trained targets, in nats per token (per image).
        logits: (B, T, vocab) for LMs, (B, classes) for the ViT, in the compute dtype.
        aux_loss: MoE load-balancing loss averaged over MoE layers (1 = balanced); None if dense.
        accuracy: Share of images classified correctly (ViT only; no gradient); else None.
    """

    loss: Tensor
    task_loss: Tensor
    logits: Tensor
    aux_loss: Tensor | None = None
    accuracy: Tensor | None = None


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy (nats/token), in float32, of logits (B, T, vocab) against
    targets (B, T); ``IGNORE_INDEX`` targets are skipped. Every LM's loss (presets, hf, module)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX
    )


@torch.no_grad()
def heldout_score(
    model: Callable[[TrainBatch], ModelOutput], batches: Iterable[TrainBatch]
) -> tuple[float, float | None, int]:
    """(mean task loss, accuracy or None, training units) of ``model`` over ``batches``, each
    batch weighed by its ``n_tokens``: the held-out score every evaluation reports."""
    loss_sum, correct, n, has_accuracy = 0.0, 0.0, 0, False
    for batch in batches:
        out = model(batch)
        loss_sum += float(out.task_loss) * batch.n_tokens
        if out.accuracy is not None:
            has_accuracy = True
            correct += float(out.accuracy) * batch.n_tokens
        n += batch.n_tokens
    total = max(n, 1)
    return loss_sum / total, (correct / total if has_accuracy else None), n
