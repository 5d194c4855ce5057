"""Which synchronizer owns which fragment when several share a run (``synchronizer.share: fair``).

Pure: no bus, no clock. Every synchronizer computes the same answer from the same inputs, the
live synchronizers (fresh heartbeats) and each fragment's shard (its Redis Cluster master, or
the fragment itself on one Redis), so they agree without talking to each other:

* shards are sorted by name and dealt round-robin to the live synchronizers, sorted by id: a
  synchronizer owns whole shards, so its merges go to "its" masters;
* a synchronizer takes the free fragments of its shards, and releases a fragment it holds that
  belongs to a live peer (that peer takes it next);
* a peer whose heartbeat went stale drops out of the live set, its shards are dealt again, and
  the survivors take its fragments as soon as its leases expire.

The leases stay the only guard: two synchronizers that briefly disagree (one saw a peer that the
other did not yet) may both try a fragment, and only one gets its lease.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Ownership", "plan_ownership"]


@dataclass(frozen=True, slots=True)
class Ownership:
    """Who should own each fragment, and why.

    Attributes:
        owner_of: Fragment → the synchronizer that should own it.
        live: The synchronizers it was dealt among, sorted.
        reason: One line for logs, events and the dashboard.
    """

    owner_of: Mapping[int, str]
    live: tuple[str, ...]
    reason: str

    def mine(self, me: str) -> frozenset[int]:
        """The fragments ``me`` should own."""
        return frozenset(p for p, owner in self.owner_of.items() if owner == me)


def plan_ownership(shards: Mapping[int, str], me: str, peers: Iterable[str]) -> Ownership:
    """Deal the shards of ``shards`` (fragment → shard name) among ``me`` and ``peers``.

    Raises:
        ValueError: No fragments.
    """
    if not shards:
        raise ValueError("no fragments to share")
    live = tuple(sorted({me, *peers}))
    names = sorted(set(shards.values()))
    dealer = {shard: live[i % len(live)] for i, shard in enumerate(names)}
    owner_of = {p: dealer[shard] for p, shard in sorted(shards.items())}
    counts = {sid: sum(o == sid for o in owner_of.values()) for sid in live}
    spread = ", ".join(f"{sid} {n}" for sid, n in counts.items())
    reason = (
        f"{len(names)} shards dealt among {len(live)} live synchronizers "
        f"({spread} of {len(owner_of)} fragments)"
    )
    return Ownership(owner_of, live, reason)
