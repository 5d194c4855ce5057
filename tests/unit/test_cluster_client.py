"""Cluster URLs and the fan-out of group reads over slots: pure, no server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dd_queue.bus._fanout import FanOut
from dd_queue.bus._redis_conn import (
    ClusterSeeds,
    RedisOptions,
    client_kwargs,
    cluster_seeds,
    is_cluster_url,
    redact_url,
    seed_url,
    split_password,
)
from dd_queue.bus._replies import fullest_memory_info
from dd_queue.bus.types import MemoryInfo
from dd_queue.errors import ConfigError


def test_cluster_url_names_seeds_user_and_tls() -> None:
    assert cluster_seeds("redis://h:1/0") is None
    assert cluster_seeds("redis+cluster://a:7000,b.example:7001") == ClusterSeeds(
        (("a", 7000), ("b.example", 7001)), None, False
    )
    assert cluster_seeds("rediss+cluster://ops@[::1]:7000/0") == ClusterSeeds(
        (("::1", 7000),), "ops", True
    )
    assert is_cluster_url("rediss+cluster://a:1") and not is_cluster_url("rediss://a:1")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://a", "not host:port"),
        ("redis+cluster://a:7000,b", "not host:port"),
        ("redis+cluster://a:0", "not host:port"),
        ("redis+cluster://a:7000/3", "only database 0"),
        ("redis+cluster://a:7000?x=1", "only database 0"),
    ],
)
def test_bad_cluster_urls_are_refused_with_the_fix(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        cluster_seeds(url)


def test_credentials_leave_a_cluster_url_and_never_show() -> None:
    url, password = split_password("redis+cluster://ops:s%40cret@a:7000,b:7001")
    assert (url, password) == ("redis+cluster://ops@a:7000,b:7001", "s@cret")
    assert redact_url("redis+cluster://ops:x@a:7000,b:7001") == "redis+cluster://a:7000,b:7001"
    assert redact_url("redis://u:p@h:6379/0") == "redis://h:6379/0"
    assert seed_url("rediss+cluster://ops@a:7000,b:7001") == "rediss://ops@a:7000/0"
    assert seed_url("redis://h:1/0") == "redis://h:1/0"


def test_tls_files_need_a_tls_cluster_url() -> None:
    options = RedisOptions(tls_ca_file=__file__)  # type: ignore[arg-type]
    assert client_kwargs("rediss+cluster://a:1", options)["ssl_cert_reqs"] == "required"
    with pytest.raises(ConfigError, match="rediss"):
        client_kwargs("redis+cluster://a:1", options)


def test_the_fullest_master_is_the_limit() -> None:
    raw = {
        "a:1": {"used_memory": 900, "maxmemory": 0},
        "b:2": {"used_memory": 500, "maxmemory": 1000},
        "c:3": {"used_memory": 100, "maxmemory": 1000},
    }
    assert fullest_memory_info(raw) == MemoryInfo(500, 1000)
    assert fullest_memory_info({"a:1": {"used_memory": 7}, "b:2": {"used_memory": 9}}) == (
        MemoryInfo(9, 0)
    )


def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# ── FanOut ──────────────────────────────────────────────────────────────────────────────────
class Slot:
    """A fake slot: entries queued by the test, a blocking read that waits for them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: list[str] = []
        self.cond = threading.Condition()
        self.fail: Exception | None = None

    def put(self, *items: str) -> None:
        with self.cond:
            self.queue.extend(items)
            self.cond.notify_all()

    def read(self, block_ms: int | None) -> list[str]:
        with self.cond:
            if self.fail is not None:
                raise self.fail
            if not self.queue and block_ms:
                self.cond.wait(block_ms / 1000)
            got, self.queue[:] = list(self.queue), []
            return got

    def part(self) -> tuple[str, Callable[[int | None], list[str]]]:
        return self.name, self.read


def test_fanout_returns_what_is_there_in_part_order_without_blocking() -> None:
    a, b = Slot("a"), Slot("b")
    b.put("b1")
    a.put("a1", "a2")
    fan: FanOut[str] = FanOut()
    assert fan.read([a.part(), b.part()], block_ms=5000) == ["a1", "a2", "b1"]
    assert fan.read([a.part(), b.part()], block_ms=None) == []
    assert fan.in_flight == 0


