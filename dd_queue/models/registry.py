"""Build a model from a preset name (or a spec) with field overrides; optimizer parameter groups.

``build_model("gpt-tiny", n_layers=1, seed=0)`` returns an initialised ``nn.Module`` whose
``forward(batch)`` returns a ``ModelOutput``. On ``device="meta"`` nothing is allocated or
initialised (use it to inspect names and shapes of big models, or build there, ``to_empty`` on
the GPU and call ``init_parameters``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dd_queue.models.gpt import GPT
from dd_queue.models.layers import init_gpt2_
from dd_queue.models.spec import ModelSpec, resolve_spec
from dd_queue.models.vit import ViT

Model = GPT | ViT


def build_model(
    preset: str | ModelSpec,
    *,
    seed: int | None = None,
    device: str | torch.device | None = None,
    **overrides: Any,
) -> Model:
    """Build and initialise the model of a preset (or spec) with field overrides.

    Args:
        preset: A name from ``PRESETS`` (e.g. ``"gpt-tiny"``) or a ``ModelSpec``.
        seed: Seed of the initialisation (same seed, same device → identical parameters); None
            draws from torch's global generator.
        device: Where to allocate (default: torch's default device). ``"meta"`` allocates
            nothing and skips initialisation.
        **overrides: ``ModelSpec`` fields to replace, e.g. ``n_layers=1, vocab_size=50304``.

    Returns:
        A ``GPT`` (families ``gpt`` and ``moe``) or a ``ViT``, in training mode.

    Raises:
        ConfigError: Unknown preset or field, or an invalid shape.
    """
    spec = resolve_spec(preset, **overrides)
    target = torch.device(device) if device is not None else torch.get_default_device()
    with target:
        model: Model = ViT(spec) if spec.family == "vit" else GPT(spec)
    if target.type != "meta":
        init_parameters(model, seed=seed)
    return model


def init_parameters(model: Model, *, seed: int | None = None) -> None:
    """(Re-)initialise every parameter in place, GPT-2 style (see ``layers.init_gpt2_``).

    Args:
        model: A model from ``build_model``, on a real device.
        seed: Seed of a generator on the parameters' device; None uses torch's global one.
    """
    device = next(model.parameters()).device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    init_gpt2_(model, model.spec, generator)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: weight decay on matrices and embeddings, none on vectors.

    Norm weights and biases (1-D tensors) are not decayed (nanoGPT's rule). Each group carries
    ``names`` (parameter names, in ``named_parameters`` order) for logs and checkpoints; torch
    optimizers keep extra group keys as they are.

    Args:
        model: The module to optimise.
        weight_decay: Decoupled weight decay of the first group.

    Returns:
        ``[{"params", "names", "weight_decay"}, ...]``, empty groups left out.
    """
    groups: list[dict[str, Any]] = []
    for decay, wanted in ((weight_decay, True), (0.0, False)):
        named = [
            (n, p)
            for n, p in model.named_parameters()
            if p.requires_grad and (p.ndim >= 2) == wanted
        ]
        if named:
            groups.append(
                {
                    "params": [p for _, p in named],
                    "names": [n for n, _ in named],
                    "weight_decay": decay,
                }
            )
    return groups
