"""Exact run tallies: what one closed round or one batch of dead letters adds to a fragment's
counters, and how the counters read back as per-learner counts and histograms.

A fragment's state keeps ``counters: dict[str, int]`` that change only inside the commit that
settles what they count (``dd_queue.fragment_state``). Next to the flat totals (``merged``,
``rounds_merged``, ``bytes_in``, ...) they hold namespaced keys:

=============================  ===================================================================
``learner/<id>/<outcome>``     that learner's entries settled with that outcome (``dead_lettered``
                               too; ``?`` for an entry too broken to name its learner)
``learner/<id>/tokens_merged`` tokens of its merged contributions
``fate/<id>/<outcome>``        tokens whose first carrier (below) was that learner's entry settled
                               with that outcome (``dead_lettered`` too)
``dlq/<reason>``               dead letters by reason tag (the reason's text before ``:``)
``hist/<name>/le=<bound>``     observations in (previous bound, bound]; ``le=+Inf`` above the last
``hist/<name>/sum_e6``         the observations' sum × 10⁶, rounded (integers keep counters exact)
=============================  ===================================================================

**Token fate.** A contribution's ``n_tokens`` counts every token since the learner last received
the fragment, so a later send of the same span carries the earlier ones' tokens again. Its
``new_tokens`` are those no earlier send of that span carried: each token trained for a fragment
has one *first carrier*, and its fate is the outcome of that entry (``carried`` adds none: the
entry is settled later). A ``duplicate`` is a later snapshot tagged with a round the learner
already answered, and its new tokens are its own; only a send the bus retried after its reply
was lost would count twice, and the fate then says it does not balance. On the learner's
side ``dd_queue.learner.tokens`` counts what it computed, published and dropped; ``token_fate``
balances the two.

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
    "TokenFate",
    "dead_letter_increments",
    "dead_letters",
    "histogram",
    "learner_counts",
    "merged_token_share",
    "reason_tag",
    "round_increments",
    "run_token_fates",
    "summed",
    "token_fate",
    "token_fates",
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

_LEARNER, _DLQ, _HIST, _FATE = "learner/", "dlq/", "hist/", "fate/"
_NO_FATE = frozenset({"carried"})
_SCALE = 1_000_000


@dataclass(frozen=True, slots=True)
class Observed:
    """What one closed round saw, in plain values (the synchronizer fills it from its record).

    Attributes:
        entries: ``(learner_id, outcome)`` of every settled entry (``carried`` ones are skipped).
        contributors: ``(learner_id, n_tokens, staleness)`` of every merged contribution.
        durations_s: Phase name (a ``HISTOGRAMS`` key) → seconds; None when the phase did not
            happen (no quorum, no merge).
        fates: ``(learner_id, outcome, new_tokens)`` of every settled entry whose envelope was
            read (the token fate of the tokens it carried first).
    """

    entries: tuple[tuple[str, str], ...] = ()
    contributors: tuple[tuple[str, int, int], ...] = ()
    durations_s: Mapping[str, float | None] | None = None
    fates: tuple[tuple[str, str, int], ...] = ()


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
    counts.update(_fate_increments(observed.fates))
    return dict(counts)


def _fate_increments(fates: Iterable[tuple[str, str, int]]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for learner_id, outcome, new_tokens in fates:
        if new_tokens < 0:
            raise ValueError(f"{learner_id}: new_tokens must be ≥ 0, got {new_tokens}")
        if outcome not in _NO_FATE and new_tokens:
            counts[f"{_FATE}{learner_id}/{outcome}"] += new_tokens
    return counts


def reason_tag(reason: str) -> str:
    """The tag of a dead letter's reason: its text before the first ``:`` (``corrupt: ...``)."""
    return reason.partition(":")[0].strip() or "?"


def dead_letter_increments(rejected: Iterable[tuple[str, str, int]]) -> dict[str, int]:
    """What dead-lettering ``(learner_id or "?", reason, new_tokens)`` entries adds to the
    counters (``new_tokens`` 0 when the envelope does not decode)."""
    counts: Counter[str] = Counter()
    for learner_id, reason, new_tokens in rejected:
        counts[f"{_LEARNER}{learner_id}/dead_lettered"] += 1
        counts[f"{_DLQ}{reason_tag(reason)}"] += 1
        counts.update(_fate_increments([(learner_id, "dead_lettered", new_tokens)]))
    return dict(counts)


