"""Which architecture a run trains, as plain data (no torch): where the model comes from, the
token vocabulary and window the data must fit, and what identifies it in the run digest.

Three sources, one description:
- ``preset``: a ``ModelSpec`` (``spec.py``), built by ``registry.build_model``.
- ``hf``: a Hugging Face ``transformers`` causal-LM config, read from a local ``config.json``
  (a directory holding one, or the file) and/or given inline; built with
  ``AutoModelForCausalLM.from_config``. Nothing is downloaded.
- ``module``: ``package.module:factory``, a callable returning an ``nn.Module`` (see
  ``custom.py`` for the adapter that gets the loss out of it).

Every process builds the model through the same builder (``builder.build``) from this
description; the run digest hashes ``identity``, so a learner configured with another
architecture is refused before it trains. Parameter shapes are checked on top of that by the
fragment plan's digest, which every learner compares with the synchronizer's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dd_queue.errors import ConfigError
from dd_queue.models.spec import ModelSpec

Source = Literal["preset", "hf", "module"]
SOURCES: tuple[Source, ...] = ("preset", "hf", "module")
DEFAULT_SEQ_LEN = 128  # tokens per window of an hf/module model when model.seq_len is unset
_SAMPLE_BYTES = 1 << 20  # of each end of a weight file, for its fingerprint


@dataclass(frozen=True, slots=True)
class Architecture:
    """What every process of a run must build.

    Attributes:
        source: ``preset``, ``hf`` or ``module``.
        family: ``gpt``/``moe``/``vit`` for presets, ``hf``, or ``module``; only ``vit``
            trains on images.
        vocab_size: Token ids the model embeds (the data's ids must be below it).
        seq_len: Tokens per training window.
        spec: The preset's shape (``preset`` only).
        hf_config: The resolved ``transformers`` config keys (``hf`` only).
        factory: ``package.module:factory`` (``module`` only).
        factory_kwargs: Keyword arguments of the factory (``module`` only).
        adapter: How the loss comes out of a ``module`` model: ``logits`` or ``batch``.
        pretrained: A local ``save_pretrained`` directory every process loads (``hf``).
        weights: ``weights_fingerprint`` of ``pretrained`` (its path may differ by machine).
        freeze: Parameter name patterns (``fnmatch``) that are not trained: only the others
            are fragments, contributions and global versions.
        lora: ``{r, alpha, dropout, targets}`` of peft LoRA adapters (``hf``), or None; with
            it only the adapters are trained.
    """

    source: Source
    family: str
    vocab_size: int
    seq_len: int
    spec: ModelSpec | None = None
    hf_config: Mapping[str, Any] = field(default_factory=dict)
    factory: str | None = None
    factory_kwargs: Mapping[str, Any] = field(default_factory=dict)
    adapter: Literal["logits", "batch"] = "logits"
    pretrained: str | None = None
    weights: str | None = None
    freeze: tuple[str, ...] = ()
    lora: Mapping[str, Any] | None = None

    @property
    def is_image(self) -> bool:
        """The model classifies images (a ViT preset); every other one is a token LM."""
        return self.family == "vit"

    def identity(self) -> dict[str, Any]:
        """What the run digest hashes: the resolved architecture, nothing machine-specific."""
        trained = {"freeze": list(self.freeze)} if self.freeze else {}
        if self.spec is not None:  # as before: preset runs keep their digests
            return {**dataclasses.asdict(self.spec), **trained}
        return {
            **trained,
            "weights": self.weights,
            "lora": dict(self.lora) if self.lora else None,
            "source": self.source,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "hf_config": dict(self.hf_config),
            "factory": self.factory,
            "factory_kwargs": dict(self.factory_kwargs),
            "adapter": self.adapter,
        }

    @property
    def digest(self) -> str:
        """sha256 (hex, 12 chars) of ``identity``: names the architecture in logs and exports."""
        canonical = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]

    def describe(self) -> str:
        """One line for logs: the source and what identifies it."""
        if self.spec is not None:
            s = self.spec
            return f"preset {s.family} {s.n_layers}x{s.d_model}, vocab {s.vocab_size}"
        if self.source == "hf":
            return f"hf {self.hf_config.get('model_type')} ({self.digest}), vocab {self.vocab_size}"
        return f"module {self.factory} ({self.digest}), vocab {self.vocab_size}"


def read_hf_config(path: str | None, inline: Mapping[str, Any]) -> dict[str, Any]:
    """The ``transformers`` config keys: ``path``'s ``config.json`` (a directory holding one, or
    the file itself), updated with ``inline``; it must name a ``model_type`` and a
    ``vocab_size``.

    Raises:
        ConfigError: The file is missing or not a JSON object, or a required key is missing.
    """
    keys: dict[str, Any] = {}
    if path:
        file = Path(path)
        file = file / "config.json" if file.is_dir() else file
        try:
            loaded = json.loads(file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(
                f"model.hf_config {path!r}: cannot read {file} ({exc.strerror}); give a "
                "directory holding config.json (as save_pretrained writes it) or the file"
            ) from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model.hf_config {file} is not JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"model.hf_config {file} must hold a JSON object")
        keys.update(loaded)
    keys.update(inline)
    missing = [k for k in ("model_type", "vocab_size") if k not in keys]
    if missing:
        where = f"{path!r} and model.hf_options" if path else "model.hf_options"
        raise ConfigError(
            f"the hf model config ({where}) lacks {missing}; e.g. model_type: llama, "
            "vocab_size: 4096 (set model.hf_config to a directory with config.json, or give "
            "the keys in model.hf_options)"
        )
    if not isinstance(keys["vocab_size"], int) or keys["vocab_size"] < 2:
        raise ConfigError(
            f"the hf model config's vocab_size must be an integer >= 2, got {keys['vocab_size']!r}"
        )
    # keys transformers adds on save and that do not change the architecture
    for volatile in (
        "transformers_version",
        "_name_or_path",
        "architectures",
        "torch_dtype",
        "dtype",
    ):
        keys.pop(volatile, None)
    return keys


def weights_fingerprint(directory: str) -> str:
    """sha256 (hex, 16 chars) of a ``save_pretrained`` directory's weight files: each file's
    name, size and first and last MiB (a many-GB checkpoint is not read whole at start).

    Raises:
        ConfigError: No ``*.safetensors`` file in ``directory``.
    """
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"model.hf_pretrained {directory!r} holds no .safetensors weights: save the model "
            "with save_pretrained(..., safe_serialization=True)"
        )
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        with file.open("rb") as handle:
            head = handle.read(_SAMPLE_BYTES)
            handle.seek(max(size - _SAMPLE_BYTES, 0))
            tail = handle.read()
        digest.update(f"{file.name}:{size}:".encode() + head + tail)
    return digest.hexdigest()[:16]


def parse_factory(factory: str) -> tuple[str, str]:
    """``package.module:callable`` → (module, attribute path).

    Raises:
        ConfigError: Not of that form.
    """
    module, sep, attr = factory.partition(":")
    names = [*module.split("."), *attr.split(".")]
    if not sep or not all(n.isidentifier() for n in names):
        raise ConfigError(
            f"model.factory {factory!r} must be 'package.module:callable' (e.g. "
            "'my_models.tiny:build'), importable on every machine of the run"
        )
    return module, attr


__all__ = [
    "DEFAULT_SEQ_LEN",
    "SOURCES",
    "Architecture",
    "Source",
    "parse_factory",
    "read_hf_config",
    "weights_fingerprint",
]
