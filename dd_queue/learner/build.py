"""Build a learner process's parts from the config: device, data shard, model, ``Learner``.

The in-process runner builds its own parts (MemoryBus, FakeClock, loaders) and calls
``Learner(...)`` directly; this module is what the service uses.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from dd_queue.bus import Bus
from dd_queue.clock import Clock
from dd_queue.config import DDQConfig
from dd_queue.data import Batch, ShardSpec, build_loader
from dd_queue.errors import ConfigError
from dd_queue.faults import FaultInjector
from dd_queue.keys import check_name
from dd_queue.learner.checkpoint import LocalCheckpoint
from dd_queue.learner.dist import Group
from dd_queue.learner.learner import Learner
from dd_queue.models.builder import build

_TRAILING_NUMBER = re.compile(r"(\d+)$")


def resolve_device(name: str, *, local_rank: int = 0) -> torch.device:
    """``learner.device`` → a device: ``auto`` is ``cuda:<local rank>`` when CUDA exists, else CPU.

    Raises:
        ConfigError: CUDA asked for but not available.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"learner.device {name!r} but CUDA is not available; use cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def shard_for(
    learner_id: str, *, n_learners: int, rank: int = 0, world_size: int = 1, seed: int = 0
) -> ShardSpec:
    """The data shard of a learner rank: learner ``L<i>`` of M, rank r of R → shard i·R + r of M·R.

    Raises:
        ConfigError: The id does not end in a number, or the number is not below M.
    """
    match = _TRAILING_NUMBER.search(check_name("learner_id", learner_id))
    if match is None or int(match.group(1)) >= n_learners:
        raise ConfigError(
            f"learner id {learner_id!r} must end in a number below membership.expected_learners "
            f"({n_learners}) to pick its data shard, e.g. L0 .. L{n_learners - 1}; raise "
            "expected_learners to add learners"
        )
    index = int(match.group(1))
    return ShardSpec(index=index * world_size + rank, count=n_learners * world_size, seed=seed)


def build_loader_for(cfg: DDQConfig, learner_id: str, group: Group) -> Iterator[Batch]:
    """This rank's batches of the learner's shard."""
    spec = cfg.model.architecture()
    shard = shard_for(
        learner_id,
        n_learners=cfg.membership.expected_learners,
        rank=group.rank,
        world_size=group.world_size,
        seed=cfg.run.seed,
    )
    data = cfg.data.spec(vocab_size=spec.vocab_size)
    return build_loader(data, seq_len=spec.seq_len, shard=shard)


def build_learner(
    cfg: DDQConfig,
    learner_id: str,
    *,
    group: Group,
    bus: Bus | None,
    clock: Clock,
    device: torch.device,
) -> Learner:
    """A ``Learner`` with the configured model (parameters are replaced at ``join``)."""
    model = build(cfg.model.architecture(), seed=cfg.run.seed, device=device)
    directory = cfg.learner.checkpoint_dir
    checkpoint = (
        LocalCheckpoint(directory, run_id=cfg.run.run_id, learner_id=learner_id, rank=group.rank)
        if directory
        else None
    )
    return Learner(
        cfg,
        learner_id=learner_id,
        model=model,
        loader=build_loader_for(cfg, learner_id, group),
        bus=bus,
        clock=clock,
        injector=FaultInjector(learner_id, clock=clock),
        group=group,
        checkpoint=checkpoint,
    )


__all__ = ["build_learner", "build_loader_for", "resolve_device", "shard_for"]
