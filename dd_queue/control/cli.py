"""``ddq control``: serve the control plane and dashboard (see ``dd_queue.control.service``)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from dd_queue.config import CONFIG_HELP, load_config

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``control`` subcommand to the ``ddq`` parser."""
    p = sub.add_parser("control", help="serve the control plane API and dashboard")
    p.add_argument("--config", default="base", help=CONFIG_HELP)
    p.set_defaults(func=_cmd_control)


def _cmd_control(args: argparse.Namespace) -> int:
    from dd_queue.control.service import serve

    return serve(load_config(args.config, os.environ))
