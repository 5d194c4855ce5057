"""Soak: 64 simulated learners for 10 minutes against one Redis and against a Redis Cluster.

    python bench/bench_soak.py                         # both backends, 10 minutes each
    python bench/bench_soak.py --minutes 1 --backend redis
    python bench/bench_soak.py --json                  # last line: one JSON object

Not in CI (it runs for 20 minutes). Per backend: a private redis-server (no persistence) or the
local cluster of ``tests/rediscluster`` (3 masters + 3 replicas), the real ``Synchronizer``
pumped in this process, and M simulated learners in one spawned process that speak the real wire
protocol (``bench_synchronizer.Learners``: every round opening is answered with M int8
contributions, payload blob + stream entry, through ``RedisBus``). Quorum K = M, so every round
merges all M.

Reported:
* rounds merged and contributions sent;
* Redis memory (``INFO memory`` ``used_memory``; on the cluster the fullest master) every
  ``--sample-s``: the first sample, the peak and the steady value (median of the last half);
* streams are capped at ``redis.stream_maxlen`` (the shipped 10,000), which is what bounds
  memory; the audit therefore sees the contributions still in the ``up`` streams (every round
  record is kept: far fewer than the cap);
* after the learners stop, the synchronizer is pumped until every pending list is empty
  ("drained"), then the exactly-once audit over every fragment's round records
  (``bench_resilience.audit``): entries settled twice, merged twice, lost (sent and neither
  settled, dead-lettered nor pending).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: find tests/
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_resilience import audit
from bench_synchronizer import bench_source, config, learners_main, warm_malloc

from dd_queue.bus import RedisBus
from dd_queue.clock import SystemClock
from dd_queue.core.codec import CodecSpec, encode
from dd_queue.keys import SYNC_GROUP
from dd_queue.messages import RoundRecord
from dd_queue.synchronizer import Synchronizer
from tests.rediscluster import LocalCluster
from tests.redisproc import RedisProcess

MB = 1e6


def soak(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """One backend's soak; returns its figures."""
    cfg = config(url, args)
    rng = np.random.default_rng(0)
    spec = CodecSpec(args.codec, block_size=256)
    payloads = [
        encode((rng.standard_normal(args.elements) * 1e-3).astype(np.float32), spec)
        for _ in range(args.learners)
    ]
    bus = RedisBus(url, "bench", options=cfg.redis.options())
    sync = Synchronizer(cfg, bus=bus, clock=SystemClock(), source=bench_source(args))
    sync.start()
    spawn = mp.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    parts = [(p.header, bytes(p.payload)) for p in payloads]
    learners = spawn.Process(target=learners_main, args=(url, args, parts, ready, stop))
    learners.start()
    if not ready.wait(120):
        raise RuntimeError("the learners' process did not start")
    memory: list[tuple[float, int]] = []
    started = next_sample = time.monotonic()
    while time.monotonic() - started < args.minutes * 60:
        sync.pump(block_ms=50)
        if time.monotonic() >= next_sample:
            info = bus.memory_info()
            memory.append((time.monotonic() - started, info.used_bytes if info else 0))
            next_sample += args.sample_s
    stop.set()
    learners.join(60)
    drained_at = time.monotonic()
    while time.monotonic() - drained_at < 120:
        sync.pump(block_ms=50)
        if all(
            bus.pending_summary(bus.keys.up(p), SYNC_GROUP).count == 0
            for p in range(args.fragments)
        ):
            break
    drain_s = time.monotonic() - drained_at
    totals: dict[str, int] = {}
    rounds = 0
    limits = cfg.wire.message_limits()
    for p in range(args.fragments):
        records = [
            RoundRecord.from_fields(e.fields, run_id="bench", limits=limits)
            for e in bus.read(bus.keys.rounds(p), count=10_000_000)
        ]
        rounds += sum(r.decision == "merge" for r in records)
        sent = {e.id for e in bus.read(bus.keys.up(p), count=10_000_000)}
        dlq = {e.fields["ddq.dlq.id"].decode() for e in bus.read(bus.keys.dlq(p), count=1_000_000)}
        pending = {e.id for e in bus.read_own_pending(bus.keys.up(p), SYNC_GROUP, "sync-0")}
        for key, n in audit(records, sent, dlq, pending).items():
            totals[key] = totals.get(key, 0) + n
    final = bus.memory_info()
    sync.close()
    bus.close()
    values = [m for _, m in memory]
    steady = statistics.median(values[len(values) // 2 :]) if values else 0
    return {
        "minutes": args.minutes,
        "rounds_merged": rounds,
        "contributions_sent": totals.get("sent", 0),
        "audit": totals,
        "drain_s": drain_s,
        "memory_first_mb": values[0] / MB if values else None,
        "memory_peak_mb": max(values) / MB if values else None,
        "memory_steady_mb": steady / MB,
        "memory_after_mb": final.used_bytes / MB if final else None,
        "memory_samples": [(round(t, 1), m) for t, m in memory],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="per backend")
    parser.add_argument("--learners", type=int, default=64, help="M (default %(default)s)")
    parser.add_argument("--fragments", type=int, default=8, help="P (default %(default)s)")
    parser.add_argument("--elements", type=int, default=16_384, help="per fragment")
    parser.add_argument("--codec", default="int8", choices=["fp32", "bf16", "int8", "int4"])
    parser.add_argument("--backend", choices=["redis", "cluster", "both"], default="both")
    parser.add_argument("--sample-s", type=float, default=5.0, help="memory sample interval")
    parser.add_argument(
        "--round-s", type=float, default=0.1, help="one round opened every (default %(default)s)"
    )
    parser.add_argument(
        "--stream-maxlen",
        type=int,
        default=10_000,
        help="redis.stream_maxlen (default %(default)s, the shipped default): the streams' cap",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.learners < 1 or args.fragments < 1:
        parser.error("--minutes must be > 0, --learners and --fragments >= 1")
    args.fetch_processes, args.merge_threads, args.keys_dir = 0, 1, None
    args.synchronizers, args.commit_replicas = 1, 0
    logging.basicConfig(level=logging.WARNING)
    warm_malloc()
    results: dict[str, dict[str, Any]] = {}
    if args.backend in ("redis", "both"):
        with RedisProcess() as server:
            results["one redis-server"] = soak(server.url, args)
    if args.backend in ("cluster", "both"):
        with LocalCluster() as cluster:
            results["cluster (3 + 3)"] = soak(cluster.url, args)
    print(
        f"M={args.learners} P={args.fragments} {args.elements:,} elements/fragment {args.codec}, "
        f"{args.minutes:g} min per backend\n"
    )
    print("| backend | rounds | sent | settled twice | merged twice | lost | pending | drain s "
          "| memory first / peak / steady / after MB |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, r in results.items():
        a = r["audit"]
        print(
            f"| {name} | {r['rounds_merged']} | {a.get('sent', 0)} | {a.get('settled_twice', 0)} "
            f"| {a.get('merged_twice', 0)} | {a.get('lost', 0)} | {a.get('pending', 0)} "
            f"| {r['drain_s']:.1f} | {r['memory_first_mb']:.1f} / {r['memory_peak_mb']:.1f} / "
            f"{r['memory_steady_mb']:.1f} / {r['memory_after_mb']:.1f} |"
        )
    if args.json:
        print(json.dumps({"settings": vars(args), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
