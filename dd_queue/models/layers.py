"""Transformer building blocks shared by the LM, the MoE LM and the ViT.

Pre-norm residual blocks (x + f(norm(x))) with RMSNorm (Zhang & Sennrich, arXiv 1910.07467):
one weight per channel, no bias and no mean subtraction, cheaper than LayerNorm and as good in
practice. Linear layers carry no bias (PaLM / LLaMA habit): fewer tiny tensors to ship per
fragment, no change in quality at these scales.

Positions: rotary embeddings (RoPE, Su et al., arXiv 2104.09864) for the LMs. Chosen over learned
positions because they add no parameter tensor (nothing position-specific to merge or to ship),
they work at any length up to ``seq_len`` without a table, and the rotation angles are computed
from the sequence length inside ``forward`` (no buffers: nothing to re-create after building on
the ``meta`` device, nothing extra in ``state_dict``). The ViT keeps a learned ``pos_embed``.

Everything in the dense path is shape-static: no Python branch depends on tensor values, so
``torch.compile(fullgraph=True)`` traces it without graph breaks, and matmuls run in bf16 under
CUDA autocast while the rotation tables, norms and softmax stay in fp32 where autocast puts them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dd_queue.models.spec import ModelSpec


def rope_tables(seq_len: int, head_dim: int, base: float, device: torch.device) -> Tensor:
    """Cosine and sine of the RoPE angles, stacked: shape ``(2, seq_len, head_dim // 2)``, fp32.

    Angle of position t and pair i is ``t · base^(−2i / head_dim)`` (radians).
    """
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = torch.pow(torch.tensor(base, device=device, dtype=torch.float32), -exponents)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.stack((angles.cos(), angles.sin()))


def apply_rope(x: Tensor, tables: Tensor) -> Tensor:
    """Rotate channel pairs ``(x[..., :h], x[..., h:])`` of ``x`` (B, heads, T, head_dim)."""
    cos, sin = tables[0].to(x.dtype), tables[1].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Multi-head self-attention through ``scaled_dot_product_attention``.

    Tensors: ``qkv.weight`` (3·d × d, fused query/key/value), ``proj.weight`` (d × d, residual
    output projection).
    """

    def __init__(self, spec: ModelSpec, *, causal: bool, rope: bool) -> None:
        super().__init__()
        self.n_heads, self.head_dim = spec.n_heads, spec.head_dim
        self.causal, self.rope, self.rope_base = causal, rope, spec.rope_base
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model, bias=False)
        self.proj = nn.Linear(spec.d_model, spec.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Map ``x`` (B, T, d) to (B, T, d)."""
        batch, length, width = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, T, head_dim)
        if self.rope:
            tables = rope_tables(length, self.head_dim, self.rope_base, x.device)
            q, k = apply_rope(q, tables), apply_rope(k, tables)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        out: Tensor = self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return out


class MLP(nn.Module):
    """Two-layer GELU MLP. Tensors: ``fc.weight`` (h × d), ``proj.weight`` (d × h, residual)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=False)
        self.proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Map ``x`` (..., d) to (..., d)."""
        out: Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``.

    The feed-forward part is a dense ``MLP`` or, when given, a mixture-of-experts layer whose
    ``forward`` returns ``(output, aux_loss)``; ``forward`` returns the block output and that
    auxiliary loss (``None`` for dense blocks, decided at build time, not from data).
    """

    def __init__(
        self, spec: ModelSpec, *, causal: bool, rope: bool, ffn: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(spec.d_model, eps=1e-6)
        self.attn = Attention(spec, causal=causal, rope=rope)
        self.mlp_norm = nn.RMSNorm(spec.d_model, eps=1e-6)
        self.is_moe = ffn is not None
        self.mlp = ffn if ffn is not None else MLP(spec.d_model, spec.mlp_ratio * spec.d_model)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Map ``x`` (B, T, d) to ``(x', aux_loss or None)``."""
        x = x + self.attn(self.attn_norm(x))
        if self.is_moe:
            out, aux = self.mlp(self.mlp_norm(x))
            return x + out, aux
        return x + self.mlp(self.mlp_norm(x)), None


def init_gpt2_(module: nn.Module, spec: ModelSpec, generator: torch.Generator | None) -> None:
    """GPT-2 initialisation, in place (Radford et al. 2019; nanoGPT).

    Matrices and embeddings: N(0, ``init_std``²). Residual output projections (tensors named
    ``*proj.weight`` and the experts' ``*proj``): N(0, (``init_std`` / √(2·n_layers))²), so the
    residual stream's variance does not grow with depth. Norm weights 1, biases 0.
    """
    residual_std = spec.init_std / (2 * spec.n_layers) ** 0.5
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.ndim < 2 and name.endswith("bias"):
                param.zero_()
            elif param.ndim < 2 and "norm" in name:
                param.fill_(1.0)
            else:
                residual = name.endswith(("proj.weight", "experts.proj"))
                std = residual_std if residual else spec.init_std
                param.normal_(0.0, std, generator=generator)
