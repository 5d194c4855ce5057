"""Windows over the token shards of ``ddq prepare`` (data source ``prepared``).

Example ids: the non-overlapping windows of ``seq_len + 1`` tokens *within* each shard file
(a window never crosses files; a partial window at a file's end is dropped), train files first
in manifest order, then the val files. Ids ``0 .. n_train − 1`` are training windows and the
last ``n_heldout`` ids the validation split's, so ``ShardLoader`` holds out exactly the
validation documents (chosen by document when the data was prepared) instead of a share of
windows. Files are memory-mapped read-only: only the windows a batch touches are read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dd_queue.data.batch import Batch
from dd_queue.data.manifest import Manifest, SplitName
from dd_queue.errors import ConfigError


class PreparedDataset:
    """The train and val windows of a prepared dataset (``Dataset`` protocol of ``loader.py``).

    Attributes:
        manifest: The prepared dataset's manifest.
        seq_len: Tokens per input (a window holds ``seq_len + 1``).
        n_examples: Windows in all: ``n_train + n_heldout``.
        n_train: Training windows (ids ``0 .. n_train − 1``).
        n_heldout: Validation windows (the tail ids); 0 without a val split.
        fingerprint: ``"<data fingerprint[:16]>:<tokenizer sha256[:8]>:T<seq_len>"``.
        description: One line for logs.
    """

    def __init__(self, manifest: Manifest, seq_len: int, *, vocab_size: int | None = None) -> None:
        """Memory-map the shard files and number their windows.

        Args:
            manifest: From ``read_manifest`` (which checked the files' sizes).
            seq_len: Tokens per input.
            vocab_size: The model's vocabulary; checked to cover the data's ids (None: unchecked).

        Raises:
            ConfigError: ``seq_len`` < 1, a model vocabulary smaller than the data's, a file
                that cannot be mapped, or no training window.
        """
        if seq_len < 1:
            raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
        if vocab_size is not None and vocab_size < manifest.vocab_size:
            raise ConfigError(
                f"the prepared data at {manifest.root} has ids up to {manifest.vocab_size - 1} "
                f"but the model's vocabulary is {vocab_size}: set the model's vocab_size to at "
                f"least {manifest.vocab_size}"
            )
        self.manifest, self.seq_len = manifest, seq_len
        self._maps: list[np.memmap[Any, np.dtype[Any]]] = []
        firsts: list[int] = []
        self.n_train = self._map_split("train", firsts, 0)
        self.n_heldout = self._map_split("val", firsts, self.n_train)
        self.n_examples = self.n_train + self.n_heldout
        if self.n_train == 0:
            raise ConfigError(
                f"the train split of {manifest.root} ({manifest.train.tokens} tokens in "
                f"{len(manifest.train.files)} files) has no window of {seq_len + 1} tokens: use "
                "a shorter seq_len, or prepare more data or larger --shard-tokens"
            )
        self._first = np.asarray(firsts, dtype=np.int64)
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)
        self.fingerprint = f"{manifest.fingerprint[:16]}:{manifest.tokenizer_sha256[:8]}:T{seq_len}"
        self.description = (
            f"prepared {manifest.root}: {self.n_train} train + {self.n_heldout} val windows of "
            f"{seq_len + 1} tokens, vocab {manifest.vocab_size} ({manifest.dtype})"
        )

    def _map_split(self, name: SplitName, firsts: list[int], first_id: int) -> int:
        """Map the files of one split that hold a window, numbering its windows from
        ``first_id`` (each mapped file's first id goes to ``firsts``); return its window count."""
        window, total = self.seq_len + 1, 0
        for path, entry in zip(
            self.manifest.paths(name), self.manifest.split(name).files, strict=True
        ):
            windows = entry.tokens // window
            if windows == 0:
                continue
            try:
                tokens = np.memmap(path, dtype=self.manifest.np_dtype, mode="r")
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"cannot map {path}: {exc}; restore the directory or rerun `ddq prepare`"
                ) from None
            firsts.append(first_id + total)
            self._maps.append(tokens)
            total += windows
        return total

    def gather(self, ids: npt.NDArray[np.int64]) -> Batch:
        """Windows ``ids`` as a batch: inputs/targets (len(ids), seq_len) int64.

        Raises:
            IndexError: An id outside ``0 .. n_examples − 1``.
        """
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.n_examples):
            raise IndexError(f"window ids must be in [0, {self.n_examples}), got {ids}")
        file_of = np.searchsorted(self._first, ids, side="right") - 1
        windows = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for index in np.unique(file_of):
            rows = file_of == index
            starts = (ids[rows] - self._first[index]) * (self.seq_len + 1)
            windows[rows] = self._maps[index][starts[:, None] + self._offsets]
        batch = torch.from_numpy(windows)
        return Batch(batch[:, :-1].contiguous(), batch[:, 1:].contiguous(), len(ids) * self.seq_len)


__all__ = ["PreparedDataset"]
