"""Architecture rule: ``dd_queue/core`` stays pure (no I/O, no clocks, no torch).

The core is the functional part of "functional core, imperative shell" (design.md): time comes
in as ``now``, never from ``time``; Redis, HTTP, threads, processes and torch stay in the shell
(a pass may be split between threads, but the shell owns them: ``core.workers``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "dd_queue" / "core"
FORBIDDEN = frozenset(
    {
        "redis",
        "fastapi",
        "starlette",
        "uvicorn",
        "asyncio",
        "threading",
        "concurrent",
        "time",
        "os",
        "socket",
        "subprocess",
        "torch",
    }
)
# Inside dd_queue, the core may use only itself and the error tree (dd_queue.clock imports time).
ALLOWED_PROJECT = ("dd_queue.core", "dd_queue.errors")


def forbidden_imports(source: str) -> list[str]:
    """Return every forbidden module that ``source`` imports, as written."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            outside_core = top == "dd_queue" and not any(
                name == ok or name.startswith(ok + ".") for ok in ALLOWED_PROJECT
            )
            if top in FORBIDDEN or outside_core:
                found.append(name)
    return found


def core_modules() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def test_core_has_modules() -> None:
    assert (CORE / "__init__.py").exists(), f"{CORE} is not a package"


@pytest.mark.parametrize("module", core_modules(), ids=lambda p: p.relative_to(CORE).as_posix())
def test_core_module_imports_no_io(module: Path) -> None:
    bad = forbidden_imports(module.read_text(encoding="utf-8"))
    rel = module.relative_to(CORE.parents[1]).as_posix()
    assert not bad, (
        f"{rel} imports {', '.join(bad)}: dd_queue/core must stay pure "
        "(pass time in as `now`, keep I/O in the shell, use numpy rather than torch)"
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import os", ["os"]),
        ("import os.path", ["os.path"]),
        ("from time import monotonic", ["time"]),
        ("import numpy as np, threading", ["threading"]),
        ("from redis.asyncio import Redis", ["redis.asyncio"]),
        ("def f():\n    import torch\n", ["torch"]),
        ("from dd_queue.clock import FakeClock", ["dd_queue.clock"]),
        ("from dd_queue import clock", ["dd_queue"]),
        ("import timeit, osmosis, numpy", []),
        ("from dd_queue.errors import CoreError", []),
        ("from dd_queue.core.rounds import RoundView", []),
        ("from . import rounds\nfrom .policy import decide", []),
    ],
    ids=[
        "os",
        "os-submodule",
        "from-time",
        "multi-import",
        "redis-submodule",
        "nested-import",
        "project-clock",
        "project-package",
        "lookalike-names",
        "errors-ok",
        "core-ok",
        "relative-ok",
    ],
)
def test_checker_catches_what_it_should(source: str, expected: list[str]) -> None:
    assert forbidden_imports(source) == expected
