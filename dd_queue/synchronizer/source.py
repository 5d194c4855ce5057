"""Where a new run's initial global model Θ comes from: the config's model, arrays, or a file.

A ``ModelSource`` gives the parameter shapes (to plan fragments, cheaply: the config's model is
built on torch's ``meta`` device, which allocates nothing) and, only when a run is created, the
initial float32 values. Learners plan from their own model's ``named_parameters()``; the plan
digest in every fragment's state lets them check that they and the synchronizer agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from dd_queue.config import ModelConfig, SynchronizerConfig
from dd_queue.core.fragments import FragmentPlan, plan_fragments
from dd_queue.errors import ConfigError, CoreError

__all__ = ["ArraySource", "ConfigModelSource", "ModelSource", "plan_of"]

Arrays = Mapping[str, npt.NDArray[np.float32]]


class ModelSource(Protocol):
    """The shapes and initial values of the global model."""

    @property
    def origin(self) -> str:
        """Where the values come from, for logs and the state's reason."""
        ...

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name → shape."""
        ...

    def arrays(self) -> Arrays:
        """Parameter name → initial float32 values (may be expensive: called on creation only)."""
        ...


@dataclass(frozen=True, slots=True)
class ArraySource:
    """Given arrays (tests, benchmarks, a re-seed from an exported file).

    Attributes:
        values: Parameter name → array (converted to float32 when read).
        origin: Description for logs.
    """

    values: Mapping[str, npt.ArrayLike]
    origin: str = "arrays"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(np.shape(a)) for name, a in self.values.items()}

    def arrays(self) -> Arrays:
        return {name: np.asarray(a, dtype=np.float32) for name, a in self.values.items()}


@dataclass(slots=True)
class ConfigModelSource:
    """The config's model (preset + overrides), initialised with the run's seed on the CPU.

    Attributes:
        model: The ``model`` section.
        seed: ``run.seed``: the same seed gives the same Θ(0) on every machine.
    """

    model: ModelConfig
    seed: int
    _shapes: dict[str, tuple[int, ...]] | None = field(default=None, init=False)

    @property
    def origin(self) -> str:
        return f"model {self.model.preset} seed {self.seed}"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self._shapes is None:
            from dd_queue.models import build_model  # torch: only where a model is needed

            meta = build_model(self.model.spec(), device="meta")
            self._shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
        return dict(self._shapes)

    def arrays(self) -> Arrays:
        from dd_queue.models import build_model

        model = build_model(self.model.spec(), seed=self.seed, device="cpu")
        return {name: p.detach().float().numpy().copy() for name, p in model.named_parameters()}


def plan_of(source: ModelSource, sync: SynchronizerConfig) -> FragmentPlan:
    """The fragment plan of ``source``'s parameters, as learners compute it.

    Raises:
        ConfigError: ``n_fragments`` does not fit the model.
    """
    try:
        return plan_fragments(
            source.shapes(), sync.n_fragments, embedding_patterns=sync.embedding_patterns
        )
    except CoreError as exc:  # name the config field to change
        raise ConfigError(f"synchronizer.n_fragments={sync.n_fragments}: {exc}") from exc
