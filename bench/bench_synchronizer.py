"""Synchronizer throughput: rounds/s, quorum → published latency, payload MB/s vs raw redis-py.

    python bench/bench_synchronizer.py                    # M = 16, P = 24, 1M-element int8, ~60 s
    python bench/bench_synchronizer.py --seconds 10 --learners 4 --fragments 4
    python bench/bench_synchronizer.py --json             # last line: one JSON object
    python bench/bench_synchronizer.py --cluster --synchronizers 3   # on a Redis Cluster

Against a redis-server this script starts on a free loopback port (no persistence):

* **ours**: the real ``Synchronizer`` (``RedisBus`` + ``SystemClock``), pumped in the main
  thread, with quorum K = M (every round merges all M learners; the fast path, no grace wait).
  Simulated learners run in one publisher *process* (``multiprocessing`` spawn, as real
  learners live in other processes, so they share the machine's CPUs but not the
  synchronizer's GIL): for every round opening they publish M int8 contributions of the
  fragment (encoded once per learner up front, so the learners' encoding costs nothing here).
  Each round the synchronizer fetches and decodes M payloads, re-anchors, merges (RDA), takes
  the Nesterov step, stages Θ_p and the momentum (fp32, 8 B/element) and commits.
* **raw**: the same payload bytes through plain redis-py in the same topology: a producer
  process ``XADD``s each payload (inline), the main thread ``XREADGROUP``s (COUNT 16) and
  ``XACK``s them, 512 payloads (~1 s) per run: a sustained rate like ours (until 2026-11-30 it
  was 64 payloads, a 0.13 s burst that read anywhere from 286 to 797 MB/s on this machine);
  run before and after ours, the better of the two counts. It moves bytes and
  does nothing else: per 1 B/element of int8 read, ours also checks and decodes it (4 B/element
  of fp32), merges, steps, and writes 8 B/element of new state (Θ_p and momentum, fp32).

Both clocks start once the other process is up and connected (its start-up is not timed).
Every process of the bench (this one and both children) first allocates and frees one 8 MB
buffer (``warm_malloc``): glibc then serves the 1 MB buffers of payloads from its heap instead of
mapping fresh, page-faulting memory for each, as it does in any process that has handled large
arrays already. Without it a fresh producer process moves ~200 MB/s instead of ~450 (measured),
which would flatter the ratio.

``--cluster`` runs ours on a local Redis Cluster (3 masters + 3 replicas, ``tests/rediscluster``)
instead, with ``--synchronizers N`` synchronizer processes sharing the fragments
(``synchronizer.share: fair``: each owns whole shards), and ``--commit-replicas`` for the
durability switch (every commit waits for that many replicas). raw stays on a single
redis-server: the same baseline. CPU is then reported per MB merged (ms/MB) by role, so the cost
on machines with more cores can be computed from it.

Payload MB/s = contribution payload bytes merged (or moved, for raw) ÷ wall time. Latency of a
round: from its quorum (when the M-th contribution was admitted; the round record's
``quorum_at_s``) to its version's ``down`` entry (the commit; stream id in server ms).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: find tests/

from dd_queue.auth import Auth, principals, write_keys
from dd_queue.bus import RedisBus, ops
from dd_queue.clock import SystemClock
from dd_queue.config import DDQConfig, validate_config
from dd_queue.core.codec import CodecSpec, EncodedTensor, TensorHeader, encode
from dd_queue.messages import Contribution, GlobalFragment, RoundOpen, RoundRecord
from dd_queue.synchronizer import ArraySource, Synchronizer
from tests.rediscluster import LocalCluster
from tests.redisproc import RedisProcess

MB = 1e6


def warm_malloc() -> None:
    """Free one 8 MB allocation: glibc's mmap threshold rises to 8 MB, so later buffers up to
    that size come from the heap (no page faults per payload; see the module doc)."""
    buffer = bytearray(8 << 20)
    del buffer


def config(url: str, args: argparse.Namespace) -> DDQConfig:
    return validate_config(
        {
            "run": {"run_id": "bench", "log_level": "WARNING"},
            "redis": {
                "url": url,
                "stream_maxlen": getattr(args, "stream_maxlen", 100_000),
                "rounds_maxlen": getattr(args, "rounds_maxlen", 100_000),
                "commit_replicas": getattr(args, "commit_replicas", 0),
            },
            "wire": {"codec": args.codec},
            "synchronizer": {
                "n_fragments": args.fragments,
                "sync_every_steps": args.fragments,
                "quorum": args.learners,
                "round_timeout_s": 120.0,
                "initial_step_time_s": getattr(args, "round_s", 0.005),  # H = P: per round
                "version_ring": 2,
                "lease_ttl_s": 30.0,
                "fetch_processes": args.fetch_processes,
                "merge_threads": args.merge_threads,
                "share": "fair" if getattr(args, "synchronizers", 1) > 1 else "greedy",
            },
            "membership": {"expected_learners": args.learners},
            "auth": {"keys_dir": getattr(args, "keys_dir", None)},
        }
    )


def learners_main(
    url: str,
    args: argparse.Namespace,
    payloads: list[tuple[TensorHeader, bytes]],
    ready: Any,
    stop: Any,
) -> None:
    """The learners' process: set ``ready`` once connected, answer openings until ``stop``."""
    warm_malloc()
    cfg = config(url, args)
    learners = Learners(cfg, url, [EncodedTensor(h, memoryview(b)) for h, b in payloads])
    ready.set()
    learners.run(stop)


