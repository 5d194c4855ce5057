"""Scoring the global model Θ of an in-process run on the held-out split.

Θ is assembled fragment by fragment (``Synchronizer.theta(p)``, or a data-parallel learner's own
parameters) into a private copy of the model, which then runs the same held-out batches every
time: the examples every learner's shard leaves out (``ShardLoader.eval_batches``). The loss is
the token-weighted mean task cross-entropy (nats per token, or per image); the accuracy is
reported for image models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dd_queue.config import DDQConfig
from dd_queue.core.fragments import plan_fragments, shapes_from_named
from dd_queue.data import Batch, Dataset, ShardLoader
from dd_queue.learner.params import FragmentParams
from dd_queue.models.base import heldout_score
from dd_queue.models.builder import build, embedding_names, synced_parameters

__all__ = ["EvalPoint", "GlobalEvaluator"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalPoint:
    """One evaluation of the global model.

    Attributes:
        virtual_s: Virtual time of the evaluation, seconds.
        tokens: Tokens trained by all learners together so far.
        loss: Held-out loss, nats per token (per image).
        accuracy: Held-out accuracy (image models), else None.
        versions: Fragment → global version evaluated.
        train_loss: Mean training loss of the steps since the previous evaluation (None if none).
    """

    virtual_s: float
    tokens: int
    loss: float
    accuracy: float | None
    versions: dict[int, int]
    train_loss: float | None = None


class GlobalEvaluator:
    """Builds the evaluation model and held-out batches once; ``evaluate`` scores Θ.

    Args:
        cfg: The run's config (model, synchronizer fragment plan, data).
        dataset: The run's dataset (shared with the learners' loaders).
        batch_size: Examples per held-out batch (the same for every variant).
        n_batches: Held-out batches per evaluation.
    """

    def __init__(
        self, cfg: DDQConfig, dataset: Dataset, *, batch_size: int, n_batches: int
    ) -> None:
        self.model = build(cfg.model.architecture(), seed=cfg.run.seed)
        self.model.eval()
        sync = cfg.synchronizer
        synced = synced_parameters(self.model).items()
        shapes = shapes_from_named((n, p.shape) for n, p in synced)
        plan = plan_fragments(
            shapes,
            sync.n_fragments,
            embedding_patterns=sync.embedding_patterns,
            embedding_names=embedding_names(self.model),
        )
        self.params = FragmentParams(plan, self.model)
        loader = ShardLoader(dataset, batch_size=batch_size, eval_fraction=cfg.data.eval_fraction)
        self.batches: list[Batch] = list(loader.eval_batches(max_batches=n_batches))

    @torch.no_grad()
    def score(self, fragment: Callable[[int], np.ndarray]) -> tuple[float, float | None]:
        """Load every fragment from ``fragment(p)`` and return (loss, accuracy or None)."""
        for p in range(self.params.n_fragments):
            self.params.write(p, fragment(p), alpha=0.0)
        loss, accuracy, _ = heldout_score(self.model, self.batches)
        return loss, accuracy
