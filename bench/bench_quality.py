"""Quality benchmarks of Decoupled DiLoCo in the deterministic in-process runner (issue 4).

    python bench/bench_quality.py                   # all four, ~9 min on 2 CPUs (1 thread)
    python bench/bench_quality.py --only 2,4        # some of them
    python bench/bench_quality.py --json            # the tables, then one JSON object (last line)

Each benchmark is an experiment file in ``config/experiments/`` run by ``dd_queue.runner`` (the
same ``Learner`` and ``Synchronizer`` classes as the services, on a ``MemoryBus`` and a virtual
clock; model math is real, time is simulated: base step 1 virtual second). All use gpt-tiny
(2 layers × 128, 0.43 M parameters) on byte-level stdlib text, sequences of 64, batch 8 per
learner, P = 4 fragments, H = 8, fp32 contributions, outer Nesterov lr 0.5, μ 0.5, RDA unless
the benchmark varies it, seed 0:

1. ``fault_free``: decoupled M = 4 vs synchronous M = 4 vs data-parallel (4× batch), equal
   tokens (200 steps per learner, 409,600 tokens); plus data-parallel sent through the decoupled
   exchange (one learner, K = 1, outer SGD(1)) to price the τ = 1 overlap alone.
2. ``heterogeneous``: 2 of 4 learners 1.2× slower, 10% jitter: K = M (synchronous) vs K = 1
   without grace window vs K = 1 + grace window; goodput and eval loss.
3. ``merge_rule``: RDA vs weighted mean at M = 4 and 8, 200 steps per learner.
4. ``failures``: Poisson failures (MTBF 120 s per learner, repair 10 s + Exp(20 s), rejoin
   5 s) for 300 virtual s: decoupled vs synchronous, plus the fault-free decoupled run
   (constant learning rate after warm-up).

Every variant is scored on the same held-out examples (16 batches of 8 sequences of 64).
Results (JSON per experiment, with per-round rows) and plots (held-out loss vs tokens and vs
virtual time) go to ``bench/results/``. The vision run is skipped when scikit-learn (the digits
set) is not installed and no real image set is at hand; the script says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dd_queue.runner.experiment import ExperimentResult, markdown_table, run_experiment  # noqa: E402
from dd_queue.runner.plots import plot_experiment  # noqa: E402
from dd_queue.runner.result import RunResult  # noqa: E402
from dd_queue.runner.spec import load_experiment  # noqa: E402

EXPERIMENTS = {"1": "fault_free", "2": "heterogeneous", "3": "merge_rule", "4": "failures"}


def loss_at(run: RunResult, *, tokens: float | None = None, time_s: float | None = None) -> float:
    """Held-out loss interpolated at a token count or a virtual time (clamped to the run)."""
    xs = [e.tokens if tokens is not None else e.virtual_s for e in run.evals]
    ys = [e.loss for e in run.evals]
    x = tokens if tokens is not None else time_s
    return float(np.interp(x, xs, ys))


def waiting_s(run: RunResult) -> float:
    return sum(row["waiting_s"] for row in run.learners)


def table_fault_free(runs: list[RunResult]) -> str:
    dp = next((r for r in runs if r.mode == "data-parallel"), None)
    half = runs[0].tokens / 2
    lines = [
        "| variant | tokens | eval loss (equal tokens) | vs data-parallel | loss at half tokens "
        "| virtual s | goodput | contributors/round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        delta = f"{r.final.loss - dp.final.loss:+.4f}" if dp is not None else "-"
        lines.append(
            f"| {r.name} | {r.tokens:,} | {r.final.loss:.4f} | {delta} "
            f"| {loss_at(r, tokens=half):.4f} | {r.stop_s:.0f} | {r.goodput.goodput:.1%} "
            f"| {r.rounds.mean_contributors:.2f} |"
        )
    return "\n".join(lines) + "\n"


def table_heterogeneous(runs: list[RunResult]) -> str:
    common = min(r.stop_s for r in runs)
    lines = [
        f"| variant | goodput | waiting s (all learners) | virtual s to the budget "
        f"| eval loss (equal tokens) | eval loss at {common:.0f} s | contributors/round "
        "| late contributions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r.name} | {r.goodput.goodput:.1%} | {waiting_s(r):.0f} | {r.stop_s:.0f} "
            f"| {r.final.loss:.4f} | {loss_at(r, time_s=common):.4f} "
            f"| {r.rounds.mean_contributors:.2f} | {r.rounds.late_or_dropped} |"
        )
    return "\n".join(lines) + "\n"


def table_merge_rule(runs: list[RunResult]) -> str:
    by = {(r.settings["synchronizer"]["merge_rule"], r.n_learners): r for r in runs}
    ms = sorted({m for _, m in by})
    lines = [
        "| merge rule | " + " | ".join(f"M = {m}: eval loss" for m in ms) + " |",
        "|---|" + "---:|" * len(ms),
    ]
    for rule in ("rda", "mean"):
        cells = [f"{by[(rule, m)].final.loss:.4f}" if (rule, m) in by else "-" for m in ms]
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    diffs = [
        f"{by[('rda', m)].final.loss - by[('mean', m)].final.loss:+.4f}"
        if ("rda", m) in by and ("mean", m) in by
        else "-"
        for m in ms
    ]
    lines.append("| rda − mean | " + " | ".join(diffs) + " |")
    return "\n".join(lines) + "\n"


def table_failures(runs: list[RunResult]) -> str:
    faulty = [r for r in runs if sum(row["failures"] for row in r.learners) > 0]
    tokens = min((r.tokens for r in faulty), default=min(r.tokens for r in runs))
    lines = [
        "| variant | failures | goodput | uptime | down chip-s | waiting chip-s | tokens in "
        f"{runs[0].stop_s:.0f} s | eval loss at {runs[0].stop_s:.0f} s "
        f"| eval loss at {tokens:,} tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        g = r.goodput
        failures = sum(row["failures"] for row in r.learners)
        lines.append(
            f"| {r.name} | {failures} | {g.goodput:.1%} | {g.uptime:.1%} | {g.down_chip_s:.0f} "
            f"| {g.waiting_chip_s:.0f} | {r.tokens:,} | {r.final.loss:.4f} "
            f"| {loss_at(r, tokens=tokens):.4f} |"
        )
    return "\n".join(lines) + "\n"


TABLES = {
    "fault_free": table_fault_free,
    "heterogeneous": table_heterogeneous,
    "merge_rule": table_merge_rule,
    "failures": table_failures,
}


def summary(result: ExperimentResult) -> dict[str, Any]:
    return {
        r.name: {
            "mode": r.mode,
            "n_learners": r.n_learners,
            "tokens": r.tokens,
            "stop_s": round(r.stop_s, 3),
            "eval_loss": round(r.final.loss, 5),
            "goodput": round(r.goodput.goodput, 5),
            "uptime": round(r.goodput.uptime, 5),
            "waiting_s": round(waiting_s(r), 3),
            "failures": sum(row["failures"] for row in r.learners),
            "merged_rounds": r.rounds.merged,
            "mean_contributors": round(r.rounds.mean_contributors, 3),
            "elapsed_s": round(r.elapsed_s, 1),
        }
        for r in result.runs
    }


def run_one(name: str, out: Path, *, quiet: bool) -> tuple[ExperimentResult, float]:
    spec = load_experiment(ROOT / "config" / "experiments" / f"{name}.yaml")
    started = time.perf_counter()

    def progress(run: RunResult) -> None:
        if not quiet:
            sys.stderr.write(
                f"  {name}/{run.name}: loss {run.final.loss:.4f} ({run.elapsed_s:.0f} s)\n"
            )

    result = run_experiment(spec, progress=progress)
    elapsed = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result.to_dict(), separators=(",", ":")) + "\n")
    plot_experiment(result.runs, out / f"{name}.png", title=f"{name}: {spec.description}")
    print(f"## {name} ({elapsed:.0f} s)\n\n{spec.description}\n")
    print(TABLES[name](list(result.runs)))
    print(markdown_table(result.runs))
    return result, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="1,2,3,4", help="benchmarks to run (%(default)s)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results folder")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (%(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--json", action="store_true", help="print one JSON object, last")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    payload: dict[str, Any] = {}
    for key in args.only.split(","):
        name = EXPERIMENTS.get(key.strip(), key.strip())
        result, elapsed = run_one(name, Path(args.out), quiet=args.quiet)
        payload[name] = {"elapsed_s": round(elapsed, 1), "runs": summary(result)}
    if importlib.util.find_spec("sklearn") is None:
        note = "vision skipped: scikit-learn (digits) is not installed and no real image set"
        print(f"_{note}._\n")
        payload["vision"] = note
    payload["elapsed_s"] = round(time.perf_counter() - started, 1)
    print(f"total {payload['elapsed_s']:.0f} s")
    if args.json:
        print(json.dumps(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
