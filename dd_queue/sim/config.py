"""The simulator's own configuration: one typed, frozen pydantic tree, loaded from YAML.

``config/sim/default.yaml`` states every field with the physical argument for its default; the
defaults here are the same numbers (a test checks it). Precedence, lowest first: model defaults <
YAML file < ``--set section.field=value`` overrides < the command line's own flags (which the
CLI turns into overrides). Unknown keys are rejected with their dotted path.

This tree is separate from ``dd_queue.config`` (the services' config): the simulator sizes a
cluster that does not exist yet, so it shares only the policy knobs, which it hands to
``dd_queue.core.policy.PolicyParams`` unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dd_queue.core.policy import PolicyParams
from dd_queue.errors import ConfigError, CoreError
from dd_queue.validation import read_yaml_mapping, validate_model

__all__ = [
    "REGIMES",
    "AccountingSpec",
    "ClusterSpec",
    "DecoupledSpec",
    "ElasticSpec",
    "Regime",
    "RepairSpec",
    "RunSpec",
    "SimConfig",
    "SpmdSpec",
    "SweepSpec",
    "load_sim_config",
    "validate_sim_config",
]

Regime = Literal["plain_dp", "elastic_dp", "decoupled"]
REGIMES: tuple[Regime, ...] = ("plain_dp", "elastic_dp", "decoupled")
_P99_Z = 2.3263478740408408  # standard normal quantile of 0.99


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class ClusterSpec(_Section):
    """The hardware: how many chips, how they fail and how fast they are."""

    chips: int = Field(1_200_000, ge=1, description="Chips allocated to the job.")
    chips_per_slice: int = Field(
        256, ge=1, description="Chips in one slice: the unit that fails and is swapped."
    )
    chip_mtbi_days: float = Field(
        365.25, gt=0, description="Per-chip mean time between interruptions, days (.inf: none)."
    )
    step_s: float = Field(1.0, gt=0, description="Inner-step time of a median-speed chip, s.")
    speed_sigma: float = Field(
        0.01, ge=0, le=0.5, description="σ of ln(per-chip step-time factor); 0: identical chips."
    )

    @property
    def n_slices(self) -> int:
        """Whole slices in the job (``chips // chips_per_slice``)."""
        return self.chips // self.chips_per_slice

    @property
    def slice_failure_rate_per_s(self) -> float:
        """Poisson rate of interruptions of one slice, per second (0 without failures)."""
        if math.isinf(self.chip_mtbi_days):
            return 0.0
        return self.chips_per_slice / (self.chip_mtbi_days * 86_400.0)

    @model_validator(mode="after")
    def _check_slices(self) -> Self:
        if self.chips < self.chips_per_slice:
            raise ValueError(
                f"chips {self.chips} < chips_per_slice {self.chips_per_slice}: "
                "the job needs at least one whole slice"
            )
        return self


class RepairSpec(_Section):
    """How long an interrupted slice stays out of the job (repair, or swap-in of a spare)."""

    distribution: Literal["lognormal", "exp_weibull", "fixed", "empirical"] = Field(
        "lognormal", description="Family of the return-time distribution."
    )
    median_s: float = Field(600.0, gt=0, description="lognormal: median return time, s.")
    p99_s: float = Field(14_400.0, gt=0, description="lognormal: 99th percentile, s.")
    scale_s: float = Field(600.0, gt=0, description="exp_weibull: scale λ, s.")
    shape_k: float = Field(0.7, gt=0, description="exp_weibull: Weibull shape k.")
    shape_alpha: float = Field(1.5, gt=0, description="exp_weibull: exponentiation α.")
    fixed_s: float = Field(600.0, ge=0, description="fixed: every return takes this long, s.")
    samples_s: tuple[float, ...] = Field(
        (), description="empirical: observed return times to resample, s."
    )

    @property
    def lognormal_sigma(self) -> float:
        """σ of the lognormal with the configured median and 99th percentile."""
        return math.log(self.p99_s / self.median_s) / _P99_Z

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.distribution == "lognormal" and self.p99_s < self.median_s:
            raise ValueError(f"p99_s {self.p99_s} must be ≥ median_s {self.median_s}")
        if self.distribution == "empirical":
            if not self.samples_s:
                raise ValueError("distribution empirical needs samples_s (observed seconds)")
            if any(not (math.isfinite(s) and s >= 0) for s in self.samples_s):
                raise ValueError("samples_s must be finite and ≥ 0")
        return self


class ElasticSpec(_Section):
    """Elastic data parallelism (also inside each Decoupled DiLoCo learner)."""

    detection_s: float = Field(5.0, ge=0, description="Failure → the group knows, s.")
    downscale_s: float = Field(5.0, ge=0, description="Reconfigure without the failed slice, s.")
    upscale_s: float = Field(5.0, ge=0, description="Reconfigure to re-add a returned slice, s.")


class AccountingSpec(_Section):
    """Modelling choices the paper leaves open (docs/simulator.md): one switch each."""

    barrier_wait: Literal["lost", "goodput"] = Field(
        "lost",
        description="Chips idle at a synchronous barrier waiting for the slowest chip (speed "
        "variance): lost goodput, or counted as training time.",
    )
    failure_during_stall: Literal["extends", "absorbed"] = Field(
        "extends",
        description="A failure (or return) during a stall starts the detection/restart or "
        "reconfiguration again, or is handled by the one already under way.",
    )


class SpmdSpec(_Section):
    """Plain SPMD data parallelism with checkpoint/restart."""

    restart_s: float = Field(30.0, ge=0, description="Restart from checkpoint after detection, s.")
    checkpoint_interval_s: float | None = Field(
        None, gt=0, description="Training time between checkpoints, s; null: checkpoint_rule."
    )
    checkpoint_rule: Literal["young", "daly"] = Field(
        "young",
        description="Interval when checkpoint_interval_s is null: Young's √(2δM) or Daly's "
        "higher-order optimum (M = the job's mean time between failures).",
    )
    checkpoint_cost_s: float = Field(0.5, ge=0, description="Blocking time of one checkpoint, s.")
    waits_for_repair: bool = Field(
        False, description="Restart only once the failed slice is back (no hot spare)."
    )


class DecoupledSpec(_Section):
    """Decoupled DiLoCo: learners, and the synchronizer's quorum policy."""

    learners: int = Field(8, ge=1, description="M, learners (each an elastic group of slices).")
    quorum: int = Field(1, ge=1, description="K, minimum distinct learners per merge.")
    quorum_policy: Literal["wait", "shrink"] = Field(
        "wait", description="When K exceeds the live learners: keep waiting, or lower K."
    )
    grace_gamma: float = Field(0.5, ge=0, le=1, description="γ, share of the slack to wait.")
    grace_cap_s: float | None = Field(None, ge=0, description="Grace cap, s; null: ξ_step.")
    overlap_steps: float = Field(2.0, ge=0, description="τ, overlap in inner steps.")
    inner_steps_h: int = Field(24, ge=1, description="H; fragments P = H (one round per step).")
    round_timeout_s: float = Field(60.0, gt=0, description="Abandon a round without quorum, s.")
    transfer_s: float = Field(0.5, ge=0, description="Learner → synchronizer upload, s.")
    sync_s: float = Field(0.5, ge=0, description="ξ_sync: pull + merge + outer step + publish, s.")
    policy_mode: Literal["closed_form", "exact"] = Field(
        "closed_form",
        description="Vectorised equivalent of decide(), or decide() per round (~0.2 ms each).",
    )
    policy_rounds: int = Field(
        200_000, ge=1, description="Rounds evaluated (evenly spread); the rest are extrapolated."
    )

    def policy_params(self) -> PolicyParams:
        """The core ``PolicyParams`` these knobs describe.

        Raises:
            ConfigError: If the core rejects a value.
        """
        try:
            return PolicyParams(
                quorum=self.quorum,
                quorum_policy=self.quorum_policy,
                grace_gamma=self.grace_gamma,
                grace_cap_s=self.grace_cap_s,
                overlap_steps=self.overlap_steps,
                round_timeout_s=self.round_timeout_s,
            )
        except CoreError as exc:
            raise ConfigError(f"decoupled: {exc}") from None


class RunSpec(_Section):
    """What to simulate and for how long."""

    duration_days: float = Field(30.0, gt=0, description="Simulated wall time, days.")
    seed: int = Field(0, ge=0, description="Seed of numpy's Generator (SeedSequence).")
    repetitions: int = Field(1, ge=1, description="Independent repetitions (seeds spawned).")
    regimes: tuple[Regime, ...] = Field(REGIMES, min_length=1, description="Regimes to run.")

    @property
    def duration_s(self) -> float:
        """Simulated wall time, seconds."""
        return self.duration_days * 86_400.0


class SweepSpec(_Section):
    """The grid of ``ddq simulate --sweep``: chips × regimes × learners."""

    chips: tuple[int, ...] = Field(
        (16_384, 65_536, 262_144, 1_200_000, 2_400_000), min_length=1, description="Chip counts."
    )
    learners: tuple[int, ...] = Field((2, 4, 8, 16), min_length=1, description="M values.")
    duration_days: float = Field(7.0, gt=0, description="Simulated days per sweep point.")


class SimConfig(_Section):
    """The whole simulator configuration."""

    cluster: ClusterSpec = ClusterSpec()
    accounting: AccountingSpec = AccountingSpec()
    repair: RepairSpec = RepairSpec()
    elastic: ElasticSpec = ElasticSpec()
    spmd: SpmdSpec = SpmdSpec()
    decoupled: DecoupledSpec = DecoupledSpec()
    run: RunSpec = RunSpec()
    sweep: SweepSpec = SweepSpec()

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.decoupled.learners > self.cluster.n_slices and "decoupled" in self.run.regimes:
            raise ValueError(
                f"decoupled.learners {self.decoupled.learners} exceeds the "
                f"{self.cluster.n_slices} slices: each learner needs at least one slice"
            )
        return self

    @property
    def digest(self) -> str:
        """Short sha256 of the resolved config (identifies a result)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def validate_sim_config(raw: Mapping[str, Any], *, source: str = "<dict>") -> SimConfig:
    """Validate a plain mapping into a ``SimConfig``.

    Raises:
        ConfigError: Listing every bad key by its dotted path.
    """
    return validate_model(
        SimConfig,
        raw,
        what="simulator config",
        source=source,
        reference="config/sim/default.yaml",
    )


def load_sim_config(
    path: str | Path | None = None, overrides: Mapping[str, str] | None = None
) -> SimConfig:
    """Load a simulator config and apply ``section.field=value`` overrides.

    Args:
        path: A YAML file such as ``config/sim/default.yaml``; None: the model defaults.
        overrides: Dotted key → value parsed as a YAML scalar (``2.5``, ``[4, 8]``, ``null``).

    Raises:
        ConfigError: Unreadable or invalid YAML, an unknown key, an invalid value.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml_mapping(Path(path), what="simulator config")
    for key, value in (overrides or {}).items():
        _set_dotted(raw, key, value)
    return validate_sim_config(raw, source=str(path) if path is not None else "<defaults>")


def _set_dotted(raw: dict[str, Any], key: str, value: str) -> None:
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override {key!r} must look like section.field (e.g. cluster.chips)")
    section, name = parts
    if section not in SimConfig.model_fields:
        raise ConfigError(f"override {key!r}: unknown section {section!r}")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: bad value {value!r}: {exc}") from None
    node = raw.setdefault(section, {})
    if not isinstance(node, dict):
        raise ConfigError(f"override {key!r}: {section} is not a section in the file")
    node[name] = tuple(parsed) if isinstance(parsed, list) else parsed
