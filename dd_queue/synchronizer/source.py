"""Where a new run's initial global model Θ comes from: the config's model, arrays, or a file.

A ``ModelSource`` gives the parameter shapes (to plan fragments, cheaply: the config's model is
built on torch's ``meta`` device, which allocates nothing) and, only when a run is created, the
initial float32 values. Learners plan from their own model's synchronized parameters (all but
the frozen ones: ``models.builder.synced_parameters``); the plan
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

    def embedding_names(self) -> frozenset[str]:
        """Tensors the architecture's embedding modules hold (merged by the weighted mean,
        whatever their names): learners find the same by module type."""
        ...


@dataclass(frozen=True, slots=True)
class ArraySource:
    """Given arrays (tests, benchmarks, a re-seed from an exported file).

    Attributes:
        values: Parameter name → array (converted to float32 when read).
        origin: Description for logs.
        embeddings: Tensors of the architecture's embedding modules (``load_init`` fills it
            from the config's model; empty: the name patterns alone decide).
    """

    values: Mapping[str, npt.ArrayLike]
    origin: str = "arrays"
    embeddings: frozenset[str] = frozenset()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(np.shape(a)) for name, a in self.values.items()}

    def embedding_names(self) -> frozenset[str]:
        return self.embeddings

    def arrays(self) -> Arrays:
        return {name: np.asarray(a, dtype=np.float32) for name, a in self.values.items()}


@dataclass(slots=True)
class ConfigModelSource:
    """The config's model (any source: ``models/builder.py``), initialised with the run's seed
    on the CPU.

    Attributes:
        model: The ``model`` section.
        seed: ``run.seed``: the same seed gives the same Θ(0) on every machine.
    """

    model: ModelConfig
    seed: int
    _layout: tuple[dict[str, tuple[int, ...]], frozenset[str]] | None = field(
        default=None, init=False
    )

    @property
    def origin(self) -> str:
        return f"model {self.model.architecture().describe()} seed {self.seed}"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._meta()[0])

    def embedding_names(self) -> frozenset[str]:
        """The parameters of the model's embedding modules (as the learners find them)."""
        return self._meta()[1]

    def _meta(self) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
        if self._layout is None:
            from dd_queue.models.builder import build, embedding_names, synced_parameters

            meta = build(self.model.architecture(), device="meta")
            shapes = {name: tuple(p.shape) for name, p in synced_parameters(meta).items()}
            self._layout = (shapes, embedding_names(meta))
        return self._layout

    def arrays(self) -> Arrays:
        from dd_queue.models.builder import build, synced_parameters

        model = build(self.model.architecture(), seed=self.seed, device="cpu")
        synced = synced_parameters(model).items()
        return {name: p.detach().float().numpy().copy() for name, p in synced}


def plan_of(source: ModelSource, sync: SynchronizerConfig) -> FragmentPlan:
    """The fragment plan of ``source``'s parameters, as learners compute it (their embedding
    modules found by type: ``source.embedding_names()``).

    Raises:
        ConfigError: ``n_fragments`` does not fit the model.
    """
    try:
        return plan_fragments(
            source.shapes(),
            sync.n_fragments,
            embedding_patterns=sync.embedding_patterns,
            embedding_names=source.embedding_names(),
        )
    except CoreError as exc:  # name the config field to change
        raise ConfigError(f"synchronizer.n_fragments={sync.n_fragments}: {exc}") from exc
