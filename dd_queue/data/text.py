"""Text corpora as token arrays, and fixed-length windows over them. Nothing is downloaded.

Sources:
- ``stdlib``: byte-level (vocab 256) text of the running Python's standard library, found with
  ``sysconfig.get_paths()["stdlib"]``: files ending in ``.py``, ``.rst``, ``.txt`` (by default),
  without ``site-packages``/``dist-packages``/``__pycache__`` (they differ between machines).
- ``files``: byte-level text of a directory (files with the given suffixes, recursively) or of
  a glob pattern (``**`` recurses).
- ``bin``: a pre-tokenised nanoGPT-style ``uint16`` file (e.g. GPT-2 BPE ids), memory-mapped:
  only the windows a batch touches are read.

File order is by sha256 of the path relative to its root (ties: the path), not alphabetical:
the ``max_bytes`` cap keeps a prefix and the held-out split is the tail, and hashed order makes
both a spread of the whole tree rather than, say, only ``asyncio/`` and only ``zoneinfo/``. It
is the same on every machine with the same files. Unreadable files and files containing NUL
bytes (binary) are skipped. Files are concatenated without separators.

Windows: example j is tokens ``[j·(T+1), (j+1)·(T+1))``; inputs are its first T tokens and targets
its last T. Windows do not overlap, so the held-out windows share no token with training ones.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from dd_queue.data.batch import Batch
from dd_queue.data.spec import TEXT_SUFFIXES, MiB
from dd_queue.errors import ConfigError

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SAMPLE_BYTES = MiB  # bytes of each end of a .bin file that its fingerprint reads


@dataclass(frozen=True, slots=True)
class TokenCorpus:
    """A 1-D token array with what identifies it.

    Attributes:
        tokens: Token ids, uint8 (bytes) or uint16 (``.bin``), possibly a read-only memmap.
        vocab_size: Upper bound of the ids (256 for bytes; declared for ``.bin``).
        fingerprint: sha256 hex identifying the content (for a ``.bin``: its size and first and
            last MiB, so a terabyte file is not read at start).
        description: One line for logs, e.g. ``"stdlib /usr/lib/python3.11: 812 files, 16 MiB"``.
    """

    tokens: npt.NDArray[np.uint8] | npt.NDArray[np.uint16]
    vocab_size: int
    fingerprint: str
    description: str

    @classmethod
    def from_bytes(cls, data: bytes, *, description: str = "bytes") -> TokenCorpus:
        """A byte-level corpus (vocab 256) over ``data``."""
        tokens = np.frombuffer(data, dtype=np.uint8)
        return cls(tokens, 256, hashlib.sha256(data).hexdigest(), description)


def stdlib_root() -> Path:
    """Directory of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_text_files(root: Path, suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[Path]:
    """Files under ``root`` ending in one of ``suffixes``, in hashed order (module docstring)."""
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        found.extend(Path(folder, f) for f in files if f.endswith(tuple(suffixes)))
    return _hashed_order(found, root)


def glob_text_files(pattern: str) -> list[Path]:
    """Regular files matching ``pattern`` (``**`` recurses), in hashed order."""
    return _hashed_order([Path(p) for p in glob.glob(pattern, recursive=True)], Path())


def _hashed_order(paths: list[Path], root: Path) -> list[Path]:
    def key(path: Path) -> tuple[str, str]:
        rel = path.relative_to(root).as_posix() if root.parts else path.as_posix()
        return hashlib.sha256(rel.encode()).hexdigest(), rel

    return sorted((p for p in paths if p.is_file()), key=key)


def read_text_files(files: Sequence[Path], max_bytes: int) -> tuple[bytes, int]:
    """Concatenate files in order until ``max_bytes``; the last one is cut to fit.

    Returns:
        ``(data, files_used)``; unreadable and binary (NUL-containing) files are skipped.
    """
    parts: list[bytes] = []
    total = 0
    for path in files:
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if b"\x00" in data:
            continue
        parts.append(data[: max_bytes - total])
        total += len(parts[-1])
    return b"".join(parts), len(parts)


def load_text_files(files: Sequence[Path], *, max_bytes: int, origin: str) -> TokenCorpus:
    """A byte-level corpus of ``files`` (in the given order), capped at ``max_bytes``.

    Raises:
        ConfigError: ``max_bytes`` < 1, or no readable text at all.
    """
    if max_bytes < 1:
        raise ConfigError(f"max_bytes must be >= 1, got {max_bytes}")
    data, used = read_text_files(files, max_bytes)
    if not data:
        raise ConfigError(f"no readable text in {origin} ({len(files)} candidate files)")
    mib = len(data) / MiB
    return TokenCorpus.from_bytes(data, description=f"{origin}: {used} files, {mib:.1f} MiB")


def load_token_bin(path: str | Path, *, vocab_size: int = 1 << 16) -> TokenCorpus:
    """Memory-map a nanoGPT-style ``uint16`` token file.

    Args:
        path: The ``.bin`` file (native-endian uint16 ids, no header).
        vocab_size: Declared bound of the ids (e.g. 50257 for GPT-2 BPE); not checked here.

    Raises:
        ConfigError: Missing or unreadable file, odd byte size, or fewer than 2 tokens.
    """
    file = Path(path)
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            head = handle.read(_SAMPLE_BYTES)
            handle.seek(max(size - _SAMPLE_BYTES, 0))
            tail = handle.read()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {file}: {exc.strerror}") from None
    if size % 2 or size < 4:
        raise ConfigError(f"token file {file} has {size} bytes: need an even size >= 4 (uint16)")
    digest = hashlib.sha256(size.to_bytes(8, "little") + head + tail).hexdigest()
    tokens = np.memmap(file, dtype=np.uint16, mode="r")
    return TokenCorpus(tokens, vocab_size, digest, f"{file}: {size // 2} tokens (uint16)")


class TextDataset:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a corpus."""

    def __init__(self, corpus: TokenCorpus, seq_len: int) -> None:
        """Cut ``corpus`` into windows; a partial window at the end is dropped.

        Raises:
            ConfigError: ``seq_len`` < 1 or no complete window.
        """
        if seq_len < 1:
            raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
        self.corpus, self.seq_len = corpus, seq_len
        self.n_examples = len(corpus.tokens) // (seq_len + 1)
        if self.n_examples == 0:
            raise ConfigError(
                f"corpus of {len(corpus.tokens)} tokens has no window of {seq_len + 1} tokens"
            )
        self.fingerprint = f"{corpus.fingerprint[:16]}:T{seq_len}"
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)

    def gather(self, ids: npt.NDArray[np.int64]) -> Batch:
        """Windows ``ids`` as a batch: inputs/targets (len(ids), seq_len) int64."""
        starts = ids.astype(np.int64) * (self.seq_len + 1)
        windows = torch.from_numpy(
            self.corpus.tokens[starts[:, None] + self._offsets].astype(np.int64)
        )
        return Batch(
            windows[:, :-1].contiguous(), windows[:, 1:].contiguous(), len(ids) * self.seq_len
        )
