"""The synchronizer process (as the Procfile starts it).

    python -m services.synchronizer --config config/demo.yaml [--id sync-0]
        [--allow-config-change] [--init-from model.safetensors]

The same as ``ddq synchronizer``: builds the synchronizer from the config, pumps until the first
SIGTERM/SIGINT (finish the iteration, release the leases, exit 0); a second signal exits at once.
See ``dd_queue/synchronizer/service.py``.
"""

from __future__ import annotations

import sys

from dd_queue.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["synchronizer", *sys.argv[1:]]))