def summed(counters: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Counters of several fragments added together."""
    total: Counter[str] = Counter()
    for c in counters:
        total.update(c)
    return dict(total)


def _by_learner(counters: Mapping[str, int], prefix: str) -> dict[str, dict[str, int]]:
    """Learner id → name → count, of the ``<prefix><learner>/<name>`` counters."""
    found: dict[str, dict[str, int]] = {}
    for key, n in counters.items():
        if key.startswith(prefix):
            learner_id, _, name = key[len(prefix) :].rpartition("/")
            found.setdefault(learner_id, {})[name] = n
    return found


def learner_counts(counters: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """Learner id → its counts (outcome names and ``tokens_merged``)."""
    return _by_learner(counters, _LEARNER)


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


def token_fates(counters: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """Learner id → outcome → tokens first carried by its entries settled so (module doc)."""
    return _by_learner(counters, _FATE)


@dataclass(frozen=True, slots=True)
class TokenFate:
    """One learner's tokens, computed to fate, in token·fragments (each token it trains is
    trained for every one of the P fragments; divide by P for tokens).

    Attributes:
        computed: Reported computed by the learner (every step's tokens × P).
        settled: Synchronizer outcome → tokens first carried by entries settled so.
        dropped: Not published: a ``drop`` fault, or non-finite values (learner's count).
        unsent: Trained but carried by no send: a newer global arrived first, or the learner
            stopped (computed − published − dropped, the learner's own counts).
        in_flight: Published, not settled yet (published − Σ settled).
        balanced: computed = Σ settled + dropped + unsent + in_flight with every part ≥ 0.
        reason: Why it does not balance (None when it does).
    """

    computed: int
    settled: Mapping[str, int]
    dropped: int
    unsent: int
    in_flight: int
    balanced: bool
    reason: str | None

    def parts(self) -> dict[str, int]:
        """Every fate with its tokens (settled outcomes, then the learner's own)."""
        own = {"dropped_at_learner": self.dropped, "unsent": self.unsent}
        return {**self.settled, **own, "in_flight": self.in_flight}

    def verdict(self, n_fragments: int) -> str:
        """Whether it balances, in tokens (the API's, the page's and the report's words)."""
        if not self.balanced:
            return f"does not balance: {self.reason}"
        n = max(1, n_fragments)
        flying = f"; {self.in_flight / n:,.0f} still in flight" if self.in_flight else ""
        computed = f"{self.computed / n:,.0f} tokens computed"
        return f"balanced: {computed} = the sum of their fates{flying}"


def token_fate(
    computed: int, published: int, dropped: int, settled: Mapping[str, int]
) -> TokenFate:
    """Balance a learner's own counts (``computed``, ``published``, ``dropped``) against the
    synchronizer's ``settled`` fates. ``in_flight`` is negative, and the fate unbalanced, if the
    synchronizer settled more than the learner says it published; ``unsent`` is negative if
    the learner published or dropped more than it computed."""
    total_settled = sum(settled.values())
    unsent, in_flight = computed - published - dropped, published - total_settled
    problems = []
    if in_flight < 0:
        problems.append(f"{-in_flight} more tokens settled than published")
    if unsent < 0:
        problems.append(f"{-unsent} more tokens published or dropped than computed")
    if any(n < 0 for n in settled.values()) or dropped < 0:
        problems.append("a negative count")
    return TokenFate(
        computed=computed,
        settled=dict(sorted(settled.items())),
        dropped=dropped,
        unsent=unsent,
        in_flight=in_flight,
        balanced=not problems,
        reason="; ".join(problems) or None,
    )


def run_token_fates(
    reported: Mapping[str, Mapping[str, int]], counters: Mapping[str, int]
) -> dict[str, TokenFate]:
    """Learner → its token fate: ``reported`` are the learners' own counts
    (``ops.token_counts``), ``counters`` the fragments' counters summed (``summed``). A
    learner only one side knows of is listed too (its other side counts zero)."""
    settled = token_fates(counters)
    fates = {}
    for lid in sorted(reported.keys() | settled.keys()):
        own = reported.get(lid, {})
        fates[lid] = token_fate(
            own.get("computed", 0),
            own.get("published", 0),
            own.get("dropped", 0),
            settled.get(lid, {}),
        )
    return fates


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
