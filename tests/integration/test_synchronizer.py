"""The synchronizer against a real redis-server, in real time, with scripted learner stand-ins.

The same ``Synchronizer`` the service runs (``RedisBus`` + ``SystemClock``), pumped by the test:
quorum and grace window as the core policy says, invalid and NaN contributions dead-lettered
with reasons and never merged, a stale lease holder fenced, export and re-seeding, the evaluator.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest
import yaml

from dd_queue.bus import RedisBus
from dd_queue.cli import main as ddq_main
from dd_queue.clock import SystemClock
from dd_queue.synchronizer import Synchronizer, plan_of
from dd_queue.synchronizer.evaluator import Evaluator
from dd_queue.synchronizer.export import export_model, load_export
from dd_queue.synchronizer.service import serve
from tests.integration.conftest import wait_until
from tests.synchronizer_support import (
    beat,
    contribute,
    dead_letters,
    latest_global,
    make_config,
    pending_count,
    records,
    settled_outcomes,
    state_of,
    tiny_source,
    versions_published,
    with_nan,
)


def start(bus, cfg, sid: str = "sync-0", **kw) -> Synchronizer:
    sync = Synchronizer(
        cfg,
        bus=bus,
        clock=SystemClock(),
        synchronizer_id=sid,
        source=kw.pop("source", tiny_source()),
        **kw,
    )
    sync.start()
    return sync


def pump_until(sync: Synchronizer, predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        sync.pump(block_ms=20)


def announced_round(sync: Synchronizer, fragment: int) -> int:
    status = {s.fragment_id: s for s in sync.status()}
    pump_until(
        sync,
        lambda: {s.fragment_id: s for s in sync.status()}[fragment].announced,
        5.0,
        "a round opening",
    )
    status = {s.fragment_id: s for s in sync.status()}
    return status[fragment].round_id


def size_of(cfg, fragment: int) -> int:
    return plan_of(tiny_source(), cfg.synchronizer).fragments[fragment].size


def test_quorum_and_grace_window_follow_the_core_policy(bus, run_id):
    cfg = make_config(run_id, quorum=1, grace_cap_s=0.6, round_timeout_s=5.0)
    for learner in ("L0", "L1"):
        beat(bus, cfg, learner)
    sync = start(bus, cfg)
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    keep_alive = threading.Event()

    def beats() -> None:
        while not keep_alive.wait(0.05):
            beat(bus, cfg, "L0"), beat(bus, cfg, "L1")

    thread = threading.Thread(target=beats, daemon=True)
    thread.start()
    try:
        r = announced_round(sync, 0)
        contribute(
            bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta
        )
        pump_until(sync, lambda: sync.versions()[0] == 1, 5.0, "the grace-window merge")
        [grace] = records(bus, cfg, 0)
        assert "grace window 0.6 s" in grace.reason and "missing L1" in grace.reason
        assert 0.55 <= grace.closed_at_s - grace.quorum_at_s < 1.5
        r = announced_round(sync, 0)
        for learner in ("L0", "L1"):
            contribute(
                bus, cfg, learner_id=learner, fragment_id=0, round_id=r, base_version=1, delta=delta
            )
        pump_until(sync, lambda: sync.versions()[0] == 2, 5.0, "the fast-path merge")
        fast = records(bus, cfg, 0)[-1]
        assert "all live learners contributed (L0, L1)" in fast.reason
        assert fast.closed_at_s - fast.quorum_at_s < 0.5
    finally:
        keep_alive.set()
        thread.join()
        sync.close()


def test_an_overflowing_contribution_is_dead_lettered_and_merging_goes_on(bus, run_id):
    """Finite values near float32's max pass intake, but the outer step overflows: the round
    refuses that contribution with its reason instead of ending the process, and the next
    rounds merge."""
    cfg = make_config(run_id, quorum=1, grace_cap_s=0.0)
    sync = start(bus, cfg)
    size = size_of(cfg, 0)
    r = announced_round(sync, 0)
    bad = contribute(
        bus,
        cfg,
        learner_id="L1",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.full(size, 3e38, np.float32),
    )
    pump_until(sync, lambda: len(dead_letters(bus, 0)) == 1, 10.0, "the overflow dead-lettered")
    (letter,) = dead_letters(bus, 0)
    assert letter.fields["ddq.dlq.id"].decode() == bad
    assert letter.fields["ddq.dlq.reason"].decode().startswith("overflow: merged alone"), letter
    _merge_one(sync, bus, cfg, "L0", 0)
    msg, theta = latest_global(bus, cfg, 0)
    assert msg.version >= 1 and np.isfinite(theta).all()
    assert versions_published(bus, cfg, 0) == list(range(msg.version + 1))


def test_an_implausible_token_count_is_dead_lettered_not_weighted(bus, run_id):
    """2^62 tokens in 4 steps would take all the weight of its round: refused as implausible,
    while an honest contribution of the same round merges."""
    cfg = make_config(run_id, quorum=1, grace_cap_s=0.5, round_timeout_s=5.0)
    for learner in ("L0", "L1"):
        beat(bus, cfg, learner)
    sync = start(bus, cfg)
    size = size_of(cfg, 0)
    r = announced_round(sync, 0)
    forged = contribute(
        bus,
        cfg,
        learner_id="L1",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.full(size, 0.5, np.float32),
        n_tokens=2**62,
    )
    contribute(
        bus,
        cfg,
        learner_id="L0",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.full(size, 0.01, np.float32),
    )
    pump_until(sync, lambda: bool(records(bus, cfg, 0)), 10.0, "the round to close")
    (letter,) = dead_letters(bus, 0)
    assert letter.fields["ddq.dlq.id"].decode() == forged
    assert letter.fields["ddq.dlq.reason"].decode().startswith("implausible: 4611686018427387904")
    (record,) = records(bus, cfg, 0)
    assert [c.learner_id for c in record.contributors] == ["L0"], record


def test_more_steps_than_time_allows_are_dead_lettered_before_and_after_a_restart(bus, run_id):
    """At most ``max_steps_per_s`` steps a second since the base version was published (bus
    clock): a claim of 10^6 steps moments after v0's notice is refused as implausible while an
    honest one merges. After a restart the current version's publication comes from its
    ``down`` notice, so the bound still holds for contributions based on it."""
    cfg = make_config(run_id, quorum=1, grace_cap_s=0.0, max_steps_per_s=100.0)
    sync = start(bus, cfg)
    size = size_of(cfg, 0)
    for restarted in (False, True):
        version = latest_global(bus, cfg, 0)[0].version
        r = announced_round(sync, 0)
        forged = contribute(bus, cfg, learner_id="L1", fragment_id=0, round_id=r,
                            base_version=version, delta=np.full(size, 0.01, np.float32),
                            n_steps=10**6, n_tokens=10**6)  # fmt: skip
        letters = len(dead_letters(bus, 0))
        pump_until(sync, lambda n=letters: len(dead_letters(bus, 0)) > n, 10.0, "a dead letter")
        letter = dead_letters(bus, 0)[-1]
        assert letter.fields["ddq.dlq.id"].decode() == forged, restarted
        why = letter.fields["ddq.dlq.reason"].decode()
        assert why.startswith(f"implausible: 1000000 steps since version {version}, published "), (
            why
        )
        assert "more than 100 steps per second (synchronizer.max_steps_per_s)" in why
        _merge_one(sync, bus, cfg, "L0", version)  # 4 steps: well inside the bound
        sync.close()
        sync = start(bus, cfg)
    sync.close()


def _merge_one(sync: Synchronizer, bus, cfg, learner: str, base: int) -> None:
    """Contribute to fragment 0's next round until it merges a contribution."""
    merged = sum(r.decision == "merge" and bool(r.contributors) for r in records(bus, cfg, 0))
    deadline = time.monotonic() + 20.0
    while (
        sum(r.decision == "merge" and bool(r.contributors) for r in records(bus, cfg, 0)) == merged
    ):
        assert time.monotonic() < deadline, "no merge"
        r = announced_round(sync, 0)
        delta = np.full(size_of(cfg, 0), 0.01, np.float32)
        contribute(bus, cfg, learner_id=learner, fragment_id=0, round_id=r, base_version=base,
                   delta=delta)  # fmt: skip
        pump_until(sync, lambda r=r: not _open_at(sync, 0, r), 10.0, "the round to close")


