"""What data a learner trains on (``DataSpec``): pure settings, no torch, so the config tree
can name them without loading the data stack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dd_queue.errors import ConfigError

MiB = 1 << 20
TEXT_SUFFIXES: tuple[str, ...] = (".py", ".rst", ".txt")
Source = Literal["stdlib-text", "text-files", "token-bin", "prepared", "digits", "npz"]
TEXT_SOURCES: tuple[Source, ...] = ("stdlib-text", "text-files", "token-bin", "prepared")
PATH_SOURCES: tuple[Source, ...] = ("text-files", "token-bin", "prepared", "npz")
"""The sources that read ``path`` (and refuse to start without one)."""


@dataclass(frozen=True, slots=True)
class DataSpec:
    """Where a learner's examples come from and how they are batched.

    Attributes:
        source: ``stdlib-text`` (default; bytes of the running Python's standard library),
            ``text-files`` (bytes of a directory or glob), ``token-bin`` (uint16 memmap),
            ``prepared`` (token shards of ``ddq prepare``), ``digits`` (scikit-learn's 8×8
            digits) or ``npz`` (``images``/``labels`` arrays).
        path: Directory or glob (``text-files``), ``.bin`` file (``token-bin``), the output
            directory of ``ddq prepare`` or its ``manifest.json`` (``prepared``), or ``.npz``.
        max_bytes: Cap of the byte-level text corpora, in bytes.
        suffixes: File endings read from a directory (``stdlib-text``, ``text-files``).
        vocab_size: The model's vocabulary: the declared id bound of a ``token-bin`` file; a
            ``prepared`` dataset with a larger vocabulary is refused.
        batch_size: Examples (sequences or images) per batch.
        eval_fraction: Share of examples held out for evaluation, in [0, 1); not used by
            ``prepared``, whose validation split (chosen by document) is the held-out set.
    """

    source: Source = "stdlib-text"
    path: str | None = None
    max_bytes: int = 16 * MiB
    suffixes: tuple[str, ...] = TEXT_SUFFIXES
    vocab_size: int = 1 << 16
    batch_size: int = 8
    eval_fraction: float = 0.05

    def __post_init__(self) -> None:
        if self.source in PATH_SOURCES and not self.path:
            raise ConfigError(f"data source {self.source!r} needs data.path")
        if self.batch_size < 1 or self.max_bytes < 1:
            raise ConfigError("data.batch_size and data.max_bytes must be >= 1")


__all__ = ["PATH_SOURCES", "TEXT_SOURCES", "TEXT_SUFFIXES", "DataSpec", "MiB", "Source"]
