"""Learner step time with sync on vs off (non-blocking proof); round-open → contribution latency.

    python bench/bench_learner.py                  # gpt-tiny, batch 32, P = 8, H = 8, int8; ~200 s
    python bench/bench_learner.py --json           # the tables, then one JSON object (last line)
    python bench/bench_learner.py --preset gpt-124m --device cuda --batch 8   # on a GPU

One process trains the same model on the same fixed batch (``torch.set_num_threads(1)``), in
alternating blocks of ``--steps`` steps:

* **off**: ``InnerLoop.train_step`` alone — the plain AdamW step, no learner, no bus;
* **on**: ``Learner.step`` with the service's two pump threads, while a scripted synchronizer in
  another process (the stand-in of the learner tests) opens rounds at one per off-step time
  (P = H: every fragment is asked for once every H steps), reads every contribution with a
  blocking group read and merges it as outer SGD(1) (Θ_p ← Θ_p − Δ_p), so new global versions
  flow back and are applied between steps.

Blocks alternate (off, [control,] on, off, ...) so drift on the shared machine hits all alike.
Reported: per-step wall time (median, mean; ratio of medians, ratio of means, median of the
per-block-pair ratios; the verdict takes the worst of the three) and the training thread's CPU time
per step (``time.thread_time``): the work the training thread itself does. A learner that never
blocks has a CPU ratio ≈ 1; wall time adds whatever the machine takes away. The control block
(``--busy-control``) times sync off while another process keeps CPU 1 busy: on a small shared VM a
busy neighbour core alone moves the wall time (other tenants' work lands on CPU 0), which is what
separates "the learner waits" from "the machine is full".

Why batch 32 by default: what syncing costs a CPU learner is a fixed amount of background CPU per
contribution (encode + send here, ~3 ms, plus the stand-in's and Redis's ~5 ms on the same VM),
independent of the batch; on this 2-vCPU VM any work on CPU 1 stretches CPU 0's wall time (the
control row: a busy CPU 1 doubles it). At batch 8 (1,024 tokens, ~95 ms a step) that fixed cost is
~8% of a step; at batch 32 (~370 ms) ~2%. Neither is the training thread waiting: its CPU time
per step is the same with sync on (ratio ≈ 1.00 at both sizes).

Latency: from the synchronizer's ``XADD`` of the ``RoundOpen`` to its blocking ``XREADGROUP``
returning the contribution (both timed in the synchronizer process): one wait for the next step
boundary plus encode and send. A private redis-server is started on a free loopback port and
stopped at the end. With ``--pin`` (the default) its threads share CPU 1 with the pump and the
stand-in: Redis only works during the "on" blocks, so left to the scheduler it would take time
from the training thread in those blocks alone (BENCHMARKS.md, the #21 section).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: find tests/

from dd_queue.auth import SYNCHRONIZER, Auth, principals, write_keys
from dd_queue.bus import RedisBus, ops
from dd_queue.clock import SystemClock
from dd_queue.config import DDQConfig
from dd_queue.data import Batch
from dd_queue.keys import SYNC_GROUP
from dd_queue.learner import Learner
from dd_queue.learner.service import PumpThreads
from dd_queue.messages import MessageLimits
from dd_queue.models import build_model
from tests.redisproc import RedisProcess
from tests.unit.test_learner_standin import StandIn, plan_of


def make_config(args: argparse.Namespace, url: str) -> DDQConfig:
    return DDQConfig.model_validate(
        {
            "run": {
                "run_id": getattr(args, "run_id", None) or f"bench{uuid.uuid4().hex[:6]}",
                "log_level": "WARNING",
            },
            "redis": {"url": url},
            "model": {
                "preset": args.preset,
                "n_layers": args.n_layers,
                "d_model": args.d_model,
                "autocast": "bf16",
                "compile": args.compile,
            },
            "data": {"batch_size": args.batch},
            "wire": {"codec": args.codec, "block_size": 256},
            "learner": {"device": args.device, "warmup_steps": 10, "inner_lr": 1e-3},
            "synchronizer": {"n_fragments": args.fragments, "sync_every_steps": args.h},
            "auth": {"keys_dir": args.keys_dir},
        }
    )


def fixed_batch(cfg: DDQConfig) -> Iterator[Batch]:
    spec = cfg.model.spec()
    gen = torch.Generator().manual_seed(0)
    window = torch.randint(
        0, spec.vocab_size, (cfg.data.batch_size, spec.seq_len + 1), generator=gen
    )
    batch = Batch(window[:, :-1].contiguous(), window[:, 1:].contiguous(), window[:, 1:].numel())
    while True:
        yield batch


# ── the synchronizer stand-in (its own process) ─────────────────────────────────────────────


def synchronizer(
    cfg_json: dict[str, Any],
    ready: Any,
    active: Any,
    stop: Any,
    interval: Any,
    results: Any,
    pin_cpu: int | None,
) -> None:
    """Publish v0, then while ``active``: open rounds at ``interval`` s, merge contributions."""
    torch.set_num_threads(1)
    if pin_cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {pin_cpu})
    cfg = DDQConfig.model_validate(cfg_json)
    bus = RedisBus(cfg.redis.url, cfg.run.run_id, options=cfg.redis.options())
    model = build_model(cfg.model.preset, seed=7, device="cpu", **cfg.model.overrides())
    auth = Auth.load(cfg.auth, cfg.run.run_id, SYNCHRONIZER)  # --signed: signs and checks
    standin = StandIn(bus, plan_of(cfg, model), auth=auth)
    standin.publish_model(model)
    ready.set()
    streams = [bus.keys.up(p) for p in range(cfg.synchronizer.n_fragments)]
    latencies: list[float] = []
    opened = merged = 0
    next_open = time.perf_counter()
    while not stop.is_set():
        now = time.perf_counter()
        if active.is_set() and now >= next_open:
            standin.open_round()
            opened += 1
            next_open = now + interval.value
        wait_ms = max(1, int((next_open - time.perf_counter()) * 1000)) if active.is_set() else 20
        for entry in bus.read_group(streams, SYNC_GROUP, "bench", count=16, block_ms=wait_ms):
            seen = time.perf_counter()
            msg, delta = ops.read_contribution(
                bus, entry, run_id=cfg.run.run_id, limits=MessageLimits(), auth=auth
            )
            bus.ack(entry.stream, SYNC_GROUP, [entry.id])
            latencies.append(seen - standin.opened_at[msg.round_id])
            standin.apply_contribution(msg, delta)
            merged += 1
    results.put({"latencies_s": latencies, "opened": opened, "merged": merged})
    bus.close()


# ── the learner (this process) ──────────────────────────────────────────────────────────────


TRAINING_CPU, BACKGROUND_CPU = 0, 1


def pin_process(pid: int, cpu: int) -> None:
    """Pin every thread of process ``pid`` to one CPU (Linux; elsewhere a no-op)."""
    if not hasattr(os, "sched_setaffinity") or cpu not in os.sched_getaffinity(0):
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})


def pin(args: argparse.Namespace, cpu: int) -> None:
    """Pin the calling thread (Linux: affinity is per thread) to one CPU, with ``--pin``."""
    if args.pin and hasattr(os, "sched_setaffinity") and cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {cpu})


CPU_TIMES: dict[str, list[float]] = {"off": [], "busy": [], "on": []}
"""Training-thread CPU seconds per step, by mode (wall − CPU = time the thread waited)."""


def time_steps(step: Any, n: int, device: torch.device, mode: str = "") -> list[float]:
    times = []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if mode:
            CPU_TIMES[mode].append(time.thread_time() - c0)
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    with RedisProcess() as server, tempfile.TemporaryDirectory() as keys:
        if args.pin and server.pid is not None:
            pin_process(server.pid, BACKGROUND_CPU)  # Redis serves the on blocks only
        args.keys_dir = None
        if args.signed:  # the learner signs every contribution and heartbeat, checks globals
            run_id = f"bench{uuid.uuid4().hex[:6]}"
            write_keys(Path(keys), run_id, principals(["L0"]))
            args.keys_dir, args.run_id = keys, run_id
        cfg = make_config(args, server.url)
        device = torch.device(args.device)
        ready, active, stop = ctx.Event(), ctx.Event(), ctx.Event()
        interval, results = ctx.Value("d", 0.1), ctx.Queue()
        proc = ctx.Process(
            target=synchronizer,
            args=(
                cfg.model_dump(mode="json"),
                ready,
                active,
                stop,
                interval,
                results,
                BACKGROUND_CPU if args.pin else None,
            ),
        )
        proc.start()
        if not ready.wait(120):
            raise RuntimeError("the synchronizer stand-in did not publish version 0")
        bus = RedisBus(cfg.redis.url, cfg.run.run_id, options=cfg.redis.options())
        model = build_model(cfg.model.preset, seed=1, device=device, **cfg.model.overrides())
        batches = fixed_batch(cfg)
        learner = Learner(
            cfg, learner_id="L0", model=model, loader=batches, bus=bus, clock=SystemClock()
        )
        learner.join()
        batch = next(batches)

        def train() -> None:
            learner.inner.train_step([batch])

        off: list[list[float]] = []  # per block, per step, seconds
        busy: list[list[float]] = []
        on: list[list[float]] = []
        burning = ctx.Event()
        burner = ctx.Process(target=burn, args=(burning, stop, BACKGROUND_CPU), daemon=True)
        burner.start()
        pin(args, BACKGROUND_CPU)  # the pump threads inherit the background core
        with PumpThreads(learner, receive_block_ms=cfg.learner.receive_block_ms):
            pin(args, TRAINING_CPU)
            time_steps(learner.step, args.warmup, device)  # compile, allocate, warm caches
            time_steps(train, args.warmup, device)
            for _ in range(args.blocks):
                off.append(time_steps(train, args.steps, device, "off"))
                interval.value = statistics.median(off[-1]) * args.h / args.fragments
                if args.busy_control:
                    burning.set()
                    busy.append(time_steps(train, args.steps, device, "busy"))
                    burning.clear()
                active.set()
                on.append(time_steps(learner.step, args.steps, device, "on"))
                active.clear()
            time.sleep(0.3)  # let the last contributions land
        stop.set()
        burner.join(timeout=10)
        outcome = results.get(timeout=60)
        proc.join(timeout=30)
        learner.leave(timeout_s=2.0)
        bus.close()
    return summarize(args, cfg, learner, off, on, busy, outcome)


def median_ms(seconds: list[float]) -> float | None:
    return statistics.median(seconds) * 1000 if seconds else None


def burn(burning: Any, stop: Any, cpu: int) -> None:
    """Control load: keep ``cpu`` busy with numpy work while ``burning`` is set."""
    if hasattr(os, "sched_setaffinity") and cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {cpu})
    x = np.random.default_rng(0).random(1 << 18, dtype=np.float32)
    while not stop.is_set():
        if not burning.wait(0.05):
            continue
        np.rint(x * 127.0).astype(np.int8)


def summarize(
    args: argparse.Namespace,
    cfg: DDQConfig,
    learner: Learner,
    off_blocks: list[list[float]],
    on_blocks: list[list[float]],
    busy_blocks: list[list[float]],
    outcome: dict[str, Any],
) -> dict[str, Any]:
    """Medians and means per mode; the ratio is also taken block pair by block pair (each on
    block against the off block just before it), whose median is robust to slow drift."""
    off = [t for block in off_blocks for t in block]
    on = [t for block in on_blocks for t in block]
    pairs = [
        statistics.median(b) / statistics.median(a)
        for a, b in zip(off_blocks, on_blocks, strict=True)
    ]
    lat_ms = np.asarray(outcome["latencies_s"]) * 1000
    return {
        "signed": args.signed,
        "preset": args.preset,
        "shape": f"{cfg.model.spec().n_layers} × {cfg.model.spec().d_model}",
        "device": args.device,
        "params": learner.plan.n_elements,
        "fragments": args.fragments,
        "h": args.h,
        "codec": args.codec,
        "batch": args.batch,
        "seq_len": cfg.model.spec().seq_len,
        "pinned": args.pin,
        "blocks": len(on_blocks),
        "steps_per_mode": len(on),
        "off_median_ms": statistics.median(off) * 1000,
        "on_median_ms": statistics.median(on) * 1000,
        "off_mean_ms": statistics.fmean(off) * 1000,
        "on_mean_ms": statistics.fmean(on) * 1000,
        "ratio_median": statistics.median(on) / statistics.median(off),
        "ratio_mean": statistics.fmean(on) / statistics.fmean(off),
        "ratio_pairs_median": statistics.median(pairs),
        "ratio_worst": max(
            statistics.median(on) / statistics.median(off),
            statistics.fmean(on) / statistics.fmean(off),
            statistics.median(pairs),
        ),
        "busy_median_ms": median_ms([t for b in busy_blocks for t in b]),
        "busy_cpu_median_ms": median_ms(CPU_TIMES["busy"]),
        "off_cpu_median_ms": statistics.median(CPU_TIMES["off"]) * 1000,
        "on_cpu_median_ms": statistics.median(CPU_TIMES["on"]) * 1000,
        "rounds_opened": outcome["opened"],
        "contributions_merged": outcome["merged"],
        "contributions_sent": learner.outbox.published,
        "replaced": learner.outbox.replaced,
        "versions": learner.versions,
        "latency_p50_ms": float(np.percentile(lat_ms, 50)) if lat_ms.size else None,
        "latency_p99_ms": float(np.percentile(lat_ms, 99)) if lat_ms.size else None,
    }


def print_tables(r: dict[str, Any]) -> None:
    pinning = (
        "training on CPU 0; pump, synchronizer and Redis on CPU 1" if r["pinned"] else "no pinning"
    )
    print(
        f"model {r['preset']} {r['shape']} ({r['params']:,} parameters) on {r['device']}, batch "
        f"{r['batch']} × {r['seq_len']}; P = {r['fragments']}, H = {r['h']}, codec "
        f"{r['codec']}; {r['blocks']} block pairs, {r['steps_per_mode']} steps per mode; "
        f"{pinning}; messages {'signed (Ed25519)' if r['signed'] else 'unsigned'}\n"
    )
    verdict = "PASS" if r["ratio_worst"] <= 1.03 else "MISS"  # all three ratios must pass
    print(
        "| mode | median step ms | mean step ms | ratio of medians | ratio of means "
        "| median of block-pair ratios | target |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    print(
        f"| sync off | {r['off_median_ms']:.2f} | {r['off_mean_ms']:.2f} | 1.000 | 1.000 "
        "| 1.000 | |"
    )
    print(
        f"| sync on | {r['on_median_ms']:.2f} | {r['on_mean_ms']:.2f} | "
        f"{r['ratio_median']:.3f} | {r['ratio_mean']:.3f} | {r['ratio_pairs_median']:.3f} "
        f"| ≤ 1.03 {verdict} |\n"
    )
    cpu_ratio = r["on_cpu_median_ms"] / r["off_cpu_median_ms"]
    print("| training thread, median | sync off | sync on | on ÷ off |")
    print("|---|---:|---:|---:|")
    print(
        f"| CPU time ms/step | {r['off_cpu_median_ms']:.2f} | {r['on_cpu_median_ms']:.2f} "
        f"| {cpu_ratio:.3f} |"
    )
    if r["busy_median_ms"] is not None:
        print(
            f"| control: sync off, CPU 1 kept busy (wall / CPU ms) | {r['busy_median_ms']:.2f} / "
            f"{r['busy_cpu_median_ms']:.2f} | | {r['busy_median_ms'] / r['off_median_ms']:.3f} "
            "(wall) |"
        )
    print()
    print("| rounds opened | contributions merged | p50 open → visible ms | p99 ms |")
    print("|---:|---:|---:|---:|")
    p50, p99 = (
        f"{x:.1f}" if x is not None else "-" for x in (r["latency_p50_ms"], r["latency_p99_ms"])
    )
    print(f"| {r['rounds_opened']} | {r['contributions_merged']} | {p50} | {p99} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt-tiny", help="model preset (default gpt-tiny)")
    parser.add_argument("--n-layers", type=int, default=None, help="override the preset's depth")
    parser.add_argument("--d-model", type=int, default=None, help="override the preset's width")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    parser.add_argument("--fragments", type=int, default=8, help="P")
    parser.add_argument("--h", type=int, default=8, help="H (inner steps between syncs)")
    parser.add_argument("--codec", default="int8", help="fp32 | bf16 | int8 | int4")
    parser.add_argument("--blocks", type=int, default=6, help="off/on block pairs")
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per mode first")
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="training on CPU 0; pump threads, synchronizer and Redis on CPU 1",
    )
    parser.add_argument(
        "--busy-control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time sync off while another process keeps CPU 1 busy (shared-core control)",
    )
    parser.add_argument(
        "--signed",
        action="store_true",
        help="signed messages (dd_queue.auth): the learner signs, the stand-in checks and signs",
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON object line")
    args = parser.parse_args()
    result = run(args)
    print_tables(result)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
