"""Hugging Face ``transformers`` causal LMs behind the learner's contract (``base.py``).

``HFCausalLM`` holds the ``transformers`` model as ``self.hf``: parameter names are the model's
own with an ``hf.`` prefix (``hf.model.embed_tokens.weight``), and tied weights appear once, as
``named_parameters`` gives them. The loss is the same token cross-entropy as the presets',
computed in float32 from the logits, so losses of an hf model and a preset read alike.

Nothing is downloaded: the model is built from a config (``AutoModelForCausalLM.from_config``)
and initialised with the run's seed; exports go back through ``save_pretrained``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from dd_queue.errors import ConfigError
from dd_queue.models.arch import Architecture
from dd_queue.models.base import ModelOutput, TrainBatch, token_loss
from dd_queue.models.builder import synced_parameters

PREFIX = "hf."
ADAPTER_DIR = "adapter"  # of an export with LoRA: what PeftModel.from_pretrained loads


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
        loss = token_loss(logits, batch.targets)
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
    auto = transformers.AutoModelForCausalLM
    with device:
        try:
            if arch.pretrained and device.type != "meta":
                model = auto.from_pretrained(arch.pretrained, config=config, dtype=torch.float32)
            else:
                model = auto.from_config(config, torch_dtype=torch.float32)
        except (ValueError, OSError) as exc:  # not a causal LM, or unreadable weights
            raise ConfigError(f"transformers cannot build the hf model: {exc}") from None
    if arch.lora:
        model = _with_lora(model, arch.lora)
    return HFCausalLM(model).train()


def _with_lora(model: nn.Module, lora: Mapping[str, Any]) -> nn.Module:
    """``model`` with peft LoRA adapters on ``lora["targets"]``; only they train."""
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora_r needs peft: pip install 'dd_queue[hf]'") from None
    config = peft.LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=list(lora["targets"]),
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as exc:  # e.g. no module of that name
        raise ConfigError(f"model.lora_targets {list(lora['targets'])}: {exc}") from None


def save_hf(
    arch: Architecture,
    arrays: Mapping[str, npt.NDArray[np.float32]],
    out: str | Path,
) -> list[str]:
    """Write the synchronized parameters ``arrays`` (``hf.``-prefixed names, as training names
    them; frozen ones come from the pretrained directory) as a directory that
    ``AutoModelForCausalLM.from_pretrained`` loads (config.json + model.safetensors; with LoRA
    the adapters merged in, and the adapter alone in ``adapter/`` for peft); returns the files
    written.

    Raises:
        ConfigError: The arrays do not match the architecture's parameters.
    """
    with torch.random.fork_rng(devices=[]):  # every value is overwritten: leave the RNG be
        model = build_hf(arch, device=torch.device("cpu"))
    own = synced_parameters(model)  # the frozen ones are the pretrained directory's
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
    directory, hf = Path(out), model.hf
    if arch.lora:  # the adapter alone (PeftModel.from_pretrained), then merged into the model
        hf.save_pretrained(directory / ADAPTER_DIR)  # type: ignore[operator]
        hf = hf.merge_and_unload()  # type: ignore[operator]
    hf.save_pretrained(directory, safe_serialization=True)  # type: ignore[operator]
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


__all__ = ["PREFIX", "HFCausalLM", "build_hf", "hf_config", "save_hf"]
