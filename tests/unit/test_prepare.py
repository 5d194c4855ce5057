"""``ddq prepare`` and the ``prepared`` source: real files, real tokenizers, no network."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from dd_queue.cli import main
from dd_queue.data import (
    DataSpec,
    Manifest,
    PreparedDataset,
    ShardLoader,
    ShardSpec,
    build_dataset,
    load_corpus,
    read_manifest,
)
from dd_queue.data.manifest import token_dtype
from dd_queue.data.prepare import prepare
from dd_queue.errors import ConfigError

torch.set_num_threads(1)

SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ber", "den", "gar", "hul", "pin")
SYLLABLES += ("qua", "zor", "ell", "ost", "ing", "th", "an", "re", "ul", "po", "fex", "wy")
N_TXT, N_SUB, N_JSONL, N_PARQUET = 120, 30, 30, 20


def _documents(n: int, seed: int) -> list[str]:
    """English-like documents: sentences of pseudo-words from a seeded word list."""
    rng = random.Random(seed)
    words = sorted(
        {"".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(400)}
    )
    docs = []
    for _ in range(n):
        sentences = [
            " ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + "."
            for _ in range(rng.randint(1, 4))
        ]
        docs.append(" ".join(sentences))
    return docs


def _write_jsonl(path: Path, texts: list[str], field: str = "text") -> None:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _is_val(text: str, fraction: float) -> bool:
    """The split rule, restated: sha256(text) as a fraction of 2**64 below val_fraction."""
    return int.from_bytes(_digest(text)[:8], "big") / 2.0**64 < fraction


def _tokens(manifest: Manifest, split: str) -> np.ndarray:
    parts = [np.fromfile(p, dtype=manifest.np_dtype) for p in manifest.paths(split)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[str]]:
    """~200 documents as .txt files (with a subdirectory), a .jsonl and a .parquet, plus an
    empty file and a binary file that are skipped. Returns (inputs, the documents)."""
    root = tmp_path_factory.mktemp("corpus")
    docs = _documents(N_TXT + N_SUB + N_JSONL + N_PARQUET, seed=7)
    texts_dir = root / "texts"
    (texts_dir / "sub").mkdir(parents=True)
    for i, text in enumerate(docs[:N_TXT]):
        (texts_dir / f"doc{i:03d}.txt").write_text(text)
    for i, text in enumerate(docs[N_TXT : N_TXT + N_SUB]):
        (texts_dir / "sub" / f"page{i:02d}.md").write_text(text)
    (texts_dir / "empty.txt").write_text("  \n")
    (texts_dir / "image.png").write_bytes(b"\x89PNG\x00\x01\x02")
    rest = docs[N_TXT + N_SUB :]
    _write_jsonl(root / "lines.jsonl", rest[:N_JSONL])
    pq.write_table(
        pa.table({"text": rest[N_JSONL:], "n": list(range(N_PARQUET))}), root / "rows.parquet"
    )
    return [texts_dir, root / "lines.jsonl", root / "rows.parquet"], docs


@pytest.fixture(scope="module")
def prepared(
    corpus: tuple[list[Path], list[str]], tmp_path_factory: pytest.TempPathFactory
) -> Manifest:
    out = tmp_path_factory.mktemp("prepared") / "out"
    return prepare(corpus[0], out, vocab_size=512, val_fraction=0.1)


# --- (a) a trained tokenizer, the manifest, the split ------------------------------------------


def test_prepare_trains_a_bpe_and_writes_a_manifest_that_matches_the_files(
    corpus: tuple[list[Path], list[str]], prepared: Manifest
) -> None:
    inputs, docs = corpus
    m = prepared
    tokenizer = Tokenizer.from_file(str(m.root / "tokenizer.json"))
    assert m.tokenizer_trained and m.dtype == "uint16" and m.vocab_size <= 512
    assert m.vocab_size == tokenizer.get_vocab_size() and m.eos_id == tokenizer.token_to_id(
        "<|endoftext|>"
    )
    raw = json.loads((m.root / "manifest.json").read_text())
    assert raw["format"] == "ddq.prepared.v1" and raw["sources"] == [str(p) for p in inputs]
    assert raw["tokenizer"] == {
        "file": "tokenizer.json",
        "sha256": hashlib.sha256((m.root / "tokenizer.json").read_bytes()).hexdigest(),
        "trained": True,
    }
    assert read_manifest(m.root) == m == read_manifest(m.root / "manifest.json")
    for split in (m.train, m.val):
        for entry in split.files:
            data = (m.root / entry.name).read_bytes()
            assert (
                len(data) == entry.tokens * 2 and hashlib.sha256(data).hexdigest() == entry.sha256
            )
        assert split.tokens == sum(f.tokens for f in split.files)
    # every document, encoded alone plus its EOS, in canonical (sha256) order, split by the rule
    assert m.train.documents + m.val.documents == len(docs)
    val_docs = sorted((d for d in docs if _is_val(d, 0.1)), key=_digest)
    train_docs = sorted((d for d in docs if not _is_val(d, 0.1)), key=_digest)
    assert len(val_docs) == m.val.documents > 0 and not set(val_docs) & set(train_docs)
    for split, texts in (("train", train_docs), ("val", val_docs)):
        expected = [i for t in texts for i in [*tokenizer.encode(t).ids, m.eos_id]]
        assert _tokens(m, split).tolist() == expected
    assert m.identity() == {
        "fingerprint": m.fingerprint,
        "tokenizer_sha256": m.tokenizer_sha256,
        "vocab_size": m.vocab_size,
        "dtype": "uint16",
        "train_tokens": m.train.tokens,
        "val_tokens": m.val.tokens,
    }


def test_a_decoded_train_window_is_text_of_the_corpus(
    corpus: tuple[list[Path], list[str]], prepared: Manifest
) -> None:
    docs = corpus[1]
    tokenizer = Tokenizer.from_file(str(prepared.root / "tokenizer.json"))
    dataset = PreparedDataset(prepared, seq_len=32)
    batch = dataset.gather(np.array([0, 7, dataset.n_train - 1], dtype=np.int64))
    for row in batch.inputs.tolist():
        pieces: list[list[int]] = [[]]
        for token in row:  # cut at EOS: a window may span documents
            pieces.append([]) if token == prepared.eos_id else pieces[-1].append(token)
        text = tokenizer.decode(max(pieces, key=len))
        assert len(text) > 10 and any(text in d for d in docs), text


def test_the_same_inputs_in_another_order_give_the_same_dataset(
    corpus: tuple[list[Path], list[str]], prepared: Manifest, tmp_path: Path
) -> None:
    again = prepare(corpus[0][::-1], tmp_path / "again", vocab_size=512, val_fraction=0.1)
    assert again.fingerprint == prepared.fingerprint
    assert again.identity() == prepared.identity()
    assert again.train.files == prepared.train.files and again.val.files == prepared.val.files
    other = prepare(corpus[0], tmp_path / "other", vocab_size=512, val_fraction=0.1, seed=5)
    assert other.fingerprint != prepared.fingerprint


# --- (b) a given tokenizer ---------------------------------------------------------------------


def test_a_given_tokenizer_is_copied_and_its_hash_recorded(
    corpus: tuple[list[Path], list[str]], prepared: Manifest, tmp_path: Path
) -> None:
    source = tmp_path / "tok"
    source.mkdir()
    shutil.copy(prepared.root / "tokenizer.json", source / "tokenizer.json")
    given = prepare(corpus[0], tmp_path / "given", tokenizer=source, val_fraction=0.1)
    data = (source / "tokenizer.json").read_bytes()
    assert not given.tokenizer_trained
    assert given.tokenizer_sha256 == hashlib.sha256(data).hexdigest()
    assert (given.root / "tokenizer.json").read_bytes() == data
    assert given.identity() == prepared.identity()  # same tokenizer, same documents
    by_file = prepare(
        corpus[0][1:], tmp_path / "by-file", tokenizer=source / "tokenizer.json", vocab_size=9
    )
    assert by_file.vocab_size == prepared.vocab_size  # the tokenizer's own vocabulary counts


# --- (c) the id type ---------------------------------------------------------------------------


def test_the_id_type_is_uint16_up_to_65536_ids_else_uint32(tmp_path: Path) -> None:
    assert [token_dtype(n) for n in (257, 1 << 16, (1 << 16) + 1, 1 << 32)] == [
        "uint16",
        "uint16",
        "uint32",
        "uint32",
    ]
    with pytest.raises(ConfigError, match="vocab_size"):
        token_dtype((1 << 32) + 1)
    # a given word-level tokenizer of 70,000 ids: ids above 65535 survive the round trip
    vocab = {f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000, "[UNK]": 70_001}
    vocab |= {"alpha": 69_998, "omega": 69_999}
    del vocab["w69998"], vocab["w69999"]
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.save(str(tmp_path / "big.json"))
    (tmp_path / "in.txt").write_text("alpha omega w3 " * 30)
    big = tmp_path / "big.json"
    m = prepare([tmp_path / "in.txt"], tmp_path / "out", tokenizer=big, val_fraction=0)
    assert m.dtype == "uint32" and m.vocab_size == 70_002 and m.eos_id == 70_000
    assert (m.root / m.train.files[0].name).stat().st_size == 4 * m.train.tokens == 4 * 91
    windows = PreparedDataset(m, seq_len=5, vocab_size=70_002).gather(np.array([0]))
    assert (
        windows.inputs[0].tolist() == [69_998, 69_999, 3, 69_998, 69_999] and windows.n_tokens == 5
    )


# --- (d) shard files ---------------------------------------------------------------------------


def test_small_shards_make_several_files_and_windows_never_cross_files(
    corpus: tuple[list[Path], list[str]], prepared: Manifest, tmp_path: Path
) -> None:
    m = prepare(
        corpus[0], tmp_path / "small", tokenizer=prepared.root, shard_tokens=700, val_fraction=0
    )
    sizes = [f.tokens for f in m.train.files]
    assert len(sizes) > 3 and set(sizes[:-1]) == {700} and 0 < sizes[-1] <= 700
    assert m.val.files == () and m.val.documents == 0
    assert m.train.tokens == sum(sizes) == prepared.train.tokens + prepared.val.tokens
    seq_len = 31
    dataset = PreparedDataset(m, seq_len)
    expected = [
        tokens[j * (seq_len + 1) : (j + 1) * (seq_len + 1)]
        for tokens in (np.fromfile(p, dtype="<u2") for p in m.paths("train"))
        for j in range(len(tokens) // (seq_len + 1))
    ]
    assert dataset.n_train == dataset.n_examples == len(expected) and dataset.n_heldout == 0
    batch = dataset.gather(np.arange(dataset.n_examples, dtype=np.int64))
    full = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)
    assert full.dtype == torch.int64 and full.tolist() == [w.tolist() for w in expected]
    loader = ShardLoader(dataset, batch_size=4, eval_fraction=0.5)
    assert len(loader.eval_ids) == 0 and list(loader.eval_batches()) == []
    with pytest.raises(IndexError):
        dataset.gather(np.array([dataset.n_examples]))


# --- (e) errors --------------------------------------------------------------------------------


def test_malformed_json_lines_are_refused_with_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:3: not a JSON object"):
        prepare([bad], tmp_path / "out")
    bad.write_text('{"text": "fine"}\n{"body": "elsewhere"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: no field 'text' \(found \['body'\]\)"):
        prepare([bad], tmp_path / "out")
    bad.write_text('{"text": 3}\n')
    with pytest.raises(ConfigError, match="not a string"):
        prepare([bad], tmp_path / "out")
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["a b c"]}), table)
    with pytest.raises(ConfigError, match=r"no column 'text' \(columns: \['body'\]\)"):
        prepare([table], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing was left behind


def test_an_output_directory_is_only_overwritten_when_it_may_be(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("some words here and there " * 20)
    (tmp_path / "more.txt").write_text("other words, elsewhere " * 20)
    inputs = [tmp_path / "in.txt", tmp_path / "more.txt"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"is not empty \(notes\.txt\).*--overwrite"):
        prepare(inputs, out, vocab_size=300)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    first = prepare(inputs, out, vocab_size=300, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    again = prepare(inputs, out, vocab_size=300)  # a previous prepare output: replaced
    assert again == first
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1"):
        prepare([*inputs, bad], out, vocab_size=300)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing lost or added
    with pytest.raises(ConfigError, match="not a directory"):
        prepare(inputs, tmp_path / "in.txt")


def test_a_failure_while_writing_leaves_the_output_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "in.txt").write_text("words to keep " * 30)
    out = tmp_path / "out"
    prepare([tmp_path / "in.txt"], out, vocab_size=300, val_fraction=0)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("dd_queue.data.prepare._encode_split", disk_full)
    for target in (out, tmp_path / "new"):
        with pytest.raises(OSError, match="No space"):
            prepare([tmp_path / "in.txt"], target, vocab_size=300, val_fraction=0)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no temp dir either
    assert not (tmp_path / "new").exists()


def test_the_output_directory_is_never_read_as_input(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document number {i} " * 10)
    first = prepare([tmp_path], tmp_path / "prepared", vocab_size=300, val_fraction=0)
    second = prepare([tmp_path], tmp_path / "prepared", vocab_size=300, val_fraction=0)
    assert first.train.documents == second.train.documents == 3


def test_a_damaged_manifest_or_shard_is_refused(prepared: Manifest, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(prepared.root, copy)
    assert read_manifest(copy).root == copy
    first = copy / prepared.train.files[0].name
    first.write_bytes(first.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"train-00000\.bin has .* bytes .*truncated"):
        read_manifest(copy)
    first.unlink()
    with pytest.raises(ConfigError, match=r"train-00000\.bin .* is missing"):
        read_manifest(copy)
    raw = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**raw, "format": "other.v9"}))
    with pytest.raises(ConfigError, match=r"format is 'other\.v9'"):
        read_manifest(copy)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read manifest"):
        read_manifest(copy)
    with pytest.raises(ConfigError, match=r"run `ddq prepare"):
        read_manifest(tmp_path / "nowhere")


def test_bad_tokenizers_and_corpora_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha beta gamma " * 10)
    no_eos = Tokenizer(models.WordLevel({"[UNK]": 0, "alpha": 1}, unk_token="[UNK]"))
    no_eos.save(str(tmp_path / "no-eos.json"))
    with pytest.raises(ConfigError, match="no end-of-document token"):
        prepare(
            [tmp_path / "a.txt"],
            tmp_path / "out",
            tokenizer=tmp_path / "no-eos.json",
            val_fraction=0,
        )
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="does not exist"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tmp_path / "none")
    with pytest.raises(ConfigError, match="at least 257"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", vocab_size=100)
    with pytest.raises(ConfigError, match="fell in the validation split"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", val_fraction=0.5)  # its only document
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n\n")
    with pytest.raises(ConfigError, match=r"no documents .*1 files read"):
        prepare([tmp_path / "empty"], tmp_path / "out")
    (tmp_path / "x.bin").write_bytes(b"\x00\xff")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        prepare([tmp_path / "x.bin"], tmp_path / "out")
    with pytest.raises(ConfigError, match="val_fraction must be in"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", val_fraction=1.0)
    with pytest.raises(ConfigError, match="does not exist"):
        prepare([tmp_path / "missing"], tmp_path / "out")


# --- (f) the dataset and the loader ------------------------------------------------------------


def test_the_loader_holds_out_the_val_split_and_resumes_exactly(prepared: Manifest) -> None:
    spec = DataSpec(source="prepared", path=str(prepared.root), vocab_size=512, batch_size=4)
    dataset = build_dataset(spec, seq_len=16)
    assert isinstance(dataset, PreparedDataset) and dataset.n_heldout > 0
    assert dataset.fingerprint == (
        f"{prepared.fingerprint[:16]}:{prepared.tokenizer_sha256[:8]}:T16"
    )
    loaders = [
        ShardLoader(dataset, batch_size=4, shard=ShardSpec(i, 2, seed=3), eval_fraction=0.5)
        for i in range(2)
    ]
    train = set(range(dataset.n_train))
    eval_ids = loaders[0].eval_ids.tolist()
    assert eval_ids == list(range(dataset.n_train, dataset.n_examples))  # not eval_fraction
    a, b = (set(loader.shard_ids.tolist()) for loader in loaders)
    assert not a & b and a | b == train and not (a | b) & set(eval_ids)
    val = np.concatenate([np.fromfile(p, dtype="<u2") for p in prepared.paths("val")])
    batches = list(loaders[0].eval_batches(batch_size=5))
    seen = torch.cat([torch.cat([x.inputs, x.targets[:, -1:]], dim=1) for x in batches])
    assert len(prepared.val.files) == 1  # so the val windows are consecutive in one file
    assert seen.tolist() == val[: len(seen) * 17].reshape(-1, 17).tolist()
    loader = loaders[1]
    for _ in range(3):
        next(loader)
    saved = json.loads(json.dumps(loader.state_dict()))
    ahead = [next(loader) for _ in range(5)]
    resumed = build_loader_again(spec, saved)
    for x, y in zip(ahead, (next(resumed) for _ in range(5)), strict=True):
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
    assert ShardLoader(dataset, batch_size=4, shard=ShardSpec(1, 2, 3)).state_dict() != saved


def build_loader_again(spec: DataSpec, saved: dict[str, object]) -> ShardLoader:
    dataset = build_dataset(
        DataSpec(source="prepared", path=str(Path(str(spec.path)) / "manifest.json")), seq_len=16
    )
    loader = ShardLoader(dataset, batch_size=4, shard=ShardSpec(1, 2, seed=3))
    loader.load_state_dict(saved)
    return loader


def test_a_model_vocabulary_smaller_than_the_data_is_refused(prepared: Manifest) -> None:
    spec = DataSpec(source="prepared", path=str(prepared.root), vocab_size=300)
    with pytest.raises(ConfigError, match=f"vocab_size to at least {prepared.vocab_size}"):
        build_dataset(spec, seq_len=16)
    with pytest.raises(ConfigError, match="no window"):
        PreparedDataset(prepared, seq_len=10**7)
    with pytest.raises(ConfigError, match="build_dataset"):
        load_corpus(spec)
    with pytest.raises(ConfigError, match=r"needs data\.path"):
        DataSpec(source="prepared")


def test_reading_a_manifest_loads_neither_torch_nor_the_tokenizer_libraries(
    prepared: Manifest,
) -> None:
    code = (
        "import sys; from dd_queue.data import read_manifest; "
        f"read_manifest({str(prepared.root)!r}).identity(); "
        "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'tokenizers', 'datasets')])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


# --- (g) the command line ----------------------------------------------------------------------


def test_the_cli_prints_a_table_then_one_json_object(
    corpus: tuple[list[Path], list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jsonl = corpus[0][1]
    out = tmp_path / "cli"
    argv = ["prepare", str(jsonl), "--out", str(out), "--vocab-size", "300", "--json"]
    assert main([*argv, "--val-fraction", "0.2", "--shard-tokens", "200"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(f"prepared {out}") and any(s.startswith("train ") for s in lines)
    payload = json.loads(lines[-1])
    assert payload["format"] == "ddq.prepared.v1" and payload["seconds"] >= 0
    assert payload["splits"]["train"]["documents"] + payload["splits"]["val"]["documents"] == 30
    assert len(payload["splits"]["train"]["files"]) > 1
    assert payload == {**read_manifest(out).to_dict(), "seconds": payload["seconds"]}
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["prepare", str(jsonl), "--out", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err
