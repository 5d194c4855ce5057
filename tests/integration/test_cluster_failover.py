"""Shard failover on a real Redis Cluster (3 masters + 3 replicas) without losing acknowledged work.

"Acknowledged" is defined by ``redis.commit_replicas``: a fenced commit counts as done only once
that many replicas confirmed it (``WAIT`` on the commit's own connection); short of that the bus
raises ``NotReplicated`` and the committer rebuilds from what Redis holds, as a synchronizer does
after any bus error. Redis replication is asynchronous, so without it a master's crash may take
commits it already answered with it.

A committer here plays a synchronizer on one fragment: each fenced commit takes one contribution
(acks it), writes the fragment's state (version, contributions applied) and appends the version
notice, all in one script. Mid-run the fragment's master is failed over: planned
(``CLUSTER FAILOVER`` on its replica), by SIGKILL, or by SIGKILL while its replica lags (stopped,
its link dropped, so the master's last commits never reached it). Then, on the promoted replica:

* every commit the committer counted as done is there (the state holds it, told apart by a
  nonce from the same version redone after the failover): nothing acknowledged is lost;
* no contribution is applied twice, and every contribution is applied or still pending;
* versions in the state count the contributions applied (no version skipped or repeated);
* commits go on after the failover (after kill -9, once the old master is back as a replica:
  a master without replicas cannot acknowledge anything, so until then every commit is refused
  with ``NotReplicated`` and counts for nothing).

The control case runs the lagging-replica failover with ``commit_replicas: 0``: there commits the
master answered are lost, which is what the setting is for.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from dd_queue.bus import AckOp, AppendOp, RedisBus, RedisOptions, SetOp
from dd_queue.bus.types import Lease
from dd_queue.errors import BusError, NotReplicated
from dd_queue.keys import SYNC_GROUP
from tests.integration.conftest import wait_until
from tests.rediscluster import LocalCluster, redis_cli_path

pytestmark = pytest.mark.timeout(180)

G = SYNC_GROUP
P = 0
CONTRIBUTIONS = 400


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    """A cluster of this test's own: it fails one of its masters."""
    from tests.ci import require
    from tests.integration.conftest import require_redis_server

    require_redis_server()
    require(redis_cli_path(), "redis-cli", "apt-get install redis-tools")
    with LocalCluster() as local:
        yield local


@dataclass
class Committer:
    """Fenced commits of one fragment, one contribution each, rebuilt from Redis after errors."""

    bus: RedisBus
    stop: threading.Event = field(default_factory=threading.Event)
    confirmed: list[tuple[int, str]] = field(default_factory=list)  # (version, commit nonce)
    refused: list[str] = field(default_factory=list)  # why a commit did not count
    rebuilds: int = 0
    done_after_rebuild: int = 0

    def state(self) -> dict[str, object]:
        raw = self.bus.get(self.bus.keys.state(P))
        return {"version": 0, "applied": [], "commits": []} if raw is None else json.loads(raw)

    def run(self) -> None:
        keys, lease = self.bus.keys, None
        state: dict[str, object] = {}
        while not self.stop.is_set():
            try:
                if lease is None:
                    lease = self.bus.acquire_lease(keys.lease(P), "committer", ttl_s=2.0)
                    if lease is None:  # our own lease from before the failover: wait it out
                        time.sleep(0.05)
                        continue
                    state = self.state()
                    entries = self.bus.read_own_pending(keys.up(P), G, "committer", count=1)
                else:
                    entries = []
                entries = entries or self.bus.read_group(
                    keys.up(P), G, "committer", count=1, block_ms=100
                )
                for entry in entries:
                    state = self._commit(lease, state, entry.id, entry.fields["id"].decode())
                lease = self.bus.renew_lease(lease, ttl_s=2.0)
            except NotReplicated as exc:
                self.refused.append(str(exc))
                self.rebuilds, lease = self.rebuilds + 1, None
            except BusError as exc:  # unreachable for a moment, lease lost: rebuild as well
                self.refused.append(f"{type(exc).__name__}: {exc}")
                self.rebuilds, lease = self.rebuilds + 1, None

    def _commit(
        self, lease: Lease, state: dict[str, object], entry_id: str, contribution: str
    ) -> dict[str, object]:
        keys = self.bus.keys
        version = int(state["version"]) + 1  # type: ignore[call-overload]
        applied = [*state["applied"], contribution]  # type: ignore[misc]
        # A merge is not reproducible (another set of contributions, another moment): the
        # nonce tells a commit redone after a failover from the one that was acknowledged.
        nonce = uuid.uuid4().hex
        new = {"version": version, "applied": applied, "commits": [*state["commits"], nonce]}  # type: ignore[misc]
        self.bus.commit(
            lease,
            [
                SetOp(keys.state(P), json.dumps(new).encode()),
                AppendOp(keys.down(P), {"version": str(version).encode()}),
                AckOp(keys.up(P), G, (entry_id,)),
            ],
            commit_id=f"{P}:{version}",
        )
        self.confirmed.append((version, nonce))
        if self.rebuilds:
            self.done_after_rebuild += 1
        return new


