"""The bridge between a fragment plan and a model's parameter tensors.

A fragment is a flat fp32 vector (``core.fragments``: segments ordered by name). This module
copies a fragment out of the model into a host buffer (a snapshot) and writes a global fragment
back into the model (overwrite, or α-mix).

On CUDA the snapshot is an asynchronous device-to-host copy into pinned memory: the training
thread only enqueues the copies and records an event; the background sender waits on the event.
The copies are ordered on the current stream before the next optimizer step, so the snapshot is
exactly θ_p at the step boundary even though the next step starts at once. On CPU the copy is
synchronous and costs one memcpy of the fragment.

Writes are bit-exact in overwrite mode (``α = 0``): an fp32 copy of Θ_p into fp32 parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from dd_queue.core.fragments import FragmentPlan, Segment, shapes_from_named
from dd_queue.errors import ConfigError
from dd_queue.learner.exchange import Float32Array
from dd_queue.models.builder import synced_parameters


class FragmentParams:
    """A model's parameters grouped by the fragments of ``plan``.

    Args:
        plan: The fragment plan of the model (from ``core.fragments.plan_fragments``).
        model: The plain module (not a DDP or compiled wrapper: parameter names must match).

    Raises:
        ConfigError: The model's parameters do not match the plan's tensors and shapes.
    """

    def __init__(self, plan: FragmentPlan, model: nn.Module) -> None:
        named = synced_parameters(model)  # frozen ones are not the run's: never exchanged
        shapes = shapes_from_named((n, p.shape) for n, p in named.items())
        planned = {s.name: s.shape for f in plan.fragments for s in f.segments}
        if shapes != planned:
            diff = sorted(set(shapes.items()) ^ set(planned.items()))[:4]
            raise ConfigError(
                f"the model's parameters do not match the fragment plan (first differences: "
                f"{diff}); build the model from the run's config"
            )
        self.plan = plan
        self.device = next(iter(named.values())).device
        self._pin = self.device.type == "cuda"
        self._segments: list[list[tuple[Segment, nn.Parameter]]] = [
            [(seg, named[seg.name]) for seg in fragment.segments] for fragment in plan.fragments
        ]

    @property
    def n_fragments(self) -> int:
        """P."""
        return self.plan.n_fragments

    def size(self, fragment_id: int) -> int:
        """Elements of fragment ``fragment_id``."""
        return self.plan.fragments[fragment_id].size

    def new_buffer(self, fragment_id: int) -> torch.Tensor:
        """A flat fp32 host buffer for one fragment (pinned when the model is on CUDA)."""
        return torch.empty(self.size(fragment_id), dtype=torch.float32, pin_memory=self._pin)

    @torch.no_grad()
    def copy_out(self, fragment_id: int, out: torch.Tensor) -> Callable[[], None] | None:
        """Copy θ_p into ``out`` (a host buffer from ``new_buffer``).

        Returns:
            On CUDA, a function that waits until the asynchronous copy is done; None on CPU
            (the copy is complete when this returns).
        """
        for seg, param in self._segments[fragment_id]:
            out[seg.start : seg.stop].view(seg.shape).copy_(param, non_blocking=self._pin)
        if not self._pin:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event.synchronize

    def read(self, fragment_id: int) -> Float32Array:
        """θ_p as a new numpy array (synchronous; for tests, checks and the DDP broadcast)."""
        out = torch.empty(self.size(fragment_id), dtype=torch.float32)
        for seg, param in self._segments[fragment_id]:
            out[seg.start : seg.stop].view(seg.shape).copy_(param.detach())
        return out.numpy()

    @torch.no_grad()
    def write(self, fragment_id: int, values: Float32Array | torch.Tensor, *, alpha: float) -> None:
        """θ_p ← α·θ_p + (1 − α)·Θ_p; ``alpha == 0`` copies Θ_p bit-exactly.

        Args:
            fragment_id: p.
            values: Θ_p, flat fp32 (numpy, or a tensor on any device).
            alpha: Share of the local parameters kept, in [0, 1].

        Raises:
            ConfigError: ``values`` has the wrong size.
        """
        src = _as_tensor(values)
        if src.numel() != self.size(fragment_id):
            raise ConfigError(
                f"fragment {fragment_id} has {self.size(fragment_id)} elements, the values "
                f"{src.numel()}: the global model was built from another plan"
            )
        src = src.to(self.device)
        for seg, param in self._segments[fragment_id]:
            part = src[seg.start : seg.stop].view(seg.shape)
            if alpha == 0.0:
                param.copy_(part)
            else:
                param.mul_(alpha).add_(part, alpha=1.0 - alpha)


def _as_tensor(values: Float32Array | torch.Tensor) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().reshape(-1).to(torch.float32)
    array = np.asarray(values, dtype=np.float32).reshape(-1)
    if not array.flags.writeable:  # torch.from_numpy warns on read-only arrays; never written
        array = array.copy()
    return torch.from_numpy(array)


__all__ = ["FragmentParams"]
