"""The one model builder: every process (learner, synchronizer, evaluator, export, in-process
runner) builds its model here, from the run's ``Architecture`` (``arch.py``).

    model = build(cfg.model.architecture(), seed=cfg.run.seed, device="cpu")
    out = model(batch)                          # ModelOutput, whatever the source
    emb = embedding_names(model)                # for the fragment plan

``seed`` initialises the parameters (same seed and device → the same values); torch's global
random state is left as it was. On ``device="meta"`` nothing is allocated or initialised: the
synchronizer plans fragments from such a model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from dd_queue.models.arch import Architecture


def build(
    arch: Architecture, *, seed: int | None = None, device: str | torch.device | None = None
) -> nn.Module:
    """The model of ``arch``: ``forward(batch)`` returns a ``ModelOutput``; in training mode.

    Raises:
        ConfigError: The architecture cannot be built (unknown preset field, transformers
            missing or refusing the config, a factory that fails).
    """
    target = torch.device(device) if device is not None else torch.get_default_device()
    with _seeded(seed, target):
        if arch.spec is not None:  # (its modules' default init draws from the global RNG)
            from dd_queue.models.registry import build_model

            return build_model(arch.spec, seed=seed, device=target)
        if arch.source == "hf":
            from dd_queue.models.hf import build_hf

            return build_hf(arch, device=target)
        from dd_queue.models.custom import build_module

        return build_module(arch, device=target)


def embedding_names(model: nn.Module) -> frozenset[str]:
    """Names (as ``named_parameters`` gives them) of the parameters of ``nn.Embedding``
    modules, heads tied to them included (a tied head is the same tensor, named once)."""
    weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return frozenset(name for name, p in model.named_parameters() if id(p) in weights)


@contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(seed)
        yield


__all__ = ["build", "embedding_names"]
