"""Architecture rules of the whole package: no import cycles, and no torch where none is needed.

- **No cycles.** Module A importing B while B imports A (even only for type hints, under
  ``TYPE_CHECKING``) means neither can be read, tested or changed alone. The graph is built
  from every ``import`` in ``dd_queue`` at module level, ``TYPE_CHECKING`` blocks included;
  imports inside functions are the one allowed way to defer a heavy dependency.
- **No torch in the config or the control plane.** ``import dd_queue.config`` runs at every
  CLI start and in the control plane and the synchronizer's parent; torch costs ~2 s there.
"""

from __future__ import annotations

import ast
import graphlib
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dd_queue"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(dotted: str, known: set[str]) -> str | None:
    """The module ``dotted`` names, or the module it is an attribute of."""
    while dotted and dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _imported(node: ast.Import | ast.ImportFrom, package: str, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {r for a in node.names if (r := _resolve(a.name, known))}
    base = node.module or ""
    if node.level:
        anchor = package
        for _ in range(node.level - 1):
            anchor = anchor.rpartition(".")[0]
        base = f"{anchor}.{base}".rstrip(".")
    found = set()
    for alias in node.names:
        full = f"{base}.{alias.name}"
        if (r := full if full in known else _resolve(base, known)) is not None:
            found.add(r)
    return found


def module_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The ``dd_queue`` modules that ``path`` (module ``name``) imports at module level,
    type-only imports included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    todo = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found |= _imported(node, package, known)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for field in ("body", "orelse", "handlers", "finalbody"):
                todo.extend(getattr(node, field, None) or [])
    found.discard(name)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    known = set(paths)
    return {name: module_imports(path, name, known) for name, path in paths.items()}


def a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules, the first repeated last), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


def test_the_package_has_no_import_cycles() -> None:
    found = a_cycle(import_graph())
    assert found is None, (
        f"import cycle (type-only imports count): {' → '.join(found)}. Pass what the other "
        "module needs in (a Protocol, a callable), or move the shared type next to the messages"
    )


def test_the_cycle_finder_finds_cycles_and_only_cycles(tmp_path: Path) -> None:
    pkg = tmp_path / "dd_queue"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from dd_queue import b\n",
        "b.py": "import typing\nif typing.TYPE_CHECKING:\n    from dd_queue.a import X\n",
        "c.py": "import dd_queue.a\n",
        "d.py": "def f():\n    from dd_queue import c\n",
        "sub/__init__.py": "from .e import E\n",
        "sub/e.py": "from .. import d\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert graph["dd_queue.sub.e"] == {"dd_queue.d"} and graph["dd_queue.d"] == set()
    found = a_cycle(graph)
    assert found is not None and set(found) == {"dd_queue.a", "dd_queue.b"}
    del graph["dd_queue.b"]
    assert a_cycle(graph) is None


@pytest.mark.parametrize(
    "module", ["dd_queue.config", "dd_queue.control", "dd_queue.control.app", "dd_queue.cli"]
)
def test_importing_the_config_or_the_control_plane_does_not_load_torch(module: str) -> None:
    code = f"import sys, {module}; print([m for m in sys.modules if m.split('.')[0] == 'torch'])"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]", f"import {module} loads torch: {done.stdout.strip()}"


def test_ddq_s_parser_with_every_command_registered_does_not_load_torch() -> None:
    """Every ``ddq`` start builds the whole parser (each ``COMMAND_MODULES`` entry registers its
    subcommand): none may import torch for that, or ``ddq version`` and a restarted
    synchronizer pay its ~2 s (a synchronizer loads it later, only to plan its fragments)."""
    code = (
        "import sys, dd_queue.cli as c; p = c._build_parser(); "
        "p.parse_args(['synchronizer', '--config', 'demo']); "
        "print([m for m in sys.modules if m.split('.')[0] == 'torch'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]", f"ddq's parser loads torch: {done.stdout.strip()[:300]}"


@pytest.mark.parametrize("name", ["learner", "synchronizer", "control_plane"])
def test_the_checkout_services_forward_to_the_packaged_entry_points(name: str) -> None:
    """``python -m services.<name>`` (a checkout) runs ``dd_queue.services.<name>`` (the wheel)."""
    shim = importlib.import_module(f"services.{name}")
    packaged = importlib.import_module(f"dd_queue.services.{name}")
    assert shim.main is packaged.main
