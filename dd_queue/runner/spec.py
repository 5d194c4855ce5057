"""What one in-process run simulates, and experiment files that list several variants.

An experiment YAML (``config/experiments/*.yaml``)::

    name: fault_free
    seed: 0                      # model init, data order, step times and failures
    config: {model: {...}, synchronizer: {...}}     # a DDQConfig tree (over the defaults)
    runner: {n_learners: 4, token_budget: 1000000}  # RunnerSpec fields shared by the variants
    variants:
      - name: decoupled
      - name: synchronous
        runner: {mode: synchronous}
      - name: rda-8
        runner: {n_learners: 8}
        config: {synchronizer: {merge_rule: rda}}

Each variant deep-merges its own ``config`` and ``runner`` over the shared ones; every variant
runs on the same seed. ``RunnerSpec.derive`` then sets what the mode implies on the config
(expected learners, K = M for ``synchronous``, one learner with M× the batch and no merges for
``data-parallel``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dd_queue.config import DDQConfig, validate_config
from dd_queue.errors import ConfigError
from dd_queue.validation import deep_merge, read_yaml_mapping

__all__ = [
    "NO_SYNC_STEPS",
    "ExperimentSpec",
    "FailureSpec",
    "Mode",
    "RunnerSpec",
    "VariantSpec",
    "deep_merge",
    "load_experiment",
]

Mode = Literal["decoupled", "synchronous", "data-parallel"]
NO_SYNC_STEPS = 1_000_000_000
"""H of the data-parallel baseline: learner-paced fragments come due only after this many steps,
i.e. never, so the synchronizer never merges and the learner trains plainly."""


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class FailureSpec(_Spec):
    """Each learner fails as a Poisson process; a failed learner is repaired, then restarts.

    The time to the next failure is exponential with mean ``mtbf_s`` from the moment a learner
    (re)starts; the repair time is ``repair_min_s`` plus an exponential with mean
    ``repair_mean_s − repair_min_s``; a repaired learner spends ``restart_s`` rejoining.
    """

    mtbf_s: float = Field(gt=0, description="Mean time between failures of one learner, s.")
    repair_mean_s: float = Field(gt=0, description="Mean repair time, s.")
    repair_min_s: float = Field(0.0, ge=0, description="Shortest repair time, s.")
    restart_s: float = Field(0.0, ge=0, description="Rejoin time after repair (restarting), s.")

    @model_validator(mode="after")
    def _check_repair(self) -> Self:
        if self.repair_min_s > self.repair_mean_s:
            raise ValueError(
                f"repair_min_s {self.repair_min_s} exceeds repair_mean_s {self.repair_mean_s}"
            )
        return self


class RunnerSpec(_Spec):
    """How one run is simulated: mode, learners, step-time model, failures, budget, evals."""

    mode: Mode = Field("decoupled", description="decoupled | synchronous | data-parallel.")
    n_learners: int = Field(4, ge=1, description="M learners (data-parallel: chips).")
    token_budget: int | None = Field(
        None, ge=1, description="Stop once all learners together trained this many tokens."
    )
    max_virtual_s: float | None = Field(None, gt=0, description="Stop at this virtual time, s.")
    step_time_s: float = Field(1.0, gt=0, description="Base inner-step time, virtual s.")
    speed_factors: tuple[float, ...] | None = Field(
        None, description="Step-time factor per learner (null: slow_fraction/slow_factor)."
    )
    slow_fraction: float = Field(0.0, ge=0, le=1, description="Share of learners that are slow.")
    slow_factor: float = Field(1.0, gt=0, description="Step-time factor of the slow learners.")
    jitter: float = Field(0.0, ge=0, lt=1, description="Relative std of each step's time.")
    failures: FailureSpec | None = Field(None, description="Failure model (null: none).")
    sync_wait_steps: int = Field(
        1, ge=1, description="τ of synchronous mode: steps a contribution may stay unmerged."
    )
    eval_every_s: float = Field(30.0, gt=0, description="Virtual seconds between evaluations.")
    eval_batch_size: int | None = Field(
        None, ge=1, description="Held-out examples per eval batch (null: one learner's batch)."
    )
    drain_s: float | None = Field(
        None, ge=0, description="After the budget, let rounds close this long (null: H steps)."
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.token_budget is None and self.max_virtual_s is None:
            raise ValueError("set token_budget or max_virtual_s (or both): a run must end")
        if self.speed_factors is not None:
            if len(self.speed_factors) != self.n_learners:
                raise ValueError(
                    f"speed_factors has {len(self.speed_factors)} entries for "
                    f"{self.n_learners} learners"
                )
            if any(f <= 0 for f in self.speed_factors):
                raise ValueError("speed_factors must all be > 0")
        if self.mode == "data-parallel" and self.failures is not None:
            raise ValueError(
                "data-parallel is the fault-free baseline here (any failure stalls the whole "
                "job); remove failures from its variant"
            )
        return self

    def factors(self) -> tuple[float, ...]:
        """Step-time factor of each learner: the given list, or the last ``slow_fraction`` of
        the learners (rounded) at ``slow_factor`` and the rest at 1."""
        if self.speed_factors is not None:
            return self.speed_factors
        n_slow = round(self.slow_fraction * self.n_learners)
        n_fast = self.n_learners - n_slow
        return tuple(1.0 if i < n_fast else self.slow_factor for i in range(self.n_learners))

    def derive(self, cfg: DDQConfig) -> DDQConfig:
        """The config this mode runs: expected learners; K = M and learner-paced fragments
        (synchronous: every learner sends fragment p at the same step offsets, as in Streaming
        DiLoCo, so the quorum of all M is a step barrier); one learner with M× the batch and no
        merges (data-parallel).

        Raises:
            ConfigError: ``learner.max_steps`` is set (the budget ends a run here).
        """
        if cfg.learner.max_steps:
            raise ConfigError(
                f"learner.max_steps {cfg.learner.max_steps}: the runner ends a run by "
                "runner.token_budget / max_virtual_s; set learner.decay_steps for the schedule"
            )
        raw = cfg.model_dump(mode="python")
        raw["membership"]["expected_learners"] = self.n_learners
        if self.mode == "synchronous":
            raw["synchronizer"].update(quorum=self.n_learners, schedule="learner")
        if self.mode == "data-parallel":
            raw["membership"]["expected_learners"] = 1
            raw["synchronizer"].update(quorum=1, schedule="learner", sync_every_steps=NO_SYNC_STEPS)
            raw["data"]["batch_size"] = cfg.data.batch_size * self.n_learners
        return validate_config(raw, source=f"{self.mode} runner")


class VariantSpec(_Spec):
    """One line of an experiment: a name and what it changes."""

    name: str = Field(min_length=1, description="Label in tables, JSON and plots.")
    runner: dict[str, Any] = Field(default_factory=dict, description="RunnerSpec overrides.")
    config: dict[str, Any] = Field(default_factory=dict, description="DDQConfig overrides.")


class ExperimentSpec(_Spec):
    """An experiment file: shared config and runner settings, and the variants to run."""

    name: str = Field(min_length=1, description="Experiment name (file names of results).")
    description: str = Field("", description="What the experiment asks.")
    seed: int = Field(0, ge=0, description="One seed for every variant.")
    config: dict[str, Any] = Field(default_factory=dict, description="DDQConfig tree.")
    runner: dict[str, Any] = Field(default_factory=dict, description="RunnerSpec fields.")
    variants: tuple[VariantSpec, ...] = Field(min_length=1, description="What to compare.")

    @model_validator(mode="after")
    def _unique(self) -> Self:
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names must be unique, got {names}")
        return self

    def resolve(self, variant: VariantSpec) -> tuple[DDQConfig, RunnerSpec]:
        """The config (mode applied) and runner spec of one variant.

        Raises:
            ConfigError: A field is unknown or invalid (the message names the variant).
        """
        raw = deep_merge(self.config, variant.config)
        raw.setdefault("run", {})
        raw["run"] = {"run_id": "experiment", **raw["run"], "seed": self.seed}
        where = f"experiment {self.name!r} variant {variant.name!r}"
        cfg = validate_config(raw, source=where)
        try:
            spec = RunnerSpec.model_validate(deep_merge(self.runner, variant.runner))
        except ValidationError as exc:
            raise ConfigError(f"{where}: invalid runner settings: {exc}") from None
        return spec.derive(cfg), spec


def load_experiment(path: str | Path) -> ExperimentSpec:
    """Read and validate an experiment YAML file.

    Raises:
        ConfigError: The file is missing, not YAML, or not a valid experiment.
    """
    file = Path(path)
    raw = read_yaml_mapping(file, what="experiment file")
    try:
        return ExperimentSpec.model_validate(dict(raw))
    except ValidationError as exc:
        raise ConfigError(f"experiment file {file}: {exc}") from None
