"""Wall time of the goodput simulator at the issue's scale: 2.4M chips, 30 days, M = 16.

    python bench/bench_sim.py            # best of 3 (each run: all three regimes)
    python bench/bench_sim.py --json     # the table, then one JSON object as the last line
    python bench/bench_sim.py --repeats 1
    python bench/bench_sim.py --set accounting.failure_during_stall=absorbed   # an option

One run draws the failure history and chip speeds once and simulates plain DP, elastic DP and
Decoupled DiLoCo (M = 16) on it, with the documented defaults of ``config/sim/default.yaml``
(one interruption per chip-year: ~197 000 slice interruptions in 30 days). Times are wall
seconds of ``dd_queue.sim.simulate``; per-regime times come from running each regime alone on
the same seed (so they include drawing the failures each time). Target: under 10 s.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

from dd_queue.sim import load_sim_config, simulate

TARGET_S = 10.0
CASE = {
    "cluster.chips": "2400000",
    "decoupled.learners": "16",
    "run.duration_days": "30",
    "run.seed": "0",
}


def _best_s(overrides: dict[str, str], repeats: int) -> tuple[float, list[Any]]:
    cfg = load_sim_config("config/sim/default.yaml", overrides)
    best, results = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        results = simulate(cfg)
        best = min(best, time.perf_counter() - start)
    return best, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs; the best is kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a field"
    )
    args = parser.parse_args()
    case = CASE | dict(item.split("=", 1) for item in args.set)
    total_s, results = _best_s(case, args.repeats)
    per_regime = {
        regime: _best_s(case | {"run.regimes": f"[{regime}]"}, args.repeats)[0]
        for regime in ("plain_dp", "elastic_dp", "decoupled")
    }
    print("| case | wall s (best) | target | |")
    print("|---|---:|---:|---|")
    verdict = "PASS" if total_s < TARGET_S else "FAIL"
    print(
        f"| 2.4M chips × 30 d, M = 16, all regimes | {total_s:.2f} | < {TARGET_S:g} | {verdict} |"
    )
    for regime, seconds in per_regime.items():
        print(f"| … {regime} alone | {seconds:.2f} | | |")
    print()
    print("| regime | goodput | uptime | interruptions |")
    print("|---|---:|---:|---:|")
    for r in results:
        good, up = f"{100 * r.goodput:.1f}%", f"{100 * r.uptime:.1f}%"
        print(f"| {r.label} | {good} | {up} | {r.interruptions:,.0f} |")
    if args.json:
        payload = {
            "bench": "sim",
            "case": case,
            "wall_s": total_s,
            "per_regime_wall_s": per_regime,
            "target_s": TARGET_S,
            "pass": total_s < TARGET_S,
            "goodput": {r.label: r.goodput for r in results},
            "python": platform.python_version(),
            "machine": platform.machine(),
        }
        print(json.dumps(payload))


if __name__ == "__main__":
    main()
