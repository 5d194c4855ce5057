"""matplotlib, optional (``pip install 'dd_queue[plots]'``): found and loaded in one place for
every PNG the project writes (``ddq simulate --plot``, ``ddq experiment``)."""

from __future__ import annotations

import importlib.util
from typing import Any

from dd_queue.errors import ConfigError

__all__ = ["matplotlib_available", "pyplot"]


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported."""
    return importlib.util.find_spec("matplotlib") is not None


def pyplot(skip_hint: str) -> Any:
    """``matplotlib.pyplot`` on the headless Agg backend.

    Args:
        skip_hint: How to run without plots (e.g. ``pass --no-plot``), for the error.

    Raises:
        ConfigError: matplotlib is not installed (the message says how to install it).
    """
    if not matplotlib_available():
        raise ConfigError(
            "plots need matplotlib, which is not installed: pip install 'dd_queue[plots]' "
            f"(or pip install matplotlib), or {skip_hint}"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
