"""A run on a real Redis Cluster (3 masters + 3 replicas): the services as separate ``ddq``
processes (synchronizer, evaluator, control plane, 3 learners) given only a
``redis+cluster://`` URL. Rounds merge with every learner's contributions, and the fragments'
keys really sit on all three masters: each master's own keyspace (asked without the cluster
client) holds the state of the fragments the key-to-slot map puts there."""

from __future__ import annotations

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
