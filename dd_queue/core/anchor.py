"""Re-anchoring contributions made against older global versions (Decoupled DiLoCo, step 3).

The paper anchors every outer gradient at the synchronizer's current Θ_p: Δ_m = Θ_p(now) − θ_m.
A learner sends Δ_m against its own base version b, so the synchronizer moves it with
Θ_p(now) − Θ_p(b) + Δ_m, using a ``VersionRing`` of recent global versions of the fragment
(Douillard et al., arXiv 2604.21428). If b has left the ring, the contribution is dropped and the
returned ``Anchoring`` says why. ``anchor="learner"`` keeps Δ_m as sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from dd_queue.core.blockwise import add_into, shares_memory
from dd_queue.core.merge import F32, ContributionData
from dd_queue.errors import CoreError

__all__ = ["Anchoring", "VersionRing", "anchor_contributions", "re_anchor"]


class VersionRing:
    """The last ``capacity`` global versions Θ_p(v) of one fragment, in preallocated slots.

    Push the initial version and every new one after its outer step; the latest is "now" for
    :func:`re_anchor`. Versions must rise. ``get`` returns a read-only view (None if absent).
    """

    __slots__ = ("_slots", "_where")

    def __init__(self, *, capacity: int, size: int) -> None:
        if capacity < 1 or size < 0:
            raise CoreError(f"VersionRing needs capacity ≥ 1 and size ≥ 0, got {capacity}, {size}")
        self._slots: F32 = np.empty((capacity, size), dtype=np.float32)
        self._where: dict[int, int] = {}  # version → slot, oldest first

    @property
    def versions(self) -> tuple[int, ...]:
        """Versions held, oldest first."""
        return tuple(self._where)

    @property
    def latest_version(self) -> int | None:
        """The newest version, or None when empty."""
        return next(reversed(self._where), None)

    def push(self, version: int, params: F32) -> None:
        """Copy ``params`` in as ``version``, evicting the oldest when full.

        Raises:
            CoreError: ``version`` is not newer than the latest, or the shape is wrong.
        """
        latest = self.latest_version
        if latest is not None and version <= latest:
            raise CoreError(f"version {version} is not newer than v{latest}; versions only rise")
        if params.shape != self._slots.shape[1:]:
            raise CoreError(f"params of shape {params.shape}; the ring holds {self._slots.shape}")
        if len(self._where) < len(self._slots):
            slot = len(self._where)
        else:
            slot = self._where.pop(next(iter(self._where)))
        np.copyto(self._slots[slot], params, casting="same_kind")
        self._where[version] = slot

    def get(self, version: int) -> F32 | None:
        """Θ_p(version) as a read-only view (valid until that version is evicted), or None."""
        slot = self._where.get(version)
        if slot is None:
            return None
        view: F32 = self._slots[slot]
        view.flags.writeable = False
        return view


@dataclass(frozen=True, slots=True)
class Anchoring:
    """What anchoring did to one contribution: the anchored one (None if dropped) and why."""

    learner_id: str
    contribution: ContributionData | None
    reason: str

    @property
    def dropped(self) -> bool:
        """True when the contribution cannot be anchored and must not be merged."""
        return self.contribution is None


def re_anchor(contrib: ContributionData, ring: VersionRing, *, out: F32 | None = None) -> Anchoring:
    """Move Δ_m from its base version b to the ring's latest: Θ_p(now) − Θ_p(b) + Δ_m.

    Args:
        contrib: The contribution, made against ``contrib.base_version``.
        ring: Recent global versions of its fragment; the latest is "now".
        out: Buffer for the re-anchored Δ (a new array when None; unused if b is current).

    Returns:
        The anchored contribution (``base_version`` = now), or a drop with its reason when b has
        left the ring (too stale) or is newer than now.

    Raises:
        CoreError: The ring is empty, or Δ_m or ``out`` does not match it.
    """
    now, base, who = ring.latest_version, contrib.base_version, contrib.learner_id
    if now is None:
        raise CoreError("the version ring is empty; push the current global version first")
    if base == now:
        return Anchoring(who, contrib, f"{who}: base v{base} is current")
    if base > now:
        return Anchoring(who, None, f"{who}: base v{base} is newer than current v{now}; dropped")
    old = ring.get(base)
    if old is None:
        held = ring.versions
        why = f"{who}: base v{base} left the ring (holds v{held[0]}..v{now}); dropped as too stale"
        return Anchoring(who, None, why)
    cur = ring.get(now)
    if cur is None or contrib.delta.shape != cur.shape:
        raise CoreError(f"{who}: delta shape {contrib.delta.shape} does not match the ring's")
    dst = np.empty_like(cur) if out is None else out
    shared = any(shares_memory(dst, x) for x in (cur, old, contrib.delta))
    if dst.shape != cur.shape or dst.dtype != np.float32 or shared:
        raise CoreError(f"{who}: out must be a separate float32 buffer of shape {cur.shape}")
    np.subtract(cur, old, out=dst)
    add_into(dst, contrib.delta)  # (a Blockwise Δ is dequantised piece by piece)
    # the norms (if any) were of the old Δ
    anchored = replace(contrib, delta=dst, base_version=now, sq_norms=None)
    return Anchoring(who, anchored, f"{who}: re-anchored from v{base} to v{now}")


def anchor_contributions(
    contribs: Iterable[ContributionData],
    ring: VersionRing | None,
    *,
    anchor: Literal["synchronizer", "learner"] = "synchronizer",
) -> tuple[tuple[ContributionData, ...], tuple[Anchoring, ...]]:
    """Anchor every contribution; return the ones to merge and every outcome (for the record).

    ``anchor="learner"`` keeps each Δ_m against its own base (``ring`` may be None).

    Raises:
        CoreError: Synchronizer anchoring without a ring, or as :func:`re_anchor`.
    """
    outcomes: list[Anchoring] = []
    for c in contribs:
        if anchor == "learner":
            outcomes.append(Anchoring(c.learner_id, c, f"{c.learner_id}: learner anchoring"))
        elif ring is None:
            raise CoreError("synchronizer anchoring needs the fragment's VersionRing")
        else:
            outcomes.append(re_anchor(c, ring))
    kept = tuple(o.contribution for o in outcomes if o.contribution is not None)
    return kept, tuple(outcomes)
