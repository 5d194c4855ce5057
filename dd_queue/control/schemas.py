"""Response models of the control plane (pydantic; they are the OpenAPI schema).

Times: ``*_at_s`` are wall-clock seconds since the epoch, ``*_age_s`` and ``*_s`` durations in
seconds. Maps keyed by fragment id use the id as a string (JSON object keys).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from dd_queue.messages import RoundRecord

__all__ = [
    "ChaosSchedule",
    "ChaosView",
    "Contributions",
    "DashboardSnapshot",
    "DecisionView",
    "EffectView",
    "ErrorView",
    "EvalPoint",
    "EventView",
    "FaultView",
    "FragmentView",
    "GoodputView",
    "Health",
    "LearnerState",
    "LearnerView",
    "QuorumView",
    "Readiness",
    "RoundView",
    "StateView",
    "SynchronizerView",
    "TokenFateView",
]

LearnerState = Literal["active", "straggling", "stalled", "dead", "left"]


class _View(BaseModel):
    model_config = ConfigDict(frozen=True)


class ErrorView(_View):
    """Every 4xx/5xx answer: what went wrong and what to do."""

    detail: str | list[dict[str, object]]


class Health(_View):
    """The process is up."""

    status: Literal["ok"] = "ok"
    uptime_s: float = Field(description="Seconds since the control plane started.")


class Readiness(_View):
    """Whether the control plane can serve the run, and why (not)."""

    ready: bool
    reason: str = Field(description="Why (not) ready: Redis reachable, synchronizer heartbeat.")


class Contributions(_View):
    """One learner's contributions as the synchronizer settled them."""

    sent: int = Field(description="Settled by the synchronizer (every outcome but carried).")
    merged: int
    dropped: int = Field(description="Settled unmerged: superseded, late, stale, duplicate, ...")
    dead_lettered: int


class LearnerView(_View):
    """One learner: liveness with its reason, progress, contributions, versions."""

    learner_id: str
    state: LearnerState
    reason: str
    heartbeat_age_s: float | None
    process_state: str = Field(description="What the learner's heartbeat says (training, ...).")
    step: int
    n_tokens: int
    step_time_s: float | None
    train_loss: float | None = Field(description="Loss of its latest inner step (heartbeat).")
    contributions: Contributions
    last_weights: dict[str, float] = Field(description="Fragment → weight in its last merge.")
    versions: dict[str, int] = Field(description="Fragment → global version it holds.")
    queue_depths: dict[str, int]
    host: str
    pid: int
    device: str
    restarts: int
    active_faults: list[str] = Field(description="Ids of faults not yet closed.")


class SynchronizerView(_View):
    """One synchronizer's last heartbeat."""

    synchronizer_id: str
    state: str
    heartbeat_age_s: float
    fragments: dict[str, int] = Field(description="Owned fragment → version.")
    held: int
    host: str
    pid: int


class FragmentView(_View):
    """One fragment's committed state and its current grace window."""

    fragment_id: int
    version: int
    last_merged_round_id: int | None
    last_reason: str
    committed_by: str
    quorum_ema_s: float | None = Field(description="ξ_quorum estimate, seconds.")
    sync_ema_s: float | None = Field(description="ξ_sync estimate, seconds.")
    grace_window_s: float = Field(description="ξ_grace now (core.policy.grace_window).")
    grace_note: str
    last_merge_at_s: float | None
    counters: dict[str, int]


class QuorumView(_View):
    """The quorum policy's settings and the live figures it decides on."""

    quorum: int
    quorum_policy: str
    live_learners: int
    expected_learners: int
    step_time_s: float | None = Field(description="ξ_step: median step time of live learners.")
    grace_gamma: float
    grace_cap_s: float | None
    round_timeout_s: float


class DecisionView(_View):
    """A round's closing decision and its reason."""

    fragment_id: int
    round_id: int
    decision: Literal["merge", "abandon"]
    reason: str
    closed_at_s: float


class EvalPoint(_View):
    """One held-out evaluation of the global model (``eval.done`` event)."""

    at_s: float
    loss: float
    accuracy: float | None
    min_version: int | None


class GoodputView(_View):
    """Goodput and uptime since the control plane started observing."""

    goodput: float = Field(description="Training chip-seconds ÷ allocated chip-seconds.")
    uptime: float = Field(description="Share of wall time during which some learner trained.")
    observed_s: float
    training_s: float
    waiting_s: float
    down_s: float
    history: list[tuple[float, float, float]] = Field(description="(at_s, goodput, uptime).")


class ChaosSchedule(_View):
    """A chaos schedule: seed, spec and targets (enough to replay it)."""

    schedule_id: str
    seed: int
    started_at_s: float
    duration_s: float
    rates_per_min: dict[str, float]
    targets: list[str]
    planned: int
    by: str
    replay_of: str | None


class ChaosView(_View):
    """The chaos schedule being played (or the last one) and the stored ones."""

    active: bool
    schedule: ChaosSchedule | None = Field(description="The running (or last) schedule.")
    fired: int
    skipped: list[str]
    next_at_s: float | None = Field(description="Wall time of the next planned fault.")
    stored: list[ChaosSchedule] = Field(description="Schedules stored in Redis, newest first.")


