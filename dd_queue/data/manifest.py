"""The manifest of a prepared dataset (``ddq.prepared.v1``): what ``ddq prepare`` wrote, and
the cheap check of it that every process makes (``read_manifest`` reads the JSON and stats the
token files; it hashes nothing and imports neither tokenizers nor torch, so the config can call it
for the run digest). The pipeline that writes it is ``prepare.py``; the dataset over it
``prepared.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dd_queue.errors import ConfigError

FORMAT = "ddq.prepared.v1"
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SplitName = Literal["train", "val"]
TokenDtype = Literal["uint16", "uint32"]
SPLITS: tuple[SplitName, ...] = ("train", "val")
OUTPUT_FILE = re.compile(r"^(train|val)-\d{5,}\.bin$")  # the token files prepare writes


def token_dtype(vocab_size: int) -> TokenDtype:
    """The narrowest id type of a vocabulary: ``uint16`` up to 65536 ids, else ``uint32``.

    Raises:
        ConfigError: ``vocab_size`` < 1 or above 2³² (no supported id type holds it).
    """
    if not 1 <= vocab_size <= 1 << 32:
        raise ConfigError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# --- the manifest ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenFile:
    """One shard file of a split.

    Attributes:
        name: File name inside the output directory, e.g. ``train-00000.bin``.
        tokens: Token ids in it (its byte size is ``tokens × itemsize``).
        sha256: sha256 hex of its bytes (recorded at write time; ``read_manifest`` does not
            re-hash, to stay cheap on large datasets).
    """

    name: str
    tokens: int
    sha256: str


@dataclass(frozen=True, slots=True)
class SplitManifest:
    """One split (train or val): its files in order, its token and document counts."""

    files: tuple[TokenFile, ...]
    tokens: int
    documents: int

    def to_dict(self) -> dict[str, Any]:
        """The split's entry in ``manifest.json``."""
        files = [{"name": f.name, "tokens": f.tokens, "sha256": f.sha256} for f in self.files]
        return {"files": files, "tokens": self.tokens, "documents": self.documents}


