"""Where a run's keys live on a Redis Cluster: the slot of each key family, and which node holds
it, given the nodes' slot ranges (pure: no server).

Each fragment's keys share one hash tag (``{<run>.f<k>}``), so a fragment is one slot. The
heartbeats, round openings and events are placed away from fragment 0's third of the slots
(``dd_queue.keys``: on 3 masters, never on fragment 0's master); the control streams and
counters hash by their whole names, like any other keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from redis.crc import key_slot

from dd_queue.keys import Keys

N_SLOTS = 16384


def run_slots(keys: Keys, n_fragments: int) -> dict[str, int]:
    """Key family → slot: ``fragment <k>`` for each fragment, then the run-wide keys."""
    families = {f"fragment {k}": keys.state(k) for k in range(n_fragments)}
    families.update(
        {
            "heartbeats": keys.heartbeat_seen(),
            "events": keys.events(),
            "openings": keys.opened_rounds(),
            "control:all": keys.control("all"),
            "counts:tokens": keys.counts("tokens"),
        }
    )
    return {name: key_slot(key.encode()) for name, key in families.items()}


@dataclass(frozen=True, slots=True)
class NodeSlots:
    """A master and the slot ranges it serves (inclusive)."""

    node: str
    ranges: tuple[tuple[int, int], ...]

    def holds(self, slot: int) -> bool:
        return any(lo <= slot <= hi for lo, hi in self.ranges)


def even_split(n_masters: int) -> list[NodeSlots]:
    """The ranges ``redis-cli --cluster create`` gives ``n_masters`` masters (an even split)."""
    step = N_SLOTS / n_masters
    return [
        NodeSlots(f"master {i}", ((round(i * step), round((i + 1) * step) - 1),))
        for i in range(n_masters)
    ]


def placement(slots: Mapping[str, int], nodes: Sequence[NodeSlots]) -> dict[str, list[str]]:
    """Node → the key families it holds (every node listed, in ``nodes`` order)."""
    held: dict[str, list[str]] = {n.node: [] for n in nodes}
    for family, slot in slots.items():
        owner = next((n.node for n in nodes if n.holds(slot)), None)
        if owner is None:
            raise ValueError(f"no node serves slot {slot} ({family})")
        held[owner].append(family)
    return held


__all__ = ["N_SLOTS", "NodeSlots", "even_split", "placement", "run_slots"]
