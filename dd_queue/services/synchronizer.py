"""The synchronizer process (as the Procfile starts it).

    python -m dd_queue.services.synchronizer --config config/demo.yaml [--id sync-0]
        [--allow-config-change] [--init-from model.safetensors]

The same as ``ddq synchronizer``: builds the synchronizer from the config, pumps until the first
SIGTERM/SIGINT (finish the iteration, release the leases, exit 0); a second signal exits at once.
See ``dd_queue/synchronizer/service.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dd_queue import cli


def main(argv: Sequence[str] | None = None) -> int:
    """``ddq synchronizer`` with these arguments (default: the command line's); the exit code."""
    return cli.main(["synchronizer", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
