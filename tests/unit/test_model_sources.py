"""Model sources (preset | hf | module): one architecture description, one builder, one digest.

Invariants: an hf config read from a file or given inline identifies the same architecture; the
builder's seeded init is reproducible and leaves torch's global random state alone; a meta build
allocates nothing; embeddings are found by module type (tied heads included); an hf export
loads back in ``transformers`` bit for bit; config mistakes are refused with the fix named; the
run digest's five parts each move with their own settings only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dd_queue.config import DDQConfig, digest_mismatch, load_config, validate_config
from dd_queue.config.schema import RUN_DIGEST_PARTS
from dd_queue.core.fragments import plan_fragments, shapes_from_named
from dd_queue.data.batch import Batch
from dd_queue.errors import ConfigError
from dd_queue.models.arch import DEFAULT_SEQ_LEN, Architecture, parse_factory, read_hf_config
from dd_queue.models.base import IGNORE_INDEX, ModelOutput
from dd_queue.models.builder import build, embedding_names
from dd_queue.synchronizer.export import HF_METADATA, check_export

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
HERE = "tests.unit.test_model_sources"
VOCAB = 128
LLAMA = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "tie_word_embeddings": True,
}
DIGEST_RE = re.compile(r"[0-9a-f]{8}(-[0-9a-f]{8}){4}")


# --- test modules for model.source: module (importable as tests.unit.test_model_sources:...) ---


class LookupLM(nn.Module):
    """An embedding whose name has no 'embed' in it; forward(inputs) → logits (B, T, V)."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.lookup = nn.Embedding(vocab_size, width)
        self.mix = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab_size, bias=False)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.out(torch.tanh(self.mix(self.lookup(inputs))))


