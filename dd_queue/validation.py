"""Reading config-like YAML files and validating them into pydantic models, one way for the run
config, the simulator config and the runner's experiment files: every bad key is named by its
dotted path, and every unreadable file gets the same kind of message."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from dd_queue.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def validate_model(
    model: type[M], raw: Mapping[str, Any], *, what: str, source: str, reference: str
) -> M:
    """``model`` validated from ``raw``.

    Args:
        model: The pydantic model.
        raw: The mapping (YAML and overrides merged).
        what: What it is, for the message (``"config"``, ``"simulator config"``).
        source: Where it came from (a path, ``"<dict>"``).
        reference: The file that lists every key, named for unknown keys.

    Raises:
        ConfigError: ``invalid <what> <source>:`` then one line per bad key.
    """
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(part) for part in err["loc"]) or "<top>"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = f"unknown key (check the spelling against {reference})"
            lines.append(f"  {where}: {msg}")
        raise ConfigError(f"invalid {what} {source}:\n" + "\n".join(lines)) from None


def read_yaml_mapping(path: Path, *, what: str) -> dict[str, Any]:
    """The mapping a YAML file holds (an empty file holds ``{}``).

    Args:
        path: The file.
        what: What it is, for the message (``"config"``, ``"experiment file"``).

    Raises:
        ConfigError: The file cannot be read, is not YAML, or holds something else.
    """
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{what} {path} must hold a mapping, not {type(loaded).__name__}")
    return loaded


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in: nested mappings merge, anything else replaces."""
    merged = dict(base)
    for key, value in over.items():
        old = merged.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = deep_merge(old, value)
        else:
            merged[key] = value
    return merged


__all__ = ["deep_merge", "read_yaml_mapping", "validate_model"]
