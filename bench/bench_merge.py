"""Merge + outer-step throughput of the synchronizer, next to a plain memory-copy baseline.

    python bench/bench_merge.py            # M = 2, 8, 32 × N = 1M, 16M elements (~15-60 s, 2 GB)
    python bench/bench_merge.py --quick    # N = 1M only (a few seconds)
    python bench/bench_merge.py --json     # the table, then one JSON object as the last line

Throughput is defined on the data the merge must read: the bytes of all M contributions,
M × N × 4 B of float32, divided by the wall time of ``merge_fragment`` (token weights, anchored
contributions) with the outer step in place on the N-element fragment
(``merge_fragment(step=OuterStep(...))``: a weighted mean steps each merged piece while it is in
cache, as the synchronizer does; until 2026-12-07 the bench called ``nesterov_step`` after the
merge, which stores Δ and reads it back). The baseline is ``np.copyto`` of
the same bytes (each of the M contribution buffers copied into one N-element buffer), measured in
the same run. Each timing is the best of ``--repeats`` runs after one warm-up, merge and copy
timed alternately. The merge and the outer step share their pieces between ``--threads``
threads, by default as many as a synchronizer with the default config takes on this machine
(``synchronizer.merge_threads: 0``: the cores its 2 fetch processes leave, 1 to 4; so 1 on a
2-core machine). The copy is one ``np.copyto`` per buffer, on one thread. Targets: the
weighted mean reaches ≥ 25% of the copy rate, RDA (which reads every contribution twice: norms,
then the sum) ≥ 10%.

    python bench/bench_merge.py --quick --threads 2   # the merge on two threads

Below ~1M elements the targets stop being meaningful: the copy baseline runs from cache, and the
merge's fixed cost (~0.1 ms: validation, layout, weights) and the N-element outer step, which do
not shrink with M, dominate at M = 2 (e.g. 15% at 256K elements, M = 2).

The fragment is laid out like a small transformer's: one embedding tensor (1/8 of N, always merged
by the weighted mean) and six dense tensors.

A second table compares, for int8 contributions (blocks of 256), what the synchronizer does with
them (``codec.decode_delta``: the codes and scales kept, ``core.blockwise``) against decoding them
to float32 first, timed alternately: the RDA merge + outer step, the per-segment norms a fetch
process computes, and the decode itself. Speed-up = decoded time ÷ codes time.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dd_queue.config import SynchronizerConfig
from dd_queue.core.codec import CodecSpec, DecodeLimits, decode, decode_delta, encode
from dd_queue.core.fragments import Fragment, plan_fragments
from dd_queue.core.merge import ContributionData, merge_fragment, segment_sq_norms
from dd_queue.core.outer import NesterovState, OuterStep, nesterov_step
from dd_queue.core.workers import Workers
from dd_queue.synchronizer.workers import merge_threads, shared_workers

TARGETS = {"mean": 0.25, "rda": 0.10}
LEARNER_COUNTS = (2, 8, 32)


def _fragment(n: int) -> Fragment:
    emb = n // 8
    dense = (n - emb) // 6
    shapes = {"tok_embeddings.weight": (emb,)}
    shapes |= {f"layers.{i}.w": (dense,) for i in range(5)}
    shapes["layers.5.w"] = (n - emb - 5 * dense,)
    return plan_fragments(shapes, 1).fragments[0]


def _contributions(n: int, m_max: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal(n, dtype=np.float32)
    noise = rng.standard_normal(n, dtype=np.float32)
    out = []
    for m in range(m_max):  # distinct directions without generating m_max random vectors
        v = np.multiply(base, np.float32(0.5 + 0.01 * m))
        v += noise * np.float32((-1) ** m * (0.3 + 0.02 * m))
        out.append(v)
    return out


def _best_pair_s(
    a: Callable[[], object], b: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Best wall time of ``a`` and of ``b``, timed alternately so that load from other processes
    on a shared machine hits both alike; one untimed warm-up each (first touch of pages)."""
    a()
    b()
    best_a = best_b = float("inf")
    for _ in range(repeats):
        for fn, is_a in ((a, True), (b, False)):
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if is_a:
                best_a = min(best_a, elapsed)
            else:
                best_b = min(best_b, elapsed)
    return best_a, best_b


def _row(
    rule: str, vectors: list[np.ndarray], fragment: Fragment, repeats: int, workers: Workers | None
) -> dict[str, Any]:
    n, m = fragment.size, len(vectors)
    contribs = [
        ContributionData(f"L{i}", v, tokens=4096 + 64 * i, steps=8, base_version=0)
        for i, v in enumerate(vectors)
    ]
    params = np.zeros(n, dtype=np.float32)
    state = NesterovState.zeros(n)
    delta = np.empty(n, dtype=np.float32)
    sink = np.empty(n, dtype=np.float32)

    def merge_and_step() -> None:
        step = OuterStep(params, state, lr=0.7, momentum=0.9)
        merge_fragment(
            contribs,
            fragment,
            rule=rule,  # type: ignore[arg-type]
            out=delta,
            workers=workers,
            step=step,
        )

    def copy_baseline() -> None:
        for v in vectors:
            np.copyto(sink, v)

    nbytes = m * n * 4
    merge_s, copy_s = _best_pair_s(merge_and_step, copy_baseline, repeats)
    ratio = copy_s / merge_s
    return {
        "rule": rule,
        "learners": m,
        "elements": n,
        "mb_read": nbytes / 1e6,
        "merge_ms": merge_s * 1e3,
        "merge_gb_s": nbytes / merge_s / 1e9,
        "copy_gb_s": nbytes / copy_s / 1e9,
        "ratio": ratio,
        "target": TARGETS[rule],
        "passed": ratio >= TARGETS[rule],
    }


