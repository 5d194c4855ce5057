"""Logging set-up: one line per event, prefixed with who speaks; text for people, JSON for tools.

Library code logs through ``logging.getLogger(__name__)`` with dotted event names as the message's
first word (``round.merged``, ``contribution.duplicate``) and details in ``extra={"ddq": {...}}``.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, Literal


class _TextFormatter(logging.Formatter):
    def __init__(self, ident: str) -> None:
        super().__init__("%(asctime)s %(levelname)-7s [" + ident + "] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        details = getattr(record, "ddq", None)
        if details:
            line += " " + " ".join(f"{k}={v}" for k, v in details.items())
        return line


class _JsonFormatter(logging.Formatter):
    def __init__(self, ident: str) -> None:
        super().__init__()
        self._ident = ident

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "at": record.created,
            "level": record.levelname,
            "who": self._ident,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        details = getattr(record, "ddq", None)
        if details:
            obj.update(details)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def setup_logging(
    ident: str,
    *,
    level: str = "INFO",
    fmt: Literal["text", "json"] = "text",
) -> None:
    """Configure the root logger once per process.

    Args:
        ident: Who speaks, e.g. ``"learner L2"`` or ``"synchronizer"``.
        level: Logging level name.
        fmt: ``text`` or ``json``.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(ident) if fmt == "json" else _TextFormatter(ident))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
