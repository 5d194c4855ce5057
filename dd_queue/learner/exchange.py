"""What the training thread and the background pump hand each other, thread-safely.

Three latest-wins structures (Decoupled DiLoCo, Douillard et al., arXiv 2604.21428: a learner
never waits, so nothing here ever blocks the training thread beyond a short lock):

- ``Outbox`` — at most one *waiting* snapshot per fragment. The training thread ``put``s a
  snapshot at a step boundary; if the previous one of the same fragment was not yet taken by
  the sender, the new one replaces it (latest wins). Host buffers are pooled per fragment, so
  steady state allocates nothing (pinned buffers on CUDA are expensive to allocate).
- ``Inbox`` — at most one *verified* global fragment per fragment waiting to be applied, always
  the newest version (a gap is fine: catch-up by latest). It also remembers the version each
  fragment holds, so the receiver never fetches what is not newer.
- ``RoundBook`` — the newest announced round of every fragment, and (synchronizer-paced mode)
  which fragments were asked for since the last step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

Float32Array = npt.NDArray[np.float32]

log = logging.getLogger("dd_queue.learner")


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """θ_p taken at a step boundary, with what the contribution needs besides Δ.

    Attributes:
        fragment_id: p.
        round_id: The round the contribution answers.
        base_version: Global version of p that the local copy started from.
        base: Θ_p(base_version), exact fp32; never mutated (a new global replaces the object).
        values: Flat fp32 host copy of θ_p (pinned on CUDA; filled asynchronously there).
        ready: Waits until ``values`` is filled (a CUDA event), or None when already filled.
        n_steps: Inner steps since p was last received.
        n_tokens: Tokens trained since then.
        step: The learner's inner-step count when the snapshot was taken.
        taken_at_s: Clock time of the snapshot, seconds.
    """

    fragment_id: int
    round_id: int
    base_version: int
    base: Float32Array
    values: torch.Tensor
    ready: Callable[[], None] | None
    n_steps: int
    n_tokens: int
    step: int
    taken_at_s: float


class Outbox:
    """Per-fragment latest-wins slots of snapshots waiting to be published.

    Args:
        new_buffer: Allocates a flat fp32 host buffer for fragment ``p``.
    """

    def __init__(self, new_buffer: Callable[[int], torch.Tensor]) -> None:
        self._new_buffer = new_buffer
        self._cond = threading.Condition()
        self._waiting: dict[int, Snapshot] = {}
        self._free: dict[int, list[torch.Tensor]] = {}
        self.replaced = 0
        self.published = 0

    def buffer(self, fragment_id: int) -> torch.Tensor:
        """A free host buffer for a snapshot of ``fragment_id`` (pooled)."""
        with self._cond:
            pool = self._free.get(fragment_id)
            if pool:
                return pool.pop()
        return self._new_buffer(fragment_id)

    def put(self, snapshot: Snapshot) -> bool:
        """Queue a snapshot; returns True when it replaced a waiting one of the same fragment."""
        with self._cond:
            old = self._waiting.pop(snapshot.fragment_id, None)
            self._waiting[snapshot.fragment_id] = snapshot  # goes to the back of the line
            if old is not None:
                self.replaced += 1
                self._recycle(old)
            self._cond.notify_all()
        return old is not None

    def take(self, *, block_ms: int = 0) -> Snapshot | None:
        """The snapshot waiting longest, or None after ``block_ms`` (0: do not wait)."""
        with self._cond:
            if not self._waiting and block_ms > 0:
                self._cond.wait(block_ms / 1000)
            if not self._waiting:
                return None
            fragment_id = next(iter(self._waiting))
            return self._waiting.pop(fragment_id)

    def done(self, snapshot: Snapshot, *, published: bool) -> None:
        """Return a taken snapshot's buffer to the pool (after publishing or dropping it)."""
        with self._cond:
            self.published += int(published)
            self._recycle(snapshot)

    def restore(self, snapshot: Snapshot) -> bool:
        """Put a taken snapshot back after a failed send, unless a newer one is waiting.

        Returns:
            True when it waits again; False when a newer one superseded it (it is recycled).
        """
        with self._cond:
            if snapshot.fragment_id in self._waiting:
                self.replaced += 1
                self._recycle(snapshot)
                return False
            self._waiting[snapshot.fragment_id] = snapshot
            self._cond.notify_all()
            return True

    def depth(self) -> int:
        """Snapshots waiting to be published."""
        with self._cond:
            return len(self._waiting)

    def wake(self) -> None:
        """Wake a sender blocked in ``take`` (shutdown)."""
        with self._cond:
            self._cond.notify_all()

    def _recycle(self, snapshot: Snapshot) -> None:
        self._free.setdefault(snapshot.fragment_id, []).append(snapshot.values)


