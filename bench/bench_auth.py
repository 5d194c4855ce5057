"""What signing costs per message: Ed25519 signatures of entries and blobs (dd_queue.auth) against
the codec work the same contribution already costs, measured in the same run.

    python bench/bench_auth.py                       # 53k and 1M elements, int8; ~10 s
    python bench/bench_auth.py --elements 1048576 --codec fp32 --json

For each size: the learner's side (encode the contribution; sign its entry; sign its blob, which
hashes the payload) and the synchronizer's (check the entry; check the blob; decode), medians
of ``--repeats`` runs, one thread. The ratio column is the signature work ÷ the codec work of
the same side: what turning signatures on adds to the CPU a contribution costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dd_queue.auth import SYNCHRONIZER, Auth, principals, write_keys
from dd_queue.config import AuthConfig
from dd_queue.core.codec import CodecSpec, DecodeLimits, decode, encode
from dd_queue.messages import Contribution
from dd_queue.wire import blob_parts

RUN = "bench"


def median_ms(call: Callable[[], object], repeats: int) -> float:
    call()  # warm
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def measure(elements: int, codec: str, repeats: int, keys: Path) -> dict[str, float]:
    learner = Auth.load(AuthConfig(keys_dir=keys), RUN, "learner.L0")
    sync = Auth.load(AuthConfig(keys_dir=keys), RUN, SYNCHRONIZER)
    x = (np.random.default_rng(0).standard_normal(elements) * 1e-3).astype(np.float32)
    spec = CodecSpec(codec, block_size=256)
    encoded = encode(x, spec)
    msg = Contribution(
        run_id=RUN,
        config_digest="d",
        learner_id="L0",
        fragment_id=0,
        round_id=1,
        base_version=0,
        n_steps=8,
        n_tokens=8 * 4096,
        tensor=encoded.header,
        created_at_s=time.time(),
    )
    stream, key = "ddq:bench:{bench.f0}:up", "ddq:bench:{bench.f0}:up:1:L0"
    fields = learner.sign_fields("contribution", run_id=RUN, where=stream, fields=msg.to_fields())
    signer, check = learner.blob_signer(RUN), sync.blob_check(RUN, "learner.L0")
    assert signer is not None and check is not None
    payload = memoryview(encoded.payload).cast("B")
    sig = signer(key, encoded.header, payload)
    limits = DecodeLimits()
    out = {
        "payload_bytes": float(payload.nbytes),
        "encode_ms": median_ms(lambda: encode(x, spec), repeats),
        "sign_entry_ms": median_ms(
            lambda: learner.sign_fields(
                "contribution", run_id=RUN, where=stream, fields=msg.to_fields()
            ),
            repeats,
        ),
        "sign_blob_ms": median_ms(
            lambda: blob_parts(run_id=RUN, blob_key=key, encoded=encoded, sign=signer), repeats
        )
        - median_ms(lambda: blob_parts(run_id=RUN, blob_key=key, encoded=encoded), repeats),
        "decode_ms": median_ms(lambda: decode(encoded.header, payload, limits=limits), repeats),
        "check_entry_ms": median_ms(
            lambda: sync.check_fields(
                "contribution", "learner.L0", run_id=RUN, where=stream, fields=fields
            ),
            repeats,
        ),
        "check_blob_ms": median_ms(lambda: check(key, encoded.header, payload, sig), repeats),
    }
    out["learner_ratio"] = (out["sign_entry_ms"] + out["sign_blob_ms"]) / out["encode_ms"]
    out["synchronizer_ratio"] = (out["check_entry_ms"] + out["check_blob_ms"]) / out["decode_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--elements", type=int, nargs="+", default=[53_328, 1 << 20], help="per contribution"
    )
    parser.add_argument("--codec", default="int8", choices=["fp32", "bf16", "int8", "int4"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as keys:
        write_keys(Path(keys), RUN, principals(["L0"]))
        for n in args.elements:
            rows[n] = measure(n, args.codec, args.repeats, Path(keys))
    print(f"codec {args.codec}; medians of {args.repeats}; one thread\n")
    print("| elements | payload KB | encode ms | sign entry + blob ms | learner ratio ", end="")
    print("| decode ms | check entry + blob ms | synchronizer ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in rows.items():
        print(
            f"| {n:,} | {r['payload_bytes'] / 1024:.0f} | {r['encode_ms']:.3f} | "
            f"{r['sign_entry_ms']:.3f} + {r['sign_blob_ms']:.3f} | {r['learner_ratio']:.2f} | "
            f"{r['decode_ms']:.3f} | {r['check_entry_ms']:.3f} + {r['check_blob_ms']:.3f} | "
            f"{r['synchronizer_ratio']:.2f} |"
        )
    if args.json:
        print(json.dumps({"codec": args.codec, "repeats": args.repeats, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