class Learners:
    """M simulated learners: answer every round opening with M pre-encoded contributions."""

    def __init__(self, cfg: DDQConfig, url: str, payloads: list[EncodedTensor]) -> None:
        self.cfg, self.payloads = cfg, payloads
        self.digest = cfg.run_digest  # a property that hashes the whole config: once
        self.bus = RedisBus(url, cfg.run.run_id, options=cfg.redis.options())
        self.bus.get(self.bus.keys.state(0))  # connected
        # each simulated learner signs with its own key (--signed), as real ones do
        self.auths = [
            Auth.load(cfg.auth, cfg.run.run_id, f"learner.L{m}") for m in range(len(payloads))
        ]

    def run(self, stop: Any) -> None:
        limits, after = self.cfg.wire.message_limits(), "0-0"
        while not stop.is_set():
            for entry in self.bus.read(self.bus.keys.opened_rounds(), after_id=after, block_ms=100):
                after = entry.id
                opening = RoundOpen.from_fields(entry.fields, run_id="bench", limits=limits)
                self.answer(opening.fragment_id, opening.round_id)
        self.bus.close()

    def answer(self, fragment: int, round_id: int) -> None:
        latest = ops.latest_global(self.bus, fragment)
        assert latest is not None
        limits = self.cfg.wire.message_limits()
        base = GlobalFragment.from_fields(latest.fields, run_id="bench", limits=limits).version
        for m, encoded in enumerate(self.payloads):
            msg = Contribution(
                run_id="bench",
                config_digest=self.digest,
                learner_id=f"L{m}",
                fragment_id=fragment,
                round_id=round_id,
                base_version=base,
                n_steps=24,
                n_tokens=24 * 4096,
                tensor=encoded.header,
                created_at_s=time.time(),
            )
            ops.send_contribution(
                self.bus,
                msg,
                encoded,
                ttl_s=600,
                maxlen=self.cfg.redis.stream_maxlen,  # as real learners cap the up streams
                auth=self.auths[m],
            )


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads) so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int, int]:
    """(all, idle + iowait, steal) CPU ticks of the machine so far (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values[:8]), values[3] + values[4], values[7]


def fetch_children(parent: int | None = None) -> list[int]:
    """Process ids of the fetch processes (``dd_queue.synchronizer.fetchers``) of ``parent``
    (default: this process)."""
    parent = os.getpid() if parent is None else parent
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue  # gone meanwhile
        if ppid == parent and b"dd_queue.synchronizer.fetchers" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


class CpuMeter:
    """CPU seconds used by each role's processes, and the machine's idle and steal shares,
    between ``__init__`` and ``stop``: where the machine's time goes in a round."""

    def __init__(self, roles: dict[str, list[int]]) -> None:
        self.roles = roles
        self._start = {role: sum(map(cpu_seconds, pids)) for role, pids in roles.items()}
        self.started_s = dict(self._start)
        self._machine = machine_ticks()

    def stop(self, rounds: int) -> dict[str, float]:
        """ms of CPU per merged round by role, then ``idle_pct`` and ``steal_pct``."""
        used = {role: sum(map(cpu_seconds, pids)) for role, pids in self.roles.items()}
        per_round = {
            role: 1000 * (used[role] - self._start[role]) / max(rounds, 1) for role in self.roles
        }
        total, idle, steal = (b - a for a, b in zip(self._machine, machine_ticks(), strict=True))
        return {
            **per_round,
            "total": sum(per_round.values()),
            "idle_pct": 100 * idle / max(total, 1),
            "steal_pct": 100 * steal / max(total, 1),
        }


