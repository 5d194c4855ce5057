"""Train only part of the model, through the in-process runner (real learners, synchronizer
and codec on a MemoryBus): LoRA adapters on a pretrained Hugging Face model, freeze patterns,
and a ``module:factory`` model.

With LoRA only the adapters are fragments: each contribution carries the adapter's bytes, not
the model's; the frozen base stays the pretrained weights in every learner; the export's
``adapter/`` loads with peft and holds the global adapter bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dd_queue.core.fragments import unflatten_fragment
from dd_queue.models.builder import synced_parameters
from dd_queue.models.hf import ADAPTER_DIR, save_hf
from tests.unit.test_runner_support import make_runner, tiny_experiment

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LLAMA = {
    "model_type": "llama",
    "vocab_size": 256,  # bytes: the tiny experiment's stdlib text
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


NOT_PRESET = ("n_layers", "d_model", "n_heads")
# peft asks transformers a deprecated question when it wraps a model (dd_queue filters it there)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**LLAMA)
    )
    out = tmp_path_factory.mktemp("pretrained")
    model.save_pretrained(out, safe_serialization=True)
    return out


def _run(model: dict[str, Any]) -> tuple[Any, Any]:
    """The tiny runner experiment with ``model`` (the preset's shape fields cleared for hf and
    module models), 16 steps per learner."""
    shape = {} if model.get("source", "preset") == "preset" else dict.fromkeys(NOT_PRESET)
    spec = tiny_experiment(
        config={"model": {"seq_len": 16, **shape, **model}}, runner={"token_budget": 16 * 32}
    )
    runner, _, _ = make_runner(spec)
    return runner, runner.run()


def _bytes_per_contribution(runner: Any) -> float:
    """Payload bytes the synchronizer received per contribution, summed over the fragments
    (a contribution of a learner round spans every fragment)."""
    per_fragment = []
    for rt in runner.sync.fragments.values():
        counters = rt.state.counters
        settled = sum(
            v for k, v in counters.items() if "/" not in k and not k.startswith(("bytes", "rounds"))
        )
        per_fragment.append(counters["bytes_in"] / max(settled, 1))
    return float(sum(per_fragment))


def _global(runner: Any) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for p, rt in runner.sync.fragments.items():
        out |= {
            n: np.array(v) for n, v in unflatten_fragment(rt.fragment, runner.sync.theta(p)).items()
        }
    return out


def test_lora_trains_only_the_adapters_and_sends_only_their_bytes(
    pretrained: Path, tmp_path: Path
) -> None:
    hf = {"source": "hf", "hf_pretrained": str(pretrained)}
    runner, result = _run({**hf, "lora_r": 4, "lora_targets": ["q_proj", "v_proj"]})
    full_runner, _ = _run(hf)
    assert result.rounds.merged > 0 and np.isfinite(result.final.loss)
    theta = _global(runner)
    assert theta and all(".lora_A." in n or ".lora_B." in n for n in theta), sorted(theta)
    base = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    adapter_elements = sum(v.size for v in theta.values())
    full_elements = sum(p.numel() for p in base.parameters())
    assert set(_global(full_runner)) == {f"hf.{n}" for n, _ in base.named_parameters()}
    lora_bytes, full_bytes = _bytes_per_contribution(runner), _bytes_per_contribution(full_runner)
    # fp32 contributions: 4 bytes an element, plus a small header per fragment
    assert 4 * adapter_elements <= lora_bytes < 4 * adapter_elements + 4096, lora_bytes
    assert 4 * full_elements <= full_bytes < 4 * full_elements + 4096, full_bytes
    print(f"bytes per contribution: LoRA {lora_bytes:,.0f}, full fine-tuning {full_bytes:,.0f}")
    # every learner's frozen base is still the pretrained weights
    for slot in runner.slots:
        model = slot.learner.inner.model.hf.base_model.model
        for name, p in model.named_parameters():
            if "lora_" not in name:
                ref = dict(base.named_parameters())[name.replace(".base_layer", "")]
                torch.testing.assert_close(p, ref, rtol=0, atol=0, msg=name)
    # the export: the adapter alone loads with peft and holds the global adapter bit for bit
    files = save_hf(runner.cfg.model.architecture(), theta, tmp_path / "export")
    assert f"{ADAPTER_DIR}/adapter_model.safetensors" in files and "model.safetensors" in files
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(pretrained),
        tmp_path / "export" / ADAPTER_DIR,
    )
    got = {f"hf.{n}": p.detach().numpy() for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(got) == set(theta)
    for name, value in theta.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(merged(x).logits, loaded(input_ids=x).logits, atol=1e-5, rtol=0)


def test_freeze_patterns_keep_parameters_out_of_the_fragments() -> None:
    runner, result = _run({"freeze": ["wte.*"]})
    assert result.rounds.merged > 0
    theta = _global(runner)
    assert theta and not any(n.startswith("wte.") for n in theta), sorted(theta)
    for slot in runner.slots:  # the frozen embedding is the seeded init in every learner
        wte = slot.learner.inner.model.wte.weight
        assert not wte.requires_grad
        torch.testing.assert_close(
            wte, runner.slots[0].learner.inner.model.wte.weight, rtol=0, atol=0
        )


def test_a_module_factory_model_trains_through_the_in_process_runner() -> None:
    module = {
        "source": "module",
        "factory": "dd_queue.models.example_module:build",
        "factory_kwargs": {"d_model": 32, "n_layers": 1},
        "vocab_size": 256,
    }
    runner, result = _run(module)
    assert result.rounds.merged > 0 and np.isfinite(result.final.loss)
    first = result.evals[0].loss
    assert result.final.loss < first, (first, result.final.loss)
    assert {"net.tokens.weight", "net.positions.weight"} <= set(_global(runner))


def test_synced_parameters_are_the_trainable_ones(pretrained: Path) -> None:
    from dd_queue.config import validate_config
    from dd_queue.models.builder import build

    cfg = validate_config(
        {"model": {"source": "hf", "hf_pretrained": str(pretrained), "lora_r": 2}}
    )
    model = build(cfg.model.architecture(), seed=0)
    synced = synced_parameters(model)
    assert synced and all(p.requires_grad for p in synced.values())
    assert all(not p.requires_grad for n, p in model.named_parameters() if n not in synced)
