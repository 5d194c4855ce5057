"""Calibration: point the simulator at a real run's recorded events and predict its goodput.

**Recording format** (JSON, ``schema: "ddq.sim.recording"``, ``schema_version: 1``)::

    {
      "schema": "ddq.sim.recording", "schema_version": 1, "run_id": "demo",
      "window_s": [0.0, 600.0],
      "learners": [{"learner_id": "L0", "chips": 1, "step_times_s": [0.98, 1.01]}],
      "faults": [{"fault_id": "f1", "learner_id": "L1", "kind": "kill",
                  "at_s": 120.0, "recovered_at_s": 170.0}],
      "rounds": [{"fragment_id": 0, "round_id": 7, "opened_at_s": 7.0, "closed_at_s": 7.6,
                  "decision": "merge", "contributors": ["L0", "L2"]}],
      "intervals": [{"group_id": "L0", "kind": "training", "start_s": 0.0, "end_s": 600.0,
                     "chips": 1}],
      "policy": {"quorum": 1, "grace_gamma": 0.5, "overlap_steps": 2.0}
    }

``faults`` are the ``/api/faults`` commands with the time the learner was training again;
``rounds`` are a subset of the fields of the synchronizer's ``RoundRecord``; ``intervals`` are the
run's goodput ledger (``dd_queue.core.goodput.ChipInterval``), from which the *measured* goodput
and uptime come through the core ``summarize`` (the services' own arithmetic). ``policy`` holds
``DecoupledSpec`` fields (the run's synchronizer settings).

**Predictions.** A learner is one slice of its chips (a kill takes the whole process).

- *replay*: the recorded fault times and outage durations, fed to the same timeline, ledger and
  round code as a simulation (detection and reconfiguration are inside the recorded outages).
  It checks the model of a run given its failures.
- *fitted*: a Poisson rate (faults ÷ learner-seconds in the job, the maximum-likelihood rate of
  the simulator's alternating up/out model), outage durations resampled
  (``empirical``), the mean step time; ``repetitions`` simulated runs give mean ± std. It checks
  the model as a forecaster, as a user would size a cluster.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dd_queue.core.goodput import ChipInterval, IntervalKind, summarize
from dd_queue.errors import ConfigError
from dd_queue.sim.config import DecoupledSpec, ElasticSpec, SimConfig, validate_sim_config
from dd_queue.sim.failures import SliceFailures
from dd_queue.sim.ledger import summarize_timelines
from dd_queue.sim.regimes import simulate
from dd_queue.sim.rounds import simulate_rounds
from dd_queue.sim.timeline import GroupTimeline, elastic_timeline

__all__ = ["Calibration", "Recording", "calibrate", "load_recording"]

SCHEMA = "ddq.sim.recording"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RecordedLearner(_Model):
    """One learner of the recorded run."""

    learner_id: str = Field(min_length=1)
    chips: int = Field(1, ge=1)
    step_times_s: tuple[float, ...] = Field(min_length=1)


class RecordedFault(_Model):
    """One injected fault and when its learner trained again."""

    fault_id: str = ""
    learner_id: str
    kind: str = "kill"
    at_s: float
    recovered_at_s: float

    @model_validator(mode="after")
    def _check(self) -> RecordedFault:
        if self.recovered_at_s < self.at_s:
            raise ValueError(f"fault {self.fault_id or self.learner_id}: recovered before it hit")
        return self


class RecordedRound(_Model):
    """The fields of a ``RoundRecord`` that calibration reads."""

    fragment_id: int = Field(ge=0)
    round_id: int = Field(ge=0)
    opened_at_s: float
    closed_at_s: float
    decision: Literal["merge", "abandon"]
    contributors: tuple[str, ...] = ()


class RecordedInterval(_Model):
    """One ``ChipInterval`` of the run's goodput ledger."""

    group_id: str
    kind: IntervalKind
    start_s: float
    end_s: float
    chips: int = Field(ge=1)


