"""The ``ddq`` command line.

    ddq version                               print the version
    ddq config --config config/demo.yaml      print the resolved config (YAML), its digest and
                                              the run digest (contributions must match it)
    ddq config --config config/demo.yaml --json

Small subcommands live here; bigger ones live in their own modules (listed in
``COMMAND_MODULES``), each exposing ``register(subparsers)`` that adds its parser with
``set_defaults(func=...)``. A command function takes the parsed arguments and returns the exit
code. Commands that report numbers accept ``--json`` and then print one JSON object as their
last line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence

import yaml

from dd_queue import __version__
from dd_queue.config import CONFIG_HELP, load_config
from dd_queue.errors import DDQError, exit_code

COMMAND_MODULES: tuple[str, ...] = (
    "dd_queue.acl",
    "dd_queue.auth",
    "dd_queue.bus.cli",
    "dd_queue.control.cli",
    "dd_queue.data.cli",
    "dd_queue.learner.cli",
    "dd_queue.report.cli",
    "dd_queue.runner.cli",
    "dd_queue.sim.cli",
    "dd_queue.startup",
    "dd_queue.supervise",
    "dd_queue.synchronizer.cli",
    "dd_queue.up.cli",
)
"""Modules that add subcommands (``register(subparsers)``), e.g. ``dd_queue.learner.cli``."""


def _cmd_version(args: argparse.Namespace) -> int:
    sys.stdout.write(f"dd_queue {__version__}\n")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, os.environ)
    data = cfg.public_dict()
    if args.json:
        digests = {"digest": cfg.digest, "run_digest": cfg.run_digest}
        sys.stdout.write(json.dumps({**digests, "config": data}) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
        sys.stdout.write(f"# digest: {cfg.digest}\n# run digest: {cfg.run_digest}\n")
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddq", description="Decoupled DiLoCo over Redis.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("version", help="print the version")
    p.set_defaults(func=_cmd_version)

    p = sub.add_parser("config", help="validate a config and print it resolved, with its digest")
    p.add_argument("--config", default="base", help=CONFIG_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of YAML")
    p.set_defaults(func=_cmd_config)

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddq`` console script; returns the process exit code."""
    args = _build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except DDQError as exc:
        sys.stderr.write(f"ddq: error: {exc}\n")
        return exit_code(exc)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
