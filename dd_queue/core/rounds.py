"""Contribution bookkeeping: learner counters and the synchronizer's state of one round.

Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) weighs a learner's contribution to
fragment ``p`` by the steps and tokens it trained since it last received ``p``; the learner keeps
those counters in a ``FragmentCounters`` per fragment.

The synchronizer keeps one ``RoundState`` per fragment: the open round and every contribution
held for the fragment since its last merge. Rules, in the order they are checked:

1. **duplicate** — the identity ``(learner, fragment, round)`` was already held in this round
   window, or was merged by the previous merge: at-least-once delivery redelivers, and a
   contribution is applied at most once.
2. **late** — its round is one the fragment already merged: the merge went ahead without it.
3. **invalid** — its round was not opened yet, or its base version is newer than the
   fragment's version (state from another synchronizer lifetime, or a bug); never merged.
4. **stale** — ``staleness = current version − base version`` exceeds ``max_staleness``.
5. **superseded** — the same learner's contribution from a newer round is already held.
6. **replaced** / **accepted** — the latest contribution per learner wins until merged: a
   newer one replaces the older one (the older one's entry can be acked with the merge).

Abandoned rounds keep their contributions: ``reopened`` carries them into the fragment's next
round (their staleness cannot grow, since the version only changes on a merge). ``after_merge``
starts the next round window with the version one higher and nothing held.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal

from dd_queue.errors import CoreError

__all__ = [
    "STEP_SLACK_S",
    "Admission",
    "AdmissionKind",
    "ContributionClaim",
    "ContributionMeta",
    "FragmentCounters",
    "RoundState",
    "RoundView",
    "implausible",
]

AdmissionKind = Literal[
    "accepted", "replaced", "duplicate", "late", "invalid", "stale", "superseded"
]


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CoreError(f"{name} must be an integer ≥ 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class FragmentCounters:
    """A learner's counters for one fragment, since it last received that fragment.

    Attributes:
        steps: Inner steps trained since the fragment was last received.
        tokens: Tokens trained since then.
        base_version: Global version of the fragment the local copy came from.
    """

    steps: int = 0
    tokens: int = 0
    base_version: int = 0

    def __post_init__(self) -> None:
        _check_count("steps", self.steps)
        _check_count("tokens", self.tokens)
        _check_count("base_version", self.base_version)

    def after_step(self, tokens: int) -> FragmentCounters:
        """Return the counters after one inner step that trained ``tokens`` tokens.

        Raises:
            CoreError: If ``tokens`` is negative.
        """
        _check_count("tokens", tokens)
        return replace(self, steps=self.steps + 1, tokens=self.tokens + tokens)

    def after_receive(self, version: int) -> FragmentCounters:
        """Return the counters after overwriting the fragment with global ``version``.

        Counters restart at 0 and the base becomes ``version``.

        Raises:
            CoreError: If ``version`` is not newer than ``base_version``; the caller must skip
                such a fragment instead of overwriting its newer local copy.
        """
        _check_count("version", version)
        if version <= self.base_version:
            raise CoreError(
                f"global version {version} is not newer than base version {self.base_version}; "
                "skip it instead of applying it"
            )
        return FragmentCounters(steps=0, tokens=0, base_version=version)


@dataclass(frozen=True, slots=True, kw_only=True)
class ContributionClaim:
    """What a contribution says of itself: whose it is, what it answers, and the work behind it.

    ``dd_queue.messages.Contribution`` (the wire envelope) and ``ContributionMeta`` (the
    synchronizer's bookkeeping) both extend it, so these fields are named once.

    Attributes:
        learner_id: The contributing learner, e.g. ``"L3"``.
        fragment_id: The fragment, ≥ 0.
        round_id: The global round the contribution answers, ≥ 0.
        base_version: Global version of the fragment the learner trained from.
        n_steps: Inner steps since the learner last received the fragment.
        n_tokens: Tokens since then.
    """

    learner_id: str
    fragment_id: int
    round_id: int
    base_version: int
    n_steps: int
    n_tokens: int

    @property
    def identity(self) -> tuple[str, int, int]:
        """The deduplication key ``(learner_id, fragment_id, round_id)``."""
        return (self.learner_id, self.fragment_id, self.round_id)


_CLAIM_FIELDS = tuple(f.name for f in fields(ContributionClaim))


STEP_SLACK_S = 1.0
"""Seconds added to a contribution's training window before the step bound: bus timestamps are
whole milliseconds, and the learner's first step may begin within the publishing commit's tick."""


def implausible(
    claim: ContributionClaim,
    *,
    max_tokens_per_step: int,
    max_steps_per_s: float,
    trained_for_s: float | None,
) -> str | None:
    """Why a contribution's counters cannot be true (its dead-letter reason), or None.

    A learner counts ``n_steps`` and ``n_tokens`` from the moment it received its base version,
    which was no earlier than that version's publication. So ``n_tokens`` is at most
    ``n_steps × max_tokens_per_step``, and ``n_steps`` at most ``max_steps_per_s`` times the
    window from the publication to the contribution's arrival (plus ``STEP_SLACK_S``).

    Args:
        claim: The contribution's claim.
        max_tokens_per_step: Most tokens one inner step of this run can carry.
        max_steps_per_s: Most inner steps a learner can take in a second.
        trained_for_s: Seconds from the base version's publication to the contribution's
            arrival, both on the bus's clock (so learners' clocks do not matter); None when the
            publication time is not known (the step bound is then not applied).
    """
    if claim.n_tokens > max(claim.n_steps, 1) * max_tokens_per_step:
        return (
            f"{claim.n_tokens} tokens in {claim.n_steps} steps: more than "
            f"{max_tokens_per_step} tokens per step (synchronizer.max_tokens_per_step) "
            "cannot come from this run's model and batches; it would outweigh every other "
            "learner"
        )
    if trained_for_s is None:
        return None
    trained_s = max(trained_for_s, 0.0)  # an arrival "before" the publication: a restored Redis
    window_s = trained_s + STEP_SLACK_S
    if claim.n_steps > max_steps_per_s * window_s:
        return (
            f"{claim.n_steps} steps since version {claim.base_version}, published "
            f"{trained_s:.3f} s before it arrived: more than "
            f"{max_steps_per_s:g} steps per second (synchronizer.max_steps_per_s) over "
            f"{window_s:.3f} s"
        )
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ContributionMeta(ContributionClaim):
    """What the synchronizer knows of one contribution, without its payload: its claim and
    ``entry_id``, the opaque bus reference (stream entry id) the shell acks it by."""

    entry_id: str = ""

    def __post_init__(self) -> None:
        if not self.learner_id:
            raise CoreError("learner_id must be a non-empty string")
        for name in _CLAIM_FIELDS:
            if name != "learner_id":
                _check_count(name, getattr(self, name))

    @classmethod
    def of(cls, claim: ContributionClaim, entry_id: str) -> ContributionMeta:
        """The bookkeeping of ``claim`` (e.g. a decoded ``Contribution``) read as ``entry_id``."""
        return cls(**{name: getattr(claim, name) for name in _CLAIM_FIELDS}, entry_id=entry_id)


@dataclass(frozen=True, slots=True)
class Admission:
    """The outcome of offering one contribution to a round.

    Attributes:
        kind: accepted / replaced (both admitted) or duplicate / late / invalid / stale /
            superseded (not admitted; the shell acks and counts it).
        reason: Human-readable explanation naming the learner.
        staleness: ``current version − base version`` of the offered contribution.
        replaced: The contribution this one displaced (kind ``replaced``), else None.
    """

    kind: AdmissionKind
    reason: str
    staleness: int
    replaced: ContributionMeta | None = None

    @property
    def admitted(self) -> bool:
        """True when the contribution is now held for the next merge."""
        return self.kind in ("accepted", "replaced")


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundView:
    """What the quorum policy sees of a round (see ``dd_queue.core.policy.decide``).

    Attributes:
        fragment_id: The fragment.
        round_id: The open round's global id.
        opened_at_s: When the round opened, seconds.
        current_version: The fragment's global version before this round's merge.
        arrivals: ``(learner_id, first_arrival_s)`` of every held contribution, earliest
            first: when each learner first counted toward the quorum in this window.
        staleness: ``(learner_id, staleness)`` of every held contribution, by learner id.
        refused: Learners whose answer to this round was refused (stale, unreadable, ...) and
            who hold nothing: they answered, and will not answer this round again.
    """

    fragment_id: int
    round_id: int
    opened_at_s: float
    current_version: int
    arrivals: tuple[tuple[str, float], ...] = ()
    staleness: tuple[tuple[str, int], ...] = ()
    refused: frozenset[str] = frozenset()

    @property
    def contributors(self) -> frozenset[str]:
        """The learners with a held contribution."""
        return frozenset(learner for learner, _ in self.arrivals)

    @property
    def first_arrival_s(self) -> float | None:
        """When the first held contribution arrived, or None when nothing is held."""
        return self.arrivals[0][1] if self.arrivals else None

    def quorum_at_s(self, quorum: int) -> float | None:
        """When the ``quorum``-th distinct learner arrived, or None if fewer are held."""
        if quorum < 1:
            raise CoreError(f"quorum must be ≥ 1, got {quorum}")
        return self.arrivals[quorum - 1][1] if len(self.arrivals) >= quorum else None


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundState:
    """The synchronizer's immutable state of one fragment's open round.

    Build the first one with ``RoundState.open``; every transition returns a new state.

    Attributes:
        fragment_id: The fragment.
        round_id: The open round's global id.
        opened_at_s: When it opened, seconds.
        current_version: The fragment's global version (before this round's merge).
        last_merged_round_id: The fragment's last merged round, or None before the first merge.
        held: The held contributions, one per learner, sorted by learner id.
        first_arrivals: ``(first_arrival_s, learner_id)`` per held learner, sorted.
        seen: Identities admitted in this window (held, or replaced by a newer one).
        merged: ``seen`` of the previous window, which the previous merge accounted for
            (so a redelivery is reported as a duplicate rather than as late).
        refused: Learners whose answer to the open round was refused and who hold nothing
            (``refusing``): the policy waits for no more from them in this round.
    """

    fragment_id: int
    round_id: int
    opened_at_s: float
    current_version: int
    last_merged_round_id: int | None = None
    held: tuple[ContributionMeta, ...] = ()
    first_arrivals: tuple[tuple[float, str], ...] = ()
    seen: frozenset[tuple[str, int, int]] = field(default_factory=frozenset)
    merged: frozenset[tuple[str, int, int]] = field(default_factory=frozenset)
    refused: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def open(
        cls, *, fragment_id: int, round_id: int, opened_at_s: float, current_version: int
    ) -> RoundState:
        """Open a fragment's first round window (nothing held, nothing merged yet)."""
        for name, value in (
            ("fragment_id", fragment_id),
            ("round_id", round_id),
            ("current_version", current_version),
        ):
            _check_count(name, value)
        return cls(
            fragment_id=fragment_id,
            round_id=round_id,
            opened_at_s=opened_at_s,
            current_version=current_version,
        )

    def admit(
        self, contribution: ContributionMeta, *, now: float, max_staleness: int
    ) -> tuple[RoundState, Admission]:
        """Offer one contribution; return the new state and what happened to it.

        Args:
            contribution: The contribution's metadata; its fragment must be this round's.
            now: Arrival time, seconds.
            max_staleness: Largest accepted ``current version − base version``, ≥ 0.

        Returns:
            ``(new_state, admission)``; ``new_state is self`` when nothing was admitted.

        Raises:
            CoreError: If the contribution belongs to another fragment (a routing bug).
        """
        c = contribution
        if c.fragment_id != self.fragment_id:
            raise CoreError(
                f"contribution for fragment {c.fragment_id} offered to fragment "
                f"{self.fragment_id}'s round; route contributions by fragment"
            )
        staleness = self.current_version - c.base_version
        rejection = self._rejection(c, staleness, max_staleness)
        if rejection is not None:
            return self, rejection
        old = self._held_of(c.learner_id)
        held = tuple(sorted((*[h for h in self.held if h is not old], c), key=_learner_key))
        arrivals = self.first_arrivals
        if old is None:
            arrivals = tuple(sorted((*arrivals, (now, c.learner_id))))
        new = replace(
            self,
            held=held,
            first_arrivals=arrivals,
            seen=self.seen | {c.identity},
            refused=self.refused - {c.learner_id},
        )
        who = f"{c.learner_id} round {c.round_id}"
        if old is None:
            return new, Admission("accepted", f"{who} accepted{_stale_note(staleness)}", staleness)
        reason = f"{who} replaces its round {old.round_id} contribution{_stale_note(staleness)}"
        return new, Admission("replaced", reason, staleness, replaced=old)

    def _rejection(
        self, c: ContributionMeta, staleness: int, max_staleness: int
    ) -> Admission | None:
        who = f"{c.learner_id} round {c.round_id}"
        if c.identity in self.seen:
            return Admission("duplicate", f"{who} is a duplicate; already received", staleness)
        if c.identity in self.merged:
            reason = f"{who} is a duplicate; already counted in version {self.current_version}"
            return Admission("duplicate", reason, staleness)
        last = self.last_merged_round_id
        if last is not None and c.round_id <= last:
            reason = f"{who} is late: fragment {self.fragment_id} merged round {last} without it"
            return Admission("late", reason, staleness)
        if c.round_id > self.round_id:
            reason = f"{who} is invalid: round {self.round_id} is the newest opened"
            return Admission("invalid", reason, staleness)
        if staleness < 0:
            reason = (
                f"{who} is invalid: base version {c.base_version} is newer than "
                f"version {self.current_version}"
            )
            return Admission("invalid", reason, staleness)
        if staleness > max_staleness:
            reason = (
                f"{who} is stale: base version {c.base_version} is {staleness} behind "
                f"version {self.current_version} > max_staleness {max_staleness}"
            )
            return Admission("stale", reason, staleness)
        old = self._held_of(c.learner_id)
        if old is not None and old.round_id > c.round_id:
            reason = f"{who} is superseded by its round {old.round_id} contribution"
            return Admission("superseded", reason, staleness)
        return None

    def _held_of(self, learner_id: str) -> ContributionMeta | None:
        return next((h for h in self.held if h.learner_id == learner_id), None)

    def without(self, learner_ids: frozenset[str]) -> RoundState:
        """Drop these learners' held contributions (refused after admission: a merge with
        them is not finite). They no longer count toward quorum; their identities stay in
        ``seen``, so a redelivery is a duplicate; those that answered the open round with it
        are ``refused`` in it."""
        answered = {h.learner_id for h in self.held if h.round_id == self.round_id}
        return replace(
            self,
            held=tuple(h for h in self.held if h.learner_id not in learner_ids),
            first_arrivals=tuple(a for a in self.first_arrivals if a[1] not in learner_ids),
            refused=self.refused | (answered & learner_ids),
        )

    def refusing(self, learner_id: str, round_id: int) -> RoundState:
        """A learner's answer to ``round_id`` was settled without being held (refused as
        stale, unreadable, implausible, ...). When it answered the open round and holds
        nothing, it is ``refused`` there: a learner answers a round once, so the round waits
        for nothing more from it. Other rounds' answers change nothing."""
        if round_id != self.round_id or self._held_of(learner_id) is not None:
            return self
        return replace(self, refused=self.refused | {learner_id})

    def reopened(self, *, round_id: int, opened_at_s: float) -> RoundState:
        """Abandon the open round and open ``round_id``, keeping every held contribution.

        Raises:
            CoreError: If ``round_id`` is not after the open round.
        """
        if round_id <= self.round_id:
            raise CoreError(f"reopened round {round_id} must be after round {self.round_id}")
        return replace(self, round_id=round_id, opened_at_s=opened_at_s, refused=frozenset())

    def after_merge(self, *, round_id: int, opened_at_s: float) -> RoundState:
        """Record that the open round merged everything held; open ``round_id`` next.

        The fragment's version becomes ``current_version + 1``.

        Raises:
            CoreError: If nothing is held, or ``round_id`` is not after the merged round.
        """
        if not self.held:
            raise CoreError(f"round {self.round_id} holds no contribution; nothing to merge")
        if round_id <= self.round_id:
            raise CoreError(f"next round {round_id} must be after merged round {self.round_id}")
        return RoundState(
            fragment_id=self.fragment_id,
            round_id=round_id,
            opened_at_s=opened_at_s,
            current_version=self.current_version + 1,
            last_merged_round_id=self.round_id,
            merged=self.seen,
        )

    def view(self) -> RoundView:
        """Project the state for ``policy.decide``."""
        return RoundView(
            fragment_id=self.fragment_id,
            round_id=self.round_id,
            opened_at_s=self.opened_at_s,
            current_version=self.current_version,
            arrivals=tuple((learner, t) for t, learner in self.first_arrivals),
            staleness=tuple(
                (h.learner_id, self.current_version - h.base_version) for h in self.held
            ),
            refused=self.refused,
        )


def _learner_key(c: ContributionMeta) -> str:
    return c.learner_id


def _stale_note(staleness: int) -> str:
    return f" ({staleness} version{'s' if staleness != 1 else ''} stale)" if staleness else ""