def bench_source(args: argparse.Namespace) -> ArraySource:
    rng = np.random.default_rng(0)
    return ArraySource(
        {
            f"block{p}.w": rng.standard_normal(args.elements).astype(np.float32) * 0.02
            for p in range(args.fragments)
        },
        origin="bench",
    )


def sync_main(url: str, args: argparse.Namespace, sid: str, ready: Any, stop: Any) -> None:
    """One synchronizer process (``--synchronizers`` > 1): pump until ``stop``."""
    warm_malloc()
    logging.basicConfig(level=logging.WARNING)
    cfg = config(url, args)
    bus = RedisBus(url, "bench", options=cfg.redis.options())
    sync = Synchronizer(
        cfg, bus=bus, clock=SystemClock(), source=bench_source(args), synchronizer_id=sid
    )
    sync.start()
    ready.set()
    while not stop.is_set():
        sync.pump(block_ms=50)
    sync.close()
    bus.close()


def run_ours(url: str, args: argparse.Namespace, redis_pids: list[int]) -> dict[str, Any]:
    cfg = config(url, args)
    rng = np.random.default_rng(0)
    rng.standard_normal(args.elements * args.fragments)  # the source's draws (same payloads)
    spec = CodecSpec(args.codec, block_size=256)
    payloads = [
        encode((rng.standard_normal(args.elements) * 1e-3).astype(np.float32), spec)
        for _ in range(args.learners)
    ]
    bus = RedisBus(url, "bench", options=cfg.redis.options())
    spawn = mp.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    n_syncs = getattr(args, "synchronizers", 1)
    sync, syncs = None, []
    if n_syncs == 1:  # in this process, as always
        sync = Synchronizer(cfg, bus=bus, clock=SystemClock(), source=bench_source(args))
        sync.start()
    else:
        for i in range(n_syncs):
            up = spawn.Event()
            proc = spawn.Process(target=sync_main, args=(url, args, f"sync-{i}", up, stop))
            proc.start()
            if not up.wait(120):
                raise RuntimeError(f"synchronizer process {i} did not start")
            syncs.append(proc)
    parts = [(p.header, bytes(p.payload)) for p in payloads]
    learners = spawn.Process(target=learners_main, args=(url, args, parts, ready, stop))
    learners.start()
    if not ready.wait(60):
        raise RuntimeError("the learners' process did not start")
    assert learners.pid is not None
    sync_pids = [os.getpid()] if sync is not None else [p.pid for p in syncs if p.pid]
    roles = {
        "synchronizer": sync_pids,
        "fetch_processes": [c for pid in sync_pids for c in fetch_children(pid)],
        "redis_server": redis_pids,
        "learners": [learners.pid],
    }
    bytes_before = merged_payload_bytes(bus, cfg)
    meter = CpuMeter(roles)
    started = time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        if sync is not None:
            sync.pump(block_ms=50)
        else:
            time.sleep(0.05)
    elapsed = time.perf_counter() - started
    merged_bytes = merged_payload_bytes(bus, cfg) - bytes_before
    cpu_s = {role: sum(map(cpu_seconds, pids)) for role, pids in roles.items()}
    rounds, latencies = merged_rounds(bus, cfg)
    cpu = meter.stop(len(rounds))
    cpu_ms_per_mb = {
        role: 1000 * (cpu_s[role] - meter.started_s[role]) / max(merged_bytes / MB, 1e-9)
        for role in roles
    }
    stop.set()
    learners.join(30)
    for proc in syncs:
        proc.join(60)
        if proc.is_alive():  # never outlive the bench's servers
            proc.terminate()
            proc.join(10)
    if sync is not None:
        sync.close()
    bus.close()
    return {
        "rounds": len(rounds),
        "seconds": elapsed,
        "rounds_s": len(rounds) / elapsed,
        "payload_mb_s": merged_bytes / MB / elapsed,
        "latency_p50_ms": float(np.percentile(latencies, 50)) if latencies else float("nan"),
        "latency_p99_ms": float(np.percentile(latencies, 99)) if latencies else float("nan"),
        "payload_mb_per_round": args.learners * payloads[0].payload.nbytes / MB,
        "cpu_ms_per_round": cpu,
        "cpu_ms_per_mb": cpu_ms_per_mb,
        "synchronizers": n_syncs,
    }


