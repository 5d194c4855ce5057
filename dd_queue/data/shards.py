"""Which examples each learner trains on, in which order: held-out split, shards, epochs.

Pure index arithmetic over example ids ``0 .. n − 1`` (an example is a text window or an image);
no torch, no I/O. Everything is a function of (dataset size, seed, learner index, learner count),
so every process that rebuilds it gets the same answer.

- **Held-out split**: the last ``n_eval = ceil(eval_fraction · n)`` ids in dataset order. It does
  not depend on the run seed, so runs with different seeds evaluate on the same examples. Dataset
  order is chosen by each dataset so that its tail is a fair sample (text: whole files in hashed
  order; images: a fixed hashed shuffle).
- **Shards**: the remaining ids, permuted by the seed, dealt round-robin: shard i of M gets
  positions i, i + M, i + 2M, ... Shards are disjoint and together cover every training id;
  sizes differ by at most one. A learner keeps its shard for the whole run (learners run at
  different speeds, so per-epoch global reshuffles would make them overlap).
- **Epochs**: each epoch visits the learner's shard once in an order keyed by
  (seed, learner index, epoch), then wraps to the next epoch.
- **Position**: ``(epoch, position)`` of the next example; ``ShardCursor.state_dict()`` saves it
  with the shard's identity, so a restarted learner neither repeats nor skips data, and a saved
  position is refused (``ConfigError``) by a cursor of a different shard, seed or dataset.

Permutations come from a counter-based hash (splitmix64, Steele et al. 2014) and a stable sort,
not from numpy's ``Generator``, whose streams numpy does not promise to keep across versions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dd_queue.errors import ConfigError

Ids = npt.NDArray[np.int64]
CURSOR_FORMAT = "ddq.shard_cursor.v1"
_SHARD_SALT = 0x5A4D  # keys the shard-assignment permutation apart from the epoch orders
_U64 = np.uint64


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def hash_permutation(n: int, *key: int) -> Ids:
    """A permutation of ``0 .. n − 1`` determined by ``key`` alone (stable across versions).

    Args:
        n: Length (≥ 0).
        *key: Non-negative integers, e.g. ``(seed, learner_index, epoch)``.

    Returns:
        int64 array of length ``n``.
    """
    if any(k < 0 or k >= 1 << 64 for k in key):
        raise ConfigError(f"permutation keys must be integers in [0, 2**64), got {key}")
    state = np.zeros(1, dtype=np.uint64)  # arrays, not scalars: uint64 wrap-around is silent
    for part in key:
        state = _splitmix64(state ^ np.array([part], dtype=np.uint64))
    scores = _splitmix64(np.arange(n, dtype=np.uint64) ^ state)
    return np.argsort(scores, kind="stable").astype(np.int64)


def holdout_split(n_examples: int, eval_fraction: float) -> tuple[Ids, Ids]:
    """Split ids into ``(train_ids, eval_ids)``: the held-out ids are the dataset's tail.

    Args:
        n_examples: Examples in the dataset.
        eval_fraction: Share held out, in [0, 1); any positive share holds out at least one.

    Returns:
        ``(arange(n − n_eval), arange(n − n_eval, n))`` with ``n_eval = ceil(fraction · n)``.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n_eval = math.ceil(eval_fraction * n_examples)
    n_train = n_examples - n_eval
    return np.arange(n_train, dtype=np.int64), np.arange(n_train, n_examples, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Which learner this is and how data is dealt.

    Attributes:
        index: This learner's shard, 0-based (``L3`` → 3).
        count: Number of shards M (learners the run is planned for).
        seed: Run seed; keys the shard assignment and every epoch order.
    """

    index: int = 0
    count: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count or self.seed < 0:
            raise ConfigError(
                f"shard {self.index} of {self.count} (seed {self.seed}) is invalid: need "
                "count >= 1, 0 <= index < count and seed >= 0"
            )

    def select(self, train_ids: Ids) -> Ids:
        """This shard's ids out of ``train_ids`` (seeded permutation, dealt round-robin)."""
        if len(train_ids) < self.count:
            raise ConfigError(
                f"{len(train_ids)} training examples cannot fill {self.count} shards: use a "
                "larger corpus (max_bytes), shorter sequences or a smaller eval_fraction"
            )
        permuted = train_ids[hash_permutation(len(train_ids), self.seed, _SHARD_SALT)]
        return permuted[self.index :: self.count]


class ShardCursor:
    """Position in one shard's endless, epoch-by-epoch stream of example ids."""

    def __init__(
        self, shard_ids: Ids, spec: ShardSpec, *, identity: Mapping[str, int | str]
    ) -> None:
        """Start at epoch 0, position 0.

        Args:
            shard_ids: This shard's example ids (non-empty).
            spec: The shard's index, count and seed (keys the epoch orders).
            identity: What a saved state must match besides the spec (e.g. dataset fingerprint,
                example count), JSON-able values.
        """
        if len(shard_ids) == 0:
            raise ConfigError("a shard must hold at least one example")
        self.shard_ids, self.spec = shard_ids, spec
        self._identity = {
            "format": CURSOR_FORMAT,
            **identity,
            "shard": f"{spec.index}/{spec.count}",
            "seed": spec.seed,
            "shard_size": len(shard_ids),
        }
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = -1, shard_ids

    def _epoch_order(self) -> Ids:
        if self._order_epoch != self.epoch:
            perm = hash_permutation(
                len(self.shard_ids), self.spec.seed, self.spec.index, self.epoch
            )
            self._order, self._order_epoch = self.shard_ids[perm], self.epoch
        return self._order

    def take(self, n: int) -> Ids:
        """The next ``n`` example ids, wrapping into the next epoch(s) as needed."""
        parts: list[Ids] = []
        while n > 0:
            order = self._epoch_order()
            chunk = order[self.position : self.position + n]
            parts.append(chunk)
            n -= len(chunk)
            self.position += len(chunk)
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def state_dict(self) -> dict[str, int | str]:
        """The position and the shard's identity, as a small JSON-able dict."""
        return {**self._identity, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Continue from a saved position.

        Raises:
            ConfigError: The state belongs to another shard, seed or dataset, or is malformed.
        """
        changed = {k: (state.get(k), v) for k, v in self._identity.items() if state.get(k) != v}
        if changed:
            detail = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in changed.items())
            raise ConfigError(
                f"saved data position does not belong to this shard ({detail}); start the "
                "learner with the data config it was saved under, or discard the position"
            )
        epoch, position = state.get("epoch"), state.get("position")
        if (
            not isinstance(epoch, int)
            or not isinstance(position, int)
            or epoch < 0
            or not (0 <= position < len(self.shard_ids))
        ):
            raise ConfigError(
                f"saved data position epoch={epoch!r} position={position!r} is invalid"
            )
        self.epoch, self.position = epoch, position
