"""Bandwidth-limited learner: where each codec stops keeping up (DiLoCo's reason to exist).

    sudo python bench/bench_wan.py                       # 1 Gbit, 100 Mbit, 20 Mbit × 4 codecs
    sudo python bench/bench_wan.py --rates 20mbit --codecs int8 int4 --seconds 20 --json

Real processes, as on two hosts: a private redis-server and ``ddq synchronizer`` on the host; one
``ddq learner`` in its own network namespace (``tests/netns.py``), reaching Redis only over a
veth pair whose two directions are limited by ``tc tbf`` (rate, burst 256 kB, latency 50 ms; no
netem on these machines, so no added delay). The model has a few million parameters (gpt-tiny
widened to 4 × 256, 3.4M), P = 4 fragments, H = 20, synchronizer-paced, quorum 1.

Per rate and codec, over ``--seconds`` after the learner's first ``--warmup-steps``:

* **step ratio**: the learner's seconds per inner step ÷ the same learner's with sync off (a run
  with H = 10⁶: it joins, then never contributes), both read from its heartbeats;
* **latency**: round open → the contribution visible (its ``up`` entry's id time), median and
  p90, from the round records;
* **bytes/step**: contribution bytes merged plus global bytes published, ÷ inner steps (the
  link carries both: contributions up, every new global version down);
* **rounds made**: the share of rounds closed in the window that merged the learner's
  contribution (the rest were abandoned at ``round_timeout_s`` waiting for it).

Needs root and iproute2 (``ip netns``, ``tc``). Each point takes ``--seconds`` plus the
processes' start (~10 s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dd_queue.bus import RedisBus
from dd_queue.bus.types import parse_stream_id
from dd_queue.fragment_state import FragmentState
from dd_queue.messages import Heartbeat, MessageLimits, RoundRecord
from tests.netns import NetNamespace, netns_available
from tests.redisproc import RedisProcess

ROOT = Path(__file__).resolve().parents[1]
LIMITS = MessageLimits()
P, H, OFF_H = 4, 20, 1_000_000


def write_config(path: Path, run_id: str, url: str, codec: str, h: int) -> Path:
    raw = {
        "extends": "base.yaml",
        "run": {"run_id": run_id, "log_level": "WARNING"},
        "redis": {
            "url": url,
            "socket_timeout_s": 30.0,
            "blob_socket_timeout_s": 300.0,
            "unavailable_after_s": 60.0,
        },
        "model": {"preset": "gpt-tiny", "n_layers": 4, "d_model": 256, "n_heads": 4},
        "data": {"batch_size": 8, "max_bytes": 1 << 20},
        "wire": {"codec": codec, "block_size": 256},
        "learner": {"device": "cpu", "warmup_steps": 10, "join_timeout_s": 600.0},
        "synchronizer": {
            "n_fragments": P,
            "sync_every_steps": h,
            "round_timeout_s": 30.0,
            "fetch_processes": 0,
        },
        "membership": {"expected_learners": 1, "dead_after_s": 60.0, "stalled_after_s": 30.0},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


def learner_beat(bus: RedisBus) -> Heartbeat | None:
    info = bus.heartbeats().get("L0")
    if info is None:
        return None
    return Heartbeat.from_bytes(info.payload, run_id=bus.keys.run_id, limits=LIMITS)


def counters(bus: RedisBus) -> dict[str, int]:
    total = {"bytes_in": 0, "bytes_out": 0}
    for p in range(P):
        raw = bus.get(bus.keys.state(p))
        if raw is not None:
            state = FragmentState.from_bytes(raw, run_id=bus.keys.run_id, limits=LIMITS)
            for name in total:
                total[name] += state.counters.get(name, 0)
    return total


def rounds_between(bus: RedisBus, t0: float, t1: float) -> list[RoundRecord]:
    out = []
    for p in range(P):
        for entry in bus.read(bus.keys.rounds(p), after_id="0-0", count=100_000):
            record = RoundRecord.from_fields(entry.fields, run_id=bus.keys.run_id, limits=LIMITS)
            if t0 <= record.closed_at_s <= t1:
                out.append(record)
    return out


def run_point(
    ns: NetNamespace,
    server: RedisProcess,
    work: Path,
    *,
    rate: str,
    codec: str,
    h: int,
    seconds: float,
    warmup_steps: int,
) -> dict[str, Any]:
    """One run: synchronizer on the host, the learner in the namespace at ``rate``."""
    run_id = f"wan-{codec}-{rate}-{h}".replace(".", "_")
    url = f"redis://{ns.outside}:{server.port}/0"
    config = write_config(work / f"{run_id}.yaml", run_id, url, codec, h)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ddq = [sys.executable, "-m", "dd_queue.cli"]
    commands = {
        "sync": [*ddq, "synchronizer", "--config", str(config)],
        "learner": [*ns.wrap, *ddq, "learner", "--config", str(config), "--learner-id", "L0"],
    }
    procs = []
    for name, argv in commands.items():
        with (work / f"{run_id}.{name}.log").open("wb") as log:
            procs.append(
                subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
    bus = RedisBus(url, run_id)
    try:
        deadline = time.monotonic() + 600
        while (beat := learner_beat(bus)) is None or beat.step < warmup_steps:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{run_id}: the learner did not start; see {work}")
            time.sleep(0.5)
        wall0, step0, bytes0 = time.time(), beat.step, counters(bus)
        time.sleep(seconds)
        beat = learner_beat(bus)
        assert beat is not None
        wall1, step1, bytes1 = time.time(), beat.step, counters(bus)
        records = rounds_between(bus, wall0, wall1)
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        bus.close()
    steps = max(step1 - step0, 1)
    latencies = [
        parse_stream_id(e.entry_id)[0] / 1e3 - r.opened_at_s
        for r in records
        for e in r.entries
        if e.learner_id == "L0" and e.outcome == "merged"
    ]
    made = sum(1 for r in records if any(c.learner_id == "L0" for c in r.contributors))
    moved = sum(bytes1[k] - bytes0[k] for k in bytes1)
    return {
        "rate": rate,
        "codec": codec,
        "h": h,
        "seconds": wall1 - wall0,
        "steps": steps,
        "step_s": (wall1 - wall0) / steps,
        "rounds_closed": len(records),
        "rounds_made": made,
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "latency_p90_s": (
            statistics.quantiles(latencies, n=10)[-1] if len(latencies) > 1 else None
        ),
        "bytes_per_step": moved / steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit", "20mbit"])
    parser.add_argument("--codecs", nargs="+", default=["fp32", "bf16", "int8", "int4"])
    parser.add_argument("--seconds", type=float, default=30.0, help="measured per point")
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    if not netns_available():
        sys.stderr.write("bench_wan: needs root and iproute2 (ip netns, tc)\n")
        return 2
    started = time.perf_counter()
    points = []
    with tempfile.TemporaryDirectory() as tmp, NetNamespace.create() as ns:
        work = Path(tmp)
        # the bench's own server, reachable only from the namespace's link: no password
        extra = ("--bind", f"127.0.0.1 {ns.outside}", "--protected-mode", "no")
        with RedisProcess(extra_args=extra) as server:
            ns.limit(None)
            timing = {"seconds": args.seconds, "warmup_steps": args.warmup_steps}
            off = run_point(ns, server, work, rate="none", codec="int8", h=OFF_H, **timing)
            for rate in args.rates:
                ns.limit(rate)
                for codec in args.codecs:
                    point = run_point(ns, server, work, rate=rate, codec=codec, h=H, **timing)
                    point["step_ratio"] = point["step_s"] / off["step_s"]
                    points.append(point)
                    print(f"  {rate} {codec}: {point['step_ratio']:.2f}", file=sys.stderr)
    took = time.perf_counter() - started
    print(
        f"gpt-tiny 4 × 256, P = {P}, H = {H}, batch 8 × 128, quorum 1; tc tbf both ways "
        f"(burst 256kb, latency 50ms); sync off: {off['step_s'] * 1e3:.0f} ms/step; {took:.0f} s\n"
    )
    head = ("link", "codec", "step ratio (on ÷ off)", "open → visible p50 / p90 s", "MB/step")
    print("| " + " | ".join(head) + " | rounds made |")
    print("|---|---|---:|---:|---:|---:|")
    for r in points:
        p50 = f"{r['latency_p50_s']:.2f}" if r["latency_p50_s"] is not None else "-"
        p90 = f"{r['latency_p90_s']:.2f}" if r["latency_p90_s"] is not None else "-"
        share = f"{r['rounds_made']}/{r['rounds_closed']}"
        print(
            f"| {r['rate']} | {r['codec']} | {r['step_ratio']:.2f} | {p50} / {p90} | "
            f"{r['bytes_per_step'] / 1e6:.2f} | {share} |"
        )
    if args.json:
        print(json.dumps({"off": off, "points": points, "seconds": took}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
