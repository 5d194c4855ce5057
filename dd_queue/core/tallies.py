"""Exact run tallies: what one closed round or one batch of dead letters adds to a fragment's
counters, and how the counters read back as per-learner counts and histograms.

A fragment's state keeps ``counters: dict[str, int]`` that change only inside the commit that
settles what they count (``dd_queue.fragment_state``). Next to the flat totals (``merged``,
``rounds_merged``, ``bytes_in``, ...) they hold namespaced keys:

=============================  ===================================================================
``learner/<id>/<outcome>``     that learner's entries settled with that outcome (``dead_lettered``
                               too; ``?`` for an entry too broken to name its learner)
``learner/<id>/tokens_merged`` tokens of its merged contributions
``dlq/<reason>``               dead letters by reason tag (the reason's text before ``:``)
``hist/<name>/le=<bound>``     observations in (previous bound, bound]; ``le=+Inf`` above the last
``hist/<name>/sum_e6``         the observations' sum × 10⁶, rounded (integers keep counters exact)
=============================  ===================================================================

They live in Redis and change only in commits, so an exporter that derives its counters from
them reads the same totals after it restarts: the counters it exports never go down.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "DURATION_BOUNDS_S",
    "HISTOGRAMS",
    "STALENESS_BOUNDS",
    "Histogram",
    "Observed",
    "dead_letter_increments",
    "dead_letters",
    "histogram",
    "learner_counts",
    "merged_token_share",
    "reason_tag",
    "round_increments",
    "summed",
    "tokens_merged",
]

STALENESS_BOUNDS: tuple[float, ...] = (0, 1, 2, 3, 4, 8, 16)
"""Upper bounds of the staleness histogram, versions behind (Prometheus ``le`` style)."""
DURATION_BOUNDS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120
)  # fmt: skip
"""Upper bounds of the round-phase duration histograms, seconds."""

HISTOGRAMS: dict[str, tuple[float, ...]] = {
    "staleness_versions": STALENESS_BOUNDS,
    "open_to_quorum_s": DURATION_BOUNDS_S,
    "quorum_to_merge_s": DURATION_BOUNDS_S,
    "merge_to_commit_s": DURATION_BOUNDS_S,
}
"""Every histogram the counters keep, with its bounds. The round phases: from the round's
opening to its quorum; from the quorum to the merge decision (the grace window used); from the
decision to the commit being written (decode, merge, outer step, staging)."""

_LEARNER, _DLQ, _HIST = "learner/", "dlq/", "hist/"
_SCALE = 1_000_000


@dataclass(frozen=True, slots=True)
class Observed:
    """What one closed round saw, in plain values (the synchronizer fills it from its record).

    Attributes:
        entries: ``(learner_id, outcome)`` of every settled entry (``carried`` ones are skipped).
        contributors: ``(learner_id, n_tokens, staleness)`` of every merged contribution.
        durations_s: Phase name (a ``HISTOGRAMS`` key) → seconds; None when the phase did not
            happen (no quorum, no merge).
    """

    entries: tuple[tuple[str, str], ...] = ()
    contributors: tuple[tuple[str, int, int], ...] = ()
    durations_s: Mapping[str, float | None] | None = None


@dataclass(frozen=True, slots=True)
class Histogram:
    """One histogram read back: cumulative counts per bound (the last is ``+Inf``)."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]  # len(bounds) + 1
    total: float

    @property
    def count(self) -> int:
        """Observations in all."""
        return self.cumulative[-1]


def _bucket_key(name: str, bound: float) -> str:
    return f"{_HIST}{name}/le={'+Inf' if math.isinf(bound) else f'{bound:g}'}"


def _observe(name: str, value: float) -> dict[str, int]:
    bounds = HISTOGRAMS[name]
    if not math.isfinite(value):
        raise ValueError(f"histogram {name}: observation {value} is not finite")
    value = max(0.0, value)
    bound = next((b for b in bounds if value <= b), math.inf)
    return {_bucket_key(name, bound): 1, f"{_HIST}{name}/sum_e6": round(value * _SCALE)}


def round_increments(observed: Observed) -> dict[str, int]:
    """What one closed round adds to its fragment's counters (module doc)."""
    counts: Counter[str] = Counter()
    for learner_id, outcome in observed.entries:
        if outcome != "carried":
            counts[f"{_LEARNER}{learner_id}/{outcome}"] += 1
    for learner_id, n_tokens, staleness in observed.contributors:
        counts[f"{_LEARNER}{learner_id}/tokens_merged"] += n_tokens
        counts.update(_observe("staleness_versions", staleness))
    for name, seconds in (observed.durations_s or {}).items():
        if seconds is not None:
            counts.update(_observe(name, seconds))
    return dict(counts)


def reason_tag(reason: str) -> str:
    """The tag of a dead letter's reason: its text before the first ``:`` (``corrupt: ...``)."""
    return reason.partition(":")[0].strip() or "?"


def dead_letter_increments(rejected: Iterable[tuple[str, str]]) -> dict[str, int]:
    """What dead-lettering ``(learner_id or "?", reason)`` entries adds to the counters."""
    counts: Counter[str] = Counter()
    for learner_id, reason in rejected:
        counts[f"{_LEARNER}{learner_id}/dead_lettered"] += 1
        counts[f"{_DLQ}{reason_tag(reason)}"] += 1
    return dict(counts)


def summed(counters: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Counters of several fragments added together."""
    total: Counter[str] = Counter()
    for c in counters:
        total.update(c)
    return dict(total)


def learner_counts(counters: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """Learner id → its counts (outcome names and ``tokens_merged``)."""
    found: dict[str, dict[str, int]] = {}
    for key, n in counters.items():
        if key.startswith(_LEARNER):
            learner_id, _, what = key[len(_LEARNER) :].rpartition("/")
            found.setdefault(learner_id, {})[what] = n
    return found


def tokens_merged(counters: Mapping[str, int]) -> int:
    """Tokens of every merged contribution, all learners together."""
    return sum(c.get("tokens_merged", 0) for c in learner_counts(counters).values())


def merged_token_share(merged: int, n_fragments: int, trained: int) -> float | None:
    """Tokens in merged contributions ÷ tokens trained, per fragment: ``merged`` is summed over
    ``n_fragments`` fragments (each fragment's contributions carry the tokens trained since the
    learner last received it). Goodput counts chip time; this counts the work that reached the
    global model. None before any token was trained."""
    if trained <= 0 or n_fragments <= 0:
        return None
    return merged / n_fragments / trained


def dead_letters(counters: Mapping[str, int]) -> dict[str, int]:
    """Reason tag → dead letters."""
    return {k[len(_DLQ) :]: n for k, n in counters.items() if k.startswith(_DLQ)}


def histogram(counters: Mapping[str, int], name: str) -> Histogram:
    """Histogram ``name`` read back from the counters (all zeros before any observation)."""
    bounds = HISTOGRAMS[name]
    running, cumulative = 0, []
    for bound in (*bounds, math.inf):
        running += counters.get(_bucket_key(name, bound), 0)
        cumulative.append(running)
    total = counters.get(f"{_HIST}{name}/sum_e6", 0) / _SCALE
    return Histogram(bounds=bounds, cumulative=tuple(cumulative), total=total)
