"""Shared test set-up: every test gets its tier's marker, and its tier's time limit, from the
folder it lives in (an explicit ``@pytest.mark.timeout`` on a test wins)."""

from __future__ import annotations

from pathlib import Path

import pytest

_TIERS = {"unit": "unit", "golden": "unit", "integration": "integration", "e2e": "e2e"}
_TIMEOUT_S = {"unit": 60, "integration": 120, "e2e": 600}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = _TIERS.get(Path(str(item.fspath)).parent.name)
        if tier is None:
            continue
        item.add_marker(getattr(pytest.mark, tier))
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(_TIMEOUT_S[tier]))
