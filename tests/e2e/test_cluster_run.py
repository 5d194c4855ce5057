"""Runs on a real Redis Cluster (3 masters + 3 replicas), the services as separate ``ddq``
processes given only a ``redis+cluster://`` URL.

One synchronizer, evaluator, control plane and 3 learners: rounds merge with every learner's
contributions, and the fragments' keys really sit on all three masters (each master's own
keyspace, asked without the cluster client, holds the state of the fragments the key-to-slot map
puts there).

Two synchronizers sharing the run (``synchronizer.share: fair``): each owns whole shards; after
kill -9 of one, the other owns every fragment within the lease TTL + 2 s (from the kill to its
last lease acquisition, in its log) and merges go on."""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path

import pytest
import redis

from dd_queue.bus.slots import NodeSlots, placement, run_slots
from dd_queue.keys import Keys
from tests.ci import require
from tests.e2e.services_support import Services
from tests.integration.conftest import require_redis_server
from tests.rediscluster import LocalCluster, redis_cli_path

pytestmark = pytest.mark.timeout(400)

RUN = "cl"
FRAGMENTS = 4  # run "cl" puts them on all three masters (1, 1 and 2)
LEARNERS = ("L0", "L1", "L2")


def test_services_train_on_a_cluster_with_fragments_on_every_master(tmp_path: Path) -> None:
    require_redis_server()
    require(redis_cli_path(), "redis-cli", "apt-get install redis-tools")
    with LocalCluster() as cluster:
        services = Services(tmp_path, cluster.url, run_id=RUN)
        services.env["DDQ__SYNCHRONIZER__N_FRAGMENTS"] = str(FRAGMENTS)
        services.env["DDQ__MEMBERSHIP__EXPECTED_LEARNERS"] = str(len(LEARNERS))
        try:
            for role in ("synchronizer", "evaluator", "control"):
                services.start(role)
            for learner in LEARNERS:
                services.start("learner", learner)
            services.wait_for(lambda: services.merging(LEARNERS), 300, "merges on the cluster")
            state = services.state()
            assert state["rounds_merged"] >= 2

            masters = cluster.masters()
            nodes = [NodeSlots(str(m.port), m.slots) for m in masters]
            slots = run_slots(Keys(RUN), FRAGMENTS)
            fragments = {k: v for k, v in slots.items() if k.startswith("fragment")}
            held = placement(fragments, nodes)
            assert all(held.values()), f"a master without fragments: {held}"
            keys = Keys(RUN)
            for node in nodes:  # each master's own keyspace has its fragments' state
                client = cluster.client(int(node.node))
                try:
                    for k in range(FRAGMENTS):
                        if f"fragment {k}" in held[node.node]:
                            assert client.exists(keys.state(k)) == 1, (node.node, k)
                        else:  # the master sends us to the fragment's owner
                            with pytest.raises(redis.exceptions.MovedError) as moved:
                                client.exists(keys.state(k))
                            owner = str(moved.value).rpartition(":")[2]
                            assert f"fragment {k}" in held[owner], (moved.value, held)
                finally:
                    client.close()
        finally:
            services.close()
    assert services.exit_codes == dict.fromkeys(services.procs, 0), services.logs()


LEASE_TTL_S = 2.0  # write_config's synchronizer.lease_ttl_s
_ACQUIRED = re.compile(r"^(\S+ \S+) INFO .*lease\.acquired fragment (\d+) token", re.M)


def _owners(services: Services) -> dict[str, set[int]]:
    """Synchronizer id → the fragments its last heartbeat says it owns (control plane)."""
    return {
        s["synchronizer_id"]: {int(p) for p in s["fragments"]}
        for s in services.state()["synchronizers"]
        if s["heartbeat_age_s"] < 1.0
    }


def test_two_synchronizers_split_the_shards_and_one_takes_all_after_a_kill(
    tmp_path: Path,
) -> None:
    require_redis_server()
    require(redis_cli_path(), "redis-cli", "apt-get install redis-tools")
    with LocalCluster() as cluster:
        services = Services(tmp_path, cluster.url, run_id=RUN)
        services.env["DDQ__SYNCHRONIZER__N_FRAGMENTS"] = str(FRAGMENTS)
        services.env["DDQ__SYNCHRONIZER__SHARE"] = "fair"
        services.env["DDQ__MEMBERSHIP__EXPECTED_LEARNERS"] = str(len(LEARNERS))
        try:
            for sid in ("sync-a", "sync-b"):
                services.start("synchronizer", name=sid, extra=["--id", sid])
            services.start("evaluator")
            services.start("control")
            for learner in LEARNERS:
                services.start("learner", learner)

            shard = {p: cluster.master_of_key(Keys(RUN).state(p)) for p in range(FRAGMENTS)}

            def split() -> dict[str, set[int]] | None:
                """The settled deal: both own fragments, each fragment once, whole shards."""
                owners = _owners(services)
                mine = [owners.get(sid, set()) for sid in ("sync-a", "sync-b")]
                whole = all(mine) and sorted(mine[0] | mine[1]) == list(range(FRAGMENTS))
                by_shard = all(
                    {shard[p] for p in fragments}.isdisjoint(
                        shard[p] for p in set(range(FRAGMENTS)) - fragments
                    )
                    for fragments in mine
                )
                return owners if whole and by_shard and not mine[0] & mine[1] else None

            owners = services.wait_for(split, 120, "both synchronizers owning whole shards")
            services.wait_for(lambda: services.merging(LEARNERS), 300, "merges, two syncs")

            orphans = owners["sync-a"]
            services.procs["sync-a"].kill()  # kill -9
            killed_at = time.time()
            services.procs["sync-a"].wait()
            del services.procs["sync-a"]
            services.wait_for(
                lambda: _owners(services).get("sync-b") == set(range(FRAGMENTS)),
                60,
                "sync-b owning every fragment",
            )
            taken = {
                int(p): datetime.strptime(at, "%Y-%m-%d %H:%M:%S,%f").timestamp()
                for at, p in _ACQUIRED.findall(services.log("sync-b"))
            }
            took_s = max(taken[p] for p in orphans) - killed_at
            assert took_s <= LEASE_TTL_S + 2.0, f"took {took_s:.2f} s"
            merged = services.state()["rounds_merged"]
            services.wait_for(
                lambda: services.state()["rounds_merged"] >= merged + 2 * FRAGMENTS,
                120,
                "merges after the takeover",
            )
        finally:
            services.close()
    assert services.exit_codes == dict.fromkeys(services.procs, 0), services.logs()
