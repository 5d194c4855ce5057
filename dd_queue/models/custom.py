"""Your own ``nn.Module`` behind the learner's contract (``base.py``): ``model.source: module``.

``model.factory`` names a callable, ``package.module:callable``, that takes
``model.factory_kwargs`` and returns an ``nn.Module``; it must be importable on every machine of
the run. A factory with a ``vocab_size`` parameter that the kwargs leave out gets
``model.vocab_size``. ``model.adapter`` says how the loss comes out of it:

- ``logits`` (default): ``net(batch.inputs)`` with token ids (B, T) int64 returns logits
  (B, T, vocab), or an object with a ``.logits`` attribute (as ``transformers`` models do); the
  loss is the token cross-entropy against ``batch.targets`` (``IGNORE_INDEX`` skipped).
- ``batch``: ``net(batch)`` returns a ``ModelOutput``, or a scalar loss tensor (then the task
  loss is that loss and there are no logits). Use it when the loss is your own.

The module is wrapped as ``self.net``: parameter names gain a ``net.`` prefix. Embeddings are
found by module type (``nn.Embedding``), so the fragment plan merges them by the weighted mean
whatever they are called. ``dd_queue.models.example_module:build`` is a worked example.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from torch import Tensor, nn

from dd_queue.errors import ConfigError
from dd_queue.models.arch import Architecture, parse_factory
from dd_queue.models.base import ModelOutput, TrainBatch, token_loss


class ModuleLM(nn.Module):
    """A factory's module with its adapter: ``forward(batch)`` → ``ModelOutput``.

    Attributes:
        net: The module the factory returned.
        adapter: ``logits`` or ``batch`` (module doc).
    """

    def __init__(self, net: nn.Module, adapter: str) -> None:
        super().__init__()
        self.net, self.adapter = net, adapter

    def forward(self, batch: TrainBatch) -> ModelOutput:
        if self.adapter == "batch":
            return self._own_loss(self.net(batch))
        out = self.net(batch.inputs)
        logits = out if isinstance(out, Tensor) else getattr(out, "logits", None)
        if not isinstance(logits, Tensor) or logits.ndim != 3:
            raise ConfigError(
                "model.adapter 'logits': the module must return logits (B, T, vocab) or an "
                f"object with .logits; it returned {type(out).__name__}. Use adapter 'batch' "
                "to return the loss yourself"
            )
        loss = token_loss(logits, batch.targets)
        return ModelOutput(loss=loss, task_loss=loss, logits=logits)

    @staticmethod
    def _own_loss(out: Any) -> ModelOutput:
        if isinstance(out, ModelOutput):
            return out
        if isinstance(out, Tensor) and out.ndim == 0:
            return ModelOutput(loss=out, task_loss=out.detach(), logits=out.new_empty(0))
        raise ConfigError(
            "model.adapter 'batch': the module must return a ModelOutput or a scalar loss "
            f"tensor, not {type(out).__name__}"
        )


def build_module(arch: Architecture, *, device: torch.device) -> ModuleLM:
    """Call the factory on ``device`` (torch's current random state: the builder seeds it).

    Raises:
        ConfigError: The factory cannot be imported, fails, or returns no ``nn.Module``.
    """
    assert arch.factory is not None
    module_name, attr = parse_factory(arch.factory)
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"model.factory {arch.factory!r} cannot be imported ({exc}); it must be on the "
            "Python path of every learner and of the synchronizer"
        ) from None
    kwargs = dict(arch.factory_kwargs)
    if "vocab_size" not in kwargs and _accepts(target, "vocab_size"):
        kwargs["vocab_size"] = arch.vocab_size  # model.vocab_size, so it is set in one place
    with device:
        try:
            net = target(**kwargs)
        except TypeError as exc:
            raise ConfigError(
                f"model.factory {arch.factory!r} with {dict(arch.factory_kwargs)}: {exc}"
            ) from None
    if not isinstance(net, nn.Module):
        raise ConfigError(
            f"model.factory {arch.factory!r} returned {type(net).__name__}, not an nn.Module"
        )
    return ModuleLM(net, arch.adapter).train()


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


__all__ = ["ModuleLM", "build_module"]
