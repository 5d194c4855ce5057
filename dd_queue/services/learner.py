"""Learner entry point.

    python -m dd_queue.services.learner --config config/demo.yaml --learner-id L0
    torchrun --nproc-per-node 2 -m dd_queue.services.learner --config demo --learner-id L0

Joins the run named in the config, waits for the synchronizer's global model, trains, and
publishes fragment contributions until ``learner.max_steps`` or a signal (first: finish the
step and flush; second: exit at once). Everything lives in ``dd_queue.learner``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from dd_queue.config import load_config
from dd_queue.errors import DDQError, exit_code
from dd_queue.learner.cli import add_arguments
from dd_queue.learner.service import run


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``--config`` and ``--learner-id``, run the learner; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="dd_queue.services.learner", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, os.environ)
        return run(cfg, args.learner_id, environ=os.environ)
    except DDQError as exc:
        sys.stderr.write(f"learner: error: {exc}\n")
        return exit_code(exc)


if __name__ == "__main__":
    raise SystemExit(main())