@dataclass(frozen=True, slots=True)
class Manifest:
    """A prepared dataset: what ``manifest.json`` says, plus the directory it lies in.

    Attributes:
        root: Directory holding the manifest, the tokenizer and the shard files.
        dtype: Id type of the shard files (little-endian ``uint16`` or ``uint32``).
        vocab_size: Ids are in ``[0, vocab_size)``; the model's vocabulary must be at least this.
        eos_id: Id appended after every document.
        tokenizer_file: The tokenizer's file name inside ``root``.
        tokenizer_sha256: sha256 hex of the tokenizer file's bytes.
        tokenizer_trained: Whether ``prepare`` trained it (else it was given).
        fingerprint: sha256 hex of the documents and the split rule (module docstring).
        val_fraction: Share of documents meant for validation, in [0, 1).
        seed: Salt of the split key (0: the plain sha256 of the text).
        shard_tokens: Most tokens per shard file.
        train: The training split.
        val: The validation split (empty when ``val_fraction`` is 0).
        sources: The inputs, as given to ``prepare``.
        ddq_version: ``dd_queue.__version__`` that wrote it.
    """

    root: Path
    dtype: TokenDtype
    vocab_size: int
    eos_id: int
    tokenizer_file: str
    tokenizer_sha256: str
    tokenizer_trained: bool
    fingerprint: str
    val_fraction: float
    seed: int
    shard_tokens: int
    train: SplitManifest
    val: SplitManifest
    sources: tuple[str, ...]
    ddq_version: str

    @property
    def itemsize(self) -> int:
        """Bytes per token id (2 or 4)."""
        return 2 if self.dtype == "uint16" else 4

    @property
    def np_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the shard files (explicitly little-endian)."""
        return np.dtype("<u2" if self.dtype == "uint16" else "<u4")

    def split(self, name: SplitName) -> SplitManifest:
        """The ``train`` or ``val`` split."""
        return self.train if name == "train" else self.val

    def paths(self, name: SplitName) -> list[Path]:
        """The files of split ``name``, in manifest order."""
        return [self.root / f.name for f in self.split(name).files]

    def identity(self) -> dict[str, int | str]:
        """What identifies the data for the run digest (no paths: the same data elsewhere is
        the same data): fingerprint, tokenizer hash, vocab size, dtype, tokens per split."""
        return {
            "fingerprint": self.fingerprint,
            "tokenizer_sha256": self.tokenizer_sha256,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
            "train_tokens": self.train.tokens,
            "val_tokens": self.val.tokens,
        }

    def to_dict(self) -> dict[str, Any]:
        """The content of ``manifest.json``."""
        return {
            "format": FORMAT,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokenizer": {
                "file": self.tokenizer_file,
                "sha256": self.tokenizer_sha256,
                "trained": self.tokenizer_trained,
            },
            "fingerprint": self.fingerprint,
            "val_fraction": self.val_fraction,
            "seed": self.seed,
            "shard_tokens": self.shard_tokens,
            "splits": {"train": self.train.to_dict(), "val": self.val.to_dict()},
            "sources": list(self.sources),
            "ddq_version": self.ddq_version,
        }


def _manifest_path(path: str | Path) -> Path:
    where = Path(path)
    return where / MANIFEST_FILE if where.is_dir() else where


def read_manifest(path: str | Path) -> Manifest:
    """Read and check a prepared dataset's manifest (cheap: no token file is read or hashed).

    Args:
        path: The output directory of ``prepare`` or its ``manifest.json``.

    Raises:
        ConfigError: No manifest, not JSON, another format, a malformed field, or a shard file
            that is missing or whose byte size is not its token count × the id size.
    """
    file = _manifest_path(path)
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"no prepared dataset at {path}: {file} does not exist; run `ddq prepare INPUTS "
            f"--out {Path(path)}` first (or point data.path at its directory)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read manifest {file}: {exc}; rerun `ddq prepare`") from None
    manifest = _parse_manifest(raw, file)
    _check_files(manifest, file)
    return manifest


def _bad(file: Path, what: str) -> ConfigError:
    return ConfigError(f"manifest {file}: {what}; rerun `ddq prepare` to rewrite it")


def _get(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], file: Path) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _bad(file, f"field {key!r} is {value!r}, expected {getattr(kind, '__name__', kind)}")
    return value


def _count(obj: Mapping[str, Any], key: str, file: Path) -> int:
    value: int = _get(obj, key, int, file)
    if value < 0:
        raise _bad(file, f"field {key!r} is negative ({value})")
    return value


def _parse_split(raw: Any, name: str, file: Path) -> SplitManifest:
    if not isinstance(raw, dict):
        raise _bad(file, f"splits.{name} is missing or not an object")
    files: list[TokenFile] = []
    for entry in _get(raw, "files", list, file):
        if not isinstance(entry, dict):
            raise _bad(file, f"splits.{name}.files holds {entry!r}, not an object")
        fname: str = _get(entry, "name", str, file)
        if not OUTPUT_FILE.match(fname) or not fname.startswith(f"{name}-"):
            raise _bad(file, f"splits.{name} names file {fname!r}: expected {name}-NNNNN.bin")
        files.append(
            TokenFile(fname, _count(entry, "tokens", file), _get(entry, "sha256", str, file))
        )
    split = SplitManifest(tuple(files), _count(raw, "tokens", file), _count(raw, "documents", file))
    if split.tokens != sum(f.tokens for f in files):
        raise _bad(file, f"splits.{name}.tokens {split.tokens} != the sum over its files")
    return split


def _parse_manifest(raw: Any, file: Path) -> Manifest:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise _bad(file, f"format is {found!r}, expected {FORMAT!r}")
    dtype = raw.get("dtype")
    if dtype not in ("uint16", "uint32"):
        raise _bad(file, f"dtype is {dtype!r}, expected 'uint16' or 'uint32'")
    vocab_size, eos_id = _count(raw, "vocab_size", file), _count(raw, "eos_id", file)
    if vocab_size > (1 << 16 if dtype == "uint16" else 1 << 32):
        raise _bad(file, f"vocab_size {vocab_size} does not fit dtype {dtype}")
    if eos_id >= vocab_size:
        raise _bad(file, f"eos_id {eos_id} is not below vocab_size {vocab_size}")
    tokenizer, splits = raw.get("tokenizer"), raw.get("splits")
    if not isinstance(tokenizer, dict) or not isinstance(splits, dict):
        raise _bad(file, "'tokenizer' and 'splits' must be objects")
    sources = _get(raw, "sources", list, file)
    val_fraction = float(_get(raw, "val_fraction", (int, float), file))
    return Manifest(
        root=file.parent,
        dtype=dtype,
        vocab_size=vocab_size,
        eos_id=eos_id,
        tokenizer_file=_get(tokenizer, "file", str, file),
        tokenizer_sha256=_get(tokenizer, "sha256", str, file),
        tokenizer_trained=_get(tokenizer, "trained", bool, file),
        fingerprint=_get(raw, "fingerprint", str, file),
        val_fraction=val_fraction,
        seed=_count(raw, "seed", file) if "seed" in raw else 0,
        shard_tokens=_count(raw, "shard_tokens", file) if "shard_tokens" in raw else 0,
        train=_parse_split(splits.get("train"), "train", file),
        val=_parse_split(splits.get("val"), "val", file),
        sources=tuple(str(s) for s in sources),
        ddq_version=str(raw.get("ddq_version", "")),
    )


def _check_files(manifest: Manifest, file: Path) -> None:
    for name in SPLITS:
        for entry in manifest.split(name).files:
            path = manifest.root / entry.name
            try:
                size = path.stat().st_size
            except OSError:
                raise ConfigError(
                    f"prepared dataset {manifest.root}: {entry.name} (listed in {file.name}) is "
                    "missing; restore the directory or rerun `ddq prepare`"
                ) from None
            expected = entry.tokens * manifest.itemsize
            if size != expected:
                raise ConfigError(
                    f"prepared dataset {manifest.root}: {entry.name} has {size} bytes but the "
                    f"manifest says {entry.tokens} {manifest.dtype} tokens ({expected} bytes): "
                    "the file is truncated or from another run; rerun `ddq prepare`"
                )


__all__ = [
    "FORMAT",
    "MANIFEST_FILE",
    "OUTPUT_FILE",
    "SPLITS",
    "TOKENIZER_FILE",
    "Manifest",
    "SplitManifest",
    "SplitName",
    "TokenDtype",
    "TokenFile",
    "read_manifest",
    "token_dtype",
]
