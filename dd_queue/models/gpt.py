"""Decoder-only transformer language model, dense (``gpt``) or mixture-of-experts (``moe``).

Token embedding ``wte.weight`` (vocab × d) → ``n_layers`` pre-norm causal blocks with RoPE →
final RMSNorm ``norm_f`` → logits. With ``tie_embeddings`` the output layer is ``wte.weight``
itself, used through ``F.linear``: no second module holds it, so it appears exactly once in both
``named_parameters()`` and ``state_dict()``. Untied, the output layer is ``lm_head.weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dd_queue.models.base import ModelOutput, TrainBatch, token_loss
from dd_queue.models.layers import Block
from dd_queue.models.moe import MoE
from dd_queue.models.spec import ModelSpec


class GPT(nn.Module):
    """Causal LM; ``forward(batch)`` returns the next-token loss (and MoE auxiliary loss)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.wte = nn.Embedding(spec.vocab_size, spec.d_model)
        self.blocks = nn.ModuleList(
            Block(spec, causal=True, rope=True, ffn=MoE(spec) if spec.family == "moe" else None)
            for _ in range(spec.n_layers)
        )
        self.norm_f = nn.RMSNorm(spec.d_model, eps=1e-6)
        self.lm_head = (
            None if spec.tie_embeddings else nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        )

    def logits(self, tokens: Tensor) -> tuple[Tensor, Tensor | None]:
        """Next-token logits (B, T, vocab) for ``tokens`` (B, T) int64, and the mean MoE aux loss.

        Returns:
            ``(logits, aux_loss)``; ``aux_loss`` is None for a dense model.
        """
        x = self.wte(tokens)
        aux_losses: list[Tensor] = []
        for block in self.blocks:
            x, aux = block(x)
            if aux is not None:
                aux_losses.append(aux)
        x = self.norm_f(x)
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        aux_loss = torch.stack(aux_losses).mean() if aux_losses else None
        return F.linear(x, weight), aux_loss

    def forward(self, batch: TrainBatch) -> ModelOutput:
        """Mean next-token cross-entropy (nats/token) over targets that are not ``IGNORE_INDEX``."""
        logits, aux_loss = self.logits(batch.inputs)
        task_loss = token_loss(logits, batch.targets)
        loss = task_loss
        if aux_loss is not None:
            loss = task_loss + self.spec.aux_loss_weight * aux_loss
        return ModelOutput(loss=loss, task_loss=task_loss, logits=logits, aux_loss=aux_loss)
