"""A worked example of ``model.source: module``: a small causal LM written as a plain
``nn.Module`` (token embedding, causal self-attention blocks from torch, tied output layer).

    model:
      source: module
      factory: dd_queue.models.example_module:build
      factory_kwargs: {d_model: 64, n_layers: 2}
      vocab_size: 256
      seq_len: 64

``forward(inputs)`` takes token ids (B, T) and returns logits (B, T, vocab): the default
``logits`` adapter computes the loss. Copy it as the start of your own.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class TinyLM(nn.Module):
    """Embedding → ``n_layers`` pre-norm causal transformer layers → tied output layer."""

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, max_len: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        for emb in (self.tokens, self.positions):  # N(0, 1), torch's default, makes the tied
            nn.init.normal_(emb.weight, std=0.02)  # head's first logits far too large

    def forward(self, inputs: Tensor) -> Tensor:
        t = inputs.size(1)
        x = self.tokens(inputs) + self.positions(torch.arange(t, device=inputs.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=inputs.device)
        h = self.norm(self.blocks(x, mask=mask, is_causal=True))
        logits: Tensor = h @ self.tokens.weight.T  # tied to the token embedding
        return logits


def build(
    vocab_size: int = 256,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    max_len: int = 512,
) -> TinyLM:
    """The factory ``model.factory`` names."""
    return TinyLM(vocab_size, d_model, n_layers, n_heads, max_len)


__all__ = ["TinyLM", "build"]
