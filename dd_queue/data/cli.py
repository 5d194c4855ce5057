"""``ddq prepare``: tokenize text into train/val token shards with a manifest.

    ddq prepare corpus/ extra.jsonl --out data/prepared              # trains a 4096-id BPE
    ddq prepare books.parquet --out data/books --tokenizer gpt2/      # a given tokenizer.json
    ddq prepare corpus/ --out data/prepared --val-fraction 0.01 --json

Then train on it with ``data: {source: prepared, path: data/prepared}`` and a model vocabulary
of at least the manifest's ``vocab_size``. What is written, and how documents are split and
fingerprinted: ``dd_queue.data.prepare``. ``tokenizers`` and ``datasets`` are imported when the
command runs, not when ``ddq`` starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dd_queue.data.manifest import Manifest

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``prepare`` subcommand to the ``ddq`` parser."""
    p = sub.add_parser(
        "prepare",
        help="tokenize text/.jsonl/.parquet into train/val token shards with a manifest",
        description="Tokenize documents into token shards for the 'prepared' data source.",
    )
    p.add_argument("inputs", nargs="+", help="text files, .jsonl, .parquet, or directories of them")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument(
        "--tokenizer",
        help="a tokenizer.json or a directory holding one (default: train a byte-level BPE)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        help="ids of the BPE to train; ignored with --tokenizer (default: %(default)s)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        help="share of documents for validation, in [0, 1) (default: %(default)s)",
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=1 << 24,
        help="most tokens per shard file (default: %(default)s)",
    )
    p.add_argument(
        "--text-field",
        default="text",
        help="field of a .jsonl object / column of a .parquet file (default: %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="salt of the document split (default: %(default)s)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty directory that holds no previous prepare output",
    )
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.set_defaults(func=_cmd_prepare)


def _cmd_prepare(args: argparse.Namespace) -> int:
    from dd_queue.data.prepare import prepare

    started = time.perf_counter()
    manifest = prepare(
        args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        text_field=args.text_field,
        seed=args.seed,
        overwrite=args.overwrite,
    )
    seconds = time.perf_counter() - started
    sys.stdout.write(summary(manifest, seconds))
    if args.json:
        sys.stdout.write(json.dumps({**manifest.to_dict(), "seconds": round(seconds, 3)}) + "\n")
    return 0


def summary(manifest: Manifest, seconds: float) -> str:
    """A short table of a prepared dataset (documents, tokens and files per split)."""
    kind = "trained byte-level BPE" if manifest.tokenizer_trained else "given"
    lines = [
        f"prepared {manifest.root} in {seconds:.2f} s",
        f"tokenizer: {kind}, vocab {manifest.vocab_size}, EOS id {manifest.eos_id}, "
        f"sha256 {manifest.tokenizer_sha256[:12]}",
        f"dtype: {manifest.dtype}   fingerprint: {manifest.fingerprint[:16]}",
        "",
        f"{'split':<6} {'documents':>10} {'tokens':>14} {'files':>6}",
    ]
    for name in ("train", "val"):
        split = manifest.train if name == "train" else manifest.val
        lines.append(f"{name:<6} {split.documents:>10,} {split.tokens:>14,} {len(split.files):>6}")
    return "\n".join(lines) + "\n"
