"""A run seeded from Hugging Face weights, and exported back to them, through a real Redis.

``ddq synchronizer --init-from`` takes a ``save_pretrained`` directory (float32 or bf16) or a
plain safetensors file: the first global model must equal those weights bit for bit. ``ddq
export --format hf`` writes the global model back as a directory ``from_pretrained`` loads,
again bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dd_queue.bus import RedisBus
from dd_queue.clock import SystemClock
from dd_queue.errors import ConfigError
from dd_queue.synchronizer import Synchronizer
from dd_queue.synchronizer.export import export_hf, global_model, load_init
from tests.synchronizer_support import make_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

LLAMA = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


def _cfg(run_id: str, **keys: Any) -> Any:
    return make_config(
        run_id, model__source="hf", model__hf_options={**LLAMA, **keys}, model__seq_len=16
    )


def _pretrained(tmp_path: Path, dtype: Any = None, **keys: Any) -> tuple[Path, dict[str, Any]]:
    """A saved model whose weights are not any seed's init, and its tensors (float32)."""
    config = transformers.AutoConfig.for_model(**{**LLAMA, **keys})
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    if dtype is not None:
        model = model.to(dtype)
    out = tmp_path / "pretrained"
    model.save_pretrained(out, safe_serialization=True)
    own = {n: p.detach().to(torch.float32).numpy().copy() for n, p in model.named_parameters()}
    return out, own


def _start(bus: RedisBus, cfg: Any, source: Any) -> Synchronizer:
    sync = Synchronizer(cfg, bus=bus, clock=SystemClock(), synchronizer_id="s0", source=source)
    sync.start()
    return sync


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_the_first_global_model_is_the_pretrained_weights_bit_for_bit(
    bus: RedisBus, run_id: str, tmp_path: Path, dtype: str | None
) -> None:
    cfg = _cfg(run_id)
    directory, own = _pretrained(tmp_path, getattr(torch, dtype) if dtype else None)
    sync = _start(bus, cfg, load_init(directory, cfg))
    try:
        tensors, versions, _ = global_model(bus, cfg)
        assert set(versions.values()) == {0}
        assert set(tensors) == {f"hf.{n}" for n in own}  # tied lm_head: once, as the embedding
        for name, value in own.items():
            np.testing.assert_array_equal(tensors[f"hf.{name}"], value, err_msg=name)
    finally:
        sync.close()


def test_export_hf_loads_in_transformers_bit_for_bit(
    bus: RedisBus, run_id: str, tmp_path: Path
) -> None:
    cfg = _cfg(run_id, tie_word_embeddings=False)
    directory, _ = _pretrained(tmp_path, tie_word_embeddings=False)
    sync = _start(bus, cfg, load_init(directory, cfg))
    try:
        tensors, _, _ = global_model(bus, cfg)
        metadata = export_hf(bus, cfg, tmp_path / "export")
    finally:
        sync.close()
    assert metadata["versions"] == {str(p): 0 for p in range(cfg.synchronizer.n_fragments)}
    assert {"config.json", "model.safetensors", "ddq_metadata.json"} <= set(metadata["files"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    params = dict(loaded.named_parameters())
    assert set(params) == {n.removeprefix("hf.") for n in tensors}
    for name, value in tensors.items():
        np.testing.assert_array_equal(params[name.removeprefix("hf.")].detach().numpy(), value)
    # the directory may be written again (an earlier export), and a run restarts from it
    export_hf(bus, cfg, tmp_path / "export")
    again = load_init(tmp_path / "export", cfg)
    for name, value in again.arrays().items():
        np.testing.assert_array_equal(value, tensors[name])


def test_a_plain_safetensors_file_with_training_names_seeds_a_run(
    bus: RedisBus, run_id: str, tmp_path: Path
) -> None:
    from safetensors.numpy import save_file

    cfg = _cfg(run_id)
    _, own = _pretrained(tmp_path)
    file = tmp_path / "weights.safetensors"
    save_file({f"hf.{n}": v for n, v in own.items()}, str(file))
    source = load_init(file, cfg)
    assert set(source.arrays()) == {f"hf.{n}" for n in own}


def test_weights_that_do_not_fit_are_refused_before_a_run_is_created(
    run_id: str, tmp_path: Path
) -> None:
    from safetensors.numpy import save_file

    cfg = _cfg(run_id)
    _, own = _pretrained(tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    cases = {
        "lacks": {n: v for n, v in own.items() if n != name},
        "shape": {**own, name: np.zeros((3, 3), np.float32)},
        "does not have": {**own, "extra.weight": np.zeros(4, np.float32)},
    }
    for words, tensors in cases.items():
        file = tmp_path / f"{words.replace(' ', '_')}.safetensors"
        save_file(tensors, str(file))
        with pytest.raises(ConfigError, match=words):
            load_init(file, cfg)
    with pytest.raises(ConfigError, match=r"no model\.safetensors"):
        load_init(tmp_path, cfg)  # a directory without weights
    with pytest.raises(ConfigError, match="no such file"):
        load_init(tmp_path / "missing", cfg)
