"""What a fragment's ``state`` key holds: everything a synchronizer needs to continue exactly.

The state is small: versions, digests, counters, EMAs and *references* to the blobs that hold
Θ_p (the current global fragment, and the recent versions kept for re-anchoring) and the outer
momentum. It is written only by a fenced commit, together with what the commit publishes, so
the committed state and the published versions never disagree. A new or restarted synchronizer
loads it, fetches the blobs and continues with the next version.

Counters are exact: they change only inside the same commit that settles the entries they
count (``contributions`` by outcome, ``rounds`` by decision, bytes in and out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

from dd_queue.bus import BlobRef
from dd_queue.core.codec import TensorHeader
from dd_queue.core.fragments import Fragment, Segment
from dd_queue.core.policy import Ema, Estimates
from dd_queue.errors import CorruptPayload
from dd_queue.messages import Message, MessageLimits
from dd_queue.wire import require_text

__all__ = ["FragmentState", "SegmentRecord", "VersionRef", "fragment_of", "segments_of"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SegmentRecord:
    """One tensor of the fragment, in layout order: name, shape, merged by weighted mean."""

    name: str
    shape: tuple[int, ...]
    is_embedding: bool


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VersionRef:
    """A global version of the fragment: the blob reference of Θ_p and its fp32 header."""

    version: int
    blob: str  # BlobRef.to_bytes().decode()
    tensor: TensorHeader

    @property
    def ref(self) -> BlobRef:
        """The parsed blob reference."""
        return BlobRef.from_bytes(self.blob.encode())


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FragmentState(Message):
    """The committed state of one fragment (stored in ``keys.state(fragment_id)``).

    Attributes:
        fragment_id: The fragment p.
        n_fragments: P of the plan this fragment belongs to.
        plan_digest: ``FragmentPlan.digest`` of the whole plan (learners check theirs).
        config_digest: Digest of the config the run was created or last continued with.
        segments: The fragment's tensors in layout order.
        version: Global version v of Θ_p (0 after run creation; +1 per merge).
        last_merged_round_id: The fragment's last merged round, or None before the first.
        ring: Recent versions (oldest first, the current one last) with their Θ_p blobs; the
            last one is Θ_p(v).
        momentum: Blob reference of the outer Nesterov state after version v.
        quorum_ema_s: ξ_quorum, seconds from a round's opening to its quorum (None: no sample).
        sync_ema_s: ξ_sync, seconds from the merge decision to the committed version.
        ema_samples: Samples folded into (quorum_ema_s, sync_ema_s).
        counters: Exact totals: ``merged``, ``superseded``, ... per outcome, ``dead_lettered``,
            ``rounds_merged``, ``rounds_abandoned``, ``bytes_in``, ``bytes_out``.
        last_reason: Reason of the last decision that committed (merge or abandon).
        committed_by: Synchronizer id of the last commit.
    """

    TYPE: ClassVar[str] = "fragment_state"
    run_id: str
    fragment_id: int
    n_fragments: int
    plan_digest: str
    config_digest: str
    segments: tuple[SegmentRecord, ...]
    version: int
    last_merged_round_id: int | None
    ring: tuple[VersionRef, ...]
    momentum: str
    quorum_ema_s: float | None
    sync_ema_s: float | None
    ema_samples: tuple[int, ...]
    counters: dict[str, int]
    last_reason: str
    committed_by: str

    def _validate(self, limits: MessageLimits) -> None:
        require_text(self, "run_id", "plan_digest", "config_digest", "momentum")
        if not self.ring or self.ring[-1].version != self.version:
            raise CorruptPayload(
                f"fragment {self.fragment_id} state: the ring must end with version "
                f"{self.version}, got {[r.version for r in self.ring]}"
            )
        versions = [r.version for r in self.ring]
        if versions != sorted(set(versions)):
            raise CorruptPayload(f"fragment {self.fragment_id} ring versions {versions} must rise")
        if len(self.ema_samples) != 2:
            raise CorruptPayload("ema_samples must hold (quorum, sync) sample counts")
        for r in self.ring:
            r.ref  # noqa: B018 -- parses (raises CorruptPayload on a bad reference)
        BlobRef.from_bytes(self.momentum.encode())

    @property
    def theta_ref(self) -> BlobRef:
        """Blob of Θ_p at ``version``."""
        return self.ring[-1].ref

    @property
    def momentum_ref(self) -> BlobRef:
        """Blob of the outer momentum after ``version``."""
        return BlobRef.from_bytes(self.momentum.encode())

    def estimates(self, step: Ema) -> Estimates:
        """The policy's ξ estimates: ξ_step from ``step``, ξ_quorum and ξ_sync from here."""
        quorum = Ema(self.quorum_ema_s, self.ema_samples[0])
        sync = Ema(self.sync_ema_s, self.ema_samples[1])
        return Estimates(step_s=step, quorum_s=quorum, sync_s=sync)

    def with_estimates(self, estimates: Estimates) -> FragmentState:
        """A copy holding ``estimates``' ξ_quorum and ξ_sync."""
        return dataclasses.replace(
            self,
            quorum_ema_s=estimates.quorum_s.value,
            sync_ema_s=estimates.sync_s.value,
            ema_samples=(estimates.quorum_s.n_samples, estimates.sync_s.n_samples),
        )

    def counted(self, increments: Mapping[str, int]) -> FragmentState:
        """A copy with ``increments`` added to the counters (zeros are left out)."""
        counters = dict(self.counters)
        for name, n in increments.items():
            if n:
                counters[name] = counters.get(name, 0) + n
        return dataclasses.replace(self, counters=counters)


def segments_of(fragment: Fragment) -> tuple[SegmentRecord, ...]:
    """The records of a planned fragment's segments."""
    return tuple(
        SegmentRecord(name=s.name, shape=s.shape, is_embedding=s.is_embedding)
        for s in fragment.segments
    )


def fragment_of(state: FragmentState) -> Fragment:
    """The fragment's layout, rebuilt from its state (segments laid out back to back)."""
    segments: list[Segment] = []
    start = 0
    for record in state.segments:
        size = 1
        for dim in record.shape:
            size *= dim
        segments.append(
            Segment(record.name, start, start + size, record.shape, record.is_embedding)
        )
        start += size
    return Fragment(index=state.fragment_id, segments=tuple(segments), size=start)
