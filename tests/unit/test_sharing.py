"""Synchronizers sharing a run (``synchronizer.share: fair``): the pure deal, then two real
Synchronizers on one MemoryBus under a FakeClock (split, takeover after a death, a late joiner)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dd_queue.bus import MemoryBus
from dd_queue.clock import FakeClock
from dd_queue.core.sharing import plan_ownership
from dd_queue.synchronizer import Synchronizer
from tests.synchronizer_support import make_config, tiny_source


def test_whole_shards_are_dealt_round_robin_in_sorted_order() -> None:
    shards = {0: "b:2", 1: "a:1", 2: "c:3", 3: "c:3"}
    deal = plan_ownership(shards, "s1", ["s0"])
    assert deal.live == ("s0", "s1")
    assert deal.owner_of == {0: "s1", 1: "s0", 2: "s0", 3: "s0"}  # a:1, c:3 → s0; b:2 → s1
    assert deal.mine("s1") == {0}
    assert deal.reason == "3 shards dealt among 2 live synchronizers (s0 3, s1 1 of 4 fragments)"
    assert plan_ownership(shards, "s1", []).mine("s1") == {0, 1, 2, 3}  # alone: everything


def test_no_fragments_is_an_error() -> None:
    with pytest.raises(ValueError, match="no fragments"):
        plan_ownership({}, "s0", [])


@given(
    n=st.integers(1, 40),
    names=st.sets(st.sampled_from([f"s{i}" for i in range(8)]), min_size=1),
    per_shard=st.integers(1, 4),
)
def test_every_view_of_the_same_peers_agrees_and_covers_every_fragment(
    n: int, names: set[str], per_shard: int
) -> None:
    shards = {p: f"node{p // per_shard}" for p in range(n)}
    deals = [plan_ownership(shards, me, names - {me}) for me in sorted(names)]
    assert all(d.owner_of == deals[0].owner_of for d in deals)  # they agree without talking
    owned = [deals[0].mine(me) for me in sorted(names)]
    assert sorted(p for mine in owned for p in mine) == list(range(n))  # each exactly once
    for shard in set(shards.values()):  # a shard is never split
        assert len({deals[0].owner_of[p] for p in shards if shards[p] == shard}) == 1


# ── two synchronizers on one bus ────────────────────────────────────────────────────────────
def _sync(bus: MemoryBus, clock: FakeClock, sid: str, n: int = 4) -> Synchronizer:
    sync = Synchronizer(
        make_config(n_fragments=n, share="fair"),
        bus=bus,
        clock=clock,
        synchronizer_id=sid,
        source=tiny_source(),
        wall=clock.now,
    )
    sync.start()
    return sync


def _pump(clock: FakeClock, syncs: list[Synchronizer], seconds: float) -> None:
    end = clock.now() + seconds
    while clock.now() < end:
        for sync in syncs:
            sync.pump()
        clock.advance(0.05)


def test_two_synchronizers_split_then_the_survivor_takes_all_within_the_lease_ttl() -> None:
    clock = FakeClock(1000.0)
    bus = MemoryBus("t", clock=clock)
    a = _sync(bus, clock, "sync-a")
    assert a.owned == {0, 1, 2, 3}  # alone at first: orphans are taken at once
    b = _sync(bus, clock, "sync-b")
    _pump(clock, [a, b], 2.0)
    assert a.owned == {0, 2} and b.owned == {1, 3}  # a handed b its fragments
    died_at = clock.now()  # a stops: no release, no heartbeat (a kill -9)
    ttl = a.ctx.sync.lease_ttl_s
    while b.owned != {0, 1, 2, 3}:
        _pump(clock, [b], 0.05)
        assert clock.now() - died_at <= ttl + 2.0, f"b owns {sorted(b.owned)} only"


def test_a_late_synchronizer_gets_its_share_and_nothing_is_owned_twice() -> None:
    clock = FakeClock(1000.0)
    bus = MemoryBus("t", clock=clock)
    syncs = [_sync(bus, clock, "sync-a", n=5)]
    for sid in ("sync-b", "sync-c"):
        syncs.append(_sync(bus, clock, sid, n=5))
        for _ in range(60):
            _pump(clock, syncs, 0.05)
            owned = [s.owned for s in syncs]
            assert sum(map(len, owned)) == len(set().union(*owned))  # never two owners
    assert [sorted(s.owned) for s in syncs] == [[0, 3], [1, 4], [2]]
