"""The one model builder: every process (learner, synchronizer, evaluator, export, in-process
runner) builds its model here, from the run's ``Architecture`` (``arch.py``).

    model = build(cfg.model.architecture(), seed=cfg.run.seed, device="cpu")
    out = model(batch)                          # ModelOutput, whatever the source
    emb = embedding_names(model)                # for the fragment plan

``seed`` initialises the parameters (same seed and device → the same values); torch's global
random state is left as it was. On ``device="meta"`` nothing is allocated or initialised: the
synchronizer plans fragments from such a model. (The modules' own init still calls
``normal_``, ``uniform_``, ... there; on meta tensors torch runs those through its Python
references, whose first use imports ``torch._dynamo``: 1-1.5 s of a restarted synchronizer's
start on two busy cores. ``_NoMetaValues`` skips them: a meta tensor has no values to write.)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from dd_queue.errors import ConfigError
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
    skip = _NoMetaValues() if target.type == "meta" else nullcontext()
    with _seeded(seed, target), skip:
        model: nn.Module
        if arch.spec is not None:  # (its modules' default init draws from the global RNG)
            from dd_queue.models.registry import build_model

            model = build_model(arch.spec, seed=seed, device=target)
        elif arch.source == "hf":
            from dd_queue.models.hf import build_hf

            model = build_hf(arch, device=target)
        else:
            from dd_queue.models.custom import build_module

            model = build_module(arch, device=target)
    _freeze(model, arch.freeze)
    return model


def synced_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters a run trains and synchronizes, by name: those with ``requires_grad``
    (``model.freeze`` and LoRA leave the others out). Fragments, contributions, global
    versions and Θ(0) hold these alone; the frozen ones every process builds the same
    (a pretrained directory, or the seeded init)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _freeze(model: nn.Module, patterns: tuple[str, ...]) -> None:
    """Stop training the parameters whose names match one of ``patterns``.

    Raises:
        ConfigError: A pattern matches no parameter, or every parameter is frozen.
    """
    if not patterns:
        return
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise ConfigError(
                f"model.freeze pattern {pattern!r} matches no parameter; names look like "
                f"{names[:3]} (fnmatch: use * for any part)"
            )
    for name, p in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            p.requires_grad_(False)
    if not synced_parameters(model):
        raise ConfigError(f"model.freeze {list(patterns)} freezes every parameter")


def embedding_names(model: nn.Module) -> frozenset[str]:
    """Names (as ``named_parameters`` gives them) of the synchronized parameters of
    ``nn.Embedding`` modules, heads tied to them included (a tied head is the same tensor,
    named once)."""
    weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return frozenset(name for name, p in synced_parameters(model).items() if id(p) in weights)


_VALUE_WRITES = frozenset(
    {
        # torch.nn.init
        *("normal_", "uniform_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_"),
        *("dirac_", "orthogonal_", "sparse_", "xavier_uniform_", "xavier_normal_"),
        *("kaiming_uniform_", "kaiming_normal_"),
        # the Tensor methods they (and modules' reset_parameters) use
        *("zero_", "fill_", "copy_", "add_", "sub_", "mul_", "div_", "clamp_", "erfinv_"),
        *("exponential_", "bernoulli_", "random_", "fill_diagonal_"),
    }
)
"""In-place writes of values only (never of a shape, a stride or a dtype)."""


class _NoMetaValues(torch.overrides.TorchFunctionMode):
    """Skip value writes to meta tensors (module doc); every other call runs as it is."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
        name = getattr(func, "__name__", "")
        if name in _VALUE_WRITES and isinstance(first, torch.Tensor) and first.is_meta:
            return first
        return func(*args, **kwargs)


@contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(seed)
        yield


__all__ = ["build", "embedding_names", "synced_parameters"]
