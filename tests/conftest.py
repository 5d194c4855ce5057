"""Shared test set-up: every test gets its tier's marker from the folder it lives in."""

from __future__ import annotations

from pathlib import Path

import pytest

_TIERS = {"unit": "unit", "golden": "unit", "integration": "integration", "e2e": "e2e"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        tier = _TIERS.get(folder)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