def merged_payload_bytes(bus: RedisBus, cfg: DDQConfig) -> int:
    """Contribution payload bytes merged so far, over every fragment (their states' counters;
    0 for a fragment not created yet)."""
    total = 0
    for p in range(cfg.synchronizer.n_fragments):
        if bus.get(bus.keys.state(p)) is not None:
            total += bus_state_counter(bus, cfg, p, "bytes_in")
    return total


def bus_state_counter(bus: RedisBus, cfg: DDQConfig, p: int, name: str) -> int:
    from dd_queue.synchronizer import FragmentState

    raw = bus.get(bus.keys.state(p))
    assert raw is not None
    state = FragmentState.from_bytes(raw, run_id="bench", limits=cfg.wire.message_limits())
    return state.counters.get(name, 0)


def merged_rounds(bus: RedisBus, cfg: DDQConfig) -> tuple[list[RoundRecord], list[float]]:
    """Every merged round record and its quorum → published latency (ms)."""
    limits, rounds, latencies = cfg.wire.message_limits(), [], []
    for p in range(cfg.synchronizer.n_fragments):
        published = {
            GlobalFragment.from_fields(e.fields, run_id="bench", limits=limits).version: int(
                e.id.split("-")[0]
            )
            for e in bus.read(bus.keys.down(p), count=100_000)
        }
        for e in bus.read(bus.keys.rounds(p), count=100_000):
            record = RoundRecord.from_fields(e.fields, run_id="bench", limits=limits)
            if record.decision == "merge" and record.quorum_at_s is not None:
                rounds.append(record)
                latencies.append(published[record.version_after] - record.quorum_at_s * 1000)
    return rounds, latencies


def produce_raw(url: str, stream: str, payload: bytes, n: int, ready: Any, go: Any) -> None:
    """The raw producer's process: ``XADD`` ``payload`` ``n`` times once ``go`` is set."""
    warm_malloc()
    producer = redis.Redis.from_url(url)
    producer.ping()
    ready.set()
    go.wait()
    for _ in range(n):
        producer.xadd(stream, {"m": b"x" * 160, "d": payload})
    producer.close()


