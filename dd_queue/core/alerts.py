"""The run's alert rules, evaluated in Python over the exporter's own samples (pure).

``deploy/alerts.yml`` holds these rules in PromQL for the user's Prometheus; this module holds
the same rules (name, severity, ``for`` duration, condition) for the dashboard's alerts panel, so
a run without a Prometheus still shows them. Both read the same numbers: the control plane feeds
:func:`evaluate` the samples of the very metric families its ``/metrics`` exports. A test runs
``deploy/alerts.test.yml``'s promtool cases through :func:`evaluate` too, so the two copies of a
rule cannot drift apart silently.

Semantics follow Prometheus: a rule's condition is checked at every evaluation; a breach is
``pending`` from the first evaluation it holds and ``firing`` once it has held without a break
for the rule's ``for_s``; it is gone at the first evaluation it does not hold. ``increase`` is
the counters' growth over the window (a drop counts as a restart from zero), ``deriv`` the
least-squares slope. ``DDQExporterDown`` cannot be raised by the exporter itself: the dashboard
raises it when its own connection to the control plane is lost.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "HISTORY_S",
    "METRICS",
    "RULES",
    "Alert",
    "Breach",
    "Labels",
    "Rule",
    "Sample",
    "evaluate",
    "labels_of",
]

Labels = tuple[tuple[str, str], ...]
"""A series' labels, sorted by name."""


def labels_of(**labels: str) -> Labels:
    """Labels as the sorted tuple a :class:`Sample` keys its series by."""
    return tuple(sorted(labels.items()))


@dataclass(frozen=True, slots=True)
class Sample:
    """The values of some metrics at one evaluation: metric name → labels → value."""

    at_s: float
    values: Mapping[str, Mapping[Labels, float]]

    def series(self, metric: str) -> Mapping[Labels, float]:
        return self.values.get(metric, {})

    def one(self, metric: str) -> float | None:
        """The value of a metric without labels (None when it was not exported)."""
        return self.series(metric).get((), None)


@dataclass(frozen=True, slots=True)
class Breach:
    """One series for which a rule's condition holds now.

    Attributes:
        subject: What it is about (``learner L1``, ``fragment 2``, ``run``).
        link: The dashboard anchor that shows it (``#learner-L1``, ``#fragment-2``, ...).
        value: The value the condition tested.
        summary: One line for people.
    """

    subject: str
    link: str
    value: float
    summary: str


@dataclass(frozen=True, slots=True)
class Rule:
    """An alert rule: what ``deploy/alerts.yml`` says of it, and its condition in Python."""

    name: str
    severity: Literal["warning", "critical"]
    for_s: float
    description: str
    check: Callable[[Sequence[Sample]], list[Breach]] = field(repr=False)


@dataclass(frozen=True, slots=True)
class Alert:
    """A breach with its state: ``pending`` until it has held for ``for_s``, then ``firing``."""

    name: str
    severity: str
    state: Literal["pending", "firing"]
    since_s: float
    subject: str
    link: str
    value: float
    summary: str
    description: str


# ── window functions (PromQL's, over the samples kept) ───────────────────────────────────────
def _window(history: Sequence[Sample], seconds: float) -> list[Sample]:
    now = history[-1].at_s
    return [s for s in history if s.at_s >= now - seconds]


def _increase(history: Sequence[Sample], metric: str, seconds: float, **match: str) -> float:
    """Growth of the matching series summed, over the last ``seconds`` (resets: from zero)."""
    window = _window(history, seconds)
    total = 0.0
    for labels in {lab for s in window for lab in s.series(metric)}:
        if any(dict(labels).get(k) != v for k, v in match.items()):
            continue
        values = [s.series(metric)[labels] for s in window if labels in s.series(metric)]
        for before, after in itertools.pairwise(values):
            total += after - before if after >= before else after
    return total


def _deriv(points: Sequence[tuple[float, float]]) -> float | None:
    if len(points) < 2:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def _points(history: Sequence[Sample], metric: str, seconds: float) -> list[tuple[float, float]]:
    return [
        (s.at_s, v)
        for s in _window(history, seconds)
        if (v := s.one(metric)) is not None and math.isfinite(v)
    ]


# ── the rules ────────────────────────────────────────────────────────────────────────────────
def _learner_dead(history: Sequence[Sample]) -> list[Breach]:
    found = []
    for labels, value in sorted(history[-1].series("ddq_learner_state").items()):
        tags = dict(labels)
        if tags.get("state") == "dead" and value == 1:
            learner = tags.get("learner", "?")
            found.append(
                Breach(
                    f"learner {learner}", f"#learner-{learner}", value, f"learner {learner} is dead"
                )
            )
    return found


def _no_merge(history: Sequence[Sample]) -> list[Breach]:
    now = history[-1]
    expected = {
        dict(lab).get("fragment"): v for lab, v in now.series("ddq_round_expected_seconds").items()
    }
    found = []
    for labels, age in sorted(now.series("ddq_last_merge_age_seconds").items()):
        p = dict(labels).get("fragment")
        limit = expected.get(p)
        if limit is not None and age > 5 * limit:
            found.append(
                Breach(
                    f"fragment {p}",
                    f"#fragment-{p}",
                    age,
                    f"fragment {p}: no merge for {age:.0f} s",
                )
            )
    return found


def _abandoned_rising(history: Sequence[Sample]) -> list[Breach]:
    abandoned = _increase(history, "ddq_rounds_total", 600, decision="abandon")
    every = _increase(history, "ddq_rounds_total", 600)
    if abandoned > 0.2 * every and abandoned >= 3:
        return [
            Breach(
                "rounds",
                "#timeline",
                abandoned,
                f"{abandoned:.0f} rounds abandoned in 10 minutes (over 20% of rounds)",
            )
        ]
    return []