def test_a_corrupt_kept_version_is_dropped_from_the_ring_not_a_crash(
    bus, run_id, redis_server, caplog
):
    """An older version's blob overwritten in Redis: a restarted synchronizer leaves it out of
    its ring with the reason, refuses a contribution based on it, and merges on."""
    cfg = make_config(run_id, quorum=1, grace_cap_s=0.0, version_ring=4)
    sync = start(bus, cfg)
    for _ in range(3):
        _merge_one(sync, bus, cfg, "L0", latest_global(bus, cfg, 0)[0].version)
    state = state_of(bus, cfg, 0)
    (kept,) = [ref for ref in state.ring if ref.version == 1]
    client = redis_server.client()
    for key in kept.ref.chunk_keys():
        client.set(key, b"\x00" * len(client.get(key) or b"x"))  # same size, wrong bytes
    client.close()
    sync.close()
    with caplog.at_level("WARNING", logger="dd_queue.synchronizer"):
        sync = start(bus, cfg)  # before: load_ring raised and the process died, every restart
    assert "fragment.ring_dropped fragment 0 version 1" in caplog.text
    version = state.version
    r = announced_round(sync, 0)
    contribute(bus, cfg, learner_id="L1", fragment_id=0, round_id=r, base_version=1,
               delta=np.full(size_of(cfg, 0), 0.01, np.float32))  # fmt: skip
    _merge_one(sync, bus, cfg, "L0", version)
    outcomes = [e for rec in records(bus, cfg, 0) for e in rec.entries if e.learner_id == "L1"]
    assert outcomes and all(e.outcome != "merged" for e in outcomes), outcomes
    msg, theta = latest_global(bus, cfg, 0)
    assert msg.version > version and np.isfinite(theta).all()
    sync.close()


