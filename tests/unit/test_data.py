"""Data: sources, held-out split, disjoint shards, epochs and exact resumption."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dd_queue.data import (
    Batch,
    DataSpec,
    ImageDataset,
    ShardLoader,
    ShardSpec,
    TextDataset,
    TokenCorpus,
    build_dataset,
    build_loader,
    hash_permutation,
    holdout_split,
    image_set_from_arrays,
    list_text_files,
    load_corpus,
    load_digits,
    load_npz,
    load_token_bin,
    stdlib_root,
)
from dd_queue.errors import ConfigError

torch.set_num_threads(1)

SMALL_STDLIB = DataSpec(max_bytes=256 * 1024, batch_size=4)


def _random_corpus(n_bytes: int, seed: int = 0) -> TokenCorpus:
    return TokenCorpus.from_bytes(np.random.default_rng(seed).bytes(n_bytes))


def _loaders(dataset: TextDataset | ImageDataset, count: int, seed: int = 0) -> list[ShardLoader]:
    return [
        ShardLoader(dataset, batch_size=3, shard=ShardSpec(i, count, seed), eval_fraction=0.1)
        for i in range(count)
    ]


def _same(a: Batch, b: Batch) -> bool:
    return torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


# --- permutations and the split ----------------------------------------------------------------


def test_hash_permutation_is_pinned_across_versions() -> None:
    # Pinned values: a change here silently changes every run's data order. Do not update
    # them unless the data order is meant to change (and say so in the changelog).
    assert hash_permutation(12, 0).tolist() == [1, 4, 5, 11, 7, 6, 9, 0, 10, 3, 2, 8]
    assert hash_permutation(12, 1, 2, 3).tolist() == [0, 7, 5, 8, 3, 6, 9, 10, 2, 1, 11, 4]


@given(n=st.integers(0, 300), key=st.lists(st.integers(0, 2**64 - 1), max_size=3))
def test_hash_permutation_is_a_permutation(n: int, key: list[int]) -> None:
    perm = hash_permutation(n, *key)
    assert sorted(perm.tolist()) == list(range(n))


def test_bad_keys_and_fractions_raise_config_error() -> None:
    with pytest.raises(ConfigError):
        hash_permutation(3, -1)
    with pytest.raises(ConfigError):
        holdout_split(10, 1.0)
    with pytest.raises(ConfigError):
        ShardSpec(index=4, count=4)


def test_holdout_is_the_tail_with_at_least_one_example() -> None:
    train, held = holdout_split(101, 0.05)
    assert held.tolist() == list(range(95, 101))  # ceil(0.05 · 101) = 6
    assert train.tolist() == list(range(95))
    assert len(holdout_split(3, 0.01)[1]) == 1 and len(holdout_split(3, 0.0)[1]) == 0


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(16, 400),
    count=st.integers(1, 8),
    seed=st.integers(0, 2**32),
    eval_fraction=st.sampled_from([0.0, 0.05, 0.2, 0.5]),
)
def test_shards_are_disjoint_and_cover_training_ids_with_holdout(
    n: int, count: int, seed: int, eval_fraction: float
) -> None:
    train, held = holdout_split(n, eval_fraction)
    shards = [ShardSpec(i, count, seed).select(train) for i in range(count)]
    every = np.concatenate([*shards, held])
    assert sorted(every.tolist()) == list(range(n))  # exact cover: no gap, no overlap
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_too_many_shards_for_the_data_is_a_config_error() -> None:
    dataset = TextDataset(_random_corpus(100), seq_len=9)  # 10 windows
    with pytest.raises(ConfigError, match="cannot fill"):
        ShardLoader(dataset, batch_size=1, shard=ShardSpec(0, 12), eval_fraction=0.1)


# --- the stdlib corpus -------------------------------------------------------------------------


def test_stdlib_corpus_is_real_python_text_in_a_stable_order() -> None:
    files = list_text_files(stdlib_root())
    assert len(files) > 100 and all(f.suffix in {".py", ".rst", ".txt"} for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert list_text_files(stdlib_root()) == files  # deterministic
    corpus = load_corpus(SMALL_STDLIB)
    assert corpus.vocab_size == 256 and len(corpus.tokens) == 256 * 1024
    text = corpus.tokens.tobytes()
    assert b"def " in text and b"import " in text


def test_stdlib_shards_and_holdout_cover_every_window_exactly_once() -> None:
    dataset = build_dataset(SMALL_STDLIB, seq_len=64)
    loaders = _loaders(dataset, count=4)
    ids = np.concatenate([ld.shard_ids for ld in loaders] + [loaders[0].eval_ids])
    assert sorted(ids.tolist()) == list(range(dataset.n_examples))
    assert all(np.array_equal(ld.eval_ids, loaders[0].eval_ids) for ld in loaders)


def test_text_batches_are_shifted_windows_of_the_corpus() -> None:
    dataset = TextDataset(_random_corpus(5000), seq_len=16)
    batch = dataset.gather(np.array([0, 7]))
    tokens = torch.from_numpy(dataset.corpus.tokens.astype(np.int64))
    assert batch.inputs.dtype == batch.targets.dtype == torch.int64
    assert torch.equal(batch.inputs[1], tokens[7 * 17 : 7 * 17 + 16])
    assert torch.equal(batch.targets[1], tokens[7 * 17 + 1 : 7 * 17 + 17])
    assert batch.n_tokens == 2 * 16


def test_two_processes_build_identical_views() -> None:
    a = build_loader(SMALL_STDLIB, seq_len=32, shard=ShardSpec(1, 3, seed=5))
    b = build_loader(SMALL_STDLIB, seq_len=32, shard=ShardSpec(1, 3, seed=5))
    assert a.state_dict() == b.state_dict()
    assert all(_same(next(a), next(b)) for _ in range(20))
    other_seed = build_loader(SMALL_STDLIB, seq_len=32, shard=ShardSpec(1, 3, seed=6))
    assert not np.array_equal(a.shard_ids, other_seed.shard_ids)
    assert np.array_equal(a.eval_ids, other_seed.eval_ids)  # held-out does not depend on seed


# --- epochs and resumption ---------------------------------------------------------------------


def test_each_epoch_visits_the_shard_once_in_a_new_order() -> None:
    dataset = TextDataset(_random_corpus(20_000), seq_len=15)  # 1250 windows
    loader = ShardLoader(dataset, batch_size=7, shard=ShardSpec(2, 4, seed=1))
    size = len(loader.shard_ids)
    seen = loader.cursor.take(size)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 0
    second = loader.cursor.take(size)
    assert sorted(seen.tolist()) == sorted(second.tolist()) == sorted(loader.shard_ids.tolist())
    assert not np.array_equal(seen, second)


@settings(max_examples=40, deadline=None)
@given(
    n_bytes=st.integers(200, 3000),
    count=st.integers(1, 4),
    data=st.data(),
    batch_size=st.integers(1, 7),
    stop=st.integers(0, 25),
    more=st.integers(1, 15),
)
def test_resuming_from_saved_state_yields_exactly_the_continuation(
    n_bytes: int, count: int, data: st.DataObject, batch_size: int, stop: int, more: int
) -> None:
    dataset = TextDataset(_random_corpus(n_bytes, seed=n_bytes), seq_len=7)
    index = data.draw(st.integers(0, count - 1))
    shard = ShardSpec(index, count, seed=3)
    if len(holdout_split(dataset.n_examples, 0.1)[0]) < count:
        return
    reference = ShardLoader(dataset, batch_size=batch_size, shard=shard, eval_fraction=0.1)
    expected = [next(reference) for _ in range(stop + more)][stop:]
    first = ShardLoader(dataset, batch_size=batch_size, shard=shard, eval_fraction=0.1)
    for _ in range(stop):
        next(first)
    saved = json.loads(json.dumps(first.state_dict()))  # it must survive JSON
    restarted = ShardLoader(dataset, batch_size=batch_size, shard=shard, eval_fraction=0.1)
    restarted.load_state_dict(saved)
    assert all(_same(next(restarted), want) for want in expected)


def test_saved_state_of_another_shard_or_dataset_is_refused() -> None:
    dataset = TextDataset(_random_corpus(4000), seq_len=15)
    saved = ShardLoader(dataset, batch_size=2, shard=ShardSpec(0, 2)).state_dict()
    with pytest.raises(ConfigError, match="shard"):
        ShardLoader(dataset, batch_size=2, shard=ShardSpec(1, 2)).load_state_dict(saved)
    with pytest.raises(ConfigError, match="seed"):
        ShardLoader(dataset, batch_size=2, shard=ShardSpec(0, 2, seed=1)).load_state_dict(saved)
    other = TextDataset(_random_corpus(4000, seed=9), seq_len=15)
    with pytest.raises(ConfigError, match="dataset"):
        ShardLoader(other, batch_size=2, shard=ShardSpec(0, 2)).load_state_dict(saved)
    with pytest.raises(ConfigError, match="invalid"):
        loader = ShardLoader(dataset, batch_size=2, shard=ShardSpec(0, 2))
        loader.load_state_dict({**saved, "position": 10**6})


def test_eval_batches_cover_the_holdout_in_a_fixed_order() -> None:
    dataset = TextDataset(_random_corpus(8000), seq_len=15)  # 500 windows, 25 held out
    loader = ShardLoader(dataset, batch_size=4, eval_fraction=0.05)
    batches = list(loader.eval_batches(batch_size=10))
    assert [b.n_tokens for b in batches] == [150, 150, 75]
    assert len(list(loader.eval_batches(max_batches=2))) == 2
    again = list(loader.eval_batches(batch_size=10))
    assert all(_same(a, b) for a, b in zip(batches, again, strict=True))


# --- other text sources ------------------------------------------------------------------------


def test_token_bin_is_memory_mapped_uint16(tmp_path: Path) -> None:
    ids = np.arange(1000, dtype=np.uint16) * 50
    path = tmp_path / "train.bin"
    ids.tofile(path)
    corpus = load_token_bin(path, vocab_size=50257)
    assert isinstance(corpus.tokens, np.memmap) and corpus.vocab_size == 50257
    loader = build_loader(
        DataSpec(source="token-bin", path=str(path), batch_size=2), seq_len=9, shard=ShardSpec()
    )
    batch = next(loader)
    window = int(batch.inputs[0, 0]) // 50
    assert batch.inputs[0].tolist() == [50 * (window + i) for i in range(9)]
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ConfigError, match="even size"):
        load_token_bin(tmp_path / "odd.bin")
    with pytest.raises(ConfigError, match="cannot read"):
        load_token_bin(tmp_path / "missing.bin")


def test_text_files_from_a_directory_or_glob_skip_binary_and_respect_the_cap(
    tmp_path: Path,
) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha " * 20)
    (tmp_path / "sub" / "b.py").write_text("beta = 1\n" * 20)
    (tmp_path / "c.txt").write_bytes(b"\x00binary")
    (tmp_path / "d.md").write_text("not a listed suffix")
    spec = DataSpec(source="text-files", path=str(tmp_path), max_bytes=10_000)
    text = load_corpus(spec).tokens.tobytes()
    assert len(text) == 120 + 180 and b"\x00" not in text and b"suffix" not in text
    globbed = DataSpec(source="text-files", path=str(tmp_path / "**" / "*.py"), max_bytes=50)
    assert load_corpus(globbed).tokens.tobytes() == b"beta = 1\n" * 5 + b"beta "
    with pytest.raises(ConfigError, match="no readable text"):
        build_dataset(DataSpec(source="text-files", path=str(tmp_path / "*.none")), seq_len=4)
    with pytest.raises(ConfigError, match=r"needs data\.path"):
        DataSpec(source="text-files")


# --- images ------------------------------------------------------------------------------------


def _write_npz(path: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    np.savez(path, images=images, labels=labels)
    return path


def test_npz_images_load_standardised_and_shard(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(50, 6, 6), dtype=np.uint8)
    labels = np.arange(50) % 5  # sorted files are common: the fixed shuffle must mix them
    path = _write_npz(tmp_path / "set.npz", images, labels)
    image_set = load_npz(path)
    assert image_set.images.shape == (50, 1, 6, 6) and image_set.images.max() <= 1.0
    dataset = ImageDataset(image_set)
    assert abs(float(dataset.images.mean())) < 1e-5 and float(
        dataset.images.std()
    ) == pytest.approx(1, rel=1e-2)
    loaders = _loaders(dataset, count=3)
    ids = np.concatenate([ld.shard_ids for ld in loaders] + [loaders[0].eval_ids])
    assert sorted(ids.tolist()) == list(range(50))
    batch = next(loaders[0])
    assert batch.inputs.dtype == torch.float32 and batch.targets.dtype == torch.int64
    assert batch.inputs.shape == (3, 1, 6, 6) and batch.n_tokens == 3
    held_labels = set(dataset.labels[torch.from_numpy(loaders[0].eval_ids)].tolist())
    assert len(held_labels) > 1


def test_channel_last_arrays_are_transposed_and_bad_arrays_refused(tmp_path: Path) -> None:
    rgb = np.zeros((4, 8, 8, 3), dtype=np.float32)
    assert image_set_from_arrays(rgb, np.zeros(4, dtype=np.int64), name="x").images.shape == (
        4,
        3,
        8,
        8,
    )
    with pytest.raises(ConfigError, match="labels"):
        image_set_from_arrays(rgb, np.array([0, 1, 2, -1]), name="x")
    with pytest.raises(ConfigError, match="out of range"):
        image_set_from_arrays(rgb, np.array([0, 1, 2, 9]), name="x", n_classes=5)
    with pytest.raises(ConfigError, match="need images"):
        image_set_from_arrays(rgb, np.zeros(3, dtype=np.int64), name="x")
    np.savez(tmp_path / "bad.npz", pictures=rgb)
    with pytest.raises(ConfigError, match="lacks array"):
        load_npz(tmp_path / "bad.npz")


def test_digits_load_when_scikit_learn_is_installed() -> None:
    if importlib.util.find_spec("sklearn") is None:
        with pytest.raises(ConfigError, match="scikit-learn"):
            load_digits()
        return
    digits = load_digits()
    assert digits.images.shape == (1797, 1, 8, 8) and digits.n_classes == 10
    assert digits.images.min() >= 0.0 and digits.images.max() == 1.0