def _bus(cluster: LocalCluster, replicas: int) -> RedisBus:
    options = RedisOptions(
        unavailable_after_s=20.0, commit_replicas=replicas, commit_wait_ms=500, max_block_ms=200,
        socket_timeout_s=2.0, connect_timeout_s=0.5,
    )  # fmt: skip
    return RedisBus(cluster.url, "fo", options=options)


@pytest.mark.parametrize(
    ("how", "replicas"),
    [("planned", 1), ("kill-9", 1), ("kill-9-lagging", 1), ("kill-9-lagging", 0)],
    ids=["planned", "kill-9", "kill-9-lagging-replica", "kill-9-lagging-replica-no-wait"],
)
def test_failover_keeps_every_acknowledged_commit_and_applies_none_twice(
    cluster: LocalCluster, how: str, replicas: int
) -> None:
    bus = _bus(cluster, replicas=replicas)
    keys = bus.keys
    bus.ensure_group(keys.up(P), G)
    for i in range(CONTRIBUTIONS):
        bus.append(keys.up(P), {"id": f"c{i}".encode()})
    master = cluster.master_of_key(keys.up(P))
    replica = cluster.replica_of(master)
    committer = Committer(bus)
    thread = threading.Thread(target=committer.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(committer.confirmed) >= 50, 60, "commits before the failover")
        before = len(committer.confirmed)
        if how == "planned":
            cluster.planned_failover(replica)
        elif how == "kill-9":
            cluster.kill(master)
        else:  # the replica misses the master's last writes, then the master dies
            refused = len(committer.refused)
            cluster.cut_off(replica, master)
            wait_until(lambda: cluster.replicas_connected(master) == 0, 10, "the link dropped")
            wait_until(
                lambda: len(committer.confirmed) >= before + 20 or len(committer.refused) > refused,
                30,
                "commits while the replica misses them",
            )
            cluster.kill(master)
            before = len(committer.confirmed)
            cluster.thaw(replica)
        cluster.wait_promoted(replica, timeout_s=30)
        assert cluster.master_of_key(keys.up(P)) == replica
        if how != "planned":
            # The promoted master has no replica left, so nothing it commits can be
            # acknowledged (commits are refused with NotReplicated) until the old master is
            # back: restarted, it rejoins as the new master's replica.
            cluster.node(master).start()
            cluster.wait_healthy(30)
        wait_until(
            lambda: committer.done_after_rebuild >= 20 or len(committer.confirmed) >= before + 60,
            60,
            "commits after the failover",
        )
    finally:
        committer.stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()

    state = Committer(_bus(cluster, replicas=0)).state()  # what the promoted master holds
    applied = list(state["applied"])  # type: ignore[call-overload]
    assert len(applied) == len(set(applied)), "a contribution applied twice"
    assert state["version"] == len(applied), "versions must count the contributions applied"
    kept = set(state["commits"])  # type: ignore[call-overload]
    lost = [(v, nonce) for v, nonce in committer.confirmed if nonce not in kept]
    if replicas:
        assert not lost, f"acknowledged commits lost in the failover: {lost[:5]}"
    else:  # the control: the master's reply alone is no acknowledgement
        assert lost, "a lagging replica promoted, yet no commit the master answered was lost"
    pending = bus.pending_summary(keys.up(P), G).count
    unread = CONTRIBUTIONS - len(applied) - pending
    assert unread >= 0, "more contributions than were appended"
    assert len(committer.confirmed) > before, "no commit after the failover"
    bus.close()
