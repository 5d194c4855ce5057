"""Local checkpoint of what the global model does not hold: inner-optimizer state, data position.

Parameters always come from the synchronizer's published global model (a restarted learner loads
the newest versions), but AdamW's moments, the step count (learning-rate schedule) and the data
position are the learner's own. Saving them every ``learner.checkpoint_every_steps`` lets a
restarted learner resume them instead of starting AdamW cold and re-reading its shard.

One file per learner and rank, ``<checkpoint_dir>/<run_id>/<learner_id>.rank<r>.pt``, written to
a temporary file and renamed (a crash mid-write leaves the previous checkpoint intact). The save
runs on the training thread between steps: it is local disk, not the network, and rare.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dd_queue.errors import ConfigError
from dd_queue.learner.inner import InnerLoop

log = logging.getLogger("dd_queue.learner")

FORMAT = "ddq.learner_checkpoint.v1"


class LocalCheckpoint:
    """The checkpoint file of one learner rank.

    Args:
        directory: ``learner.checkpoint_dir``.
        run_id: The run.
        learner_id: The learner.
        rank: The rank within a torchrun group (0 for a single process).
    """

    def __init__(self, directory: str | Path, *, run_id: str, learner_id: str, rank: int) -> None:
        self.run_id, self.learner_id = run_id, learner_id
        self.path = Path(directory) / run_id / f"{learner_id}.rank{rank}.pt"

    def save(self, state: dict[str, Any]) -> None:
        """Write ``state`` (tensors, numbers, strings, lists and dicts) atomically."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"format": FORMAT, "run_id": self.run_id, "learner_id": self.learner_id}
        tmp = self.path.with_name(self.path.name + ".tmp")
        torch.save({**payload, "state": state}, tmp)
        os.replace(tmp, self.path)
        log.debug("learner.checkpoint_saved %s", self.path)

    def load(self) -> dict[str, Any] | None:
        """The saved state, or None when there is no checkpoint.

        Raises:
            ConfigError: The file is unreadable or belongs to another run or learner.
        """
        if not self.path.exists():
            return None
        try:
            saved = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises many kinds for a damaged file
            raise ConfigError(
                f"cannot read learner checkpoint {self.path}: {exc}; delete it to start fresh"
            ) from exc
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise ConfigError(f"{self.path} is not a learner checkpoint ({FORMAT}); delete it")
        if (saved.get("run_id"), saved.get("learner_id")) != (self.run_id, self.learner_id):
            raise ConfigError(
                f"{self.path} belongs to run {saved.get('run_id')!r} learner "
                f"{saved.get('learner_id')!r}, not {self.run_id!r}/{self.learner_id!r}"
            )
        state: dict[str, Any] = saved["state"]
        return state

    def save_learner(self, inner: InnerLoop, loader: Iterator[Any], n_tokens: int) -> None:
        """Save the inner optimizer, the data position (if the loader has one) and tokens."""
        position = loader.state_dict() if hasattr(loader, "state_dict") else None
        self.save({"inner": inner.state_dict(), "loader": position, "n_tokens": n_tokens})

    def restore_learner(self, inner: InnerLoop, loader: Iterator[Any]) -> int | None:
        """Restore what ``save_learner`` saved; returns the tokens trained, None without a file.

        Raises:
            ConfigError: As ``load``.
        """
        state = self.load()
        if state is None:
            return None
        inner.load_state_dict(state["inner"])
        if state.get("loader") is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(state["loader"])
        log.info("learner.resumed step %d from %s", inner.step_count, self.path)
        return int(state.get("n_tokens", 0))


__all__ = ["FORMAT", "LocalCheckpoint"]