def test_fanout_wakes_on_any_slot_and_hands_out_later_finds_next_time() -> None:
    a, b = Slot("a"), Slot("b")
    fan: FanOut[str] = FanOut()
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(fan.read([a.part(), b.part()], 5000)))
    reader.start()
    _until(lambda: fan.in_flight == 2)
    b.put("b1")
    reader.join(4)
    assert got == ["b1"]
    assert fan.in_flight == 1  # a's read still waits on its slot
    a.put("a1")  # the in-flight read takes it ...
    _until(lambda: fan.in_flight == 0)
    assert fan.read([a.part(), b.part()], block_ms=None) == ["a1"]  # ... and it is not lost
    fan.close()


def test_fanout_error_keeps_the_other_slots_finds() -> None:
    a, b = Slot("a"), Slot("b")
    a.put("a1")
    b.fail = ConnectionError("node down")
    fan: FanOut[str] = FanOut()
    with pytest.raises(ConnectionError):
        fan.read([a.part(), b.part()], block_ms=None)
    b.fail = None
    assert fan.read([a.part(), b.part()], block_ms=None) == ["a1"]


def test_fanout_times_out_empty() -> None:
    fan: FanOut[str] = FanOut()
    assert fan.read([Slot("a").part(), Slot("b").part()], block_ms=50) == []
    fan.close()


# ── the key-to-slot map and ddq slots ───────────────────────────────────────────────────────
def test_even_split_is_redis_cli_s_and_placement_names_every_family() -> None:
    from dd_queue.bus.slots import even_split, placement, run_slots
    from dd_queue.keys import Keys

    assert [n.ranges for n in even_split(3)] == [((0, 5460),), ((5461, 10922),), ((10923, 16383),)]
    slots = run_slots(Keys("cl"), 4)
    assert list(slots)[:4] == [f"fragment {p}" for p in range(4)]
    held = placement(slots, even_split(3))
    assert sorted(f for families in held.values() for f in families) == sorted(slots)
    assert all(any(f.startswith("fragment") for f in fams) for fams in held.values())  # run "cl"


def test_ddq_slots_prints_a_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from dd_queue.cli import main

    assert main(["slots", "--config", "demo", "--masters", "2", "--json"]) == 0
    out = capsys.readouterr().out
    assert "| fragment 0 |" in out and "fragments per master: master 0" in out
    found = json.loads(out.splitlines()[-1])
    assert set(found["fragments_per_master"]) == {"master 0", "master 1"}
    assert main(["slots", "--config", "demo", "--masters", "0"]) == 2


@given(run_id=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True))
def test_run_wide_streams_never_share_fragment_0_s_third_of_the_slots(run_id: str) -> None:
    from redis.crc import key_slot

    from dd_queue.keys import Keys, hash_tag

    keys = Keys(run_id)

    def third(key: str) -> int:
        return key_slot(key.encode()) * 3 // 16384

    home = third(keys.state(0))
    assert third(keys.heartbeat_seen()) == third(keys.opened_rounds()) == (home + 1) % 3
    assert third(keys.events()) == (home + 2) % 3
    assert len({hash_tag(k) for k in (keys.heartbeat_seen(), keys.heartbeat_data())}) == 1
    assert Keys(run_id).events() == keys.events()  # the same in every process


def test_cluster_sizing_scales_with_learners_and_model_over_h(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import cluster_sizing

    one = cluster_sizing.size(
        1e9, 8, step_s=1.0, sync_every=100, bytes_per_param=1.0, sync_ms_per_mb=2.0,
        redis_ms_per_mb=2.0, read_ms_per_mb=0.5, utilization=0.5,
    )  # fmt: skip
    assert one["upstream_mb_s"] == pytest.approx(80.0)  # 8 × 1e9 B / 100 s
    assert one["downstream_mb_s"] == pytest.approx(320.0)
    # Redis: (80 × 1 + 320 × 0.5) ms/s = 0.24 cores at 50% → 1 shard; sync 0.16 / 0.5 cores
    assert one["shards"] == 1 and one["synchronizer_cores"] == pytest.approx(0.32)
    assert cluster_sizing.main(["--sync-every", "1000", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]
    biggest = next(r for r in rows if r["model"] == "70B" and r["learners"] == 512)
    assert biggest["upstream_mb_s"] == pytest.approx(70e9 * 512 * (1 + 4 / 256) / 1000 / 1e6)
