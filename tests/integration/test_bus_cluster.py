"""What only a Redis Cluster shows: lease names need a hash tag, memory is the fullest master's,
and ``ddq slots --live`` reads the cluster's own slot map (the session's local cluster)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from dd_queue.bus import InvalidArgument, RedisBus, RedisOptions
from dd_queue.cli import main
from dd_queue.keys import Keys
from tests.rediscluster import LocalCluster


@pytest.fixture
def cluster_bus(redis_cluster: LocalCluster) -> Iterator[RedisBus]:
    redis_cluster.flush()
    bus = RedisBus(redis_cluster.url, "cl", options=RedisOptions(unavailable_after_s=5.0))
    yield bus
    bus.close()


def test_a_lease_without_hash_tag_is_refused_with_the_fix(cluster_bus: RedisBus) -> None:
    assert cluster_bus.cluster
    with pytest.raises(InvalidArgument, match=r"no hash tag.*Keys\.lease"):
        cluster_bus.acquire_lease("plain-lease", "sync-0", ttl_s=5)
    lease = cluster_bus.acquire_lease(cluster_bus.keys.lease(0), "sync-0", ttl_s=5)
    assert lease is not None


def test_memory_and_shards_come_from_the_masters(
    cluster_bus: RedisBus, redis_cluster: LocalCluster
) -> None:
    info = cluster_bus.memory_info()
    assert info is not None and info.used_bytes > 0
    for p in range(4):
        key = cluster_bus.keys.state(p)
        assert cluster_bus.shard_of(key) == f"127.0.0.1:{redis_cluster.master_of_key(key)}"
    ranges = cluster_bus.slot_ranges()
    assert sum(hi - lo + 1 for (lo, hi), _ in ranges) == 16384


def test_ddq_slots_live_matches_where_the_cluster_puts_the_keys(
    redis_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DDQ__REDIS__URL", redis_cluster.url)
    monkeypatch.setenv("DDQ__RUN__RUN_ID", "cl")
    monkeypatch.setenv("DDQ__SYNCHRONIZER__N_FRAGMENTS", "8")
    assert main(["slots", "--config", "base", "--live", "--json"]) == 0
    found = json.loads(capsys.readouterr().out.splitlines()[-1])
    keys = Keys("cl")
    for p in range(8):
        port = redis_cluster.master_of_key(keys.state(p))
        assert found["master_of"][f"fragment {p}"] == f"127.0.0.1:{port}"
    assert sum(found["fragments_per_master"].values()) == 8
