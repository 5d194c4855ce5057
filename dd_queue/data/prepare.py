"""``ddq prepare``: text, JSON lines and Parquet turned into token shards with a manifest.

    manifest = prepare(["corpus/", "extra.jsonl"], "data/prepared", vocab_size=4096)
    manifest = read_manifest("data/prepared")   # manifest.py: reads the JSON, stats the files
    manifest.identity()                         # what the run digest records about the data

Layout of the output directory:

    manifest.json            what is here (``ddq.prepared.v1``, see ``Manifest.to_dict``)
    tokenizer.json           the tokenizer: trained here, or a byte-for-byte copy of the given one
    train-00000.bin, ...     token ids, raw little-endian uint16 (vocab ≤ 65536) or uint32
    val-00000.bin, ...       the validation split, likewise (none when val_fraction is 0)

Documents. Inputs are files or directories (walked recursively; hidden entries, ``__pycache__``
and the output directory itself are skipped). A ``.jsonl`` file holds one document per line
(the ``text_field`` string of each JSON object; blank lines are skipped), a ``.parquet`` file one
per row (column ``text_field``, read with HF ``datasets``), any other file is one document as
UTF-8 text. Inside a directory, files that are not UTF-8 text (NUL bytes, bad encoding) are
skipped as binary; a file named explicitly must be text. Empty and whitespace-only documents are
skipped.

Order, split and fingerprint. Documents are written in *canonical order*, sorted by the sha256 of
their UTF-8 text, so the shards, their hashes and the split do not depend on the order of the
inputs (or of files in a directory). A document goes to validation when its split key, the first
8 bytes of ``sha256(text)`` (``sha256(seed ‖ sha256(text))`` for a seed other than 0) read as a
fraction of 2⁶⁴, is below ``val_fraction``; with ``val_fraction`` > 0 and no document there, the
last one in canonical order moves there. The fingerprint is a sha256 over the format, the split
rule and its parameters (``val_fraction``, ``seed``) and ``shard_tokens`` (it decides which
windows exist: a window never crosses files), then every document's sha256 in canonical order.
It does not cover the tokenizer; ``Manifest.identity`` records the tokenizer's hash beside it.

Tokenizer. Without one given, a byte-level BPE (``train_tokenizer``) is trained on all the
documents (train and val, in canonical order), as tokenizers usually are on the whole corpus.
A given one must know an end-of-document token (``EOS_TOKENS``); its vocabulary, not
``vocab_size``, then counts.

Tokens. Each document's ids (no special tokens added by the tokenizer's post-processor) are
followed by the EOS id; the documents of a split are concatenated and cut into files of at most
``shard_tokens`` tokens (a document may continue in the next file).

Safety. Everything is written into a hidden temporary directory inside the output directory and
renamed into place at the end, ``manifest.json`` last (the old one is removed first): a failure
while reading, training, encoding or writing leaves the output directory as it was (or absent,
if this call created it), and a reader never sees a manifest naming files that are not there
yet or are from another run. An output directory that is not empty and holds no previous ``prepare``
output is refused unless ``overwrite=True``; even then only ``manifest.json``,
``tokenizer.json`` and ``train-*.bin`` / ``val-*.bin`` files are replaced or removed.

Memory: the corpus's text is held in memory (about its size in bytes, plus the tokenizer
trainer's word counts) so it can be sorted and read twice (training, encoding); tokens are
streamed to disk.

``tokenizers`` and ``datasets`` are imported only when a tokenizer is trained or loaded and when
a Parquet file is read: ``read_manifest`` imports neither (nor torch).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import numpy.typing as npt

from dd_queue import __version__
from dd_queue.data.manifest import (
    FORMAT,
    MANIFEST_FILE,
    OUTPUT_FILE,
    TOKENIZER_FILE,
    Manifest,
    SplitManifest,
    SplitName,
    TokenFile,
    token_dtype,
)
from dd_queue.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOS_TOKENS: tuple[str, ...] = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
"""Tokens taken as end-of-document, in this order of preference (the first one present wins)."""
SPLIT_RULE = "sha256(text)[:8]/2**64 < val_fraction (salted by seed != 0); else last to val"
_TEMP_PREFIX = ".prepare-"
_ENCODE_BATCH = 512  # documents per encode_batch call (tokenizers parallelises within one)
_SKIP_DIRS = frozenset({"__pycache__"})


# --- reading documents -------------------------------------------------------------------------


def _inside(path: Path, folder: Path | None) -> bool:
    if folder is None:
        return False
    return path.resolve().is_relative_to(folder)


def _input_files(inputs: Sequence[str | Path], exclude: Path | None) -> Iterator[tuple[Path, bool]]:
    """``(file, named_explicitly)`` for every input file, directories walked in sorted order."""
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            for folder, dirs, files in os.walk(path):
                if _inside(Path(folder), exclude):  # the output directory is never an input
                    dirs[:] = []
                    continue
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
                yield from ((Path(folder, f), False) for f in sorted(files) if f[0] != ".")
        elif path.is_file():
            yield path, True
        else:
            raise ConfigError(
                f"input {raw} does not exist or is not a file or directory; give text files "
                "(.txt, .md, ...), .jsonl or .parquet files, or directories of them"
            )


def _text_document(path: Path, explicit: bool) -> list[str]:
    try:
        data = path.read_bytes()
        if b"\x00" in data:
            raise ValueError("NUL bytes")
        return [data.decode("utf-8-sig")]
    except OSError as exc:
        if explicit:
            raise ConfigError(f"cannot read input {path}: {exc.strerror}") from None
    except ValueError:  # UnicodeDecodeError is one
        if explicit:
            raise ConfigError(
                f"input {path} is not UTF-8 text (binary?): convert it, or give .jsonl/.parquet"
            ) from None
    return []  # binary or unreadable file inside a directory: skipped


def _jsonl_documents(path: Path, text_field: str) -> list[str]:
    docs: list[str] = []
    try:
        with path.open(encoding="utf-8-sig") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    docs.append(_jsonl_text(line, path, number, text_field))
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text; JSON lines must be UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"cannot read input {path}: {exc.strerror}") from None
    return docs


def _jsonl_text(line: str, path: Path, number: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}:{number}: not a JSON object ({exc.msg}); each line of a .jsonl file must be "
            f'one object like {{"{text_field}": "..."}}'
        ) from None
    if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(
            f"{path}:{number}: no field {text_field!r} (found {keys}); pass --text-field NAME "
            "(text_field=) to read another field"
        )
    value = record[text_field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ConfigError(
            f"{path}:{number}: field {text_field!r} is a {type(value).__name__}, not a string"
        )
    return value


def _parquet_documents(path: Path, text_field: str) -> list[str]:
    try:
        import datasets  # type: ignore[import-untyped]  # (it ships no type information)
    except ImportError:
        raise ConfigError(
            f"reading {path} needs HF datasets (and pyarrow): pip install datasets"
        ) from None
    bars = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="ddq-parquet-") as cache:  # no global HF cache
            try:
                table = datasets.load_dataset(
                    "parquet", data_files=[str(path)], split="train", cache_dir=cache
                )
            except Exception as exc:  # pyarrow / datasets raise many kinds for a bad file
                raise ConfigError(f"cannot read Parquet file {path}: {exc}") from None
            if text_field not in table.column_names:
                raise ConfigError(
                    f"{path}: no column {text_field!r} (columns: {table.column_names}); pass "
                    "--text-field NAME (text_field=) to read another column"
                )
            values = list(table[text_field])
    finally:
        if bars:
            datasets.enable_progress_bars()
    for row, value in enumerate(values):
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                f"{path}: row {row} of column {text_field!r} is a {type(value).__name__}, "
                "not a string"
            )
    return [v for v in values if v is not None]


def _read_documents(
    inputs: Sequence[str | Path], text_field: str, exclude: Path | None
) -> tuple[list[str], int]:
    """Every non-empty document of the inputs, and how many files were read."""
    docs: list[str] = []
    files = 0
    for path, explicit in _input_files(inputs, exclude):
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            found = _jsonl_documents(path, text_field)
        elif suffix == ".parquet":
            found = _parquet_documents(path, text_field)
        else:
            found = _text_document(path, explicit)
        files += 1
        docs.extend(d for d in found if d.strip())
    return docs, files


# --- the split and the fingerprint -------------------------------------------------------------


def _split_key(digest: bytes, seed: int) -> float:
    key = digest if seed == 0 else hashlib.sha256(seed.to_bytes(8, "little") + digest).digest()
    return int.from_bytes(key[:8], "big") / 2.0**64


def _fingerprint(
    digests: Sequence[bytes], *, val_fraction: float, seed: int, shard_tokens: int
) -> str:
    rule = {"rule": SPLIT_RULE, "val_fraction": val_fraction, "seed": seed}
    header = json.dumps({"format": FORMAT, **rule, "shard_tokens": shard_tokens}, sort_keys=True)
    h = hashlib.sha256(header.encode() + b"\n")
    for digest in digests:
        h.update(digest)
    return h.hexdigest()


def _split_documents(
    docs: Sequence[tuple[bytes, str]], val_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
    """``(train, val)`` texts, each in canonical order (``docs`` must be sorted by digest)."""
    is_val = [_split_key(digest, seed) < val_fraction for digest, _ in docs]
    if val_fraction > 0 and docs and not any(is_val):
        is_val[-1] = True
    train = [text for (_, text), v in zip(docs, is_val, strict=True) if not v]
    val = [text for (_, text), v in zip(docs, is_val, strict=True) if v]
    if not train:
        raise ConfigError(
            f"all {len(docs)} documents fell in the validation split (val_fraction "
            f"{val_fraction}; with no document below it, one is moved there): the split is by "
            "document, so add documents (e.g. split a big file, or one per .jsonl line), or "
            "pass --val-fraction 0 (val_fraction=0) for no validation split"
        )
    return train, val


# --- the tokenizer -----------------------------------------------------------------------------


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("ddq prepare needs HF tokenizers: pip install tokenizers") from None
    return tokenizers


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on ``texts`` (in the given order), ``<|endoftext|>`` = id 0.

    Byte-level pre-tokenizer (no prefix space) and decoder, the 256 byte symbols as the initial
    alphabet (any text encodes, no unknown token), ``vocab_size`` ids at most (fewer when the
    corpus has too few distinct pairs to merge). Deterministic for the same texts in the same
    order.

    Raises:
        ConfigError: ``vocab_size`` below 257 (256 bytes + the EOS token).
    """
    _check_bpe_vocab(vocab_size)
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKENS[0]],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    trained: Tokenizer = tokenizer
    return trained