class RefusedView(_View):
    """Messages a reader refused (forged, unsigned, malformed, replayed), by kind and reason."""

    reader: str = Field(description="Who refused them: a learner id, a synchronizer, control.")
    kind: str = Field(description="contribution, global, fault, heartbeat, ...")
    reason: str = Field(description="unauthenticated, corrupt, incompatible, too_large, ...")
    count: int


class StateView(_View):
    """The run as a whole."""

    run_id: str
    config_digest: str
    run_digest: str
    fragments: list[FragmentView]
    rounds_merged: int
    rounds_abandoned: int
    contributions: dict[str, int] = Field(description="Contributions by outcome (all fragments).")
    bytes_in: int
    bytes_out: int
    quorum: QuorumView
    last_decisions: list[DecisionView]
    eval: list[EvalPoint]
    goodput: GoodputView
    uptime_s: float = Field(description="Seconds the control plane has observed the run.")
    synchronizers: list[SynchronizerView]
    chaos: ChaosView
    faults_enabled: bool
    writes_enabled: bool
    refused: list[RefusedView] = Field(
        description="Refused messages since the control plane started (dead-lettered "
        "contributions and every reader's reports; dd_queue.auth)."
    )
    merged_token_share: float | None = Field(
        description="Tokens in merged contributions ÷ tokens trained, per fragment (the live "
        "learners' heartbeats count the trained tokens); null before any token was trained."
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoundView(RoundRecord):
    """One closed round of one fragment: its record as the synchronizer stored it
    (``dd_queue.messages.RoundRecord``, every field, contributors and entry outcomes included)
    and the bytes it moved."""

    bytes_out: Annotated[int, Field(description="Bytes of the published global fragment (fp32).")]
    bytes_in_estimate: Annotated[
        int, Field(description="Merged payload bytes at the configured codec.")
    ]


class EffectView(_View):
    """One observed effect of a fault."""

    at_s: float
    note: str


class FaultView(_View):
    """One injected fault: who, when, what, and what was observed."""

    fault_id: str
    target: str
    kind: str
    duration_s: float | None
    params: dict[str, str | int | float | bool | None]
    by: str
    issued_at_s: float
    command_ids: list[str]
    chaos: str | None
    armed_at_s: float | None
    status: Literal["sent", "armed", "effective", "done", "no effect"]
    effects: list[EffectView]


class EventView(_View):
    """One entry of the run's event stream."""

    id: str
    kind: str
    message: str
    at_s: float
    fields: dict[str, str | int | float | bool | None]


class AlertView(_View):
    """An alert of ``deploy/alerts.yml``'s rules, evaluated by the control plane."""

    name: str = Field(description="The rule, as in deploy/alerts.yml (e.g. DDQLearnerDead).")
    severity: str = Field(description="warning or critical.")
    state: Literal["pending", "firing"] = Field(
        description="pending until the condition has held for the rule's `for`, then firing."
    )
    since_s: float = Field(description="When the condition began to hold (epoch seconds).")
    subject: str = Field(description="What it is about: learner L1, fragment 2, run, ...")
    link: str = Field(description="Dashboard anchor that shows it (#learner-L1, #fragment-2).")
    value: float | None = Field(description="The value the condition tested (null: not finite).")
    summary: str
    description: str


class AlertRuleView(_View):
    """One alert rule."""

    name: str
    severity: str
    for_s: float = Field(description="How long the condition must hold before it fires.")
    description: str


class AlertsView(_View):
    """The alerts now, and every rule they come from."""

    alerts: list[AlertView]
    rules: list[AlertRuleView]
    evaluated_at_s: float | None = Field(description="The last evaluation (null: none yet).")


class TokenFateView(_View):
    """One learner's tokens from computed to fate (``core.tallies.token_fate``). Tokens are
    token·fragments ÷ P: each token trained counts once per fragment it trained."""

    learner_id: str
    computed: float = Field(description="Tokens the learner reports it computed.")
    fates: dict[str, float] = Field(
        description="Fate → tokens: the synchronizer's outcomes of each token's first carrier "
        "(merged, late, superseded, stale, duplicate, invalid, dropped, dead_lettered), then "
        "dropped_at_learner, unsent and in_flight. They sum to computed."
    )
    balanced: bool = Field(description="Every fate ≥ 0 and they sum to computed.")
    reason: str = Field(description="Why, in one line.")
    token_fragments: dict[str, int] = Field(
        description="The exact integer counts behind the figures: computed and every fate."
    )


class DashboardSnapshot(_View):
    """Everything the dashboard shows, in one message (also each SSE ``snapshot`` event)."""

    generation: int = Field(description="Refresh counter of the control plane.")
    at_s: float
    learners: list[LearnerView]
    state: StateView
    rounds: list[RoundView]
    faults: list[FaultView]
    events: list[EventView]
    alerts: list[AlertView] = Field(description="The alerts now (GET /api/alerts).")
    train_loss: dict[str, list[tuple[float, int, float]]] = Field(
        description="Learner → (time, step, train loss) from its heartbeats, oldest first."
    )
    tokens: list[TokenFateView] = Field(description="Token fate per learner (GET /api/tokens).")
