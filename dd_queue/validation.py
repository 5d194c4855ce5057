"""Validating a plain mapping into a pydantic model, with every bad key named by its dotted
path: one message shape for the run config and the simulator config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

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


__all__ = ["validate_model"]
