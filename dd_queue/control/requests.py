"""Request bodies of the mutating routes: unknown fields refused, every number ranged.

Rules that span fields (a ``kill`` takes no duration, a ``slow`` needs one, the synchronizer only
takes ``kill``/``stall``/``disconnect``) live in model validators, so a bad body is a 422 whose
message names the field and the fix. Whether a *target* exists is checked by the route against
live membership (404 unknown, 409 not live).
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dd_queue.messages import FAULT_BOUNDS

__all__ = [
    "NAME_PATTERN",
    "RANDOM",
    "SYNCHRONIZER",
    "SYNCHRONIZER_KINDS",
    "TIMED_KINDS",
    "ChaosReplay",
    "ChaosRequest",
    "ChaosStart",
    "ChaosStop",
    "FaultKind",
    "FaultRequest",
]

FaultKind = Literal["kill", "stall", "slow", "drop", "delay", "corrupt", "disconnect"]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""Learner ids, operator names and schedule ids: the key-safe names of ``dd_queue.keys``."""
SYNCHRONIZER = "synchronizer"
RANDOM = "random"
SYNCHRONIZER_KINDS: tuple[FaultKind, ...] = ("kill", "stall", "disconnect")
TIMED_KINDS: tuple[FaultKind, ...] = ("stall", "slow", "drop", "delay", "disconnect")
_ONLY_FOR = {"factor": "slow", "delay_s": "delay", "count": "corrupt"}
LEARNER_KILL_POINTS = ("before_step", "before_publish")
SYNCHRONIZER_KILL_POINTS = ("before_round", "after_merge", "before_commit", "after_commit")
KillPoint = Literal[
    "before_step", "before_publish", "before_round", "after_merge", "before_commit", "after_commit"
]

Name = Annotated[str, Field(pattern=NAME_PATTERN, examples=["L0"])]
Operator = Annotated[
    str, Field(pattern=NAME_PATTERN, description="Who asks (recorded with the fault).")
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class FaultRequest(_Body):
    """Inject one fault into a learner or the synchronizer."""

    target: Name = Field(
        description="A learner id, 'synchronizer', or 'random' (a live learner, chosen at random)."
    )
    kind: FaultKind = Field(description="What happens to the target.")
    duration_s: float | None = Field(
        None,
        gt=FAULT_BOUNDS["duration_s"][0],
        le=FAULT_BOUNDS["duration_s"][1],
        description="Seconds the fault lasts; required for stall, slow, drop, delay and "
        "disconnect, optional for corrupt (instead of count), refused for kill.",
    )
    factor: float | None = Field(
        None,
        gt=FAULT_BOUNDS["factor"][0],
        le=FAULT_BOUNDS["factor"][1],
        description="slow only: step time multiplier (default 3).",
    )
    delay_s: float | None = Field(
        None,
        gt=FAULT_BOUNDS["delay_s"][0],
        le=FAULT_BOUNDS["delay_s"][1],
        description="delay only: seconds each contribution is held.",
    )
    count: int | None = Field(
        None,
        gt=FAULT_BOUNDS["count"][0],
        le=FAULT_BOUNDS["count"][1],
        description="corrupt only: contributions to corrupt (default 1).",
    )
    point: KillPoint | None = Field(
        None,
        description="kill only: the safe point it fires at (learner: before_step, the default, "
        "or before_publish, with a contribution in hand; synchronizer: before_round, the "
        "default, after_merge, before_commit or after_commit).",
    )
    by: Operator = "api"

    @model_validator(mode="after")
    def _check_kind(self) -> Self:
        if self.point is not None and self.kind != "kill":
            raise ValueError(f"point applies only to kind 'kill', not {self.kind!r}")
        if self.point is not None:
            learner_point = self.point in LEARNER_KILL_POINTS
            if learner_point == (self.target == SYNCHRONIZER):
                where = "the synchronizer" if self.target == SYNCHRONIZER else "a learner"
                allowed = (
                    SYNCHRONIZER_KILL_POINTS
                    if self.target == SYNCHRONIZER
                    else (LEARNER_KILL_POINTS)
                )
                raise ValueError(
                    f"point {self.point!r} is not a safe point of {where}; use one of "
                    f"{list(allowed)}"
                )
        for name, kind in _ONLY_FOR.items():
            if getattr(self, name) is not None and self.kind != kind:
                raise ValueError(f"{name} applies only to kind {kind!r}, not {self.kind!r}")
        if self.kind == "kill" and self.duration_s is not None:
            raise ValueError("a kill has no duration: leave duration_s out")
        if self.kind in TIMED_KINDS and self.duration_s is None:
            raise ValueError(f"kind {self.kind!r} needs duration_s (seconds, > 0)")
        if self.kind == "corrupt" and self.count is not None and self.duration_s is not None:
            raise ValueError("corrupt takes count or duration_s, not both")
        if self.target == SYNCHRONIZER and self.kind not in SYNCHRONIZER_KINDS:
            raise ValueError(
                f"the synchronizer takes kinds {list(SYNCHRONIZER_KINDS)}, not {self.kind!r}"
            )
        return self


class ChaosStart(_Body):
    """Start a seeded chaos schedule: one Poisson process per fault kind."""

    action: Literal["start"]
    seed: int | None = Field(
        None, ge=0, le=2**32 - 1, description="Seed of the schedule (default: drawn, returned)."
    )
    duration_s: float = Field(gt=0, le=86_400, description="Length of the schedule, seconds.")
    rates_per_min: dict[FaultKind, Annotated[float, Field(ge=0, le=60)]] = Field(
        description="Mean faults per minute of each kind, e.g. {'stall': 2, 'slow': 1}."
    )
    targets: list[Name] | None = Field(
        None, max_length=64, description="Learners to pick from (default: the live learners)."
    )
    fault_duration_s: float = Field(5.0, gt=0, le=600, description="Length of timed faults.")
    factor: float = Field(3.0, gt=1, le=100, description="Step time multiplier of slow faults.")
    delay_s: float = Field(2.0, gt=0, le=600, description="Hold of delay faults, seconds.")
    by: Operator = "api"

    @model_validator(mode="after")
    def _check_rates(self) -> Self:
        total = sum(self.rates_per_min.values())
        if total <= 0:
            raise ValueError("rates_per_min needs at least one kind with a rate > 0")
        expected = total * self.duration_s / 60
        if expected > 1000:
            raise ValueError(
                f"the schedule would hold about {expected:.0f} faults; at most 1000 "
                "(lower the rates or the duration)"
            )
        if self.targets is not None and len(set(self.targets)) != len(self.targets):
            raise ValueError("targets must not repeat")
        return self


class ChaosStop(_Body):
    """Stop the running chaos schedule (faults already armed run their course)."""

    action: Literal["stop"]
    by: Operator = "api"


class ChaosReplay(_Body):
    """Run a stored schedule again: same seed, spec and targets, so the same faults."""

    action: Literal["replay"]
    schedule_id: Name | None = Field(None, description="Stored schedule (default: the latest).")
    by: Operator = "api"


ChaosRequest = Annotated[ChaosStart | ChaosStop | ChaosReplay, Field(discriminator="action")]