def _check_bpe_vocab(vocab_size: int) -> None:
    if vocab_size < 257:
        raise ConfigError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE: use at least 257 "
            "(256 byte symbols + <|endoftext|>)"
        )
    token_dtype(vocab_size)  # refuses sizes no id type holds


def _tokenizer_file(path: str | Path) -> Path:
    where = Path(path)
    file = where / TOKENIZER_FILE if where.is_dir() else where
    if not file.is_file():
        raise ConfigError(
            f"tokenizer {path}: {file} does not exist; give a tokenizer.json file or a "
            "directory holding one (e.g. a Hugging Face model folder), or omit it to train one"
        )
    return file


def load_tokenizer(path: str | Path) -> tuple[Tokenizer, bytes]:
    """A ``tokenizers`` tokenizer from a ``tokenizer.json`` file or a directory holding one.

    Returns:
        ``(tokenizer, the file's bytes)`` (the bytes are what ``prepare`` copies and hashes).

    Raises:
        ConfigError: No such file, or one ``tokenizers`` cannot load.
    """
    file = _tokenizer_file(path)
    try:
        data = file.read_bytes()
        tokenizer: Tokenizer = _tokenizers().Tokenizer.from_str(data.decode("utf-8"))
    except ConfigError:
        raise
    except Exception as exc:  # OSError, UnicodeDecodeError, the Rust side's parse errors
        raise ConfigError(f"cannot load tokenizer {file}: {exc}") from None
    return tokenizer, data


