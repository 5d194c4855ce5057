"""``ddq synchronizer``, ``ddq evaluator`` and ``ddq export``: the synchronizer side's commands.

ddq synchronizer --config config/demo.yaml [--id sync-0] [--allow-config-change]
                 [--init-from model.safetensors]
ddq evaluator --config config/demo.yaml [--once] [--json]
ddq export --config config/demo.yaml --out model.safetensors [--format hf] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Any

from dd_queue.bus import RedisBus
from dd_queue.config import CONFIG_HELP, load_config
from dd_queue.log import setup_logging

__all__ = ["register"]


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="base", help=CONFIG_HELP)


def register(sub: Any) -> None:
    """Add the three commands to the ``ddq`` subparsers."""
    p = sub.add_parser("synchronizer", help="run a synchronizer (merges, publishes versions)")
    _config_arg(p)
    p.add_argument("--id", default="sync-0", help="stable synchronizer id (default: %(default)s)")
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="continue a run created under another config digest",
    )
    p.add_argument(
        "--init-from",
        help="create a new run from these weights: a ddq export, a Hugging Face model "
        "directory or a safetensors file",
    )
    p.set_defaults(func=_cmd_synchronizer)

    p = sub.add_parser("evaluator", help="score the global model on held-out data, periodically")
    _config_arg(p)
    p.add_argument("--once", action="store_true", help="evaluate once and exit")
    p.add_argument("--json", action="store_true", help="with --once: print one JSON object")
    p.set_defaults(func=_cmd_evaluator)

    p = sub.add_parser("export", help="write the current global model to a safetensors file")
    _config_arg(p)
    p.add_argument(
        "--out", required=True, help="output path: model.safetensors, or a directory (hf)"
    )
    p.add_argument(
        "--format",
        choices=("ddq", "hf"),
        default="ddq",
        help="ddq: one safetensors file (--init-from reads it); hf: a transformers directory",
    )
    p.add_argument("--json", action="store_true", help="print the metadata as one JSON object")
    p.set_defaults(func=_cmd_export)


def _cmd_synchronizer(args: argparse.Namespace) -> int:
    from dd_queue.synchronizer.service import install_two_stage_stop, serve

    cfg = load_config(args.config, os.environ)
    stop = threading.Event()
    install_two_stage_stop(stop)
    return serve(
        cfg,
        synchronizer_id=args.id,
        allow_config_change=args.allow_config_change,
        init_from=args.init_from,
        stop=stop,
    )


def _cmd_evaluator(args: argparse.Namespace) -> int:
    from dd_queue.startup import wait_for
    from dd_queue.synchronizer.evaluator import Evaluator
    from dd_queue.synchronizer.service import install_two_stage_stop
    from dd_queue.tracking import open_tracker

    cfg = load_config(args.config, os.environ)
    setup_logging("evaluator", level=cfg.run.log_level, fmt=cfg.run.log_format)
    stop = threading.Event()
    install_two_stage_stop(stop)
    bus = RedisBus(cfg.redis.url, cfg.run.run_id, options=cfg.redis.options())
    tracker = open_tracker(cfg, "evaluator")
    try:
        evaluator = Evaluator(cfg, bus=bus, tracker=tracker)
        if not wait_for(("redis", "run"), cfg=cfg, bus=bus, role="evaluator", stop=stop):
            return 0
        if args.once:
            result = evaluator.evaluate()
            if args.json:
                fields = {
                    "loss": result.loss,
                    "accuracy": result.accuracy,
                    "versions": result.versions,
                    "n_examples": result.n_examples,
                }
                sys.stdout.write(json.dumps(fields) + "\n")
            return 0
        evaluator.run(stop)
    finally:
        bus.close()
        tracker.close()
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from dd_queue.synchronizer.export import export_hf, export_model

    cfg = load_config(args.config, os.environ)
    bus = RedisBus(cfg.redis.url, cfg.run.run_id, options=cfg.redis.options())
    try:
        write = export_hf if args.format == "hf" else export_model
        metadata: dict[str, Any] = dict(write(bus, cfg, args.out))
    finally:
        bus.close()
    if args.json:
        sys.stdout.write(json.dumps({"out": args.out, **metadata}) + "\n")
    else:
        sys.stdout.write(f"wrote {args.out}: versions {metadata['versions']}\n")
    return 0