class Recording(_Model):
    """A recorded run (see the module docstring for the format)."""

    schema_: Literal["ddq.sim.recording"] = Field(alias="schema")
    schema_version: Literal[1]
    run_id: str = ""
    window_s: tuple[float, float]
    learners: tuple[RecordedLearner, ...] = Field(min_length=1)
    faults: tuple[RecordedFault, ...] = ()
    rounds: tuple[RecordedRound, ...] = ()
    intervals: tuple[RecordedInterval, ...] = Field(min_length=1)
    policy: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> Recording:
        known = {lr.learner_id for lr in self.learners}
        unknown = sorted({f.learner_id for f in self.faults} - known)
        if unknown:
            raise ValueError(f"faults name learners {unknown} that are not in learners")
        if self.window_s[1] <= self.window_s[0]:
            raise ValueError(f"window_s {self.window_s} must end after it begins")
        return self

    @property
    def duration_s(self) -> float:
        """Length of the window, seconds."""
        return self.window_s[1] - self.window_s[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """Measured and predicted figures of a recorded run (goodput and uptime in [0, 1]).

    Attributes:
        measured: ``goodput``, ``uptime``, ``merges_per_hour``, ``mean_quorum`` of the run.
        replay: The same figures predicted from the recorded faults.
        fitted_mean: Mean over simulated runs with fitted rates.
        fitted_std: Their standard deviation.
        fit: The fitted parameters (rate, mean outage, step time).
    """

    measured: dict[str, float]
    replay: dict[str, float]
    fitted_mean: dict[str, float]
    fitted_std: dict[str, float]
    fit: dict[str, float]

    def public_dict(self) -> dict[str, object]:
        """JSON-ready data."""
        return {
            "measured": self.measured,
            "replay": self.replay,
            "fitted_mean": self.fitted_mean,
            "fitted_std": self.fitted_std,
            "fit": self.fit,
        }


def load_recording(path: str | Path) -> Recording:
    """Read and validate a recording.

    Raises:
        ConfigError: Unreadable file, bad JSON, or a field that breaks the format.
    """
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        return Recording.model_validate(raw)
    except OSError as exc:
        raise ConfigError(f"cannot read recording {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"recording {path} is not valid JSON: {exc}") from None
    except ValidationError as exc:
        where = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise ConfigError(
            f"recording {path} does not follow {SCHEMA} v1 ({where}); "
            "see dd_queue/sim/calibrate.py for the format"
        ) from None


def calibrate(rec: Recording, *, repetitions: int = 200, seed: int = 0) -> Calibration:
    """Measured vs predicted goodput of a recorded run.

    Args:
        rec: The recording.
        repetitions: Simulated runs for the fitted prediction.
        seed: Seed of the fitted prediction.

    Returns:
        The ``Calibration``.
    """
    spec = _policy(rec)
    replay = _replay(rec, spec)
    cfg, fit = _fitted_config(rec, spec, repetitions, seed)
    agg = simulate(cfg)[0]
    fitted_mean = {
        "goodput": agg.goodput,
        "uptime": agg.uptime,
        "merges_per_hour": agg.merges_per_hour or 0.0,
        "mean_quorum": agg.mean_quorum or 0.0,
    }
    return Calibration(
        measured=_measured(rec),
        replay=replay,
        fitted_mean=fitted_mean,
        fitted_std={"goodput": agg.goodput_std},
        fit=fit,
    )


def _policy(rec: Recording) -> DecoupledSpec:
    try:
        return DecoupledSpec.model_validate({**rec.policy, "learners": len(rec.learners)})
    except ValidationError as exc:
        raise ConfigError(f"recording policy is not a valid decoupled section: {exc}") from None


def _measured(rec: Recording) -> dict[str, float]:
    ledger = [ChipInterval(**iv.model_dump()) for iv in rec.intervals]
    s = summarize(ledger, window_s=rec.window_s)
    merges = [r for r in rec.rounds if r.decision == "merge"]
    hours = rec.duration_s / 3600.0
    quorum = float(np.mean([len(r.contributors) for r in merges])) if merges else 0.0
    return {
        "goodput": s.goodput,
        "uptime": s.uptime,
        "merges_per_hour": len(merges) / hours,
        "mean_quorum": quorum,
    }


def _replay(rec: Recording, spec: DecoupledSpec) -> dict[str, float]:
    t0, duration = rec.window_s[0], rec.duration_s
    zero = ElasticSpec(detection_s=0.0, downscale_s=0.0, upscale_s=0.0)
    timelines: list[GroupTimeline] = []
    for lr in rec.learners:
        mine = sorted(
            (f for f in rec.faults if f.learner_id == lr.learner_id), key=lambda f: f.at_s
        )
        at = np.array([f.at_s - t0 for f in mine], dtype=np.float64)
        rep = np.array([f.recovered_at_s - f.at_s for f in mine], dtype=np.float64)
        fails = SliceFailures(np.zeros(at.size, dtype=np.int64), at, rep)
        timelines.append(
            elastic_timeline(
                lr.learner_id,
                n_slices=1,
                chips_per_slice=lr.chips,
                failures=fails,
                spec=zero,
                step_s=float(np.mean(lr.step_times_s)),
                busy_fraction=1.0,
                duration_s=duration,
            )
        )
    s = summarize_timelines(timelines, duration)
    rounds = simulate_rounds(timelines, spec, duration)
    return {
        "goodput": s.goodput,
        "uptime": s.uptime,
        "merges_per_hour": rounds.merges_per_hour,
        "mean_quorum": rounds.mean_quorum,
    }


def _fitted_config(
    rec: Recording, spec: DecoupledSpec, repetitions: int, seed: int
) -> tuple[SimConfig, dict[str, float]]:
    chips = [lr.chips for lr in rec.learners]
    if len(set(chips)) != 1:
        raise ConfigError(f"fitted calibration needs learners of equal size, got chips {chips}")
    outages = [f.recovered_at_s - f.at_s for f in rec.faults]
    up_s = len(rec.learners) * rec.duration_s - sum(outages)  # a learner that is out can't fail
    rate = len(outages) / up_s
    step_s = float(np.mean(np.concatenate([lr.step_times_s for lr in rec.learners])))
    mtbi_days = chips[0] / rate / 86_400.0 if rate > 0 else float("inf")
    raw = {
        "cluster": {
            "chips": chips[0] * len(chips),
            "chips_per_slice": chips[0],
            "chip_mtbi_days": mtbi_days,
            "step_s": step_s,
            "speed_sigma": 0.0,
        },
        "repair": {"distribution": "empirical", "samples_s": outages or [0.0]},
        "elastic": {"detection_s": 0.0, "downscale_s": 0.0, "upscale_s": 0.0},
        "decoupled": spec.model_dump(),
        "run": {
            "duration_days": rec.duration_s / 86_400.0,
            "seed": seed,
            "repetitions": repetitions,
            "regimes": ["decoupled"],
        },
    }
    fit = {
        "faults_per_learner_hour": rate * 3600.0,
        "mean_outage_s": float(np.mean(outages)) if outages else 0.0,
        "step_s": step_s,
        "learners": float(len(chips)),
    }
    return validate_sim_config(raw, source=f"calibration of {rec.run_id or 'recording'}"), fit
