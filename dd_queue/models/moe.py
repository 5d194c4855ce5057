"""Mixture-of-experts feed-forward layer: top-k routing with a load-balancing auxiliary loss.

Each token's router probabilities are p = softmax(W_r x) over E experts; the token goes to its
``top_k`` most probable experts and the layer returns Σ_j g_j · expert_j(x). Gates g are the raw
probabilities for k = 1 (Switch Transformer, Fedus et al., arXiv 2101.03961; renormalising one
gate would make it 1 and cut the router off from the LM loss) and the top-k probabilities
renormalised to sum to 1 for k > 1 (GShard / Mixtral).

Load balancing (Switch Transformer, eq. 4, generalised to top-k):

    L_aux = E · Σ_e f_e · P_e,   f_e = (assignments to e) / (N · k),   P_e = mean_n p_{n,e}

f_e is a count (no gradient); P_e carries the gradient to the router. L_aux = 1 when routing is
uniform and grows towards E as it collapses onto one expert. It is computed from the learner's
own batch (Decoupled DiLoCo keeps the auxiliary loss per learner: nothing about routing crosses
the bus) and averaged over the MoE layers by the model.

Dispatch is dropless: tokens are sorted by expert and each expert runs one matmul on its slice
(index ops, one host sync for the per-expert counts). Under ``torch.compile`` this is the one
part of the model that breaks the graph, as allowed by design. ``index_add_`` is deterministic
on CPU (the in-process runner) but not on CUDA.

Tensors: ``router.weight`` (E × d), ``experts.fc`` (E × d × h), ``experts.proj`` (E × h × d).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dd_queue.models.spec import ModelSpec


class Experts(nn.Module):
    """E independent GELU MLPs stored as two stacked tensors, ``fc`` and ``proj``."""

    def __init__(self, n_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.proj = nn.Parameter(torch.empty(n_experts, hidden, d_model))

    def run(self, expert: int, x: Tensor) -> Tensor:
        """Apply expert ``expert`` to ``x`` (n, d); returns (n, d)."""
        return F.gelu(x @ self.fc[expert]) @ self.proj[expert]


class MoE(nn.Module):
    """Routed feed-forward layer; ``forward`` returns ``(output, aux_loss)``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.n_experts, self.top_k = spec.n_experts, spec.top_k
        self.router = nn.Linear(spec.d_model, spec.n_experts, bias=False)
        self.experts = Experts(spec.n_experts, spec.d_model, spec.mlp_ratio * spec.d_model)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Map ``x`` (B, T, d) to ``(y (B, T, d), L_aux scalar fp32)``."""
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).float().softmax(dim=-1)  # (N, E), fp32 under autocast too
        gate, expert = probs.topk(self.top_k, dim=-1)  # (N, k) each
        if self.top_k > 1:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        out = self._dispatch(tokens, gate.flatten(), expert.flatten())
        return out.view_as(x), self._balance_loss(probs, expert)

    def _dispatch(self, tokens: Tensor, gate: Tensor, expert: Tensor) -> Tensor:
        """Σ over each token's k assignments of gate × expert(token); assignment a = n·k + j."""
        order = expert.argsort(stable=True)
        counts = torch.bincount(expert, minlength=self.n_experts).tolist()
        out = torch.zeros_like(tokens)
        start = 0
        for index, count in enumerate(counts):
            if count == 0:
                continue
            assignment = order[start : start + count]
            start += count
            rows = torch.div(assignment, self.top_k, rounding_mode="floor")
            y = self.experts.run(index, tokens[rows]) * gate[assignment].unsqueeze(-1)
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    def _balance_loss(self, probs: Tensor, expert: Tensor) -> Tensor:
        flat = expert.flatten()
        counts = torch.zeros(self.n_experts, device=probs.device, dtype=probs.dtype)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=probs.dtype))
        load = counts / flat.numel()  # f_e: share of assignments (sums to 1)
        importance = probs.mean(dim=0)  # P_e: mean router probability (sums to 1)
        return self.n_experts * (load * importance).sum()


def expert_load(model: nn.Module, batch: object) -> list[Tensor]:
    """Share of routing assignments per expert in each MoE layer, for one batch (diagnostics).

    Args:
        model: Any module; its ``MoE`` layers are found by type, in registration order.
        batch: What ``model.forward`` takes; the model runs once on it without gradients.

    Returns:
        One fp32 tensor of shape (E,) per MoE layer, each summing to 1.
    """
    loads: list[Tensor] = []

    def hook(layer: nn.Module, inputs: tuple[Tensor, ...], _: object) -> None:
        if isinstance(layer, MoE):
            with torch.no_grad():
                tokens = inputs[0].reshape(-1, inputs[0].shape[-1])
                expert = layer.router(tokens).topk(layer.top_k, dim=-1).indices.flatten()
                counts = torch.bincount(expert, minlength=layer.n_experts).float()
                loads.append(counts / counts.sum())

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, MoE)]
    try:
        with torch.no_grad():
            model(batch)
    finally:
        for handle in handles:
            handle.remove()
    return loads
