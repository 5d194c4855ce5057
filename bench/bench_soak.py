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
  ``--sample-s``: the first sample, the peak, the steady value (median of the last half) and
  the growth over the last half (MB/min: a plateau is ~0);
* memory is bounded by the caps: each stream is trimmed to ``redis.stream_maxlen`` (the shipped
  10,000) and each fragment's round records to ``redis.rounds_maxlen``. At this rate the ``up``
  streams reach their cap in ~2 minutes but the round records (~12.8 kB each with 64
  contributors) would reach the shipped 1,000 only after ~15 minutes, so the soak keeps 200
  (``--rounds-maxlen``) to see the plateau inside 10 minutes; from the measured bytes per entry
  it also prints the bound at the shipped caps;
* the exactly-once audit over every contribution of the run: the bench follows the ``up`` and
  ``rounds`` streams every second while they are trimmed behind it (a stream trimmed past the
  bench's position counts as a gap, expected 0). After the learners stop, the synchronizer is
  pumped until every pending list is empty ("drained"); then entries settled twice, merged
  twice and lost (sent and neither settled, dead-lettered nor pending).
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

import redis
from bench_resilience import Tally
from bench_synchronizer import bench_source, config, learners_main, warm_malloc

from dd_queue.bus import RedisBus
from dd_queue.bus.base import Bus
from dd_queue.clock import SystemClock
from dd_queue.config import DDQConfig
from dd_queue.core.codec import CodecSpec, encode
from dd_queue.fragment_state import FragmentState
from dd_queue.keys import SYNC_GROUP
from dd_queue.messages import MessageLimits, RoundRecord
from dd_queue.synchronizer import Synchronizer
from tests.rediscluster import LocalCluster
from tests.redisproc import RedisProcess

MB = 1e6


def _id(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


class Follower:
    """Reads what is new in each fragment's ``up`` and ``rounds`` streams: the ids sent and
    a :class:`Tally` of the round records, per fragment (stream ids are per stream)."""

    def __init__(self, bus: Bus, fragments: int, limits: MessageLimits) -> None:
        self.bus, self.fragments, self.limits = bus, fragments, limits
        self.sent: list[set[str]] = [set() for _ in range(fragments)]
        self.tallies = [Tally() for _ in range(fragments)]
        self.after: dict[str, str] = {}
        self.gaps = 0

    def _new(self, stream: str) -> list[Any]:
        after = self.after.get(stream, "0-0")
        first = self.bus.read(stream, count=1)
        if after != "0-0" and first and _id(first[0].id) > _id(after):
            self.gaps += 1  # trimmed past us: entries may have gone unseen
        out: list[Any] = []
        while entries := self.bus.read(stream, after_id=after, count=5000):
            out += entries
            after = entries[-1].id
        self.after[stream] = after
        return out

    def poll(self) -> None:
        for p in range(self.fragments):
            self.sent[p].update(e.id for e in self._new(self.bus.keys.up(p)))
            self.tallies[p].add(
                RoundRecord.from_fields(e.fields, run_id="bench", limits=self.limits)
                for e in self._new(self.bus.keys.rounds(p))
            )


def stream_families(bus: Bus, fragments: int) -> dict[str, list[str]]:
    """The run's streams by family (the dead-letter streams stay empty here)."""
    return {
        "up": [bus.keys.up(p) for p in range(fragments)],
        "rounds": [bus.keys.rounds(p) for p in range(fragments)],
        "down": [bus.keys.down(p) for p in range(fragments)],
        "events": [bus.keys.events()],
        "open": [bus.keys.opened_rounds()],
    }


def used_bytes(raw: Any) -> int:
    """``used_memory`` of the server, or of every master of a cluster together."""
    if isinstance(raw, redis.RedisCluster):
        info = raw.info("memory", target_nodes=redis.RedisCluster.PRIMARIES)
        return sum(int(node["used_memory"]) for node in info.values())
    return int(raw.info("memory")["used_memory"])


def memory_of(raw: Any, families: dict[str, list[str]]) -> dict[str, tuple[int, int]]:
    """``family → (bytes, entries)`` (``MEMORY USAGE … SAMPLES 0``, ``XLEN``)."""
    return {
        name: (
            sum(raw.memory_usage(k, samples=0) or 0 for k in keys),
            sum(raw.xlen(k) for k in keys),
        )
        for name, keys in families.items()
    }


def bound_mb(per_entry: dict[str, float], fragments: int, stream_maxlen: int, rounds: int) -> float:
    """Stream memory once every stream is at its cap (``MAXLEN ~`` may keep one node, 100
    entries, more)."""
    caps = {
        "up": fragments * (stream_maxlen + 100),
        "rounds": fragments * (rounds + 100),
        "down": fragments * (stream_maxlen + 100),
        "events": stream_maxlen + 100,
        "open": stream_maxlen + 100,
    }
    return sum(per_entry[name] * n for name, n in caps.items()) / MB


def soak(url: str, raw: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One backend's soak; returns its figures (``raw``: a redis-py client of the backend)."""
    cfg = config(url, args)
    rng = np.random.default_rng(0)
    spec = CodecSpec(args.codec, block_size=256)
    payloads = [
        encode((rng.standard_normal(args.elements) * 1e-3).astype(np.float32), spec)
        for _ in range(args.learners)
    ]
    bus = RedisBus(url, "bench", options=cfg.redis.options())
    follower = Follower(bus, args.fragments, cfg.wire.message_limits())
    sync = Synchronizer(cfg, bus=bus, clock=SystemClock(), source=bench_source(args))
    sync.start()
    spawn = mp.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    parts = [(p.header, bytes(p.payload)) for p in payloads]
    learners = spawn.Process(target=learners_main, args=(url, args, parts, ready, stop))
    learners.start()
    if not ready.wait(120):
        raise RuntimeError("the learners' process did not start")
    families = stream_families(bus, args.fragments)
    memory: list[tuple[float, int, int]] = []  # (s, used bytes, of which streams)
    started = next_sample = next_follow = time.monotonic()
    while time.monotonic() - started < args.minutes * 60:
        sync.pump(block_ms=50)
        now = time.monotonic()
        if now >= next_follow:
            follower.poll()
            next_follow += 1.0
        if now >= next_sample:
            streams = sum(b for b, _ in memory_of(raw, families).values())
            memory.append((now - started, used_bytes(raw), streams))
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
    follower.poll()
    totals: dict[str, int] = {}
    for p in range(args.fragments):
        dlq = {e.fields["ddq.dlq.id"].decode() for e in bus.read(bus.keys.dlq(p), count=1_000_000)}
        pending = {e.id for e in bus.read_own_pending(bus.keys.up(p), SYNC_GROUP, "sync-0")}
        for key, n in follower.tallies[p].audit(follower.sent[p], dlq, pending).items():
            totals[key] = totals.get(key, 0) + n
    rounds = merged_rounds(bus, cfg)
    at_end = memory_of(raw, families)
    per_entry = {name: b / n if n else 0.0 for name, (b, n) in at_end.items()}
    final = used_bytes(raw)
    sync.close()
    bus.close()
    return {
        "minutes": args.minutes,
        "rounds_merged": rounds,
        "contributions_sent": totals.get("sent", 0),
        "audit": {**totals, "gaps": follower.gaps},
        "drain_s": drain_s,
        "used": _series([(t, u) for t, u, _ in memory]),
        "not_streams": _series([(t, u - st) for t, u, st in memory]),
        "used_after_mb": final / MB,
        "entries_at_end": {name: n for name, (_, n) in at_end.items()},
        "bytes_per_entry": per_entry,
        "stream_bound_mb": bound_mb(
            per_entry, args.fragments, args.stream_maxlen, args.rounds_maxlen
        ),
        "stream_bound_shipped_mb": bound_mb(per_entry, args.fragments, 10_000, 1_000),
        "memory_samples": [(round(t, 1), u, st) for t, u, st in memory],
    }


def _series(samples: list[tuple[float, int]]) -> dict[str, float | None]:
    """First, peak, steady (median of the last half) MB and the last half's growth (MB/min)."""
    if not samples:
        return {"first_mb": None, "peak_mb": None, "steady_mb": None, "growth_mb_per_min": None}
    half = samples[len(samples) // 2 :]
    span_min = (half[-1][0] - half[0][0]) / 60
    return {
        "first_mb": samples[0][1] / MB,
        "peak_mb": max(v for _, v in samples) / MB,
        "steady_mb": statistics.median(v for _, v in half) / MB,
        "growth_mb_per_min": (half[-1][1] - half[0][1]) / MB / span_min if span_min else None,
    }


def merged_rounds(bus: Bus, cfg: DDQConfig) -> int:
    """Rounds merged over the run, from the fragments' counters (the records are trimmed)."""
    limits, total = cfg.wire.message_limits(), 0
    for p in range(cfg.synchronizer.n_fragments):
        raw = bus.get(bus.keys.state(p))
        if raw is not None:
            state = FragmentState.from_bytes(raw, run_id="bench", limits=limits)
            total += state.counters.get("rounds_merged", 0)
    return total


def _cell(series: dict[str, float | None]) -> str:
    if series["first_mb"] is None:
        return "–"
    growth = series["growth_mb_per_min"]
    return f"{series['first_mb']:.1f} / {series['peak_mb']:.1f} / {series['steady_mb']:.1f}, " + (
        "–" if growth is None else f"{growth:+.2f}"
    )


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
    parser.add_argument(
        "--rounds-maxlen",
        type=int,
        default=200,
        help="redis.rounds_maxlen (default %(default)s; shipped 1,000, reached after ~15 min "
        "at this rate): round records kept per fragment",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.learners < 1 or args.fragments < 1:
        parser.error("--minutes must be > 0, --learners and --fragments >= 1")
    if min(args.stream_maxlen, args.rounds_maxlen) < 16:
        parser.error("--stream-maxlen and --rounds-maxlen must be >= 16 (the config's floor)")
    args.fetch_processes, args.merge_threads, args.keys_dir = 0, 1, None
    args.synchronizers, args.commit_replicas = 1, 0
    logging.basicConfig(level=logging.WARNING)
    warm_malloc()
    results: dict[str, dict[str, Any]] = {}
    if args.backend in ("redis", "both"):
        with RedisProcess() as server:
            raw = redis.Redis.from_url(server.url)
            results["one redis-server"] = soak(server.url, raw, args)
            raw.close()
    if args.backend in ("cluster", "both"):
        with LocalCluster() as cluster:
            raw = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
            results["cluster (3 + 3)"] = soak(cluster.url, raw, args)
            raw.close()
    print(
        f"M={args.learners} P={args.fragments} {args.elements:,} elements/fragment {args.codec}, "
        f"{args.minutes:g} min per backend, stream_maxlen {args.stream_maxlen:,}, "
        f"rounds_maxlen {args.rounds_maxlen:,}\n"
    )
    print("| backend | rounds | sent | settled twice | merged twice | lost | gaps | pending "
          "| drain s | used MB first / peak / steady, growth MB/min | not streams MB first / "
          "peak / steady, growth | streams' bound MB: these caps / shipped |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
    for name, r in results.items():
        a = r["audit"]
        print(
            f"| {name} | {r['rounds_merged']} | {a.get('sent', 0)} | {a.get('settled_twice', 0)} "
            f"| {a.get('merged_twice', 0)} | {a.get('lost', 0)} | {a['gaps']} "
            f"| {a.get('pending', 0)} | {r['drain_s']:.1f} | {_cell(r['used'])} "
            f"| {_cell(r['not_streams'])} "
            f"| {r['stream_bound_mb']:.0f} / {r['stream_bound_shipped_mb']:.0f} |"
        )
    for name, r in results.items():
        sizes = r["bytes_per_entry"].items()
        line = ", ".join(f"{k} {r['entries_at_end'][k]:,} × {v:,.0f} B" for k, v in sizes)
        print(f"\n{name}, stream entries at the end: {line}")
    if args.json:
        print(json.dumps({"settings": vars(args), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
