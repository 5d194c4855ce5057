"""``ddq synchronizer``, ``ddq evaluator`` and ``ddq export``: the synchronizer side's commands.

ddq synchronizer --config config/demo.yaml [--id sync-0] [--allow-config-change]
                 [--init-from model.safetensors] [--resume-from snapshots/]
ddq snapshot ls snapshots/ [--json]          list the fragments' snapshots on disk
ddq snapshot verify snapshots/ [--json]      check every snapshot's checksum (exit 1: one fails)
ddq evaluator --config config/demo.yaml [--once] [--json]
ddq export --config config/demo.yaml --out model.safetensors [--format hf] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from typing import Any

from dd_queue.bus import RedisBus
from dd_queue.config import CONFIG_HELP, load_config
from dd_queue.errors import ConfigError
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
    p.add_argument(
        "--resume-from",
        help="snapshot directory: restore the fragments Redis lost from it, and keep writing "
        "snapshots there (sets synchronizer.snapshot_dir)",
    )
    p.set_defaults(func=_cmd_synchronizer)

    p = sub.add_parser("snapshot", help="list or verify the synchronizer's snapshots on disk")
    p.add_argument("action", choices=("ls", "verify"), help="ls: list; verify: check checksums")
    p.add_argument("dir", help="the snapshot directory (synchronizer.snapshot_dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.set_defaults(func=_cmd_snapshot)

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

    env = dict(os.environ)
    if args.resume_from:
        if not os.path.isdir(args.resume_from):
            raise ConfigError(f"--resume-from {args.resume_from!r} is not a directory")
        env["DDQ__SYNCHRONIZER__SNAPSHOT_DIR"] = args.resume_from
    cfg = load_config(args.config, env)
    stop = threading.Event()
    install_two_stage_stop(stop)
    return serve(
        cfg,
        synchronizer_id=args.id,
        allow_config_change=args.allow_config_change,
        init_from=args.init_from,
        stop=stop,
    )


def _cmd_snapshot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dd_queue.synchronizer import snapshots

    root = Path(args.dir)
    if not root.is_dir():
        raise ConfigError(f"{args.dir!r} is not a directory")
    checked = snapshots.verify(root) if args.action == "verify" else None
    found = [s for s, _ in checked] if checked is not None else snapshots.list_snapshots(root)
    problems = {s.path: why for s, why in checked if why} if checked else {}
    out = sys.stdout
    out.write("| run | fragment | version | outer steps | elements | written | status |\n")
    out.write("|---|---:|---:|---:|---:|---|---|\n")
    for snap in found:
        status = problems.get(snap.path, "ok" if checked is not None else "")
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snap.created_at_s))
        out.write(
            f"| {snap.run_id} | {snap.fragment_id} | {snap.version} | {snap.outer_steps} | "
            f"{snap.size:,} | {written} | {status} |\n"
        )
    out.write(f"{len(found)} snapshots under {root}")
    out.write(f", {len(problems)} unusable\n" if checked is not None else "\n")
    if args.json:
        rows = [{**dataclasses.asdict(s), "problem": problems.get(s.path)} for s in found]
        out.write(json.dumps({"snapshots": rows, "unusable": len(problems)}) + "\n")
    return 1 if problems else 0


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
