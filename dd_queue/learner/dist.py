"""The processes of one learner: a single process, or a torchrun group trained with DDP.

Under torchrun every rank trains its own slice of the learner's data shard; DDP averages the
gradients, so all replicas stay identical. Only rank 0 talks to Redis. Once per inner step the
ranks agree, in one ``all_reduce`` of a small int64 vector, on the tokens trained (summed over
ranks), whether to stop, and which global fragments rank 0 applies; each fragment to apply is
then broadcast from rank 0. Contributions are computed from rank 0's replica alone.

    torchrun --nproc-per-node 2 -m dd_queue.services.learner --config demo --learner-id L0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from dd_queue.learner.exchange import Float32Array, Received


class Group(Protocol):
    """Collectives among the ranks of one learner (all no-ops for a single process)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """Where collective tensors live (CUDA for NCCL, CPU for gloo)."""
        ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks, in place; returns it."""
        ...

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank 0's, in place; returns it."""
        ...

    def close(self) -> None:
        """Leave the group."""
        ...


class SingleProcess:
    """The group of a learner that runs as one process."""

    rank = 0
    world_size = 1
    device = torch.device("cpu")

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def close(self) -> None:
        return None


class TorchGroup:
    """The default ``torch.distributed`` process group (initialised by the caller)."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        backend = dist.get_backend()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, src=0)
        return tensor

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def group_from_env(
    environ: Mapping[str, str], *, device: torch.device, timeout_s: float = 1800.0
) -> Group:
    """The group torchrun describes in ``environ`` (``WORLD_SIZE`` > 1), else a single process.

    NCCL when ``device`` is CUDA (each rank on ``cuda:LOCAL_RANK``), gloo otherwise.
    """
    world_size = int(environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return SingleProcess()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return TorchGroup()


@dataclass(frozen=True, slots=True)
class Agreement:
    """What every rank of a learner does after an inner step.

    Attributes:
        n_tokens: Tokens trained by the step, summed over ranks.
        stop: Rank 0 asked to stop after this step.
        applied: (fragment, version, Θ_p) to apply, in fragment order; Θ_p on rank 0 only
            (None elsewhere: ``broadcast_fragment`` brings it).
    """

    n_tokens: int
    stop: bool
    applied: Sequence[tuple[int, int, Float32Array | None]]


class GroupSync:
    """The per-step agreement of a learner's ranks (nothing to agree on for one process).

    Args:
        group: The ranks.
        n_fragments: P (the agreement vector holds up to P (fragment, version) pairs).
    """

    def __init__(self, group: Group, n_fragments: int) -> None:
        self.group, self.n_fragments = group, n_fragments

    def agree(self, n_tokens: int, *, stop: bool, queued: Sequence[Received]) -> Agreement:
        """One ``all_reduce`` of ``[tokens, stop, n, (p, v) × P]``; only rank 0 fills the rest.

        Args:
            n_tokens: Tokens this rank trained.
            stop: Whether to stop (rank 0's counts).
            queued: Globals to apply (rank 0's count; empty elsewhere).
        """
        if self.group.world_size == 1:
            applied = [(r.fragment_id, r.version, r.values) for r in queued]
            return Agreement(n_tokens, stop, applied)
        vec = torch.zeros(3 + 2 * self.n_fragments, dtype=torch.int64)
        vec[0] = n_tokens
        if self.group.rank == 0:
            vec[1], vec[2] = int(stop), len(queued)
            for i, received in enumerate(queued):
                vec[3 + 2 * i], vec[4 + 2 * i] = received.fragment_id, received.version
        values = self.group.all_reduce_sum(vec.to(self.group.device)).tolist()
        pairs = [(values[3 + 2 * i], values[4 + 2 * i]) for i in range(values[2])]
        own = [r.values for r in queued] if self.group.rank == 0 else [None] * len(pairs)
        return Agreement(
            values[0], bool(values[1]), [(p, v, x) for (p, v), x in zip(pairs, own, strict=True)]
        )

    def broadcast_fragment(
        self, values: Float32Array | None, size: int
    ) -> Float32Array | torch.Tensor:
        """Θ_p from rank 0 on every rank: rank 0 gets its own array back, others a tensor."""
        if self.group.world_size == 1:
            if values is None:
                raise ValueError("a single process must have the fragment's values")
            return values
        device = self.group.device
        if self.group.rank == 0:
            if values is None:
                raise ValueError("rank 0 must have the fragment's values")
            self.group.broadcast(torch.from_numpy(np.ascontiguousarray(values)).to(device))
            return values
        return self.group.broadcast(torch.empty(size, dtype=torch.float32, device=device))


__all__ = ["Agreement", "Group", "GroupSync", "SingleProcess", "TorchGroup", "group_from_env"]
