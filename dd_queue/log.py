"""Logging set-up: one line per event, prefixed with who speaks; text for people, JSON for tools.

Library code logs through ``logging.getLogger(__name__)`` with dotted event names as the message's
first word (``round.merged``, ``contribution.duplicate``) and details in ``extra={"ddq": {...}}``.

In the JSON format values are fields, not only text: ``event`` is the message's first word, every
``extra["ddq"]`` item is a field, and so is every value the message template names with a word
of :data:`FIELD_WORDS` before its placeholder (``"round.merged fragment %d round %d → version
%d: %s"`` gives ``fragment``, ``round``, ``version`` and, for a template ending in ``: %s``,
``reason``), with its type (numbers stay numbers).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Mapping
from typing import Any, Literal

FIELD_WORDS = frozenset(
    {
        "fragment", "round", "version", "step", "loss", "lr", "tokens", "learner", "entry",
        "accuracy", "versions", "contributors", "owner", "pid", "pids",
    }
)  # fmt: skip
"""Words that name the value after them in a log template (``fragment %d``)."""
_PLACEHOLDER = re.compile(
    r"%%|%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa]"
)
_EVENT = re.compile(r"[a-z_]+(?:\.[a-z_]+)+")


def fields(**values: Any) -> Mapping[str, Mapping[str, Any]]:
    """``extra=`` for a log call: ``values`` become fields of the JSON line (and ``k=v`` text)."""
    return {"ddq": values}


def template_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The values a record's template names (module doc): ``event``, the ``FIELD_WORDS``
    before placeholders, and ``reason`` for a template ending in ``: %s``."""
    message = record.getMessage()
    head = message.split(" ", 1)[0]
    found: dict[str, Any] = {"event": head} if _EVENT.fullmatch(head) else {}
    template, args = record.msg, record.args
    if not isinstance(template, str) or not isinstance(args, tuple) or not args:
        return found
    index = 0
    for match in _PLACEHOLDER.finditer(template):
        if match.group() == "%%":
            continue
        if index >= len(args):
            break
        before = template[: match.start()].rstrip().rsplit(" ", 1)[-1]
        value = args[index]
        if before in FIELD_WORDS:
            found[before] = value
        elif before.endswith(":") and match.end() == len(template):
            found["reason"] = value if isinstance(value, str) else str(value)
        index += 1
    return found


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
        obj.update(template_fields(record))
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
