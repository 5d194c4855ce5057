"""How many Redis Cluster shards and synchronizer cores a run needs, from measured CPU per MB.

    python bench/cluster_sizing.py                       # the 2026-12-07 measurements
    python bench/cluster_sizing.py --sync-ms-per-mb 2.9 --redis-ms-per-mb 2.6 --json
    python bench/cluster_sizing.py --step-s 0.5 --sync-every 50

A pure computation (no server). Every learner sends each fragment once every H inner steps, so
the contributions arriving per second are

    upstream = M × N × bytes/param (int8: 1 + 4/256 for the block scales) / (H × t_step)

and every learner reads each new global fragment back (fp32, 4 B/param):

    downstream = M × N × 4 / (H × t_step)

Cores needed = bytes/s × CPU ms per MB / 1000, at a utilization (default 50%: headroom for
bursts, failovers and takeovers). ``--sync-ms-per-mb`` is the synchronizer's loop plus its fetch
processes, ``--redis-ms-per-mb`` every Redis node of a shard (master and replica), both per MB
of contribution merged, from ``bench_synchronizer --cluster``. A Redis node is single-threaded,
so a shard is at most one master core: shards = Redis cores for upstream (measured) plus
downstream reads at ``--read-ms-per-mb`` (not measured by the bench; the default assumes half
the upstream cost per MB, a GET against a SET + XADD + read). Synchronizers are counted in
cores (a synchronizer process with its fetch processes uses about 2).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

MB = 1e6
MODELS = {"1B": 1e9, "8B": 8e9, "70B": 70e9}
LEARNERS = (8, 64, 512)


def size(
    params: float,
    learners: int,
    *,
    step_s: float,
    sync_every: int,
    bytes_per_param: float,
    sync_ms_per_mb: float,
    redis_ms_per_mb: float,
    read_ms_per_mb: float,
    utilization: float,
) -> dict[str, float]:
    """One row: the byte rates and the cores, shards and synchronizers they need."""
    period_s = sync_every * step_s
    up = learners * params * bytes_per_param / period_s / MB
    down = learners * params * 4 / period_s / MB
    redis_cores = (up * redis_ms_per_mb / 2 + down * read_ms_per_mb) / 1000  # master's share
    sync_cores = up * sync_ms_per_mb / 1000
    return {
        "upstream_mb_s": up,
        "downstream_mb_s": down,
        "shards": max(1, math.ceil(redis_cores / utilization)),
        "synchronizer_cores": sync_cores / utilization,
        "synchronizers": max(1, math.ceil(sync_cores / utilization / 2)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-s", type=float, default=1.0, help="t_step (default %(default)s)")
    parser.add_argument("--sync-every", type=int, default=100, help="H (default %(default)s)")
    parser.add_argument("--bytes-per-param", type=float, default=1 + 4 / 256, help="int8")
    parser.add_argument("--sync-ms-per-mb", type=float, default=2.87, help="measured: 1.31 + 1.56")
    parser.add_argument("--redis-ms-per-mb", type=float, default=2.61, help="measured, 6 nodes")
    parser.add_argument("--read-ms-per-mb", type=float, default=0.65, help="assumed (see doc)")
    parser.add_argument("--utilization", type=float, default=0.5, help="of each core")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    if min(args.step_s, args.sync_every, args.utilization) <= 0 or args.utilization > 1:
        parser.error("--step-s and --sync-every must be > 0, --utilization in (0, 1]")
    rows = []
    for name, params in MODELS.items():
        for m in LEARNERS:
            row = size(
                params,
                m,
                step_s=args.step_s,
                sync_every=args.sync_every,
                bytes_per_param=args.bytes_per_param,
                sync_ms_per_mb=args.sync_ms_per_mb,
                redis_ms_per_mb=args.redis_ms_per_mb,
                read_ms_per_mb=args.read_ms_per_mb,
                utilization=args.utilization,
            )
            rows.append({"model": name, "learners": m, **row})
    print(
        f"t_step {args.step_s} s, H {args.sync_every}, {args.bytes_per_param:.3f} B/param up, "
        f"4 B/param down; CPU ms/MB: synchronizer {args.sync_ms_per_mb}, Redis "
        f"{args.redis_ms_per_mb} (+ reads {args.read_ms_per_mb}); {args.utilization:.0%} busy\n"
    )
    print("| model | M | upstream MB/s | downstream MB/s | shards | synchronizer cores |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['learners']} | {r['upstream_mb_s']:,.0f} | "
            f"{r['downstream_mb_s']:,.0f} | {r['shards']} | {r['synchronizer_cores']:,.1f} |"
        )
    if args.json:
        print(json.dumps({"settings": vars(args), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