def _open_at(sync: Synchronizer, fragment: int, round_id: int) -> bool:
    status = {s.fragment_id: s for s in sync.status()}[fragment]
    return status.round_id == round_id


def test_invalid_and_nan_contributions_are_dead_lettered_and_never_merged(bus, run_id):
    cfg = make_config(run_id, quorum=1, grace_cap_s=0.0)
    sync = start(bus, cfg)
    size = size_of(cfg, 0)
    r = announced_round(sync, 0)
    contribute(
        bus,
        cfg,
        learner_id="L0",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.empty(0),
        encoded=with_nan(size),
    )
    contribute(
        bus,
        cfg,
        learner_id="L1",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.zeros(size, np.float32),
        config_digest="0123456789abcdef",
    )
    good = contribute(
        bus,
        cfg,
        learner_id="L2",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.full(size, 0.01, np.float32),
    )
    bus.delete([bus.keys.up_blob(0, r, "L2")])  # its payload vanished: blob_missing
    pump_until(sync, lambda: len(dead_letters(bus, 0)) == 3, 5.0, "three dead letters")
    reasons = sorted(
        e.fields["ddq.dlq.reason"].decode().split(":")[0] for e in dead_letters(bus, 0)
    )
    assert reasons == ["blob_missing", "incompatible", "non_finite"]
    assert good in {e.fields["ddq.dlq.id"].decode() for e in dead_letters(bus, 0)}
    assert versions_published(bus, cfg, 0) == [0] and pending_count(bus, 0) == 0
    sync.close()


def test_stale_lease_holder_cannot_commit(bus, run_id):
    cfg = make_config(run_id, quorum=1, grace_cap_s=0.0, lease_ttl_s=1.0, claim_idle_ms=300)
    a = start(bus, cfg, "sync-a")
    r = announced_round(a, 0)
    # a stalls (as under SIGSTOP) until its leases expire in Redis
    wait_until(
        lambda: all(bus.get(bus.keys.lease(p)) is None for p in (0, 1)), 5.0, "a's leases to expire"
    )
    b = start(bus, cfg, "sync-b")
    assert b.owned == {0, 1}
    entry = contribute(
        bus,
        cfg,
        learner_id="L0",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.full(size_of(cfg, 0), 0.01, np.float32),
    )
    rt = a.fragments[0]
    rt.lease = dataclasses.replace(rt.lease, expires_at_s=time.monotonic() + 5)  # it thinks so
    a.pump(block_ms=200)  # reads the entry, merges, and is refused at the commit
    assert 0 not in a.owned and versions_published(bus, cfg, 0) == [0]
    pump_until(b, lambda: versions_published(bus, cfg, 0) == [0, 1], 5.0, "b's merge")
    assert settled_outcomes(records(bus, cfg, 0)) == {entry: ["merged"]}
    b.close()