def run_raw(
    url: str, payload: bytes, n: int, tag: str, redis_pid: int, per_round: int
) -> tuple[float, dict[str, float]]:
    """MB/s of ``n`` payloads through plain redis-py ``XADD`` (payload inline) and
    ``XREADGROUP`` + ``XACK``: a producer process against a consumer (this thread); and the
    CPU ms this took per ``per_round`` payloads (a round's worth), by process."""
    stream, client = f"raw:{tag}:up", redis.Redis.from_url(url)
    client.xgroup_create(stream, "g", id="0", mkstream=True)
    spawn = mp.get_context("spawn")
    ready, go = spawn.Event(), spawn.Event()
    process = spawn.Process(target=produce_raw, args=(url, stream, payload, n, ready, go))
    process.start()
    if not ready.wait(60):
        raise RuntimeError("the raw producer's process did not start")
    assert process.pid is not None
    meter = CpuMeter(
        {"consumer": [os.getpid()], "producer": [process.pid], "redis_server": [redis_pid]}
    )
    started = time.perf_counter()
    go.set()
    done = 0
    while done < n:
        reply: Any = client.xreadgroup("g", "c", {stream: ">"}, count=16, block=2000)
        batch = reply[0][1] if reply else []
        if any(len(fields[b"d"]) != len(payload) for _, fields in batch):
            raise RuntimeError("raw XREADGROUP returned a payload of the wrong size")
        if batch:
            client.xack(stream, "g", *[entry_id for entry_id, _ in batch])
        done += len(batch)
    elapsed = time.perf_counter() - started
    cpu = meter.stop(n // per_round)  # (the producer has sent everything; it is exiting)
    process.join(30)
    client.delete(stream)
    client.close()
    return n * len(payload) / MB / elapsed, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learners", type=int, default=16, help="M (default %(default)s)")
    parser.add_argument("--fragments", type=int, default=24, help="P (default %(default)s)")
    parser.add_argument("--elements", type=int, default=1 << 20, help="per fragment")
    parser.add_argument("--codec", default="int8", choices=["fp32", "bf16", "int8", "int4"])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of our run")
    parser.add_argument(
        "--fetch-processes",
        type=int,
        default=2,
        help="synchronizer.fetch_processes (default %(default)s; 0 = one fetch thread)",
    )
    parser.add_argument(
        "--merge-threads",
        type=int,
        default=0,
        help="synchronizer.merge_threads (default %(default)s: the cores the fetch processes "
        "leave, 1 to 4; 1 = the loop's thread alone)",
    )
    parser.add_argument(
        "--raw-payloads",
        type=int,
        default=512,
        help="payloads per raw run (default %(default)s: ~1 s, a sustained rate, not a burst)",
    )
    parser.add_argument(
        "--signed",
        action="store_true",
        help="run ours again with signed messages (dd_queue.auth) and report the cost",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="run ours on a local Redis Cluster (3 masters + 3 replicas); raw stays on one server",
    )
    parser.add_argument(
        "--synchronizers",
        type=int,
        default=1,
        help="synchronizer processes sharing the fragments (share: fair; default %(default)s, "
        "in this process)",
    )
    parser.add_argument(
        "--commit-replicas",
        type=int,
        default=0,
        help="redis.commit_replicas: every commit waits for this many replicas (--cluster)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    args.keys_dir = None
    if args.synchronizers < 1 or (args.signed and args.synchronizers > 1):
        parser.error("--synchronizers must be >= 1 (and 1 with --signed)")
    if args.commit_replicas and not args.cluster:
        parser.error("--commit-replicas needs --cluster (the bench's single server has no replica)")
    logging.basicConfig(level=logging.WARNING)
    warm_malloc()
    wall = time.perf_counter()
    with RedisProcess() as server:
        probe = server.client()
        version = str(probe.info("server").get("redis_version", "?"))
        probe.close()
        nbytes = encode(np.zeros(args.elements, np.float32), CodecSpec(args.codec)).payload.nbytes
        payload = np.random.default_rng(1).bytes(nbytes)
        n_raw = args.raw_payloads
        assert server.pid is not None
        raw_before, cpu_before = run_raw(server.url, payload, n_raw, "a", server.pid, args.learners)
        if args.cluster:
            with LocalCluster() as cluster:
                pids = [n.pid for n in cluster.nodes if n.pid is not None]
                ours = run_ours(cluster.url, args, pids)
                ours["slot_spread"] = {
                    str(m.port): sum(
                        cluster.master_of_key(f"ddq:bench:{{bench.f{p}}}:state") == m.port
                        for p in range(args.fragments)
                    )
                    for m in cluster.masters()
                }
        else:
            ours = run_ours(server.url, args, [server.pid])
        signed = None
        if args.signed:
            flush = server.client()
            flush.flushall()  # the bench's own server: the signed run starts a fresh run
            flush.close()
            with tempfile.TemporaryDirectory() as keys:
                write_keys(Path(keys), "bench", principals([f"L{m}" for m in range(args.learners)]))
                signed = run_ours(
                    server.url, argparse.Namespace(**{**vars(args), "keys_dir": keys}), [server.pid]
                )
        raw_after, cpu_after = run_raw(server.url, payload, n_raw, "b", server.pid, args.learners)
    raw = max(raw_before, raw_after)
    raw_cpu = cpu_before if raw_before >= raw_after else cpu_after
    ratio = ours["payload_mb_s"] / raw
    took = time.perf_counter() - wall
    print(f"redis-server {version}; M={args.learners} P={args.fragments} ", end="")
    print(f"{args.elements:,} elements/fragment, {args.codec}, ", end="")
    print(f"{args.fetch_processes} fetch processes, {args.merge_threads} merge threads; ", end="")
    print(f"raw: {n_raw} payloads a run; {took:.0f} s")
    if args.cluster:
        print(
            f"ours on a Redis Cluster (3 masters + 3 replicas; fragments per master "
            f"{ours['slot_spread']}), {args.synchronizers} synchronizer(s), "
            f"commit_replicas {args.commit_replicas}"
        )
    print()
    print("| rounds | rounds/s | quorum→published p50 / p99 ms | payload MB/s | raw MB/s ", end="")
    print("| ratio | target |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    print(
        f"| {ours['rounds']} | {ours['rounds_s']:.2f} | {ours['latency_p50_ms']:.0f} / "
        f"{ours['latency_p99_ms']:.0f} | {ours['payload_mb_s']:.0f} | {raw:.0f} | "
        f"{ratio:.0%} | ≥ 50% {'PASS' if ratio >= 0.5 else 'FAIL'} |"
    )
    cpu = ours["cpu_ms_per_round"]
    print(
        "\nCPU ms per merged round (this process = the synchronizer's loop; machine idle, steal)\n"
    )
    print("| synchronizer | fetch processes | redis-server | learners | total | idle | steal |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {cpu['synchronizer']:.1f} | {cpu['fetch_processes']:.1f} | {cpu['redis_server']:.1f} "
        f"| {cpu['learners']:.1f} | {cpu['total']:.1f} | {cpu['idle_pct']:.0f}% "
        f"| {cpu['steal_pct']:.0f}% |"
    )
    if signed is not None:
        cost = signed["payload_mb_s"] / ours["payload_mb_s"]
        print("\nSigned messages (Ed25519: every contribution's entry and blob checked, every")
        print("global fragment signed), the same run again\n")
        print(
            "| | rounds/s | p50 / p99 ms | payload MB/s | sync CPU ms/round | fetch CPU ms/round |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in (("unsigned", ours), ("signed", signed)):
            print(
                f"| {name} | {r['rounds_s']:.2f} | {r['latency_p50_ms']:.0f} / "
                f"{r['latency_p99_ms']:.0f} | {r['payload_mb_s']:.0f} | "
                f"{r['cpu_ms_per_round']['synchronizer']:.1f} | "
                f"{r['cpu_ms_per_round']['fetch_processes']:.1f} |"
            )
        print(f"\nsigned ÷ unsigned payload MB/s: {cost:.2f}")
    per_mb = ours["cpu_ms_per_mb"]
    print("\nCPU ms per MB of contribution payload merged, by role\n")
    print("| synchronizer(s) | fetch processes | redis-server(s) | learners |")
    print("|---:|---:|---:|---:|")
    print(
        f"| {per_mb['synchronizer']:.2f} | {per_mb['fetch_processes']:.2f} | "
        f"{per_mb['redis_server']:.2f} | {per_mb['learners']:.2f} |"
    )
    print(f"\nraw, CPU ms per {args.learners} payloads (the better raw run)\n")
    print("| consumer | producer | redis-server | total | idle | steal |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {raw_cpu['consumer']:.1f} | {raw_cpu['producer']:.1f} | "
        f"{raw_cpu['redis_server']:.1f} | {raw_cpu['total']:.1f} | {raw_cpu['idle_pct']:.0f}% "
        f"| {raw_cpu['steal_pct']:.0f}% |"
    )
    if args.json:
        print(
            json.dumps(
                {
                    **ours,
                    "raw_mb_s": raw,
                    "raw_before_mb_s": raw_before,
                    "raw_after_mb_s": raw_after,
                    "raw_cpu_ms_per_round": raw_cpu,
                    "ratio": ratio,
                    "redis_version": version,
                    "learners": args.learners,
                    "fragments": args.fragments,
                    "elements": args.elements,
                    "codec": args.codec,
                    "fetch_processes": args.fetch_processes,
                    "merge_threads": args.merge_threads,
                    "raw_payloads": n_raw,
                    "signed": signed,
                    "cluster": args.cluster,
                    "commit_replicas": args.commit_replicas,
                    "signed_ratio": signed["payload_mb_s"] / ours["payload_mb_s"]
                    if signed
                    else None,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
