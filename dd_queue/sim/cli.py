"""``ddq simulate``: the goodput simulator on the command line.

    ddq simulate                                   # defaults: 1.2M chips, M = 8, 30 days
    ddq simulate --config config/sim/default.yaml --chips 2400000 --learners 16
    ddq simulate --set repair.median_s=300 --set spmd.restart_s=55 --reps 5
    ddq simulate --sweep --csv sweep.csv --plot plots/     # chips × regimes × M
    ddq simulate --sensitivity                     # each option / parameter vs the paper
    ddq simulate --calibrate recording.json        # predicted vs measured goodput of a run
    ddq simulate ... --json                        # the table, then one JSON object last

Flags are shorthands for ``--set section.field=value`` and win over the config file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dd_queue.errors import ConfigError
from dd_queue.sim.calibrate import calibrate, load_recording
from dd_queue.sim.config import SimConfig, load_sim_config
from dd_queue.sim.plots import matplotlib_available, plot_goodput_vs_chips, plot_timeline
from dd_queue.sim.published import SOURCE
from dd_queue.sim.regimes import simulate
from dd_queue.sim.report import csv_text, describe, json_payload, results_table, sweep_table
from dd_queue.sim.sensitivity import run_sensitivity, sensitivity_payload, sensitivity_table
from dd_queue.sim.sweep import point_config, run_sweep

__all__ = ["register"]

_FLAGS = {
    "chips": "cluster.chips",
    "chips_per_slice": "cluster.chips_per_slice",
    "mtbi_days": "cluster.chip_mtbi_days",
    "learners": "decoupled.learners",
    "quorum": "decoupled.quorum",
    "days": "run.duration_days",
    "seed": "run.seed",
    "reps": "run.repetitions",
    "regimes": "run.regimes",
}


def register(subparsers: Any) -> None:
    """Add the ``simulate`` subcommand to ``ddq``'s subparsers."""
    p = subparsers.add_parser(
        "simulate", help="goodput simulator: plain DP vs elastic DP vs Decoupled DiLoCo"
    )
    p.add_argument("--config", help="simulator YAML, e.g. config/sim/default.yaml")
    p.add_argument("--chips", type=int, help="chips in the job")
    p.add_argument("--chips-per-slice", type=int, help="chips per slice (unit of failure)")
    p.add_argument("--mtbi-days", type=float, help="per-chip mean time between interruptions")
    p.add_argument("--learners", type=int, help="M, Decoupled DiLoCo learners")
    p.add_argument("--quorum", type=int, help="K, minimum quorum")
    p.add_argument("--days", type=float, help="simulated days")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument("--reps", type=int, help="repetitions")
    p.add_argument("--regimes", help="comma-separated: plain_dp,elastic_dp,decoupled")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override any config field (repeatable)",
    )
    p.add_argument("--sweep", action="store_true", help="run the chips × regimes × M sweep")
    p.add_argument(
        "--sensitivity",
        action="store_true",
        help="flip each modelling option and move each parameter to its low/high value at "
        "the paper's published points (150k, 1.2M, 2.4M chips)",
    )
    p.add_argument("--calibrate", metavar="RECORDING", help="predict a recorded run's goodput")
    p.add_argument("--json", action="store_true", help="also print one JSON object, last")
    p.add_argument("--csv", metavar="PATH", help="write the results as CSV")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument(
        "--timeline-window-s",
        type=float,
        default=600.0,
        help="length of the timeline plot's window, s (default: %(default)s)",
    )
    p.set_defaults(func=_cmd_simulate)


def _config(args: argparse.Namespace) -> SimConfig:
    overrides: dict[str, str] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r} must look like section.field=value")
        overrides[key.strip()] = value.strip()
    for flag, key in _FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides[key] = f"[{value}]" if flag == "regimes" else str(value)
    return load_sim_config(args.config, overrides)


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    cfg = _config(args)
    out = sys.stdout
    if args.sensitivity:
        return _sensitivity(args, cfg)
    if args.sweep:
        out.write(f"parameters: {describe(point_config(cfg, cfg.cluster.chips))}\n")
        chips = ", ".join(f"{c:,}" for c in cfg.sweep.chips)
        out.write(f"sweep: chips {chips}; M {list(cfg.sweep.learners)}\n\n")
        rows = run_sweep(cfg)
        out.write(sweep_table(rows) + "\n" + sweep_table(rows, field="uptime"))
        kind = "sweep"
    else:
        out.write(f"parameters: {describe(cfg)}\n\n")
        results = simulate(cfg, keep_timelines=bool(args.plot))
        rows = [(r.chips, r) for r in results]
        out.write(results_table(results))
        kind = "single"
    if args.csv:
        Path(args.csv).write_text(csv_text(rows), encoding="utf-8")
        out.write(f"\nwrote {args.csv}\n")
    if args.plot:
        _plots(args, rows, kind)
    if args.json:
        out.write(json.dumps(json_payload(cfg, rows, kind=kind)) + "\n")
    return 0


def _sensitivity(args: argparse.Namespace, cfg: SimConfig) -> int:
    out = sys.stdout
    out.write(f"baseline: {describe(cfg)}\n")
    out.write(f"each point: {cfg.sweep.duration_days:g} days, seed {cfg.run.seed}\n\n")
    rows = run_sensitivity(cfg)
    out.write(sensitivity_table(rows))
    out.write(f"\npublished: {SOURCE}\n")
    if args.json:
        out.write(json.dumps({"digest": cfg.digest, **sensitivity_payload(rows)}) + "\n")
    return 0


def _plots(args: argparse.Namespace, rows: list[Any], kind: str) -> None:
    if not matplotlib_available():
        sys.stderr.write(
            "ddq simulate: plots skipped: matplotlib is not installed "
            "(pip install 'dd_queue[plots]' or pip install matplotlib)\n"
        )
        return
    folder = Path(args.plot)
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "sweep":
        path = plot_goodput_vs_chips(rows, folder / "goodput_vs_chips.png")
    else:
        window = (0.0, float(args.timeline_window_s))
        path = plot_timeline([r for _, r in rows], folder / "timeline.png", window_s=window)
    sys.stdout.write(f"wrote {path}\n")


def _calibrate(args: argparse.Namespace) -> int:
    rec = load_recording(args.calibrate)
    reps = args.reps if args.reps is not None else 200
    result = calibrate(rec, repetitions=reps, seed=args.seed or 0)
    out = sys.stdout
    out.write(
        f"calibration of {args.calibrate} ({len(rec.learners)} learners, "
        f"{rec.duration_s:g} s, {len(rec.faults)} faults)\n\n"
    )
    out.write("| figure | measured | replay | fitted (mean ± std) |\n|---|---:|---:|---:|\n")
    for name in ("goodput", "uptime", "merges_per_hour", "mean_quorum"):
        m, r, f = result.measured[name], result.replay[name], result.fitted_mean[name]
        pct = name in ("goodput", "uptime")
        spread = f" ± {100 * result.fitted_std['goodput']:.2f}" if name == "goodput" else ""
        cells = " | ".join(_fmt(x, pct=pct) for x in (m, r, f))
        out.write(f"| {name} | {cells}{spread} |\n")
    if args.json:
        out.write(
            json.dumps({"command": "simulate", "kind": "calibration", **result.public_dict()})
            + "\n"
        )
    return 0


def _fmt(x: float, *, pct: bool) -> str:
    return f"{100 * x:.2f}%" if pct else f"{x:.2f}"
