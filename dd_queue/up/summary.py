"""The run summary of ``ddq up``: what a run did, as text for people and one JSON object."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from dd_queue.core.tallies import merged_token_share

__all__ = ["SUMMARY_NAME", "Summary", "format_summary", "summary_json"]

SUMMARY_NAME = "summary.json"
"""The summary in the run directory, as ``--json`` prints it (``ddq report`` reads it)."""


@dataclass
class Summary:
    """What one ``ddq up`` run did.

    Attributes:
        run_id: The run's namespace.
        run_dir: Where its logs and the Redis AOF are.
        wall_s: Seconds from start to stop.
        stopped_by: ``duration``, ``signal`` or ``error``.
        rounds_merged: Merged rounds over all fragments.
        rounds_abandoned: Rounds closed without a merge.
        versions: Fragment id → global version at the end.
        tokens_trained: Tokens the learners trained (sum over processes, from heartbeats).
        tokens_merged: Tokens of the contributions that were merged.
        eval_loss_start: First held-out loss the evaluator recorded (None without one).
        eval_loss_end: Last held-out loss.
        evals: Evaluations recorded.
        contributions: Learner id → contributions merged.
        learners: Learner ids that were started.
        goodput: Learners' training time ÷ their allocated time while ``ddq up`` watched
            (None before a learner was seen); the control plane's definition.
        uptime: Share of that time during which at least one learner trained.
        faults_injected: Fault commands the control plane recorded as injected.
        restarts: Processes ``ddq up`` restarted after they died.
        notes: Things worth knowing (processes that failed, missing parts).
        exported: Where the final global model was exported (``--export``), else None.
    """

    run_id: str
    run_dir: str
    wall_s: float = 0.0
    stopped_by: str = "duration"
    rounds_merged: int = 0
    rounds_abandoned: int = 0
    versions: dict[int, int] = field(default_factory=dict)
    tokens_trained: int = 0
    tokens_merged: int = 0
    eval_loss_start: float | None = None
    eval_loss_end: float | None = None
    evals: int = 0
    contributions: dict[str, int] = field(default_factory=dict)
    learners: list[str] = field(default_factory=list)
    goodput: float | None = None
    uptime: float | None = None
    faults_injected: int = 0
    restarts: int = 0
    notes: list[str] = field(default_factory=list)
    exported: str | None = None

    @property
    def contributed(self) -> list[str]:
        """Started learners with at least one merged contribution."""
        return [lid for lid in self.learners if self.contributions.get(lid, 0) > 0]

    @property
    def merged_token_share(self) -> float | None:
        """``core.tallies.merged_token_share`` of the run (the fragments seen in ``versions``)."""
        return merged_token_share(self.tokens_merged, len(self.versions), self.tokens_trained)

    @property
    def loss_fell(self) -> bool | None:
        """Whether the held-out loss fell (None with fewer than two evaluations)."""
        if self.eval_loss_start is None or self.eval_loss_end is None or self.evals < 2:
            return None
        return self.eval_loss_end < self.eval_loss_start


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def format_summary(s: Summary) -> str:
    """The summary as a few lines of text (ends with a newline)."""
    versions = ", ".join(f"f{p}=v{v}" for p, v in sorted(s.versions.items())) or "none"
    contrib = ", ".join(f"{lid}={s.contributions.get(lid, 0)}" for lid in s.learners) or "none"
    if s.evals:
        loss = f"{_loss(s.eval_loss_start)} → {_loss(s.eval_loss_end)} ({s.evals} evaluations)"
    else:
        loss = "n/a (no evaluation recorded)"
    lines = [
        f"── run {s.run_id} summary ({s.wall_s:.0f} s, stopped by {s.stopped_by}) ──",
        f"rounds merged      {s.rounds_merged} (abandoned {s.rounds_abandoned})",
        f"global versions    {versions}",
        f"tokens             {s.tokens_trained:,} trained "
        f"({s.tokens_merged:,} in merged contributions, counted per fragment)",
        f"held-out loss      {loss}",
        f"contributions      {contrib} ({len(s.contributed)}/{len(s.learners)} contributed)",
        f"goodput            {_percent(s.goodput)} (uptime {_percent(s.uptime)}; "
        f"merged-token share {_percent(s.merged_token_share)})",
        f"faults survived    {s.faults_injected} injected, {s.restarts} process restarts",
        f"run directory      {s.run_dir}",
    ]
    if s.exported:
        lines.append(f"exported           {s.exported}")
    lines += [f"note: {note}" for note in s.notes]
    return "\n".join(lines) + "\n"


def summary_json(s: Summary) -> str:
    """The summary as one JSON object on one line (no newline)."""
    data = asdict(s)
    data["versions"] = {str(p): v for p, v in s.versions.items()}
    data["contributed"] = s.contributed
    data["loss_fell"] = s.loss_fell
    data["merged_token_share"] = s.merged_token_share
    data["wall_s"] = round(s.wall_s, 3)
    return json.dumps(data, sort_keys=True)