def eos_id(tokenizer: Tokenizer, *, origin: str = "the tokenizer") -> int:
    """The id of the first of ``EOS_TOKENS`` the tokenizer knows.

    Raises:
        ConfigError: It knows none of them.
    """
    for token in EOS_TOKENS:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    raise ConfigError(
        f"{origin} has no end-of-document token (none of {', '.join(EOS_TOKENS)}): add one as a "
        "special token, or omit --tokenizer to train a byte-level BPE that has one"
    )


def _vocab_size(tokenizer: Tokenizer) -> int:
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


# --- writing -----------------------------------------------------------------------------------


class _ShardWriter:
    """Token ids appended to ``{split}-NNNNN.bin`` files of at most ``shard_tokens`` ids."""

    def __init__(self, folder: Path, split: SplitName, dtype: np.dtype[Any], shard_tokens: int):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.files: list[TokenFile] = []
        self._handle: BinaryIO | None = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, ids: npt.NDArray[np.unsignedinteger[Any]]) -> None:
        position = 0
        while position < len(ids):
            if self._handle is None:
                name = f"{self.split}-{len(self.files):05d}.bin"
                self._handle = (self.folder / name).open("wb")
                self._hash, self._count = hashlib.sha256(), 0
            chunk = ids[position : position + self.shard_tokens - self._count]
            data = chunk.astype(self.dtype, copy=False).tobytes()
            self._handle.write(data)
            self._hash.update(data)
            self._count += len(chunk)
            position += len(chunk)
            if self._count == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        if self._handle is not None:
            self._handle.close()
            name = f"{self.split}-{len(self.files):05d}.bin"
            self.files.append(TokenFile(name, self._count, self._hash.hexdigest()))
            self._handle = None

    def close(self) -> tuple[TokenFile, ...]:
        self._finish()
        return tuple(self.files)