class HeadFirstTiedLM(nn.Module):
    """A tied head registered before the embedding: the shared tensor is named after the head."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.lookup = nn.Embedding(vocab_size, width)
        self.lookup.weight = self.head.weight

    def forward(self, inputs: Tensor) -> Tensor:
        return self.head(self.lookup(inputs))


class ScalarLossLM(LookupLM):
    """adapter 'batch': forward(batch) → the scalar loss itself."""

    def forward(self, batch: Batch) -> Tensor:  # type: ignore[override]
        logits = super().forward(batch.inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch.targets.reshape(-1))


class OutputLM(LookupLM):
    """adapter 'batch': forward(batch) → a full ModelOutput (with an aux loss)."""

    def forward(self, batch: Batch) -> ModelOutput:  # type: ignore[override]
        logits = super().forward(batch.inputs)
        task = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch.targets.reshape(-1))
        aux = logits.pow(2).mean()
        return ModelOutput(
            loss=task + 0.1 * aux, task_loss=task.detach(), logits=logits, aux_loss=aux
        )


class BatchLogitsLM(LookupLM):
    """adapter 'batch' misuse: forward(batch) → logits, not a loss."""

    def forward(self, batch: Batch) -> Tensor:  # type: ignore[override]
        return super().forward(batch.inputs)


class FlatLM(LookupLM):
    """adapter 'logits' misuse: returns (B, V), not (B, T, V)."""

    def forward(self, inputs: Tensor) -> Tensor:
        return super().forward(inputs).mean(dim=1)


class WrappedLogitsLM(LookupLM):
    """adapter 'logits': an object with .logits, as transformers models return."""

    @dataclasses.dataclass
    class Out:
        logits: Tensor

    def forward(self, inputs: Tensor) -> WrappedLogitsLM.Out:  # type: ignore[override]
        return self.Out(super().forward(inputs))


def lookup_lm(vocab_size: int, width: int = 16) -> LookupLM:
    return LookupLM(vocab_size, width)


def head_first_tied_lm(vocab_size: int, width: int = 16) -> HeadFirstTiedLM:
    return HeadFirstTiedLM(vocab_size, width)


def scalar_loss_lm(vocab_size: int, width: int = 16) -> ScalarLossLM:
    return ScalarLossLM(vocab_size, width)


def output_lm(vocab_size: int, width: int = 16) -> OutputLM:
    return OutputLM(vocab_size, width)


def batch_logits_lm(vocab_size: int, width: int = 16) -> BatchLogitsLM:
    return BatchLogitsLM(vocab_size, width)


def flat_lm(vocab_size: int, width: int = 16) -> FlatLM:
    return FlatLM(vocab_size, width)


def wrapped_logits_lm(vocab_size: int, width: int = 16) -> WrappedLogitsLM:
    return WrappedLogitsLM(vocab_size, width)


def not_a_module(vocab_size: int) -> dict[str, int]:
    return {"vocab_size": vocab_size}


# --- helpers ---


def _hf_cfg(**model: object) -> DDQConfig:
    return validate_config({"model": {"source": "hf", **model}})


def _module_cfg(factory: str, **model: object) -> DDQConfig:
    fields = {"source": "module", "factory": factory, "vocab_size": 64, "seq_len": 16, **model}
    return validate_config({"model": fields})


def _batch(vocab: int, b: int = 2, t: int = 16, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t + 1), generator=g)
    return Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), b * t)


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def hf_arch() -> Architecture:
    return _hf_cfg(hf_options=LLAMA).model.architecture()


@pytest.fixture(scope="module")
def hf_model(hf_arch: Architecture) -> nn.Module:
    return build(hf_arch, seed=3, device="cpu")


# --- 1. hf: identity, seeded build, meta, tied embeddings, forward/backward ---


def test_hf_inline_config_resolves_to_an_hf_architecture(hf_arch):
    assert (hf_arch.source, hf_arch.family, hf_arch.vocab_size) == ("hf", "hf", VOCAB)
    assert hf_arch.seq_len == DEFAULT_SEQ_LEN
    assert not hf_arch.is_image
    assert dict(hf_arch.hf_config) == LLAMA
    assert re.fullmatch(r"[0-9a-f]{12}", hf_arch.digest)
    assert "llama" in hf_arch.describe() and hf_arch.digest in hf_arch.describe()


def test_hf_config_file_plus_inline_override_equals_the_inline_config(tmp_path, hf_arch):
    on_disk = {**LLAMA, "hidden_size": 64, "transformers_version": "4.0", "architectures": ["X"]}
    (tmp_path / "config.json").write_text(json.dumps(on_disk))
    from_dir = _hf_cfg(hf_config=str(tmp_path), hf_options={"hidden_size": 32})
    from_file = _hf_cfg(hf_config=str(tmp_path / "config.json"), hf_options={"hidden_size": 32})
    for cfg in (from_dir, from_file):
        arch = cfg.model.architecture()
        assert arch.identity() == hf_arch.identity()
        assert arch.digest == hf_arch.digest
    assert from_dir.run_digest == _hf_cfg(hf_options=LLAMA).run_digest
    # the file's own value, not overridden, is another architecture
    other = _hf_cfg(hf_config=str(tmp_path)).model.architecture()
    assert other.identity() != hf_arch.identity() and other.digest != hf_arch.digest
    # model.vocab_size equal to the config's is allowed and changes nothing
    same = _hf_cfg(hf_options=LLAMA, vocab_size=VOCAB).model.architecture()
    assert same.identity() == hf_arch.identity()


def test_read_hf_config_drops_volatile_keys_and_inline_wins(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**LLAMA, "torch_dtype": "bfloat16", "dtype": "bfloat16", "_name_or_path": "x"})
    )
    keys = read_hf_config(str(tmp_path), {"num_hidden_layers": 1})
    assert keys == {**LLAMA, "num_hidden_layers": 1}


def test_hf_seeded_build_is_reproducible_and_seed_dependent(hf_arch, hf_model):
    again = _params(build(hf_arch, seed=3, device="cpu"))
    first = _params(hf_model)
    assert list(again) == list(first)
    assert all(torch.equal(first[n], again[n]) for n in first)
    other = _params(build(hf_arch, seed=4, device="cpu"))
    assert any(not torch.equal(first[n], other[n]) for n in first)
    assert not torch.equal(
        first["hf.model.embed_tokens.weight"], other["hf.model.embed_tokens.weight"]
    )


def _arch_of(source: str, hf_arch: Architecture) -> Architecture:
    if source == "hf":
        return hf_arch
    if source == "module":
        return _module_cfg(f"{HERE}:lookup_lm").model.architecture()
    return validate_config({"model": {"n_layers": 1}}).model.architecture()


@pytest.mark.parametrize(
    "source",
    ["hf", "module", "preset"],
)
def test_seeded_build_leaves_torchs_global_rng_alone(source, hf_arch):
    arch = _arch_of(source, hf_arch)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    build(arch, seed=5, device="cpu")
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("source", ["hf", "module", "preset"])
def test_seeded_build_does_not_depend_on_torchs_global_rng(source, hf_arch):
    arch = _arch_of(source, hf_arch)
    torch.manual_seed(1)
    a = _params(build(arch, seed=5, device="cpu"))
    torch.manual_seed(2)
    b = _params(build(arch, seed=5, device="cpu"))
    assert list(a) == list(b)
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("source", ["hf", "module", "preset"])
def test_a_meta_build_has_the_cpu_builds_names_shapes_and_dtypes(source, hf_arch):
    """Value writes are skipped on meta (``_NoMetaValues``); nothing a plan reads may change."""
    arch = _arch_of(source, hf_arch)
    meta, cpu = build(arch, seed=0, device="meta"), build(arch, seed=0, device="cpu")

    def layout(m: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype, bool]]:
        return {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters()}

    assert layout(meta) == layout(cpu)
    assert all(p.is_meta for p in meta.parameters())
    assert embedding_names(meta) == embedding_names(cpu)


def test_planning_on_meta_does_not_import_torch_dynamo():
    """The synchronizer plans from a meta build at every (re)start; on meta tensors the modules'
    init ran through torch's Python references, which import ``torch._dynamo`` (~1 s)."""
    code = (
        "import sys; from dd_queue.config import load_config; "
        "from dd_queue.synchronizer.source import ConfigModelSource, plan_of; "
        "cfg = load_config('demo', {}); "
        "plan_of(ConfigModelSource(cfg.model, 0), cfg.synchronizer); "
        "print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "False"


def test_hf_meta_build_has_the_cpu_names_and_shapes_and_no_storage(hf_arch, hf_model):
    state = torch.get_rng_state()
    meta = build(hf_arch, seed=3, device="meta")
    assert torch.equal(torch.get_rng_state(), state)
    cpu_shapes = {n: tuple(p.shape) for n, p in hf_model.named_parameters()}
    assert {n: tuple(p.shape) for n, p in meta.named_parameters()} == cpu_shapes
    assert all(p.is_meta for p in meta.parameters())
    assert all(b.is_meta for b in meta.buffers())
    assert embedding_names(meta) == embedding_names(hf_model)


def test_hf_tied_head_is_one_parameter_named_as_the_embedding(hf_model):
    names = [n for n, _ in hf_model.named_parameters()]
    assert not any("lm_head" in n for n in names)
    assert all(n.startswith("hf.") for n in names)
    assert embedding_names(hf_model) == {"hf.model.embed_tokens.weight"}
    hf = hf_model.hf
    assert hf.lm_head.weight is hf.model.embed_tokens.weight


def test_hf_untied_head_is_not_an_embedding():
    arch = _hf_cfg(hf_options={**LLAMA, "tie_word_embeddings": False}).model.architecture()
    model = build(arch, seed=0, device="meta")
    names = {n for n, _ in model.named_parameters()}
    assert "hf.lm_head.weight" in names
    assert embedding_names(model) == {"hf.model.embed_tokens.weight"}


def test_hf_buffers_are_not_parameters(hf_model):
    buffers = {n for n, _ in hf_model.named_buffers()}
    assert any("inv_freq" in n for n in buffers)
    assert not buffers & {n for n, _ in hf_model.named_parameters()}


def test_hf_forward_loss_is_about_ln_vocab_and_backward_reaches_every_parameter(hf_arch):
    model = build(hf_arch, seed=3, device="cpu")
    batch = _batch(VOCAB)
    out = model(batch)
    assert isinstance(out, ModelOutput)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    assert out.logits.shape == (2, 16, VOCAB)
    assert abs(out.loss.item() - math.log(VOCAB)) < 0.5
    assert torch.equal(out.task_loss, out.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    assert model.hf.model.embed_tokens.weight.grad.abs().sum() > 0


def test_hf_loss_skips_ignored_targets(hf_model):
    batch = _batch(VOCAB)
    targets = batch.targets.clone()
    targets[:, 1:] = IGNORE_INDEX
    with torch.no_grad():
        out = hf_model(Batch(batch.inputs, targets, 2))
        expected = F.cross_entropy(out.logits[:, 0].float(), targets[:, 0])
    assert torch.allclose(out.loss, expected)


# --- 2. save_hf round trip ---


def test_save_hf_round_trips_bit_for_bit_through_from_pretrained(tmp_path, hf_arch, hf_model):
    from transformers import AutoModelForCausalLM

    from dd_queue.models.hf import save_hf

    g = torch.Generator().manual_seed(9)
    arrays = {
        n: (p.detach() + 0.01 * torch.randn(p.shape, generator=g)).numpy()
        for n, p in hf_model.named_parameters()
    }
    files = save_hf(hf_arch, arrays, tmp_path / "out")
    assert {"config.json", "model.safetensors"} <= set(files)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    got = {n: p.detach() for n, p in loaded.named_parameters()}
    assert set(got) == {n.removeprefix("hf.") for n in arrays}
    for name, value in arrays.items():
        assert torch.equal(got[name.removeprefix("hf.")], torch.from_numpy(value)), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # the exported config.json is a valid model.hf_config: same parameter names and shapes
    again = _hf_cfg(hf_config=str(tmp_path / "out")).model.architecture()
    rebuilt = build(again, seed=0, device="meta")
    assert {n: p.shape for n, p in rebuilt.named_parameters()} == {
        n: p.shape for n, p in hf_model.named_parameters()
    }


def test_save_hf_refuses_arrays_that_do_not_fit(tmp_path, hf_arch, hf_model):
    from dd_queue.models.hf import save_hf

    arrays = {n: p.detach().numpy().copy() for n, p in hf_model.named_parameters()}
    missing = dict(arrays)
    del missing["hf.model.norm.weight"]
    with pytest.raises(ConfigError, match=r"missing \['hf\.model\.norm\.weight'\]"):
        save_hf(hf_arch, missing, tmp_path / "a")
    extra = {**arrays, "hf.bogus.weight": np.zeros(3, np.float32)}
    with pytest.raises(ConfigError, match=r"unexpected \['hf\.bogus\.weight'\]"):
        save_hf(hf_arch, extra, tmp_path / "b")
    wrong = {**arrays, "hf.model.norm.weight": np.zeros(31, np.float32)}
    with pytest.raises(
        ConfigError, match=r"hf\.model\.norm\.weight: shape \(31,\), model has \(32,\)"
    ):
        save_hf(hf_arch, wrong, tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


# --- 3. module ---


def test_example_module_via_config_gets_model_vocab_size():
    cfg = _module_cfg(
        "dd_queue.models.example_module:build",
        vocab_size=96,
        seq_len=32,
        factory_kwargs={"d_model": 32, "n_layers": 1, "n_heads": 2, "max_len": 64},
    )
    arch = cfg.model.architecture()
    assert (arch.source, arch.family, arch.vocab_size, arch.seq_len) == ("module", "module", 96, 32)
    assert arch.identity()["factory_kwargs"] == {
        "d_model": 32,
        "n_layers": 1,
        "n_heads": 2,
        "max_len": 64,
    }
    assert "dd_queue.models.example_module:build" in arch.describe()
    model = build(arch, seed=0, device="cpu")
    assert model.net.tokens.num_embeddings == 96
    assert embedding_names(model) == {"net.tokens.weight", "net.positions.weight"}
    out = model(_batch(96, t=32))
    assert out.logits.shape == (2, 32, 96)
    assert torch.isfinite(out.loss) and abs(out.loss.item() - math.log(96)) < 0.5


def test_factory_kwargs_vocab_size_is_left_as_given():
    cfg = _module_cfg(f"{HERE}:lookup_lm", vocab_size=64, factory_kwargs={"vocab_size": 32})
    model = build(cfg.model.architecture(), seed=0, device="meta")
    assert model.net.lookup.num_embeddings == 32


def test_an_embedding_not_named_embed_is_planned_as_an_embedding():
    model = build(_module_cfg(f"{HERE}:lookup_lm").model.architecture(), seed=0, device="meta")
    emb = embedding_names(model)
    assert emb == {"net.lookup.weight"}
    shapes = shapes_from_named((n, p.shape) for n, p in model.named_parameters())
    with_names = plan_fragments(shapes, 1, embedding_names=emb)
    without = plan_fragments(shapes, 1)
    assert with_names.locate("net.lookup.weight")[1].is_embedding is True
    assert without.locate("net.lookup.weight")[1].is_embedding is False
    for name in ("net.mix.weight", "net.out.weight"):
        assert with_names.locate(name)[1].is_embedding is False
    assert with_names.digest != without.digest


def test_a_tied_head_registered_first_counts_as_the_embedding():
    model = build(_module_cfg(f"{HERE}:head_first_tied_lm").model.architecture(), seed=0)
    assert [n for n, _ in model.named_parameters()] == ["net.head.weight"]
    assert embedding_names(model) == {"net.head.weight"}


def test_adapter_batch_with_a_scalar_loss():
    model = build(
        _module_cfg(f"{HERE}:scalar_loss_lm", adapter="batch").model.architecture(), seed=0
    )
    out = model(_batch(64))
    assert isinstance(out, ModelOutput)
    assert out.loss.ndim == 0 and out.loss.requires_grad
    assert torch.equal(out.task_loss, out.loss.detach()) and not out.task_loss.requires_grad
    assert out.logits.numel() == 0
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_adapter_batch_with_a_model_output_passes_it_through():
    model = build(_module_cfg(f"{HERE}:output_lm", adapter="batch").model.architecture(), seed=0)
    out = model(_batch(64))
    assert isinstance(out, ModelOutput)
    assert out.aux_loss is not None and out.logits.shape == (2, 16, 64)
    assert torch.allclose(out.loss, out.task_loss + 0.1 * out.aux_loss)


def test_adapter_batch_refuses_logits():
    model = build(
        _module_cfg(f"{HERE}:batch_logits_lm", adapter="batch").model.architecture(), seed=0
    )
    with pytest.raises(ConfigError, match=r"ModelOutput or a scalar loss tensor"):
        model(_batch(64))


def test_adapter_logits_accepts_an_object_with_logits():
    model = build(_module_cfg(f"{HERE}:wrapped_logits_lm").model.architecture(), seed=0)
    out = model(_batch(64))
    assert out.logits.shape == (2, 16, 64) and torch.isfinite(out.loss)


def test_adapter_logits_refuses_2d_output_and_points_to_adapter_batch():
    model = build(_module_cfg(f"{HERE}:flat_lm").model.architecture(), seed=0)
    with pytest.raises(ConfigError, match=r"logits \(B, T, vocab\).*adapter 'batch'"):
        model(_batch(64))


# --- 4. config errors ---


def _refused(model: dict[str, object], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        validate_config({"model": model})


def test_hf_without_config_or_model_type_is_refused():
    _refused({"source": "hf"}, r"lacks \['model_type', 'vocab_size'\].*model\.hf_options")
    _refused(
        {"source": "hf", "hf_options": {"vocab_size": 64}},
        r"lacks \['model_type'\].*set model\.hf_config .* or give the keys in model\.hf_options",
    )


def test_hf_config_missing_dir_is_refused(tmp_path):
    missing = tmp_path / "nope"
    _refused(
        {"source": "hf", "hf_config": str(missing)},
        r"model\.hf_config .*nope.*cannot read.*give a directory holding config\.json",
    )
    (tmp_path / "empty").mkdir()
    _refused({"source": "hf", "hf_config": str(tmp_path / "empty")}, r"cannot read .*config\.json")


def test_hf_config_not_json_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("model_type: llama\n")
    _refused(
        {"source": "hf", "hf_config": str(tmp_path)}, r"model\.hf_config .*config\.json is not JSON"
    )
    (tmp_path / "list.json").write_text("[1, 2]")
    _refused({"source": "hf", "hf_config": str(tmp_path / "list.json")}, r"must hold a JSON object")


def test_hf_with_a_preset_field_is_refused():
    _refused(
        {"source": "hf", "hf_options": LLAMA, "n_layers": 3},
        r"model\.n_layers shape a preset; with model\.source 'hf' set them in model\.hf_options",
    )
    _refused(
        {"source": "module", "factory": f"{HERE}:lookup_lm", "vocab_size": 64, "d_model": 32},
        r"model\.d_model .* set them in model\.factory_kwargs",
    )


def test_hf_with_a_different_model_vocab_size_is_refused():
    _refused(
        {"source": "hf", "hf_options": LLAMA, "vocab_size": 256},
        r"model\.vocab_size 256 differs from the hf config's vocab_size 128: set it in one place",
    )


def test_hf_with_a_bad_vocab_size_is_refused():
    _refused(
        {"source": "hf", "hf_options": {**LLAMA, "vocab_size": 1}},
        r"vocab_size must be an integer >= 2",
    )


def test_module_without_factory_or_vocab_size_is_refused():
    need = r"model\.source 'module' needs model\.factory .* and model\.vocab_size"
    _refused({"source": "module", "vocab_size": 64}, need)
    _refused({"source": "module", "factory": f"{HERE}:lookup_lm"}, need)


@pytest.mark.parametrize("factory", ["dd_queue.models.example_module.build", "a:", ":b", "a-b:c"])
def test_a_factory_not_of_the_module_callable_form_is_refused(factory):
    _refused(
        {"source": "module", "factory": factory, "vocab_size": 64},
        r"must be 'package\.module:callable'",
    )
    with pytest.raises(ConfigError):
        parse_factory(factory)


def test_parse_factory_splits_module_and_attribute():
    assert parse_factory("pkg.mod:Outer.build") == ("pkg.mod", "Outer.build")


@pytest.mark.parametrize(
    "factory", ["no_such_package_ddq.models:build", "dd_queue.models.example_module:no_such"]
)
def test_an_unimportable_factory_is_refused_at_build_time(factory):
    arch = _module_cfg(factory).model.architecture()  # validation only checks the form
    with pytest.raises(
        ConfigError, match=rf"model\.factory '{re.escape(factory)}' cannot be imported"
    ):
        build(arch, seed=0)


def test_a_factory_returning_no_module_is_refused():
    with pytest.raises(ConfigError, match=r"returned dict, not an nn\.Module"):
        build(_module_cfg(f"{HERE}:not_a_module").model.architecture(), seed=0)


def test_a_factory_with_bad_kwargs_is_refused():
    arch = _module_cfg(f"{HERE}:lookup_lm", factory_kwargs={"depth": 3}).model.architecture()
    with pytest.raises(ConfigError, match=r"model\.factory .*lookup_lm.*depth"):
        build(arch, seed=0)


def test_an_unknown_hf_model_type_is_refused_at_build_time():
    arch = _hf_cfg(
        hf_options={"model_type": "no-such-model-type", "vocab_size": 64}
    ).model.architecture()
    with pytest.raises(ConfigError, match=r"no-such-model-type"):
        build(arch, seed=0, device="meta")


# --- 5. run digests ---


PART_WORDS = {
    "run_id": "run.run_id",
    "model": "model.*",
    "plan": "synchronizer.n_fragments",
    "data": "data.source",
    "expected_learners": "membership.expected_learners",
}


def _parts(cfg: DDQConfig) -> dict[str, str]:
    return dict(zip(RUN_DIGEST_PARTS, cfg.run_digest.split("-"), strict=True))


def _changed(a: DDQConfig, b: DDQConfig) -> set[str]:
    pa, pb = _parts(a), _parts(b)
    return {k for k in RUN_DIGEST_PARTS if pa[k] != pb[k]}


def test_preset_run_digest_has_five_parts_and_the_preset_identity():
    cfg = load_config(CONFIG_DIR / "base.yaml")
    assert RUN_DIGEST_PARTS == ("run_id", "model", "plan", "data", "expected_learners")
    assert DIGEST_RE.fullmatch(cfg.run_digest)
    assert cfg.run_digest == load_config(CONFIG_DIR / "base.yaml").run_digest
    assert cfg.run_identity()["model"] == dataclasses.asdict(cfg.model.spec())
    assert cfg.model.architecture().identity() == dataclasses.asdict(cfg.model.spec())
    assert digest_mismatch(cfg.run_digest, cfg.run_digest) == ""


@pytest.mark.parametrize(
    ("env", "part", "words"),
    [
        (
            {"DDQ__MEMBERSHIP__EXPECTED_LEARNERS": "3"},
            "expected_learners",
            "membership.expected_learners",
        ),
        ({"DDQ__MODEL__N_LAYERS": "1"}, "model", "the model (model.*)"),
        ({"DDQ__SYNCHRONIZER__N_FRAGMENTS": "2"}, "plan", "synchronizer.n_fragments"),
        ({"DDQ__DATA__EVAL_FRACTION": "0.1"}, "data", "the data"),
        ({"DDQ__RUN__RUN_ID": "another"}, "run_id", "run.run_id"),
    ],
)
def test_each_setting_moves_only_its_own_digest_part(env, part, words):
    base = load_config(CONFIG_DIR / "base.yaml")
    changed = load_config(CONFIG_DIR / "base.yaml", env)
    assert DIGEST_RE.fullmatch(changed.run_digest)
    assert _changed(base, changed) == {part}
    message = digest_mismatch(base.run_digest, changed.run_digest)
    assert words in message
    assert [p for p, w in PART_WORDS.items() if w in message] == [part]  # one part, one reason
    assert digest_mismatch(changed.run_digest, base.run_digest) == message


def test_settings_outside_the_identity_leave_the_digest_alone():
    base = load_config(CONFIG_DIR / "base.yaml")
    other = validate_config(
        {
            "data": {"batch_size": 3, "eval_batches": 2},
            "model": {"autocast": "off", "compile": not base.model.compile},
            "redis": {"url": "redis://elsewhere:6379/0"},
        }
    )
    assert other.run_digest == base.run_digest


def test_two_parts_changed_are_both_named():
    base = load_config(CONFIG_DIR / "base.yaml")
    other = load_config(
        CONFIG_DIR / "base.yaml",
        {"DDQ__MEMBERSHIP__EXPECTED_LEARNERS": "3", "DDQ__SYNCHRONIZER__N_FRAGMENTS": "2"},
    )
    message = digest_mismatch(base.run_digest, other.run_digest)
    assert "membership.expected_learners" in message and "synchronizer.n_fragments" in message


def test_an_hf_model_change_moves_only_the_model_part():
    a = _hf_cfg(hf_options=LLAMA)
    b = _hf_cfg(hf_options={**LLAMA, "intermediate_size": 96})
    assert _changed(a, b) == {"model"}
    assert _changed(a, validate_config({})) == {"model"}


def test_another_digest_format_is_reported_as_such():
    ours = DDQConfig().run_digest
    for theirs in ("0123456789abcdef", "-".join(ours.split("-")[:4]), ours + "-00000000"):
        assert "digest format" in digest_mismatch(ours, theirs)


# --- 6. check_export ---


def test_check_export_hf_for_a_preset_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--format hf needs model\.source 'hf'.*default format"):
        check_export(DDQConfig(), tmp_path / "out", "hf")


def test_check_export_hf_targets(tmp_path):
    cfg = _hf_cfg(hf_options=LLAMA)
    check_export(cfg, tmp_path / "new", "hf")  # not there yet: fine
    (tmp_path / "empty").mkdir()
    check_export(cfg, tmp_path / "empty", "hf")
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / HF_METADATA).write_text("{}")
    (ours / "config.json").write_text("{}")
    check_export(cfg, ours, "hf")  # an earlier export may be replaced
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"foreign exists and is not an earlier hf export"):
        check_export(cfg, foreign, "hf")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"is not an earlier hf export"):
        check_export(cfg, tmp_path / "file", "hf")


def test_check_export_ddq_to_a_directory_is_refused(tmp_path):
    check_export(DDQConfig(), tmp_path / "model.safetensors", "ddq")
    with pytest.raises(ConfigError, match=r"is a directory: the ddq format is one file"):
        check_export(DDQConfig(), tmp_path, "ddq")


@pytest.mark.parametrize("fmt", ["ddq", "hf"])
def test_check_export_with_a_missing_parent_is_refused(tmp_path, fmt):
    cfg = _hf_cfg(hf_options=LLAMA)
    with pytest.raises(ConfigError, match=r"cannot export to .*: .*missing is not a directory"):
        check_export(cfg, tmp_path / "missing" / "out", fmt)