def _dead_letters_growing(history: Sequence[Sample]) -> list[Breach]:
    grown = _increase(history, "ddq_dead_letters_total", 600)
    if grown > 0:
        return [
            Breach(
                "dead letters",
                "#events",
                grown,
                f"{grown:.0f} contributions dead-lettered in 10 minutes",
            )
        ]
    return []


def _synchronizer_down(history: Sequence[Sample]) -> list[Breach]:
    active = history[-1].one("ddq_synchronizers_active")
    if active == 0:
        return [Breach("synchronizer", "#fragments", 0.0, "no synchronizer heartbeat is fresh")]
    return []


def _loss_not_finite(history: Sequence[Sample]) -> list[Breach]:
    loss = history[-1].one("ddq_eval_loss")
    if loss is not None and (math.isnan(loss) or loss == math.inf):
        return [
            Breach("eval", "#eval", loss, "the held-out loss of the global model is not finite")
        ]
    return []


def _loss_rising(history: Sequence[Sample]) -> list[Breach]:
    loss = history[-1].one("ddq_eval_loss")
    hour = _points(history, "ddq_eval_loss", 3600)
    slope = _deriv(_points(history, "ddq_eval_loss", 900))
    if loss is None or not hour or slope is None:
        return []
    if loss > 1.1 * min(v for _, v in hour) and slope > 0:
        return [
            Breach(
                "eval",
                "#eval",
                loss,
                f"held-out loss {loss:.2f} is 10% over its best of the last hour and rising",
            )
        ]
    return []


def _redis_memory(history: Sequence[Sample]) -> list[Breach]:
    used = history[-1].one("ddq_redis_memory_used_bytes")
    most = history[-1].one("ddq_redis_memory_max_bytes")
    if used is not None and most and used / most > 0.9:
        return [
            Breach("redis", "#summary", used / most, f"Redis uses {used / most:.0%} of maxmemory")
        ]
    return []


def _raised_by_the_page(history: Sequence[Sample]) -> list[Breach]:
    return []  # the exporter cannot see itself down: the dashboard raises it (module doc)


RULES: tuple[Rule, ...] = (
    Rule(
        "DDQExporterDown", "critical", 60, "The control plane does not answer.", _raised_by_the_page
    ),
    Rule(
        "DDQLearnerDead",
        "warning",
        30,
        "Its heartbeat expired. The run goes on without it; restart it to get its tokens back.",
        _learner_dead,
    ),
    Rule(
        "DDQNoMerge",
        "critical",
        60,
        "More than 5 expected round times since the fragment's last merge.",
        _no_merge,
    ),
    Rule(
        "DDQAbandonedRoundsRising",
        "warning",
        120,
        "Rounds time out without their quorum.",
        _abandoned_rising,
    ),
    Rule(
        "DDQDeadLettersGrowing",
        "warning",
        0,
        "Corrupt, forged, non-finite or incompatible contributions.",
        _dead_letters_growing,
    ),
    Rule(
        "DDQSynchronizerDown",
        "critical",
        30,
        "Nothing merges until a synchronizer takes the fragments' leases.",
        _synchronizer_down,
    ),
    Rule("DDQLossNotFinite", "critical", 0, "The global model diverged.", _loss_not_finite),
    Rule("DDQLossRising", "warning", 600, "The global model is getting worse.", _loss_rising),
    Rule(
        "DDQRedisMemoryNearMax",
        "critical",
        60,
        "With noeviction, writes fail at maxmemory.",
        _redis_memory,
    ),
)
"""Every rule of ``deploy/alerts.yml``, in its order."""

METRICS: frozenset[str] = frozenset(
    {
        "ddq_learner_state",
        "ddq_last_merge_age_seconds",
        "ddq_round_expected_seconds",
        "ddq_rounds_total",
        "ddq_dead_letters_total",
        "ddq_synchronizers_active",
        "ddq_eval_loss",
        "ddq_redis_memory_used_bytes",
        "ddq_redis_memory_max_bytes",
    }
)
"""The metrics the rules read (the samples need hold no others)."""

HISTORY_S = 3600.0
"""The longest window a rule reads (``DDQLossRising``'s hour): older samples may go."""


def evaluate(
    history: Sequence[Sample],
    pending: Mapping[tuple[str, str], float],
    rules: Iterable[Rule] = RULES,
) -> tuple[list[Alert], dict[tuple[str, str], float]]:
    """Evaluate the rules at the newest sample.

    Args:
        history: Samples, oldest first, the newest being now (at least the last hour's).
        pending: ``(rule, subject)`` → when its breach began, from the previous evaluation.

    Returns:
        The alerts now (firing first, then by rule order), and the breaches' start times to
        pass to the next evaluation.
    """
    if not history:
        return [], {}
    now = history[-1].at_s
    alerts: list[Alert] = []
    started: dict[tuple[str, str], float] = {}
    for rule in rules:
        for breach in rule.check(history):
            key = (rule.name, breach.subject)
            since = pending.get(key, now)
            started[key] = since
            state: Literal["pending", "firing"] = (
                "firing" if now - since >= rule.for_s else "pending"
            )
            alerts.append(
                Alert(
                    name=rule.name,
                    severity=rule.severity,
                    state=state,
                    since_s=since,
                    subject=breach.subject,
                    link=breach.link,
                    value=breach.value,
                    summary=breach.summary,
                    description=rule.description,
                )
            )
    alerts.sort(key=lambda a: a.state != "firing")  # stable: rule order within each state
    return alerts, started
