"""The control plane process (as the Procfile starts it).

    python -m services.control_plane --config config/demo.yaml

The same as ``ddq control``: the FastAPI app (``dd_queue.control``) on uvicorn at
``control.host:control.port`` (127.0.0.1:8000 by default), reading the run from Redis and
writing only fault commands and their records. See ``dd_queue/control/service.py``.
"""

from __future__ import annotations

import sys

from dd_queue.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["control", *sys.argv[1:]]))
