"""Skips that must not hide a missing part in CI.

Locally a test whose tool is missing (redis-server, chromium, honcho, docker-compose, gloo, an
extra of ``.[dev]``) skips with the install hint; under CI (``CI`` set to 1/true/yes/on, any
case, as CI services set it) the same test fails and names the missing part, so a green CI
never means "not run". Platform limits that CI shares are real skips (``platform_skip``).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

__all__ = ["import_or_require", "platform_skip", "require", "under_ci"]


def under_ci() -> bool:
    """Whether this is a CI run (``CI`` = 1, true, yes or on, case-insensitive)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def require(available: object, what: str, install: str) -> None:
    """Skip (locally) or fail (CI) unless ``available`` is truthy.

    Args:
        available: Whether the part is there.
        what: The missing part, e.g. ``"redis-server"``.
        install: How to get it, e.g. ``"apt-get install redis-server"``.
    """
    if available:
        return
    message = f"{what} is not installed ({install})"
    if under_ci():
        pytest.fail(f"{message}; CI must run this test, so install it in .ci/run", pytrace=False)
    pytest.skip(message)


def import_or_require(module: str, install: str) -> ModuleType:
    """``importlib.import_module(module)``, else ``require`` fails or skips."""
    try:
        return importlib.import_module(module)
    except ImportError:
        require(False, f"python module {module!r}", install)
        raise  # unreachable: require skipped or failed


def platform_skip(reason: str) -> None:
    """A skip no install can fix (another OS or CPU): allowed in CI too."""
    pytest.skip(f"{reason} (platform)")
