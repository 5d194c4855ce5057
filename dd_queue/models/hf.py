"""Hugging Face ``transformers`` causal LMs behind the learner's contract (``base.py``).

``HFCausalLM`` holds the ``transformers`` model as ``self.hf``: parameter names are the model's
own with an ``hf.`` prefix (``hf.model.embed_tokens.weight``), and tied weights appear once, as
``named_parameters`` gives them. The loss is the same token cross-entropy as the presets',
computed in float32 from the logits, so losses of an hf model and a preset read alike.

Nothing is downloaded: the model is built from a config (``AutoModelForCausalLM.from_config``)
and initialised with the run's seed; exports go back through ``save_pretrained``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

from dd_queue.errors import ConfigError
from dd_queue.models.arch import Architecture
from dd_queue.models.base import IGNORE_INDEX, ModelOutput, TrainBatch

PREFIX = "hf."


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model.source 'hf' needs transformers: pip install 'dd_queue[hf]'"
        ) from None
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # no "initialising weights" chatter per process
    return transformers


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM: ``forward(batch)`` → ``ModelOutput`` (token cross-entropy).

    Attributes:
        hf: The ``transformers`` model (``PreTrainedModel``).
    """

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, batch: TrainBatch) -> ModelOutput:
        logits = self.hf(input_ids=batch.inputs, use_cache=False).logits
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)),
            batch.targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
        )
        return ModelOutput(loss=loss, task_loss=loss, logits=logits)


def hf_config(arch: Architecture) -> Any:
    """The ``transformers`` config object of ``arch``.

    Raises:
        ConfigError: transformers is missing, or does not know the config.
    """
    transformers = _transformers()
    keys = dict(arch.hf_config)
    model_type = keys.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **keys)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"transformers cannot build an hf config of {model_type!r}: {exc}"
        ) from None


def build_hf(arch: Architecture, *, device: torch.device) -> HFCausalLM:
    """An ``HFCausalLM`` of ``arch`` on ``device`` in float32, initialised from torch's current
    random state (the builder seeds it); ``meta`` allocates nothing."""
    transformers = _transformers()
    config = hf_config(arch)
    with device:
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        except ValueError as exc:  # e.g. a config that is not a causal LM
            raise ConfigError(
                f"the hf config is not a causal LM transformers can build: {exc}"
            ) from None
    return HFCausalLM(model).train()


def save_hf(
    arch: Architecture,
    arrays: Mapping[str, npt.NDArray[np.float32]],
    out: str | Path,
) -> list[str]:
    """Write the parameters ``arrays`` (``hf.``-prefixed names, as training names them) as a
    directory that ``AutoModelForCausalLM.from_pretrained`` loads (config.json +
    model.safetensors); returns the files written.

    Raises:
        ConfigError: The arrays do not match the architecture's parameters.
    """
    with torch.random.fork_rng(devices=[]):  # every value is overwritten: leave the RNG be
        model = build_hf(arch, device=torch.device("cpu"))
    own = dict(model.named_parameters())
    missing, extra = sorted(set(own) - set(arrays)), sorted(set(arrays) - set(own))
    if missing or extra:
        raise ConfigError(
            f"the global model does not fit the hf architecture: missing {missing[:4]}, "
            f"unexpected {extra[:4]}"
        )
    with torch.no_grad():
        for name, param in own.items():
            value = torch.from_numpy(np.ascontiguousarray(arrays[name], dtype=np.float32))
            if value.shape != param.shape:
                raise ConfigError(
                    f"{name}: shape {tuple(value.shape)}, model has {tuple(param.shape)}"
                )
            param.copy_(value)
    directory = Path(out)
    model.hf.save_pretrained(directory, safe_serialization=True)  # type: ignore[operator]
    return sorted(p.name for p in directory.iterdir())


__all__ = ["PREFIX", "HFCausalLM", "build_hf", "hf_config", "save_hf"]
