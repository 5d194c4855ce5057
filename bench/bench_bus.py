"""Contribution throughput through ``RedisBus`` versus raw redis-py on the same private server.

    python bench/bench_bus.py                       # 1, 4, 16, 64 MB payloads, ~30-60 s
    python bench/bench_bus.py --sizes 4,16 --total-mb 128 --repeats 5
    python bench/bench_bus.py --json                # last line: one JSON object

Per message, both sides move the same bytes:

* bus: ``ops.publish_contribution`` (blob chunks ``SET PX`` + ``XADD`` ref, one pipeline), then
  ``read_group`` → ``ops.fetch_blob`` → ``ack(delete_keys=chunks)``;
* raw: a ``SET EX`` + ``XADD`` pipeline, then ``XREADGROUP`` → ``GET`` → ``XACK`` + ``UNLINK``
  pipeline, on one default redis-py client.

By default the raw side is redis-py as configured out of the box, whose hiredis packer copies
every payload into one buffer; the bus's payload client sends payloads without that copy, which
is most of why it can beat raw. ``--raw-zero-copy`` gives raw the same packer, so the ratio then
shows only the bus's own overhead (chunking, separate connections, parsing).

Write and read phases are timed separately; e2e is their sum. Each cell is the best of
``--repeats`` runs, bus and raw interleaved, against a redis-server this script starts on a free
loopback port (no persistence) and stops at the end. Random payloads (incompressible).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: find tests/

from dd_queue.bus import RedisBus, RedisOptions, ops
from dd_queue.bus._redis_conn import _zero_copy_packer
from dd_queue.keys import SYNC_GROUP
from tests.redisproc import RedisProcess

MiB = 1024 * 1024
META = b"x" * 160  # a realistic msgpack envelope size for the reference entry


@dataclass
class Cell:
    """Best-of-N timings of one (variant, size)."""

    variant: str
    size_mb: float
    messages: int
    write_s: float
    read_s: float

    @property
    def total_mb(self) -> float:
        return self.size_mb * self.messages

    def mb_s(self, seconds: float) -> float:
        return self.total_mb / seconds if seconds > 0 else float("inf")


def _bus_run(bus: RedisBus, payload: bytes, n: int, run: int) -> tuple[float, float]:
    stream = bus.keys.up(run)
    bus.ensure_group(stream, SYNC_GROUP)
    write_s = read_s = 0.0
    for i in range(n):
        t0 = time.perf_counter()
        ops.publish_contribution(
            bus, fragment_id=run, round_id=i, learner_id="L0", payload=payload,
            fields={"m": META}, ttl_s=600, maxlen=10_000,
        )  # fmt: skip
        t1 = time.perf_counter()
        [entry] = bus.read_group(stream, SYNC_GROUP, "sync-0", count=1, block_ms=2000)
        data = ops.fetch_blob(bus, entry)
        bus.ack(stream, SYNC_GROUP, [entry.id], delete_keys=ops.blob_ref(entry).chunk_keys())
        t2 = time.perf_counter()
        if len(data) != len(payload):
            raise RuntimeError("bus returned a payload of the wrong size")
        write_s, read_s = write_s + (t1 - t0), read_s + (t2 - t1)
    bus.delete([stream])
    return write_s, read_s


def _raw_run(client: redis.Redis, payload: bytes, n: int, run: int) -> tuple[float, float]:
    stream = f"bench:raw:{run}:up"
    client.xgroup_create(stream, "g", id="0", mkstream=True)
    write_s = read_s = 0.0
    for i in range(n):
        key = f"bench:raw:{run}:blob:{i}"
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        pipe.set(key, payload, ex=600)
        pipe.xadd(stream, {"m": META, "blob": key}, maxlen=10_000)
        pipe.execute()
        t1 = time.perf_counter()
        reply: Any = client.xreadgroup("g", "c", {stream: ">"}, count=1, block=2000)
        entry_id, fields = reply[0][1][0]
        data: Any = client.get(fields[b"blob"])
        pipe = client.pipeline(transaction=False)
        pipe.xack(stream, "g", entry_id)
        pipe.unlink(fields[b"blob"])
        pipe.execute()
        t2 = time.perf_counter()
        if data is None or len(data) != len(payload):
            raise RuntimeError("raw GET returned a payload of the wrong size")
        write_s, read_s = write_s + (t1 - t0), read_s + (t2 - t1)
    client.delete(stream)
    return write_s, read_s


def _best(variant: str, size_mb: float, n: int, runs: list[tuple[float, float]]) -> Cell:
    write_s, read_s = min(runs, key=lambda wr: wr[0] + wr[1])
    return Cell(variant, size_mb, n, write_s, read_s)


def _measure_size(
    bus: RedisBus, client: redis.Redis, payload: bytes, n: int, repeats: int, run: int
) -> dict[str, list[tuple[float, float]]]:
    variants: dict[str, Callable[[int, int], tuple[float, float]]] = {
        "raw": partial(_raw_run, client, payload),
        "bus": partial(_bus_run, bus, payload),
    }
    for fn in variants.values():  # warm-up: connections, server and client pages
        run += 1
        fn(1, run)
    results: dict[str, list[tuple[float, float]]] = {"raw": [], "bus": []}
    for _ in range(repeats):
        for name, fn in variants.items():
            run += 1
            results[name].append(fn(n, run))
    return results


def measure(
    url: str, sizes_mb: list[float], total_mb: float, repeats: int, *, raw_zero_copy: bool
) -> list[Cell]:
    """Run every (size, variant) ``repeats`` times, interleaved; keep the best of each."""
    rng = np.random.default_rng(0)
    bus = RedisBus(url, "bench", options=RedisOptions(unavailable_after_s=30.0))
    # Default redis-py, or (to isolate the bus's own overhead) the packer the bus uses for blobs.
    extra = {"command_packer": _zero_copy_packer()} if raw_zero_copy else {}
    client = redis.Redis.from_url(url, **extra)
    cells: list[Cell] = []
    try:
        for index, size_mb in enumerate(sizes_mb):
            payload = rng.bytes(int(size_mb * MiB))
            n = max(2, round(total_mb / size_mb))
            results = _measure_size(bus, client, payload, n, repeats, run=index * 1000)
            cells += [_best(name, size_mb, n, results[name]) for name in ("raw", "bus")]
    finally:
        bus.close()
        client.close()
    return cells


def table(cells: list[Cell]) -> list[dict[str, float | int]]:
    """One row per size: MB/s and entries/s of both variants, and bus/raw ratios."""
    rows = []
    by_size: dict[float, dict[str, Cell]] = {}
    for cell in cells:
        by_size.setdefault(cell.size_mb, {})[cell.variant] = cell
    for size_mb, pair in by_size.items():
        raw, bus = pair["raw"], pair["bus"]
        e2e_raw, e2e_bus = raw.mb_s(raw.write_s + raw.read_s), bus.mb_s(bus.write_s + bus.read_s)
        rows.append(
            {
                "size_mb": size_mb,
                "messages": bus.messages,
                "raw_write_mb_s": raw.mb_s(raw.write_s),
                "bus_write_mb_s": bus.mb_s(bus.write_s),
                "raw_read_mb_s": raw.mb_s(raw.read_s),
                "bus_read_mb_s": bus.mb_s(bus.read_s),
                "raw_e2e_mb_s": e2e_raw,
                "bus_e2e_mb_s": e2e_bus,
                "bus_entries_s": bus.messages / (bus.write_s + bus.read_s),
                "ratio": e2e_bus / e2e_raw,
            }
        )
    return rows


def markdown(rows: list[dict[str, float | int]]) -> str:
    head = (
        "| payload | msgs | write raw / bus MB/s | read raw / bus MB/s | e2e raw / bus MB/s "
        "| bus entries/s | bus / raw |\n|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['size_mb']:g} MB | {r['messages']} "
            f"| {r['raw_write_mb_s']:.0f} / {r['bus_write_mb_s']:.0f} "
            f"| {r['raw_read_mb_s']:.0f} / {r['bus_read_mb_s']:.0f} "
            f"| {r['raw_e2e_mb_s']:.0f} / {r['bus_e2e_mb_s']:.0f} "
            f"| {r['bus_entries_s']:.1f} | {r['ratio']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64", help="payload sizes in MB (comma list)")
    parser.add_argument("--total-mb", type=float, default=256.0, help="MB moved per cell")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument(
        "--raw-zero-copy",
        action="store_true",
        help="give the raw client the bus's zero-copy command packer (isolates bus overhead)",
    )
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    started = time.perf_counter()
    with RedisProcess() as server:
        client = server.client()
        version = str(client.info("server").get("redis_version", "?"))
        client.close()
        cells = measure(
            server.url, sizes, args.total_mb, args.repeats, raw_zero_copy=args.raw_zero_copy
        )
        rows = table(cells)
    elapsed_s = time.perf_counter() - started
    packer = "zero-copy packer" if args.raw_zero_copy else "default redis-py (hiredis packer)"
    print(f"redis-server {version} on loopback; raw = {packer}; best of {args.repeats}; ", end="")
    print(f"{elapsed_s:.0f} s\n")
    print(markdown(rows))
    below = [f"{r['size_mb']:g} MB" for r in rows if r["ratio"] < 0.8]
    if below:
        print(f"\nbelow the 0.8 target: {', '.join(below)}")
    if args.json:
        summary = {"redis_version": version, "repeats": args.repeats, "raw_packer": packer}
        print(json.dumps({**summary, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
