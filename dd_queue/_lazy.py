"""Lazy package exports: a package's ``__init__`` names what it offers without importing torch.

``import dd_queue.config`` (every CLI start, the control plane, the synchronizer) must not pay
for torch (~2 s): ``dd_queue.data`` and ``dd_queue.models`` import their torch-free parts at
once and the rest on first use, through the module ``__getattr__`` this returns (PEP 562).
Type checkers see ordinary imports under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``name`` from ``where[name]``
    (a submodule of the package) on first access and caches it in the package."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(importlib.import_module(package), name, value)
        return value

    return __getattr__