def _encode_split(
    texts: Sequence[str],
    tokenizer: Tokenizer,
    writer: _ShardWriter,
    *,
    eos: int,
    vocab_size: int,
) -> SplitManifest:
    """Encode ``texts`` (each followed by ``eos``) into ``writer``'s files."""
    for start in range(0, len(texts), _ENCODE_BATCH):
        encodings = tokenizer.encode_batch(
            list(texts[start : start + _ENCODE_BATCH]), add_special_tokens=False
        )
        flat: list[int] = []
        for encoding in encodings:
            flat.extend(encoding.ids)
            flat.append(eos)
        ids = np.asarray(flat, dtype=np.int64)
        if ids.size and int(ids.max()) >= vocab_size:  # cannot happen with a sound tokenizer
            raise ConfigError(f"the tokenizer produced id {int(ids.max())} >= vocab {vocab_size}")
        writer.write(ids.astype(writer.dtype))
    files = writer.close()
    return SplitManifest(files, sum(f.tokens for f in files), len(texts))


def _is_prepare_output(folder: Path) -> bool:
    try:
        raw = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {out} exists and is not a directory: choose another --out")
    if not out.is_dir():
        return
    entries = sorted(p.name for p in out.iterdir() if not p.name.startswith(_TEMP_PREFIX))
    if entries and not overwrite and not _is_prepare_output(out):
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ConfigError(
            f"output directory {out} is not empty ({shown}) and holds no previous `ddq prepare` "
            "output: choose a new or empty --out, or pass --overwrite (overwrite=True) to write "
            f"into it (only {MANIFEST_FILE}, {TOKENIZER_FILE} and train-/val-*.bin are replaced)"
        )


def _install(work: Path, out: Path, manifest_text: str) -> None:
    """Move the finished files of ``work`` into ``out``, the manifest last."""
    (out / MANIFEST_FILE).unlink(missing_ok=True)  # no reader sees old manifest + new shards
    new = {p.name for p in work.iterdir()}
    for old in out.iterdir():
        if OUTPUT_FILE.match(old.name) and old.name not in new and old.is_file():
            old.unlink()
    for path in sorted(work.iterdir()):
        os.replace(path, out / path.name)
    (work / MANIFEST_FILE).write_text(manifest_text, encoding="utf-8")
    os.replace(work / MANIFEST_FILE, out / MANIFEST_FILE)
    for stale in out.iterdir():  # this run's work dir and any left by a killed earlier run
        if stale.name.startswith(_TEMP_PREFIX) and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _check_arguments(val_fraction: float, shard_tokens: int, seed: int, text_field: str) -> None:
    if not 0.0 <= val_fraction < 1.0 or math.isnan(val_fraction):
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ConfigError(f"shard_tokens must be >= 1, got {shard_tokens}")
    if not 0 <= seed < 1 << 64:
        raise ConfigError(f"seed must be in [0, 2**64), got {seed}")
    if not text_field:
        raise ConfigError("text_field must name a field (e.g. 'text')")


