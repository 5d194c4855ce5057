"""``ddq experiment``: run an experiment file in the in-process runner.

    ddq experiment --config config/experiments/fault_free.yaml
    ddq experiment --config config/experiments/failures.yaml --only decoupled --json
    ddq experiment --config ... --out bench/results --no-plot --threads 2

Runs every variant (or ``--only`` some) on the experiment's seed, prints a markdown table, and
writes ``<out>/<name>.json`` (the full result, per-round rows included) and ``<out>/<name>.png``
(loss vs tokens and vs virtual time, one line per variant). With ``--json`` the last line
printed is one JSON object: the result without per-round rows, plus the paths written.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dd_queue.runner.result import RunResult

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add the ``experiment`` subcommand to ``ddq``'s subparsers."""
    p = subparsers.add_parser(
        "experiment", help="run an experiment file in the deterministic in-process runner"
    )
    p.add_argument("--config", required=True, help="experiment YAML (config/experiments/)")
    p.add_argument("--only", help="comma-separated variant names to run (default: all)")
    p.add_argument(
        "--out", default="runs/experiments", help="folder of the JSON and PNG (%(default)s)"
    )
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (%(default)s)")
    p.add_argument("--quiet", action="store_true", help="no per-variant progress lines")
    p.add_argument("--json", action="store_true", help="also print one JSON object, last")
    p.set_defaults(func=_cmd_experiment)


def _cmd_experiment(args: argparse.Namespace) -> int:
    import torch  # only when an experiment runs: the ``ddq`` parser stays torch-free

    from dd_queue.runner.experiment import markdown_table, run_experiment
    from dd_queue.runner.plots import plot_experiment
    from dd_queue.runner.spec import load_experiment

    spec = load_experiment(args.config)
    torch.set_num_threads(max(1, args.threads))
    logging.basicConfig(level=logging.WARNING)
    only = [name.strip() for name in args.only.split(",")] if args.only else None

    def progress(run: RunResult) -> None:
        if not args.quiet:
            sys.stderr.write(
                f"{run.name}: loss {run.final.loss:.4f} at {run.tokens:,} tokens, "
                f"{run.stop_s:.0f} virtual s, goodput {run.goodput.goodput:.1%} "
                f"({run.elapsed_s:.0f} s)\n"
            )

    result = run_experiment(spec, only=only, progress=progress)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{spec.name}.json"
    json_path.write_text(json.dumps(result.to_dict(), indent=1) + "\n", encoding="utf-8")
    paths = {"json": str(json_path)}
    if not args.no_plot:
        png = plot_experiment(result.runs, out / f"{spec.name}.png", title=spec.name)
        paths["png"] = str(png)
    sys.stdout.write(f"## {spec.name}\n\n{spec.description}\n\n" if spec.description else "")
    sys.stdout.write(markdown_table(result.runs))
    sys.stdout.write("\n" + "".join(f"wrote {path}\n" for path in paths.values()))
    if args.json:
        payload = {**result.to_dict(with_rounds=False), "paths": paths}
        sys.stdout.write(json.dumps(payload) + "\n")
    return 0