def test_export_then_reseed_a_new_run(bus, run_id, redis_server, tmp_path):
    cfg = make_config(run_id, quorum=1, grace_cap_s=0.0)
    sync = start(bus, cfg)
    r = announced_round(sync, 0)
    contribute(
        bus,
        cfg,
        learner_id="L0",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.full(size_of(cfg, 0), 0.01, np.float32),
    )
    pump_until(sync, lambda: sync.versions()[0] == 1, 5.0, "a merge")
    out = tmp_path / "model.safetensors"
    metadata = export_model(bus, cfg, out)
    assert (
        metadata["versions"] == '{"0": 1, "1": 0}' and metadata["config_digest"] == cfg.run_digest
    )
    source, read_back = load_export(out)
    assert read_back == metadata
    sync.close()
    other = make_config(f"{run_id}b", quorum=1)
    bus2 = RedisBus(redis_server.url, other.run.run_id)
    try:
        seeded = start(bus2, other, source=source)
        for p in (0, 1):
            np.testing.assert_array_equal(
                latest_global(bus2, other, p)[1], latest_global(bus, cfg, p)[1]
            )
        assert "model.safetensors" in seeded.fragments[0].state.last_reason
        seeded.close()
    finally:
        bus2.close()


def test_evaluator_scores_the_global_model(bus, run_id, redis_server):
    raw = {
        "model__n_layers": 1,
        "model__d_model": 32,
        "model__n_heads": 2,
        "model__seq_len": 32,
        "data__max_bytes": 65536,
        "data__eval_batches": 2,
    }
    cfg = make_config(run_id, **raw)
    sync = Synchronizer(cfg, bus=bus, clock=SystemClock())  # the config's model and seed
    sync.start()
    result = Evaluator(cfg, bus=bus).evaluate()
    assert result.versions == {0: 0, 1: 0} and 4.0 < result.loss < 7.0  # ≈ ln 256 untrained
    events = [e for e in bus.read(bus.keys.events(), count=1000) if b"eval.done" in e.fields["m"]]
    assert len(events) == 1
    sync.close()


def test_service_serves_until_stopped_and_releases_its_leases(redis_server, run_id, bus):
    raw = {
        "redis__url": redis_server.url,
        "model__n_layers": 1,
        "model__d_model": 32,
        "model__n_heads": 2,
    }
    cfg = make_config(run_id, **raw)
    stop = threading.Event()
    thread = threading.Thread(
        target=serve, args=(cfg,), kwargs={"synchronizer_id": "svc", "stop": stop}
    )
    thread.start()
    try:
        wait_until(lambda: bus.get(bus.keys.lease(1)) is not None, 20.0, "the service's leases")
        wait_until(lambda: "svc" in bus.heartbeats(), 5.0, "the service's heartbeat")
    finally:
        stop.set()
        thread.join(10.0)
    assert not thread.is_alive()
    assert bus.get(bus.keys.lease(0)) is None and "svc" not in bus.heartbeats()


def test_export_and_evaluator_commands(bus, run_id, redis_server, tmp_path, capsys):
    raw = {
        "redis__url": redis_server.url,
        "model__n_layers": 1,
        "model__d_model": 32,
        "model__n_heads": 2,
        "model__seq_len": 32,
        "data__max_bytes": 65536,
        "data__eval_batches": 1,
    }
    cfg = make_config(run_id, **raw)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.public_dict()))
    sync = Synchronizer(cfg, bus=bus, clock=SystemClock())
    sync.start()
    out = tmp_path / "m.safetensors"
    assert ddq_main(["export", "--config", str(config), "--out", str(out), "--json"]) == 0
    exported = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert exported["versions"] == '{"0": 0, "1": 0}' and out.exists()
    assert ddq_main(["evaluator", "--config", str(config), "--once", "--json"]) == 0
    scored = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert scored["versions"] == {"0": 0, "1": 0} and scored["loss"] > 0
    sync.close()
