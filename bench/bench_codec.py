"""Codec benchmark on realistic outer gradients: size, error and speed next to a memory copy.

    python bench/bench_codec.py                      # markdown table, 4M elements
    python bench/bench_codec.py --elements 1048576 --repeats 7 --json

Data: weights w ~ N(0, 0.02²) and w2 = w − lr·H·u·U(0.5, 1) with lr = 3e-4, H = 24 inner steps
and u an AdamW-like update (m/√v, within ±1, plus weight decay 0.1·w), so the outer gradient
Δ = w − w2 has the bounded, heavy-shouldered shape of Adam steps (|Δ| ≲ lr·H ≈ 7e-3).
With ``--weights bf16`` both weights are rounded to bf16 first (the case byte shuffle helps).

Columns: bytes per parameter on the wire, relative error ‖x̂ − x‖/‖x‖, encode and decode speed in
MB/s of fp32 input (decode writes into a preallocated buffer, as the synchronizer does), and those
speeds as a fraction of ``np.copyto`` of the same array measured in the same run. Best of
``--repeats``. ``--json`` adds one JSON object with every row as the last line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from dd_queue.core.codec import CodecName, CodecSpec, DecodeLimits, decode, encode

_MB = 1e6


@dataclass(frozen=True)
class Row:
    codec: str
    zstd_level: int
    shuffle: bool
    bytes_per_param: float
    rel_error: float
    encode_mb_s: float
    decode_mb_s: float
    encode_vs_copy: float
    decode_vs_copy: float


def outer_gradient(n: int, *, weights: str, seed: int = 0) -> np.ndarray:
    """Δ = w − w2 after ``steps`` AdamW-like inner steps (see the module docstring), float32."""
    rng = np.random.default_rng(seed)
    lr, weight_decay, steps = 3e-4, 0.1, 24
    w = rng.normal(0.0, 0.02, n).astype(np.float32)
    m = rng.standard_normal(n).astype(np.float32)
    v = m * m + 0.1 * rng.chisquare(1, n).astype(np.float32)
    update = m / (np.sqrt(v) + 1e-8) + weight_decay * w  # Adam's m̂/(√v̂+ε) is within ±1
    w2 = (w - lr * steps * update * rng.uniform(0.5, 1.0, n)).astype(np.float32)
    if weights == "bf16":
        w, w2 = _round_bf16(w), _round_bf16(w2)
    return (w - w2).astype(np.float32)


def _round_bf16(x: np.ndarray) -> np.ndarray:
    u = x.view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def best_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up: page faults and lazy allocations are not the codec's cost
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(x: np.ndarray, spec: CodecSpec, repeats: int, copy_mb_s: float) -> Row:
    limits = DecodeLimits()
    out = np.empty_like(x)
    encoded = encode(x, spec)
    decode(encoded.header, encoded.payload, out=out, limits=limits)
    rel = float(np.linalg.norm((out - x).astype(np.float64)) / np.linalg.norm(x.astype(np.float64)))
    mb = x.nbytes / _MB
    enc = mb / best_s(lambda: encode(x, spec), repeats)
    dec = mb / best_s(
        lambda: decode(encoded.header, encoded.payload, out=out, limits=limits), repeats
    )
    return Row(
        codec=spec.name,
        zstd_level=spec.zstd_level or 0,
        shuffle=spec.shuffle,
        bytes_per_param=encoded.payload.nbytes / x.size,
        rel_error=rel,
        encode_mb_s=enc,
        decode_mb_s=dec,
        encode_vs_copy=enc / copy_mb_s,
        decode_vs_copy=dec / copy_mb_s,
    )


def specs(zstd_level: int) -> list[CodecSpec]:
    result = []
    choices: tuple[tuple[CodecName, int], ...] = (
        ("fp32", 256),
        ("bf16", 256),
        ("int8", 256),
        ("int4", 64),
    )
    for name, block_size in choices:
        result.append(CodecSpec(name, block_size=block_size))
        result.append(CodecSpec(name, block_size=block_size, zstd_level=zstd_level))
        if name in ("fp32", "bf16"):
            result.append(CodecSpec(name, zstd_level=zstd_level, shuffle=True))
    return result


def table(rows: list[Row], copy_mb_s: float, args: argparse.Namespace) -> str:
    lines = [
        f"{args.elements} elements ({args.elements * 4 / _MB:.1f} MB fp32), "
        f"{args.weights} weights, best of {args.repeats}; "
        f"np.copyto baseline {copy_mb_s:,.0f} MB/s",
        "",
        "| codec | zstd | shuffle | B/param | rel. error | encode MB/s | decode MB/s "
        "| encode / copy | decode / copy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.codec} | {r.zstd_level or '-'} | {'yes' if r.shuffle else '-'} "
            f"| {r.bytes_per_param:.3f} | {r.rel_error:.2%} | {r.encode_mb_s:,.0f} "
            f"| {r.decode_mb_s:,.0f} | {r.encode_vs_copy:.3f} | {r.decode_vs_copy:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 22, help="Elements (fp32) per run.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed repeats; best is kept.")
    parser.add_argument("--zstd-level", type=int, default=1, help="Level of the zstd rows.")
    parser.add_argument("--weights", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--json", action="store_true", help="Last line: one JSON object.")
    args = parser.parse_args()

    x = outer_gradient(args.elements, weights=args.weights)
    sink = np.empty_like(x)
    copy_mb_s = x.nbytes / _MB / best_s(lambda: np.copyto(sink, x), args.repeats)
    rows = [measure(x, spec, args.repeats, copy_mb_s) for spec in specs(args.zstd_level)]
    print(table(rows, copy_mb_s, args))
    if args.json:
        summary = {
            "elements": args.elements,
            "repeats": args.repeats,
            "weights": args.weights,
            "copy_mb_s": copy_mb_s,
            "rows": [asdict(r) for r in rows],
        }
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
