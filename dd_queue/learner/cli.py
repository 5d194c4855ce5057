"""``ddq learner``: run one learner process (the same as ``python -m dd_queue.services.learner``).

ddq learner --config config/demo.yaml --learner-id L0
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from dd_queue.config import load_config


def _cmd_learner(args: argparse.Namespace) -> int:
    from dd_queue.learner.service import run  # torch: only when a learner runs

    cfg = load_config(args.config, os.environ)
    return run(cfg, args.learner_id, environ=os.environ)


def register(subparsers: Any) -> None:
    """Add the ``learner`` subcommand to the ``ddq`` parser."""
    p = subparsers.add_parser(
        "learner", help="run a learner: join the run, train, publish contributions"
    )
    add_arguments(p)
    p.set_defaults(func=_cmd_learner)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The learner's two command-line flags (everything else lives in the YAML config)."""
    parser.add_argument(
        "--config", required=True, help="YAML file, or a packaged config's name: base, demo, test"
    )
    parser.add_argument("--learner-id", required=True, help="this learner's id, e.g. L0")


__all__ = ["add_arguments", "register"]
