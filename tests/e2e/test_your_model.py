"""Your model on your data, as a user runs it: ``ddq prepare`` → ``ddq up`` → export → load.

1. ``ddq prepare`` trains a byte-level BPE on a corpus the test writes and writes token shards
   with a manifest.
2. ``ddq up`` trains a tiny Llama-architecture model (an HF config directory, the BPE's
   vocabulary) with two learners; the held-out loss (the validation split) falls.
3. ``--export-format hf`` writes a directory that ``AutoModelForCausalLM.from_pretrained`` and
   ``AutoTokenizer.from_pretrained`` load; it generates, and scores the validation tokens far
   better than the untrained model.
4. A second run starts ``--init-from`` that directory: its first held-out loss is the trained
   model's, not an untrained one's (the bit-for-bit check is in
   ``tests/integration/test_init_from_hf.py``).
5. A ``module:factory`` model (``dd_queue.models.example_module``) trains through the services.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.conftest import require_redis_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512
LLAMA = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
WORDS = {
    "subject": ["the cat", "a dog", "the old man", "my sister", "the bird", "a farmer",
                "the teacher", "our neighbour", "the children", "a sailor"],
    "verb": ["sees", "likes", "finds", "carries", "paints", "watches", "follows", "builds",
             "forgets", "sells"],
    "object": ["a red ball", "the small house", "an apple", "the river", "a wooden boat",
               "the green hill", "a letter", "the garden", "a warm coat", "the bridge"],
    "tail": ["in the morning.", "after the rain.", "every day.", "near the market.",
             "with great care.", "before dinner.", "once a year.", "without a word."],
}  # fmt: skip


def _ddq(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDQ__")}
    return subprocess.run(
        [sys.executable, "-m", "dd_queue.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _last_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def write_corpus(directory: Path, n_docs: int = 1500, seed: int = 0) -> None:
    """English-like documents: sentences drawn from a small grammar (a few words each)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True)
    for i in range(n_docs):
        sentences = [
            " ".join(rng.choice(WORDS[part]) for part in WORDS).capitalize()
            for _ in range(rng.randint(6, 16))
        ]
        (directory / f"doc{i:04d}.txt").write_text(" ".join(sentences) + "\n")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus, ``ddq prepare``'s output, an HF config directory and the run's config."""
    require_redis_server()
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("your-model")
    write_corpus(root / "corpus")
    manifest = _last_json(
        _ddq("prepare", "corpus", "--out", "data", "--vocab-size", str(VOCAB), "--json", cwd=root)
    )
    assert manifest["format"] == "ddq.prepared.v1" and manifest["tokenizer"]["trained"]
    assert manifest["splits"]["val"]["tokens"] > 0 and manifest["dtype"] == "uint16"
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text(json.dumps(LLAMA))
    (root / "run.yaml").write_text(
        "extends: demo\n"
        "model: {source: hf, hf_config: llama, seq_len: 64}\n"
        "data: {source: prepared, path: data, batch_size: 8}\n"
        "synchronizer: {eval_interval_s: 5.0}\n"
    )
    return root


def _val_loss(model: Any, root: Path, n_windows: int = 32, seq_len: int = 64) -> float:
    """Mean next-token loss of ``model`` on the first validation windows of the prepared data."""
    import torch

    tokens = np.fromfile(root / "data" / "val-00000.bin", dtype="<u2").astype(np.int64)
    n = min(n_windows, len(tokens) // (seq_len + 1))
    windows = torch.from_numpy(tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1))
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits.float()
    return float(
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), windows[:, 1:].reshape(-1))
    )


@pytest.fixture(scope="module")
def trained(work: Path) -> tuple[Path, dict[str, Any]]:
    proc = _ddq(
        "up", "--config", "run.yaml", "--learners", "2", "--duration", "60",
        "--runs-dir", "runs", "--export", "exported", "--export-format", "hf", "--json",
        cwd=work,
    )  # fmt: skip
    return work / "exported", _last_json(proc)


def test_prepare_train_export_and_load_in_transformers(
    work: Path, trained: tuple[Path, dict[str, Any]]
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    exported, summary = trained
    assert summary["rounds_merged"] > 0 and summary["contributed"] == ["L0", "L1"], summary
    assert summary["evals"] >= 2 and summary["loss_fell"] is True, summary
    assert summary["exported"] == "exported", summary
    meta = json.loads((exported / "ddq_metadata.json").read_text())
    assert meta["format"] == "ddq.export.hf.v1" and meta["tokens_merged"] > 0, meta
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.eos_token == "<|endoftext|>"
    prompt = tokenizer("The cat sees", return_tensors="pt").input_ids
    out = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(out[0][prompt.shape[1] :])
    assert len(out[0]) > prompt.shape[1] and text.strip(), text
    untrained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(exported)).eval()
    before, after = _val_loss(untrained, work), _val_loss(model, work)
    assert before > math.log(VOCAB) - 1.0 and after < before - 2.0, (before, after)
    print(f"held-out loss {before:.3f} (untrained) -> {after:.3f}; generated {text!r}")


def test_a_run_from_an_hf_directory_starts_where_those_weights_are(
    work: Path, trained: tuple[Path, dict[str, Any]]
) -> None:
    from transformers import AutoModelForCausalLM

    exported, first = trained
    pretrained_loss = _val_loss(AutoModelForCausalLM.from_pretrained(exported).eval(), work)
    (work / "again.yaml").write_text("extends: run.yaml\nrun: {run_id: again}\n")
    proc = _ddq(
        "up", "--config", "again.yaml", "--learners", "2", "--duration", "30",
        "--runs-dir", "runs", "--init-from", "exported", "--json",
        cwd=work,
    )  # fmt: skip
    summary = _last_json(proc)
    assert summary["rounds_merged"] > 0 and summary["evals"] >= 1, summary
    log = (Path(summary["run_dir"]) / "synchronizer.log").read_text()
    created = [line for line in log.splitlines() if "fragment.created" in line]
    assert created and all("version 0 (exported (" in line for line in created), created
    # it continues from the trained model (a fresh one scores about ln 512 = 6.2)
    assert summary["eval_loss_start"] < pretrained_loss + 0.5, (summary, pretrained_loss)
    assert summary["eval_loss_start"] < first["eval_loss_end"] + 0.2, (summary, first)


def test_a_module_factory_model_trains_through_the_services(tmp_path: Path) -> None:
    require_redis_server()
    (tmp_path / "module.yaml").write_text(
        "extends: demo\n"
        "model: {source: module, factory: 'dd_queue.models.example_module:build',"
        " factory_kwargs: {d_model: 64, n_layers: 2}, vocab_size: 256, seq_len: 64}\n"
        "synchronizer: {eval_interval_s: 5.0}\n"
    )
    proc = _ddq(
        "up", "--config", "module.yaml", "--learners", "2", "--duration", "45",
        "--runs-dir", "runs", "--json",
        cwd=tmp_path,
    )  # fmt: skip
    summary = _last_json(proc)
    assert summary["rounds_merged"] > 0 and summary["contributed"] == ["L0", "L1"], summary
    assert summary["loss_fell"] is True, summary
