"""A learner's data: its shard as an endless, resumable batch iterator, plus the held-out split.

    spec = DataSpec(source="stdlib-text", batch_size=8)
    loader = build_loader(spec, seq_len=128, shard=ShardSpec(index=2, count=4, seed=0))
    batch = next(loader)                  # Batch(inputs, targets, n_tokens)
    saved = loader.state_dict()           # small JSON-able dict: checkpoint it
    loader.load_state_dict(saved)         # after a restart: continue exactly there
    for batch in loader.eval_batches(max_batches=8): ...

Splitting, sharding and epoch order are described in ``shards.py``; the text and image sources
in ``text.py`` and ``vision.py``; the token shards of ``ddq prepare`` in ``prepared.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from dd_queue.data.batch import Batch
from dd_queue.data.manifest import read_manifest
from dd_queue.data.prepared import PreparedDataset
from dd_queue.data.shards import Ids, ShardCursor, ShardSpec, holdout_split
from dd_queue.data.spec import TEXT_SOURCES, DataSpec
from dd_queue.data.text import (
    TextDataset,
    TokenCorpus,
    glob_text_files,
    list_text_files,
    load_text_files,
    load_token_bin,
    stdlib_root,
)
from dd_queue.data.vision import ImageDataset, load_digits, load_npz
from dd_queue.errors import ConfigError


class Dataset(Protocol):
    """Examples addressed by id ``0 .. n_examples − 1`` (a text window, an image)."""

    @property
    def n_examples(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    def gather(self, ids: npt.NDArray[np.int64]) -> Batch: ...


def load_corpus(spec: DataSpec) -> TokenCorpus:
    """The token corpus of a text source (``stdlib-text``, ``text-files``, ``token-bin``).

    Raises:
        ConfigError: ``prepared`` (many shard files, not one corpus: use ``build_dataset``) or
            an image source.
    """
    if spec.source == "prepared":
        raise ConfigError(
            "data source 'prepared' is a set of shard files, not one token corpus: load it "
            "with build_dataset (PreparedDataset)"
        )
    if spec.source == "stdlib-text":
        root = stdlib_root()
        files = list_text_files(root, spec.suffixes)
        return load_text_files(files, max_bytes=spec.max_bytes, origin=f"stdlib {root}")
    if spec.source == "token-bin" and spec.path:
        return load_token_bin(spec.path, vocab_size=spec.vocab_size)
    if spec.source == "text-files" and spec.path:
        root = Path(spec.path)
        files = (
            list_text_files(root, spec.suffixes) if root.is_dir() else glob_text_files(spec.path)
        )
        return load_text_files(files, max_bytes=spec.max_bytes, origin=spec.path)
    raise ConfigError(f"data source {spec.source!r} is not a text source ({TEXT_SOURCES})")


def build_dataset(spec: DataSpec, *, seq_len: int) -> TextDataset | PreparedDataset | ImageDataset:
    """The dataset of ``spec``: text windows of ``seq_len`` tokens, or images.

    Raises:
        ConfigError: The source's data is missing or malformed; for ``prepared``, also a model
            vocabulary (``spec.vocab_size``) smaller than the prepared data's.
    """
    if spec.source == "prepared" and spec.path:
        return PreparedDataset(read_manifest(spec.path), seq_len, vocab_size=spec.vocab_size)
    if spec.source == "digits":
        return ImageDataset(load_digits())
    if spec.source == "npz" and spec.path:
        return ImageDataset(load_npz(spec.path))
    return TextDataset(load_corpus(spec), seq_len)


def build_loader(spec: DataSpec, *, seq_len: int, shard: ShardSpec) -> ShardLoader:
    """Load the data of ``spec`` and return the loader of one learner's shard."""
    dataset = build_dataset(spec, seq_len=seq_len)
    return ShardLoader(
        dataset, batch_size=spec.batch_size, shard=shard, eval_fraction=spec.eval_fraction
    )


def _split_of(dataset: Dataset, eval_fraction: float) -> tuple[Ids, Ids]:
    """``(train_ids, eval_ids)``: the dataset's own held-out tail if it has one."""
    n, n_heldout = dataset.n_examples, getattr(dataset, "n_heldout", None)
    if n_heldout is None:
        return holdout_split(n, eval_fraction)
    if not isinstance(n_heldout, int) or not 0 <= n_heldout < n:
        raise ConfigError(f"dataset n_heldout {n_heldout!r} is not in [0, n_examples={n})")
    return np.arange(n - n_heldout, dtype=np.int64), np.arange(n - n_heldout, n, dtype=np.int64)


class ShardLoader(Iterator[Batch]):
    """Endless batches of one learner's shard, resumable from ``state_dict()``."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        shard: ShardSpec | None = None,
        eval_fraction: float = 0.05,
    ) -> None:
        """Split the dataset and position the cursor at the start of epoch 0.

        The held-out ids are the dataset's tail either way: the last ``n_heldout`` ids when the
        dataset has that attribute (``PreparedDataset``: its validation split, chosen by
        document at prepare time; ``eval_fraction`` is then not used), else the last
        ``ceil(eval_fraction · n)`` (``shards.holdout_split``).

        Args:
            dataset: The examples (shared, read-only, by all loaders of a process).
            batch_size: Examples per training batch.
            shard: This learner's shard (default: the only one, seed 0).
            eval_fraction: Share held out for evaluation (see ``shards.holdout_split``).
        """
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset, self.batch_size = dataset, batch_size
        self.shard = shard or ShardSpec()
        train_ids, self.eval_ids = _split_of(dataset, eval_fraction)
        identity: dict[str, int | str] = {
            "dataset": dataset.fingerprint,
            "n_examples": dataset.n_examples,
            "n_eval": len(self.eval_ids),
        }
        self.cursor = ShardCursor(self.shard.select(train_ids), self.shard, identity=identity)

    @property
    def shard_ids(self) -> npt.NDArray[np.int64]:
        """This learner's training example ids (disjoint from other shards and held-out ids)."""
        return self.cursor.shard_ids

    def __next__(self) -> Batch:
        return self.dataset.gather(self.cursor.take(self.batch_size))

    def state_dict(self) -> dict[str, int | str]:
        """Position (epoch, position) and shard identity: small and JSON-able."""
        return self.cursor.state_dict()

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue exactly where ``state`` was saved (``ConfigError`` if it is another shard's)."""
        self.cursor.load_state_dict(state)

    def eval_batches(
        self, *, batch_size: int | None = None, max_batches: int | None = None
    ) -> Iterator[Batch]:
        """The held-out examples in a fixed order (the same for every learner and run).

        Args:
            batch_size: Examples per batch (default: the training batch size).
            max_batches: Stop after this many batches (default: all held-out examples; the
                last batch may be smaller).
        """
        size = batch_size or self.batch_size
        starts = range(0, len(self.eval_ids), size)
        for number, start in enumerate(starts):
            if max_batches is not None and number >= max_batches:
                return
            yield self.dataset.gather(self.eval_ids[start : start + size])