@dataclass(frozen=True, slots=True, kw_only=True)
class Received:
    """A verified global fragment Θ_p(version), waiting to be applied.

    Attributes:
        fragment_id: p.
        version: Its global version.
        round_id: The round that produced it.
        values: Θ_p, fp32, bit-exact as published; owned by the learner from now on.
        received_at_s: Clock time it was verified, seconds.
    """

    fragment_id: int
    version: int
    round_id: int
    values: Float32Array
    received_at_s: float


@dataclass
class Inbox:
    """Newest verified global per fragment, and the version each fragment holds."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _queued: dict[int, Received] = field(default_factory=dict)
    _held: dict[int, int] = field(default_factory=dict)
    superseded: int = 0

    def put(self, received: Received) -> bool:
        """Queue a global if it is newer than what is held and queued; returns whether it was."""
        with self._lock:
            if received.version <= self._known(received.fragment_id):
                return False
            if received.fragment_id in self._queued:
                self.superseded += 1
            self._queued[received.fragment_id] = received
            return True

    def take_all(self) -> list[Received]:
        """Everything queued, by fragment id; the queue is left empty.

        Taken versions count as held at once (the training thread applies them in the same
        step), so the receiver never fetches them a second time in between.
        """
        with self._lock:
            taken = [self._queued[p] for p in sorted(self._queued)]
            self._queued.clear()
            for received in taken:
                self._held[received.fragment_id] = received.version
            return taken

    def queued_versions(self) -> dict[int, int]:
        """Fragment → version waiting to be applied."""
        with self._lock:
            return {p: r.version for p, r in self._queued.items()}

    def hold(self, fragment_id: int, version: int) -> None:
        """Record that ``fragment_id`` now holds ``version`` (the training thread applied it)."""
        with self._lock:
            self._held[fragment_id] = version

    def held(self) -> dict[int, int]:
        """Fragment → version applied to the model."""
        with self._lock:
            return dict(self._held)

    def known_version(self, fragment_id: int) -> int:
        """The newest version held or queued (−1 before the first)."""
        with self._lock:
            return self._known(fragment_id)

    def depth(self) -> int:
        """Globals waiting to be applied."""
        with self._lock:
            return len(self._queued)

    def _known(self, fragment_id: int) -> int:
        queued = self._queued.get(fragment_id)
        return max(self._held.get(fragment_id, -1), queued.version if queued else -1)


@dataclass
class RoundBook:
    """Newest announced round per fragment, and the fragments asked for since the last step."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _latest: dict[int, int] = field(default_factory=dict)
    _opened_at: dict[int, float] = field(default_factory=dict)  # of the newest, when known
    _requested: dict[int, int] = field(default_factory=dict)

    def announce(
        self, fragment_id: int, round_id: int, *, request: bool, opened_at_s: float | None = None
    ) -> bool:
        """Record an opened round; with ``request`` ask for a snapshot of the fragment.

        A fragment's round ids only grow within one history of the run's ``open`` stream (a
        re-read repeats an opening with its time). An id not above the newest, opened *after*
        it (``opened_at_s``), starts a new history: Redis lost the stream and a synchronizer
        restored the fragment from its snapshot, counting its rounds from there. That round
        is taken (ignoring it would leave every round of the new history unanswered until its
        ids passed the lost ones).

        Returns:
            False when the round is ignored: not above the newest, and not opened after it.
        """
        with self._lock:
            latest = self._latest.get(fragment_id, -1)
            if round_id <= latest:
                if not self._opened_after_newest(fragment_id, opened_at_s):
                    return False
                log.warning(
                    "learner.rounds_restarted fragment %d: round %d opened after round %d was; "
                    "the run's rounds start again (Redis lost them; restored from a snapshot)",
                    fragment_id,
                    round_id,
                    latest,
                )
            self._latest[fragment_id] = round_id
            if opened_at_s is None:
                self._opened_at.pop(fragment_id, None)
            else:
                self._opened_at[fragment_id] = opened_at_s
            if request:
                self._requested[fragment_id] = round_id
            return True

    def _opened_after_newest(self, fragment_id: int, opened_at_s: float | None) -> bool:
        before = self._opened_at.get(fragment_id)
        return opened_at_s is not None and before is not None and opened_at_s > before

    def take_requested(self) -> dict[int, int]:
        """Fragment → round asked for since the last call."""
        with self._lock:
            requested, self._requested = self._requested, {}
            return requested

    def latest(self, fragment_id: int) -> int | None:
        """The newest announced round of a fragment, or None."""
        with self._lock:
            return self._latest.get(fragment_id)

    def due(self, fragment_ids: Iterable[int]) -> dict[int, int]:
        """Learner-paced mode: the due fragments that have an announced round → that round."""
        with self._lock:
            return {p: self._latest[p] for p in fragment_ids if p in self._latest}


__all__ = ["Float32Array", "Inbox", "Outbox", "Received", "RoundBook", "Snapshot"]
