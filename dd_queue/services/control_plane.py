"""The control plane process (as the Procfile starts it).

    python -m dd_queue.services.control_plane --config config/demo.yaml

The same as ``ddq control``: the FastAPI app (``dd_queue.control``) on uvicorn at
``control.host:control.port`` (127.0.0.1:8000 by default), reading the run from Redis and
writing only fault commands and their records. See ``dd_queue/control/service.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dd_queue import cli


def main(argv: Sequence[str] | None = None) -> int:
    """``ddq control`` with these arguments (default: the command line's); returns the exit code."""
    return cli.main(["control", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