def _codes_rows(
    n: int, learners: tuple[int, ...], repeats: int, workers: Workers | None
) -> list[dict[str, Any]]:
    """int8 contributions: codes (``decode_delta``) against decoded float32, step by step."""
    fragment, limits = _fragment(n), DecodeLimits()
    vectors = _contributions(n, max(learners))  # distinct, as a round's contributions are
    encoded = [encode(v * np.float32(1e-3), CodecSpec("int8")) for v in vectors]
    del vectors
    e = encoded[0]
    codes = [decode_delta(x.header, x.payload, limits=limits) for x in encoded]
    floats = [decode(x.header, x.payload, limits=limits) for x in encoded]
    out = np.empty(n, dtype=np.float32)
    # as in the synchronizer, the merge gets the norms computed ahead (by the fetch processes)
    codes_norms = [segment_sq_norms(d, fragment) for d in codes]
    float_norms = [segment_sq_norms(d, fragment) for d in floats]
    rows = []

    def row(step: str, m: int, a: Callable[[], object], b: Callable[[], object]) -> None:
        codes_s, decoded_s = _best_pair_s(a, b, repeats)
        rows.append(
            {
                "step": step,
                "learners": m,
                "elements": n,
                "codes_ms": codes_s * 1e3,
                "decoded_ms": decoded_s * 1e3,
                "speedup": decoded_s / codes_s,
            }
        )

    row(
        "decode (one payload)",
        1,
        lambda: decode_delta(e.header, e.payload, out=out, limits=limits),
        lambda: decode(e.header, e.payload, out=out, limits=limits),
    )
    row(
        "segment norms (one payload)",
        1,
        lambda: segment_sq_norms(codes[0], fragment),
        lambda: segment_sq_norms(decode(e.header, e.payload, out=out, limits=limits), fragment),
    )
    params, state = np.zeros(n, dtype=np.float32), NesterovState.zeros(n)
    for m in learners:

        def merge(deltas: list[Any], norms: list[Any], m: int = m) -> None:
            contribs = [
                ContributionData(f"L{i}", deltas[i], 4096 + 64 * i, 8, 0, norms[i])
                for i in range(m)
            ]
            result = merge_fragment(contribs, fragment, rule="rda", out=out, workers=workers)
            nesterov_step(params, result.delta, state, lr=0.7, momentum=0.9, workers=workers)

        row(
            "rda merge + outer step",
            m,
            lambda: merge(codes, codes_norms),
            lambda: merge(floats, float_norms),
        )
    return rows


def _codes_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| int8 step | M | elements | codes ms | decoded ms | speed-up |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['learners']} | {r['elements']:,} | {r['codes_ms']:.2f} "
            f"| {r['decoded_ms']:.2f} | {r['speedup']:.2f}x |"
        )
    return "\n".join(lines)


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| rule | M | elements | MB read | merge+outer ms | GB/s | copy GB/s | ratio | target | |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rule']} | {r['learners']} | {r['elements']:,} | {r['mb_read']:.0f} "
            f"| {r['merge_ms']:.1f} | {r['merge_gb_s']:.2f} | {r['copy_gb_s']:.2f} "
            f"| {r['ratio']:.0%} | ≥ {r['target']:.0%} | {'PASS' if r['passed'] else 'FAIL'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the 1M-element fragment")
    parser.add_argument("--json", action="store_true", help="end with one JSON object line")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per row (best kept)")
    sync = SynchronizerConfig()
    default_threads, why = merge_threads(sync.merge_threads, sync.fetch_processes)
    parser.add_argument(
        "--threads",
        type=int,
        default=default_threads,
        help=f"threads sharing the merge and outer step (default {default_threads}: what a "
        f"synchronizer with the default config takes here, {why})",
    )
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be ≥ 1, got {args.threads}")
    workers = shared_workers(args.threads)
    sizes = (1 << 20,) if args.quick else (1 << 20, 1 << 24)
    rows = []
    for n in sizes:
        vectors = _contributions(n, max(LEARNER_COUNTS))
        fragment = _fragment(n)
        for m in LEARNER_COUNTS:
            for rule in ("mean", "rda"):
                rows.append(_row(rule, vectors[:m], fragment, args.repeats, workers))
        del vectors
    print(f"merge + outer step on {args.threads} thread(s); the copy on one\n")
    print(_table(rows))
    all_pass = all(r["passed"] for r in rows)
    print(f"\n{'all rows PASS' if all_pass else 'some rows FAIL'}\n")
    codes = _codes_rows(1 << 20, (2, 16), args.repeats, workers)
    print(_codes_table(codes))
    if args.json:
        summary = {
            "bench": "merge",
            "definition": "GB/s = bytes of all M fp32 contributions / (merge + outer step) time",
            "numpy": np.__version__,
            "machine": platform.machine(),
            "threads": args.threads,
            "rows": rows,
            "all_pass": all_pass,
            "int8_codes_rows": codes,
        }
        print(json.dumps(summary))
    return 0 if all_pass else 1


if __name__ == "__main__":
    raise SystemExit(main())
