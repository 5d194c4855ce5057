"""Bytes a learner sends per contribution: full fine-tuning against training part of the model.

    python bench/bench_contribution_bytes.py          # the table (a few seconds, CPU)
    python bench/bench_contribution_bytes.py --json   # then one JSON object as the last line

One Llama-architecture model (transformers, built from a config; nothing downloaded) is saved as
a pretrained directory, then planned the way a run plans it (``models.builder`` +
``plan_fragments``) for each variant: full fine-tuning, the embeddings frozen (``model.freeze``),
and LoRA adapters of rank 4, 8 and 16 on q_proj and v_proj (``model.lora_r``). A contribution is
one pseudo-gradient per fragment: each fragment's delta (here a random one of the right size) is
encoded with the real codec, fp32 and int8 (blocks of 256, as ``wire.codec`` does), and the
payload bytes (the blobs) are summed; each fragment's envelope adds a few hundred bytes.
Ratio = full fine-tuning's bytes ÷ the variant's, for the same codec.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from dd_queue.config import validate_config
from dd_queue.core.codec import CodecSpec, encode
from dd_queue.core.fragments import plan_fragments, shapes_from_named
from dd_queue.models.builder import build, embedding_names, synced_parameters

LLAMA = {
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "full fine-tuning": {},
    "embeddings frozen": {"freeze": ["hf.model.embed_tokens.*"]},
    "LoRA r=4 (q, v)": {"lora_r": 4},
    "LoRA r=8 (q, v)": {"lora_r": 8},
    "LoRA r=16 (q, v)": {"lora_r": 16},
}
CODECS = {"fp32": CodecSpec("fp32"), "int8": CodecSpec("int8", block_size=256)}
N_FRAGMENTS = 4


def _pretrained(directory: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _row(name: str, extra: dict[str, Any], pretrained: Path) -> dict[str, Any]:
    cfg = validate_config(
        {"model": {"source": "hf", "hf_pretrained": str(pretrained), "seq_len": 128, **extra}}
    )
    model = build(cfg.model.architecture(), seed=0, device="cpu")
    synced = synced_parameters(model)
    shapes = shapes_from_named((n, p.shape) for n, p in synced.items())
    plan = plan_fragments(
        shapes, min(N_FRAGMENTS, len(shapes)), embedding_names=embedding_names(model)
    )
    rng = np.random.default_rng(0)
    sent = {}
    for codec, spec in CODECS.items():
        total = 0
        for fragment in plan.fragments:
            delta = rng.standard_normal(fragment.size, dtype=np.float32) * np.float32(1e-3)
            encoded = encode(delta, spec)
            total += encoded.payload.nbytes
        sent[codec] = total
    return {
        "variant": name,
        "trained_params": sum(p.numel() for p in synced.values()),
        "all_params": sum(p.numel() for p in model.parameters()),
        "fragments": plan.n_fragments,
        "bytes": sent,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="end with one JSON object line")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pretrained = _pretrained(Path(tmp) / "pretrained")
        rows = [_row(name, extra, pretrained) for name, extra in VARIANTS.items()]
    full = rows[0]["bytes"]
    print("| variant | trained params | share | P | fp32 bytes | × less | int8 bytes | × less |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        r["ratio"] = {c: full[c] / r["bytes"][c] for c in CODECS}
        print(
            f"| {r['variant']} | {r['trained_params']:,} | "
            f"{r['trained_params'] / r['all_params']:.2%} | {r['fragments']} | "
            f"{r['bytes']['fp32']:,} | {r['ratio']['fp32']:.1f} | "
            f"{r['bytes']['int8']:,} | {r['ratio']['int8']:.1f} |"
        )
    if args.json:
        print(json.dumps({"bench": "contribution_bytes", "model": LLAMA, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