def prepare(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    *,
    tokenizer: str | Path | None = None,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    shard_tokens: int = 1 << 24,
    text_field: str = "text",
    seed: int = 0,
    overwrite: bool = False,
) -> Manifest:
    """Tokenize documents into train/val shard files with a manifest (module docstring).

    Args:
        inputs: Files and directories: text files (one document each), ``.jsonl`` (one per
            line), ``.parquet`` (one per row).
        out_dir: Output directory (created; see the module docstring for what may be there).
        tokenizer: A ``tokenizer.json`` or a directory holding one; None trains a byte-level
            BPE on the corpus.
        vocab_size: Ids of the BPE to train (≥ 257); ignored when ``tokenizer`` is given (its own
            vocabulary counts).
        val_fraction: Share of documents for validation, in [0, 1).
        shard_tokens: Most tokens per shard file (default 2²⁴, 32 MiB of uint16).
        text_field: Field of a ``.jsonl`` object / column of a ``.parquet`` file with the text.
        seed: Salt of the split key; 0 keys it on the plain sha256 of each text.
        overwrite: Write into a non-empty directory that holds no previous prepare output.

    Returns:
        The manifest written to ``out_dir/manifest.json``.

    Raises:
        ConfigError: Bad arguments, unreadable or malformed inputs (file and line named), no
            documents, no training document, a tokenizer without an EOS token, or an output
            directory that must not be written. Nothing in ``out_dir`` is changed then.
    """
    _check_arguments(val_fraction, shard_tokens, seed, text_field)
    if not inputs:
        raise ConfigError("prepare needs at least one input file or directory")
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    given: tuple[Tokenizer, bytes] | None = None
    if tokenizer is None:  # checked before the corpus is read: fail fast
        _check_bpe_vocab(vocab_size)
    else:
        given = load_tokenizer(tokenizer)
        eos_id(given[0], origin=f"tokenizer {tokenizer}")
        token_dtype(_vocab_size(given[0]))
    texts, n_files = _read_documents(inputs, text_field, out.resolve())
    if not texts:
        raise ConfigError(
            f"no documents in {', '.join(map(str, inputs))} ({n_files} files read; empty, "
            "whitespace-only and, inside directories, binary files are skipped)"
        )
    docs = sorted(((hashlib.sha256(t.encode()).digest(), t) for t in texts), key=lambda d: d[0])
    del texts
    train, val = _split_documents(docs, val_fraction, seed)
    fingerprint = _fingerprint(
        [d for d, _ in docs], val_fraction=val_fraction, seed=seed, shard_tokens=shard_tokens
    )
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=out))
    try:
        manifest = _prepare_in(
            work,
            out,
            train,
            val,
            [str(i) for i in inputs],
            given,
            vocab_size,
            fingerprint,
            val_fraction=val_fraction,
            seed=seed,
            shard_tokens=shard_tokens,
        )
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    return manifest


def _prepare_in(
    work: Path,
    out: Path,
    train: Sequence[str],
    val: Sequence[str],
    sources: list[str],
    given: tuple[Tokenizer, bytes] | None,
    vocab_size: int,
    fingerprint: str,
    *,
    val_fraction: float,
    seed: int,
    shard_tokens: int,
) -> Manifest:
    """Tokenize into ``work``, then move everything into ``out``."""
    if given is None:
        tokenizer = train_tokenizer([*train, *val], vocab_size)
        tokenizer.save(str(work / TOKENIZER_FILE))
        data = (work / TOKENIZER_FILE).read_bytes()
    else:
        tokenizer, data = given
        (work / TOKENIZER_FILE).write_bytes(data)
    eos, vocab = eos_id(tokenizer), _vocab_size(tokenizer)
    dtype = token_dtype(vocab)
    np_dtype = np.dtype("<u2" if dtype == "uint16" else "<u4")  # little-endian on any host
    texts_of: dict[SplitName, Sequence[str]] = {"train": train, "val": val}
    splits = {
        name: _encode_split(
            texts,
            tokenizer,
            _ShardWriter(work, name, np_dtype, shard_tokens),
            eos=eos,
            vocab_size=vocab,
        )
        for name, texts in texts_of.items()
    }
    manifest = Manifest(
        root=out,
        dtype=dtype,
        vocab_size=vocab,
        eos_id=eos,
        tokenizer_file=TOKENIZER_FILE,
        tokenizer_sha256=hashlib.sha256(data).hexdigest(),
        tokenizer_trained=given is None,
        fingerprint=fingerprint,
        val_fraction=val_fraction,
        seed=seed,
        shard_tokens=shard_tokens,
        train=splits["train"],
        val=splits["val"],
        sources=tuple(sources),
        ddq_version=__version__,
    )
    _install(work, out, json.dumps(manifest.to_dict(), indent=2) + "\n")
    return manifest


__all__ = ["EOS_TOKENS", "eos_id", "load_tokenizer", "prepare", "train_tokenizer"]
